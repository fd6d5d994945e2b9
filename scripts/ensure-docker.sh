#!/usr/bin/env bash
# Make sure a Docker engine answers and the base image `debian:bookworm-slim` exists locally.
#
# The integration tests start a real Kafka broker in a container (testcontainers), and the project's images
# build FROM debian:bookworm-slim. The build machines reach Debian's archive but no container registry, so:
#   - the engine is Debian's docker.io, started in the background when no init system manages it;
#   - the base image is made locally with `debootstrap --variant=minbase bookworm` and `docker import`ed
#     under the name Docker Hub uses, so Dockerfiles say `FROM debian:bookworm-slim` and work unchanged on
#     machines that can pull. The rootfs tarball is cached, so a second machine with the same cache is fast.
#
# Also a C compiler (Debian's gcc and libc6-dev): tests/integration/test_clock.py builds a small preload
# library with it that steps one instance's wall clock.
#
# Idempotent: when Docker runs, the image exists and cc is there this prints three lines and exits 0.
# Cache: ${FLUXJOIN_CACHE:-$HOME/.cache/fluxjoin}/docker/ (rootfs tarball, dockerd log).
# Env:   DEBIAN_MIRROR (default http://deb.debian.org/debian), DOCKER_START_TIMEOUT (seconds, default 60).
set -euo pipefail

BASE_IMAGE="debian:bookworm-slim"
SUITE="bookworm"
MIRROR="${DEBIAN_MIRROR:-http://deb.debian.org/debian}"
CACHE="${FLUXJOIN_CACHE:-$HOME/.cache/fluxjoin}/docker"
ROOTFS_TAR="$CACHE/debian-$SUITE-minbase-rootfs.tar.gz"
DOCKERD_LOG="$CACHE/dockerd.log"
TIMEOUT="${DOCKER_START_TIMEOUT:-60}"

log() { printf '[ensure-docker] %s\n' "$*" >&2; }
die() { printf '[ensure-docker] error: %s\n' "$*" >&2; exit 1; }

is_root() { [[ "$(id -u)" == 0 ]]; }

# apt-get install, with one `apt-get update` per run (fresh machines have no package lists).
APT_UPDATED=0
apt_install() {
  is_root || die "need root to apt-get install $*"
  if [[ "$APT_UPDATED" == 0 ]]; then
    log "apt-get update"
    apt-get update -qq
    APT_UPDATED=1
  fi
  log "apt-get install $*"
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "$@" >/dev/null
}

docker_ok() { command -v docker >/dev/null 2>&1 && docker info >/dev/null 2>&1; }

wait_for_docker() {
  local deadline=$((SECONDS + TIMEOUT))
  until docker_ok; do
    if ((SECONDS >= deadline)); then
      log "dockerd log tail ($DOCKERD_LOG):"
      tail -n 20 "$DOCKERD_LOG" >&2 2>/dev/null || true
      die "Docker did not answer within ${TIMEOUT}s"
    fi
    sleep 0.5
  done
}

ensure_engine() {
  if docker_ok; then
    log "docker: running ($(docker version --format '{{.Server.Version}}' 2>/dev/null || echo '?'))"
    return
  fi
  if ! is_root; then
    cat >&2 <<EOF
[ensure-docker] error: the Docker daemon is not reachable and this script is not running as root.
  Start Docker yourself (e.g. 'sudo systemctl start docker', or run 'sudo $0'),
  and make sure your user may use it ('sudo usermod -aG docker $USER', then log in again).
EOF
    exit 1
  fi
  mkdir -p "$CACHE"
  if ! command -v dockerd >/dev/null 2>&1 || ! command -v docker >/dev/null 2>&1; then
    apt_install docker.io
  fi
  # Installing docker.io under systemd starts the service; otherwise start the daemon ourselves.
  if docker_ok; then
    log "docker: running"
    return
  fi
  local t0=$SECONDS
  if [[ -d /run/systemd/system ]] && systemctl list-unit-files docker.service >/dev/null 2>&1; then
    log "starting docker.service"
    systemctl start docker
  else
    log "starting dockerd in the background (log: $DOCKERD_LOG)"
    setsid dockerd >>"$DOCKERD_LOG" 2>&1 </dev/null &
  fi
  wait_for_docker
  log "docker: running after $((SECONDS - t0)) s"
}

# Unmount anything debootstrap left mounted under $1, then delete it without crossing file systems.
remove_rootfs_dir() {
  local dir="$1" mnt
  [[ -d "$dir" ]] || return 0
  awk -v d="$dir" 'index($2, d) == 1 { print $2 }' /proc/mounts | sort -r | while read -r mnt; do
    umount -l "$mnt" 2>/dev/null || true
  done
  rm -rf --one-file-system "$dir"
}

build_rootfs_tarball() {
  is_root || die "need root to debootstrap the $BASE_IMAGE base image"
  command -v debootstrap >/dev/null 2>&1 || apt_install debootstrap
  local dir t0=$SECONDS
  dir="$(mktemp -d "${TMPDIR:-/tmp}/fluxjoin-rootfs.XXXXXX")"
  trap 'remove_rootfs_dir "'"$dir"'"' EXIT
  log "debootstrap --variant=minbase $SUITE from $MIRROR (about 30-60 s)..."
  debootstrap --variant=minbase "$SUITE" "$dir" "$MIRROR" >"$CACHE/debootstrap.log" 2>&1 \
    || { tail -n 20 "$CACHE/debootstrap.log" >&2; die "debootstrap failed (log: $CACHE/debootstrap.log)"; }
  # The same suites as Debian's own images: security fixes (e.g. for the JRE) come from bookworm-security.
  cat >"$dir/etc/apt/sources.list" <<EOF
deb $MIRROR $SUITE main
deb $MIRROR $SUITE-updates main
deb ${MIRROR%/debian}/debian-security $SUITE-security main
EOF
  rm -rf "$dir"/var/cache/apt/archives/*.deb "$dir"/var/lib/apt/lists/*
  tar --numeric-owner -C "$dir" -czf "$ROOTFS_TAR.partial" .
  mv "$ROOTFS_TAR.partial" "$ROOTFS_TAR"
  remove_rootfs_dir "$dir"
  trap - EXIT
  log "rootfs cached: $ROOTFS_TAR ($(du -h "$ROOTFS_TAR" | cut -f1), $((SECONDS - t0)) s)"
}

ensure_base_image() {
  if docker image inspect "$BASE_IMAGE" >/dev/null 2>&1; then
    log "image $BASE_IMAGE: present"
    return
  fi
  mkdir -p "$CACHE"
  if [[ -f "$ROOTFS_TAR" ]]; then
    log "using cached rootfs $ROOTFS_TAR"
  else
    build_rootfs_tarball
  fi
  local t0=$SECONDS
  docker import \
    --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
    --change 'CMD ["bash"]' \
    "$ROOTFS_TAR" "$BASE_IMAGE" >/dev/null
  log "image $BASE_IMAGE: imported in $((SECONDS - t0)) s"
}

ensure_c_compiler() {
  if command -v cc >/dev/null 2>&1 && [[ -e /usr/include/stdio.h ]]; then
    log "cc: present"
    return
  fi
  apt_install gcc libc6-dev
  log "cc: installed"
}

ensure_engine
ensure_base_image
ensure_c_compiler
