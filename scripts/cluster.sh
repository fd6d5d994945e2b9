#!/usr/bin/env bash
# A single-node Kubernetes cluster from real components, for trying fluxjoin's chart and for `make e2e`.
#
#   scripts/cluster.sh up      start it (idempotent: a running cluster is left alone), print the kubeconfig
#   scripts/cluster.sh down    stop every component and pod and delete the cluster's state (images stay)
#   scripts/cluster.sh load IMAGE...   copy images from the Docker engine into the node's containerd
#   scripts/cluster.sh status  which components run
#   scripts/cluster.sh kubeconfig      print the admin kubeconfig's path
#
# Like Kubernetes' own hack/local-up-cluster.sh, every component is a process on this machine: etcd,
# kube-apiserver, kube-controller-manager (garbage collector, StatefulSet, Job, endpoint controllers),
# kube-scheduler, kubelet, kube-proxy (iptables), CoreDNS (the `kubernetes` plugin, serving cluster.local
# on the pod bridge's gateway address, which is the kubelet's clusterDNS) and local-path-provisioner (the
# default StorageClass `local-path`, dynamic provisioning of host directories as kind does). Pods run in a
# containerd of their own (Debian's 1.6, CRI enabled, its own root and socket, so Docker's containerd is
# untouched) with runc and the CNI bridge, host-local, portmap, firewall and loopback plugins from Debian.
# Every binary is built by scripts/ensure-k8s-tools.sh from the Go module proxy; no image is pulled: the
# pause image is compiled from Kubernetes' own pause.c, and images reach the node with `load`.
#
# Machine facts this copes with (docs/kubernetes.md, "A cluster on one machine"): cgroup v1 (kubelet
# `failCgroupV1: false`, cgroupfs driver, no per-QoS cgroups), a process that may not lower
# oom_score_adj (containerd `restrict_oom_score_adj`), Docker's FORWARD policy DROP (CNI firewall plugin).
#
# Env: FLUXJOIN_CLUSTER_DIR (state, default /var/lib/fluxjoin-cluster), FLUXJOIN_CACHE (tool cache).
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REPO="$(dirname "$HERE")"
STATE="${FLUXJOIN_CLUSTER_DIR:-/var/lib/fluxjoin-cluster}"
RUN="/run/fluxjoin-cluster"
PKI="$STATE/pki"
LOGS="$STATE/logs"
CONTAINERD_ROOT="${FLUXJOIN_CACHE:-$HOME/.cache/fluxjoin}/cluster-containerd"  # images survive `down`
CONTAINERD_SOCK="$RUN/containerd.sock"
KUBECONFIG_ADMIN="$STATE/kubeconfig"
NODE="fluxjoin-node"
POD_CIDR="10.88.0.0/16"
POD_GATEWAY="10.88.0.1"  # the bridge's address: CoreDNS listens here
SERVICE_CIDR="10.96.0.0/16"
SERVICE_IP="10.96.0.1"   # kubernetes.default
API_PORT=6443
ETCD_PORT=2479           # not 2379: leaves the usual port to anybody else's etcd
PAUSE_IMAGE="registry.k8s.io/pause:3.10"
HELPER_IMAGE="debian:bookworm-slim"  # local-path-provisioner's helper pods (scripts/ensure-docker.sh)
COMPONENTS=(containerd etcd kube-apiserver kube-controller-manager kube-scheduler kubelet kube-proxy coredns
  local-path-provisioner)

log() { printf '[cluster] %s\n' "$*" >&2; }
die() { printf '[cluster] error: %s\n' "$*" >&2; exit 1; }

[[ "$(id -u)" == 0 ]] || die "the kubelet, containerd and kube-proxy need root"

BIN="$("$HERE/ensure-k8s-tools.sh" --print-bin)"
export PATH="$BIN:$PATH"

host_ip() { ip -4 route get 1.0.0.0 | sed -n 's/.* src \([0-9.]*\).*/\1/p'; }

pid_of() { [[ -f "$RUN/$1.pid" ]] && cat "$RUN/$1.pid"; }
running() { local pid; pid="$(pid_of "$1")" && [[ -n "$pid" ]] && kill -0 "$pid" 2>/dev/null; }

# start NAME COMMAND...: run in the background, in its own session, logging to $LOGS/NAME.log.
start() {
  local name="$1"; shift
  if running "$name"; then return; fi
  setsid "$@" >>"$LOGS/$name.log" 2>&1 < /dev/null &
  echo $! >"$RUN/$name.pid"
  log "started $name (pid $!, log $LOGS/$name.log)"
}

# wait_for WHAT SECONDS COMMAND...: poll until COMMAND succeeds; on timeout show the newest log lines.
wait_for() {
  local what="$1" timeout="$2" component="$3"; shift 3
  local deadline=$((SECONDS + timeout))
  until "$@" >/dev/null 2>&1; do
    if ((SECONDS > deadline)) || ! running "$component"; then
      tail -n 30 "$LOGS/$component.log" >&2 || true
      die "$what: not within ${timeout} s (log: $LOGS/$component.log)"
    fi
    sleep 1
  done
}

openssl_quiet() { openssl "$@" >/dev/null 2>&1; }

make_pki() {
  [[ -f "$PKI/done" ]] && return
  mkdir -p "$PKI"
  local ip; ip="$(host_ip)"
  ( cd "$PKI"
    openssl_quiet req -x509 -newkey rsa:2048 -nodes -days 3650 -subj /CN=fluxjoin-cluster-ca \
      -keyout ca.key -out ca.crt
    # The API server, reached as 127.0.0.1 (host), the node address (kube-proxy's endpoint for pods) and
    # kubernetes.default (in-cluster clients).
    openssl_quiet req -newkey rsa:2048 -nodes -subj /CN=kube-apiserver -keyout apiserver.key -out apiserver.csr
    printf 'subjectAltName=%s\nextendedKeyUsage=serverAuth\n' \
      "IP:127.0.0.1,IP:$ip,IP:$SERVICE_IP,DNS:localhost,DNS:kubernetes,DNS:kubernetes.default,DNS:kubernetes.default.svc,DNS:kubernetes.default.svc.cluster.local" \
      >apiserver.ext
    openssl_quiet x509 -req -in apiserver.csr -CA ca.crt -CAkey ca.key -CAcreateserial -days 3650 \
      -extfile apiserver.ext -out apiserver.crt
    # The API server's client certificate towards kubelets (logs, exec, port-forward).
    openssl_quiet req -newkey rsa:2048 -nodes -subj "/O=system:masters/CN=kube-apiserver-kubelet-client" \
      -keyout kubelet-client.key -out kubelet-client.csr
    printf 'extendedKeyUsage=clientAuth\n' >client.ext
    openssl_quiet x509 -req -in kubelet-client.csr -CA ca.crt -CAkey ca.key -CAcreateserial -days 3650 \
      -extfile client.ext -out kubelet-client.crt
    openssl_quiet genrsa -out sa.key 2048
    openssl_quiet rsa -in sa.key -pubout -out sa.pub
    # Static bearer tokens, one identity per component (the default RBAC bindings know these users).
    : >tokens.csv
    local entry
    for entry in admin/system:masters system:kube-controller-manager/ system:kube-scheduler/ \
      "system:node:$NODE/system:nodes" system:kube-proxy/ system:coredns/ system:local-path-provisioner/; do
      printf '%s,%s,%s,"%s"\n' "$(openssl rand -hex 16)" "${entry%/*}" "${entry%/*}" "${entry#*/}" >>tokens.csv
    done
    chmod 600 ./*.key tokens.csv
    touch done )
  log "made the cluster's CA, certificates and tokens in $PKI"
}

token_of() { awk -F, -v u="$1" '$2 == u {print $1}' "$PKI/tokens.csv"; }

# kubeconfig FILE USER: a kubeconfig for USER's token against the API server on 127.0.0.1.
kubeconfig() {
  local file="$1" user="$2"
  cat >"$file" <<EOF
apiVersion: v1
kind: Config
clusters:
- name: fluxjoin
  cluster:
    server: https://127.0.0.1:$API_PORT
    certificate-authority: $PKI/ca.crt
users:
- name: $user
  user:
    token: $(token_of "$user")
contexts:
- name: fluxjoin
  context: {cluster: fluxjoin, user: $user}
current-context: fluxjoin
EOF
  chmod 600 "$file"
}

write_configs() {
  mkdir -p "$STATE/config" "$STATE/cni/net.d" "$STATE/storage"
  local c="$STATE/config"
  kubeconfig "$KUBECONFIG_ADMIN" admin
  kubeconfig "$c/controller-manager.kubeconfig" system:kube-controller-manager
  kubeconfig "$c/scheduler.kubeconfig" system:kube-scheduler
  kubeconfig "$c/kubelet.kubeconfig" "system:node:$NODE"
  kubeconfig "$c/kube-proxy.kubeconfig" system:kube-proxy
  kubeconfig "$c/coredns.kubeconfig" system:coredns
  kubeconfig "$c/local-path.kubeconfig" system:local-path-provisioner

  cat >"$c/containerd.toml" <<EOF
version = 2
root = "$CONTAINERD_ROOT"
state = "$RUN/containerd"
[grpc]
  address = "$CONTAINERD_SOCK"
[ttrpc]
  address = "$RUN/containerd.sock.ttrpc"
[plugins."io.containerd.grpc.v1.cri"]
  sandbox_image = "$PAUSE_IMAGE"
  # The processes here may not lower oom_score_adj; without this every sandbox fails in runc.
  restrict_oom_score_adj = true
  [plugins."io.containerd.grpc.v1.cri".containerd]
    snapshotter = "overlayfs"
    default_runtime_name = "runc"
    [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
  [plugins."io.containerd.grpc.v1.cri".cni]
    bin_dir = "/usr/lib/cni"
    conf_dir = "$STATE/cni/net.d"
EOF

  cat >"$STATE/cni/net.d/10-fluxjoin.conflist" <<EOF
{
  "cniVersion": "1.0.0",
  "name": "fluxjoin",
  "plugins": [
    {"type": "bridge", "bridge": "fluxjoin0", "isGateway": true, "ipMasq": true, "hairpinMode": true,
     "mtu": $(cat /sys/class/net/"$(ip -4 route get 1.0.0.0 | sed -n 's/.* dev \([^ ]*\).*/\1/p')"/mtu),
     "ipam": {"type": "host-local", "ranges": [[{"subnet": "$POD_CIDR", "gateway": "$POD_GATEWAY"}]],
              "routes": [{"dst": "0.0.0.0/0"}], "dataDir": "$STATE/cni/ipam"}},
    {"type": "portmap", "capabilities": {"portMappings": true}},
    {"type": "firewall"}
  ]
}
EOF

  cat >"$c/kubelet.yaml" <<EOF
apiVersion: kubelet.config.k8s.io/v1beta1
kind: KubeletConfiguration
# cgroup v1 on these machines: allowed explicitly; the cgroupfs driver, no per-QoS cgroup tree (the cpu
# and memory hierarchies are not unified, which the per-QoS tree needs).
failCgroupV1: false
cgroupDriver: cgroupfs
cgroupsPerQOS: false
enforceNodeAllocatable: []
failSwapOn: false
containerRuntimeEndpoint: unix://$CONTAINERD_SOCK
clusterDNS: ["$POD_GATEWAY"]
clusterDomain: cluster.local
resolvConf: /etc/resolv.conf
authentication:
  anonymous: {enabled: false}
  webhook: {enabled: false}
  x509: {clientCAFile: "$PKI/ca.crt"}
authorization: {mode: AlwaysAllow}
# A laptop's disk is fuller than a node's: evict only when it is nearly full.
evictionHard: {"nodefs.available": "2%", "imagefs.available": "2%", "memory.available": "200Mi"}
imageGCHighThresholdPercent: 99
imageGCLowThresholdPercent: 98
protectKernelDefaults: false
serializeImagePulls: false
maxPods: 60
EOF

  # A running kube-proxy exits once its configuration file is written, even with the same content (and
  # Services stop working until the next `up`): written only when it changes.
  local proxy_config
  proxy_config="$(cat <<EOF
apiVersion: kubeproxy.config.k8s.io/v1alpha1
kind: KubeProxyConfiguration
mode: iptables
clusterCIDR: "$POD_CIDR"
hostnameOverride: "$NODE"
clientConnection: {kubeconfig: "$c/kube-proxy.kubeconfig"}
# kube-proxy may not write the conntrack sysctls here; leave them as the machine has them.
conntrack: {maxPerCore: 0, tcpEstablishedTimeout: 0s, tcpCloseWaitTimeout: 0s}
EOF
)"
  if [[ ! -f "$c/kube-proxy.yaml" || "$(cat "$c/kube-proxy.yaml")" != "$proxy_config" ]]; then
    printf '%s\n' "$proxy_config" >"$c/kube-proxy.yaml"
  fi

  cat >"$c/Corefile" <<EOF
cluster.local:53 {
    bind $POD_GATEWAY
    errors
    kubernetes cluster.local {
        kubeconfig $c/coredns.kubeconfig fluxjoin
        pods insecure
        ttl 5
    }
    cache 5
}
.:53 {
    bind $POD_GATEWAY
    errors
    forward . /etc/resolv.conf
    cache 30
}
EOF

  cat >"$c/local-path.json" <<EOF
{"nodePathMap": [{"node": "DEFAULT_PATH_FOR_NON_LISTED_NODES", "paths": ["$STATE/storage"]}]}
EOF
}

# (Pipes into grep count matches, `grep -c ... >/dev/null`, rather than `grep -q`: under pipefail, grep -q
# leaving early makes the writer die of SIGPIPE, and the check fails although it matched.)

# The pod bridge exists before the first pod, so CoreDNS can bind its address at once.
make_bridge() {
  if ! ip link show fluxjoin0 >/dev/null 2>&1; then
    ip link add fluxjoin0 type bridge
  fi
  ip addr show dev fluxjoin0 | grep -c "inet $POD_GATEWAY/" >/dev/null || ip addr add "$POD_GATEWAY/16" dev fluxjoin0
  ip link set fluxjoin0 up
  sysctl -qw net.ipv4.ip_forward=1
}

# Kubernetes' pause container, compiled from the pause.c in the same module as the kubelet.
make_pause_image() {
  if ctr_k8s images ls -q | grep -cx "$PAUSE_IMAGE" >/dev/null; then return; fi
  local src dir
  src="$(find "${FLUXJOIN_CACHE:-$HOME/.cache/fluxjoin}/k8s-tools/go-mod/k8s.io" -maxdepth 1 -name 'kubernetes@*' \
    | sort | tail -n 1)/build/pause/linux/pause.c"
  [[ -f "$src" ]] || die "no pause.c (run scripts/ensure-k8s-tools.sh first)"
  dir="$(mktemp -d)"
  gcc -Os -static -DVERSION=3.10-fluxjoin -o "$dir/pause" "$src"
  strip "$dir/pause"
  tar -C "$dir" -c pause | docker import -c 'ENTRYPOINT ["/pause"]' - "$PAUSE_IMAGE" >/dev/null
  rm -rf "$dir"
  load "$PAUSE_IMAGE"
}

ctr_k8s() { ctr --address "$CONTAINERD_SOCK" --namespace k8s.io "$@"; }

# load IMAGE...: Docker engine -> the node's containerd (what `kind load docker-image` does). An image the
# node has under the same Docker image id is not copied again; another name of it is only tagged.
load() {
  running containerd || die "the cluster is not up (scripts/cluster.sh up)"
  local image id ref known stamps="$CONTAINERD_ROOT/loaded"
  mkdir -p "$stamps"
  for image in "$@"; do
    id="$(docker image inspect --format '{{.Id}}' "$image")" || die "no image $image in the Docker engine"
    ref="$(image_ref "$image")"
    if [[ "$(cat "$stamps/${ref//\//_}" 2>/dev/null)" == "$id" ]] && ctr_k8s images ls -q | grep -cx "$ref" >/dev/null; then
      continue
    fi
    local t0=$SECONDS
    known="$(grep -lx "$id" "$stamps"/* 2>/dev/null | head -n 1 || true)"
    if [[ -n "$known" ]] && ctr_k8s images ls -q | grep -cx "$(basename "$known" | tr _ /)" >/dev/null; then
      ctr_k8s images tag --force "$(basename "$known" | tr _ /)" "$ref" >/dev/null
    else
      docker save "$image" | ctr_k8s images import - >/dev/null
    fi
    echo "$id" >"$stamps/${ref//\//_}"
    log "loaded $image into the node in $((SECONDS - t0)) s"
  done
}

# The name containerd gives a Docker image: docker.io/library/x:t for x:t, docker.io/u/x:t for u/x:t.
image_ref() {
  local name="$1"
  [[ "$name" == *:* ]] || name="$name:latest"
  case "$name" in
    *.*/*|localhost/*|*:*/*) echo "$name" ;;
    */*) echo "docker.io/$name" ;;
    *) echo "docker.io/library/$name" ;;
  esac
}

api_ready() { kubectl --kubeconfig "$KUBECONFIG_ADMIN" get --raw /readyz; }
node_ready() {
  kubectl --kubeconfig "$KUBECONFIG_ADMIN" get node "$NODE" \
    -o jsonpath='{.status.conditions[?(@.type=="Ready")].status}' | grep -cx True >/dev/null
}

# The node's runtime and network pieces come from Debian.
ensure_packages() {
  command -v containerd >/dev/null && command -v runc >/dev/null && [[ -x /usr/lib/cni/bridge ]] \
    && command -v conntrack >/dev/null && command -v gcc >/dev/null && return
  log "apt-get install containerd runc containernetworking-plugins conntrack iptables gcc libc6-dev"
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends containerd runc \
    containernetworking-plugins conntrack iptables gcc libc6-dev >/dev/null
}

up() {
  ensure_packages
  "$HERE/ensure-docker.sh" >/dev/null
  mkdir -p "$STATE" "$RUN" "$LOGS" "$CONTAINERD_ROOT"
  make_pki
  write_configs
  make_bridge
  local ip c="$STATE/config"; ip="$(host_ip)"

  start containerd containerd --config "$c/containerd.toml"
  wait_for "containerd" 30 containerd ctr --address "$CONTAINERD_SOCK" version

  start etcd etcd --name fluxjoin --data-dir "$STATE/etcd" \
    --listen-client-urls "http://127.0.0.1:$ETCD_PORT" --advertise-client-urls "http://127.0.0.1:$ETCD_PORT" \
    --listen-peer-urls "http://127.0.0.1:$((ETCD_PORT + 1))" \
    --initial-advertise-peer-urls "http://127.0.0.1:$((ETCD_PORT + 1))" \
    --initial-cluster "fluxjoin=http://127.0.0.1:$((ETCD_PORT + 1))" --log-level warn

  start kube-apiserver kube-apiserver --etcd-servers "http://127.0.0.1:$ETCD_PORT" \
    --bind-address 0.0.0.0 --secure-port "$API_PORT" --advertise-address "$ip" \
    --tls-cert-file "$PKI/apiserver.crt" --tls-private-key-file "$PKI/apiserver.key" \
    --client-ca-file "$PKI/ca.crt" --token-auth-file "$PKI/tokens.csv" \
    --kubelet-client-certificate "$PKI/kubelet-client.crt" --kubelet-client-key "$PKI/kubelet-client.key" \
    --authorization-mode Node,RBAC --enable-admission-plugins NodeRestriction \
    --service-account-issuer https://kubernetes.default.svc.cluster.local \
    --service-account-key-file "$PKI/sa.pub" --service-account-signing-key-file "$PKI/sa.key" \
    --service-cluster-ip-range "$SERVICE_CIDR" --allow-privileged=true \
    --kubelet-preferred-address-types InternalIP,Hostname
  wait_for "the API server" 90 kube-apiserver api_ready

  start kube-controller-manager kube-controller-manager --kubeconfig "$c/controller-manager.kubeconfig" \
    --authentication-kubeconfig "$c/controller-manager.kubeconfig" \
    --authorization-kubeconfig "$c/controller-manager.kubeconfig" \
    --service-account-private-key-file "$PKI/sa.key" --root-ca-file "$PKI/ca.crt" \
    --use-service-account-credentials --leader-elect=false --bind-address 127.0.0.1 \
    --service-cluster-ip-range "$SERVICE_CIDR"
  start kube-scheduler kube-scheduler --kubeconfig "$c/scheduler.kubeconfig" \
    --authentication-kubeconfig "$c/scheduler.kubeconfig" --authorization-kubeconfig "$c/scheduler.kubeconfig" \
    --leader-elect=false --bind-address 127.0.0.1

  make_pause_image
  start kubelet kubelet --config "$c/kubelet.yaml" --kubeconfig "$c/kubelet.kubeconfig" \
    --hostname-override "$NODE" --node-ip "$ip" --root-dir "$STATE/kubelet" --cert-dir "$PKI/kubelet"
  start kube-proxy kube-proxy --config "$c/kube-proxy.yaml"

  kubectl --kubeconfig "$KUBECONFIG_ADMIN" apply -f "$REPO/k8s/cluster/" >/dev/null
  start coredns coredns -conf "$c/Corefile"
  load "$HELPER_IMAGE"
  start local-path-provisioner local-path-provisioner --debug start --config "$c/local-path.json" \
    --kubeconfig "$c/local-path.kubeconfig" --namespace local-path-storage \
    --configmap-name local-path-config --service-account-name local-path-provisioner \
    --helper-image "$HELPER_IMAGE" --provisioner-name rancher.io/local-path

  wait_for "node $NODE Ready" 120 kubelet node_ready
  log "up: export KUBECONFIG=$KUBECONFIG_ADMIN"
  echo "$KUBECONFIG_ADMIN"
}

stop() {
  local name="$1" pid
  pid="$(pid_of "$name")" || return 0
  if [[ -n "$pid" ]] && kill -0 "$pid" 2>/dev/null; then
    kill "$pid" 2>/dev/null || true
    for _ in $(seq 1 20); do kill -0 "$pid" 2>/dev/null || break; sleep 0.5; done
    kill -9 "$pid" 2>/dev/null || true
    log "stopped $name"
  fi
  rm -f "$RUN/$name.pid"
}

down() {
  local i
  for ((i = ${#COMPONENTS[@]} - 1; i >= 1; i--)); do stop "${COMPONENTS[$i]}"; done
  # The pods' containers outlive the kubelet (their shims belong to containerd): end them, then containerd.
  if running containerd; then
    local task
    for task in $(ctr_k8s tasks ls -q 2>/dev/null); do ctr_k8s tasks kill -s SIGKILL "$task" 2>/dev/null || true; done
    sleep 1
    for task in $(ctr_k8s tasks ls -q 2>/dev/null); do ctr_k8s tasks delete -f "$task" >/dev/null 2>&1 || true; done
    for task in $(ctr_k8s containers ls -q 2>/dev/null); do ctr_k8s containers delete "$task" >/dev/null 2>&1 || true; done
  fi
  stop containerd
  pkill -f "containerd-shim-runc-v2 -namespace k8s.io -address $CONTAINERD_SOCK" 2>/dev/null || true
  # kube-proxy's rules, the pods' network namespaces and the kubelet's mounts go with the cluster.
  kube-proxy --cleanup >/dev/null 2>&1 || true
  local netns
  for netns in $(ip netns list 2>/dev/null | awk '/^cni-/ {print $1}'); do ip netns delete "$netns" || true; done
  awk -v root="$STATE/" 'index($2, root) == 1 {print $2}' /proc/mounts | sort -r | xargs -r -n1 umount -l
  awk -v root="$RUN/" 'index($2, root) == 1 {print $2}' /proc/mounts | sort -r | xargs -r -n1 umount -l
  ip link delete fluxjoin0 2>/dev/null || true
  iptables-save 2>/dev/null | grep -c 'CNI-' >/dev/null && log "note: CNI iptables chains remain (harmless)"
  rm -rf "$STATE" "$RUN"
  log "down: state deleted (images stay in $CONTAINERD_ROOT)"
}

status() {
  local name
  for name in "${COMPONENTS[@]}"; do
    if running "$name"; then echo "$name: running (pid $(pid_of "$name"))"; else echo "$name: stopped"; fi
  done
}

case "${1:-}" in
  up) up ;;
  down) down ;;
  load) shift; load "$@" ;;
  status) status ;;
  kubeconfig) echo "$KUBECONFIG_ADMIN" ;;
  *) echo "usage: $0 up|down|load IMAGE...|status|kubeconfig" >&2; exit 2 ;;
esac
