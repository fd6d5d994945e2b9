"""A real Kubernetes control plane for tests: etcd + kube-apiserver, no kubelets (the envtest pattern).

The binaries come from `scripts/ensure-k8s-tools.sh` (built from the Go module proxy). The API server runs
with TLS from a throwaway CA made with `openssl`, RBAC authorization, the default admission plugins, a
service-account signing key, and a static token for an admin user in `system:masters`. Pods are never
run (there is no kubelet and no controller-manager), but every object goes through the same validation,
defaulting, admission and authorization a real cluster applies.
"""

from __future__ import annotations

import os
import shutil
import socket
import ssl
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import kubernetes

REPO = Path(__file__).resolve().parents[2]
CRD_FILE = REPO / "charts" / "fluxjoin" / "crds" / "joinpipelines.fluxjoin.io.yaml"
GROUP, VERSION, PLURAL = "fluxjoin.io", "v1alpha1", "joinpipelines"
ENSURE_SCRIPT = REPO / "scripts" / "ensure-k8s-tools.sh"
TOOLS = ("etcd", "kube-apiserver", "kubectl", "helm")
ADMIN_TOKEN = "fluxjoin-test-admin-token"


class ClusterError(RuntimeError):
    """The control plane could not be started; the message says why and what to run."""


def tools_bin() -> Path:
    """Where ensure-k8s-tools.sh puts the binaries (it is the one place that knows the pinned versions)."""
    override = os.environ.get("FLUXJOIN_K8S_TOOLS_BIN")
    if override:
        return Path(override)
    out = subprocess.run(
        ["bash", str(ENSURE_SCRIPT), "--print-bin"], check=True, capture_output=True, text=True
    )
    return Path(out.stdout.strip())


def missing_tools(bin_dir: Path) -> list[str]:
    return [t for t in TOOLS if not os.access(bin_dir / t, os.X_OK)]


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True)


def make_pki(pki: Path) -> None:
    """CA, API server serving cert (SAN 127.0.0.1/localhost) and the service-account signing key."""
    pki.mkdir(parents=True, exist_ok=True)
    _openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2", "-subj", "/CN=fluxjoin-test-ca",
             "-keyout", "ca.key", "-out", "ca.crt", cwd=pki)  # fmt: skip
    _openssl("req", "-newkey", "rsa:2048", "-nodes", "-subj", "/CN=kube-apiserver",
             "-keyout", "apiserver.key", "-out", "apiserver.csr", cwd=pki)  # fmt: skip
    (pki / "san.ext").write_text(
        "subjectAltName=IP:127.0.0.1,DNS:localhost,DNS:kubernetes,DNS:kubernetes.default.svc\n"
        "extendedKeyUsage=serverAuth\n"
    )
    _openssl("x509", "-req", "-in", "apiserver.csr", "-CA", "ca.crt", "-CAkey", "ca.key", "-CAcreateserial",
             "-days", "2", "-extfile", "san.ext", "-out", "apiserver.crt", cwd=pki)  # fmt: skip
    _openssl("genrsa", "-out", "sa.key", "2048", cwd=pki)
    _openssl("rsa", "-in", "sa.key", "-pubout", "-out", "sa.pub", cwd=pki)


@dataclass
class _Proc:
    name: str
    popen: subprocess.Popen[bytes]
    log: Path

    def tail(self, lines: int = 40) -> str:
        try:
            text = self.log.read_text(errors="replace").splitlines()
        except OSError:
            return ""
        return "\n".join(text[-lines:])

    def stop(self) -> None:
        if self.popen.poll() is None:
            self.popen.terminate()
            try:
                self.popen.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait(timeout=5)


@dataclass
class KubeCluster:
    """A running control plane: `kubeconfig` for the CLIs, `api_client` for Python."""

    workdir: Path
    bin_dir: Path
    server: str
    kubeconfig: Path
    api_client: kubernetes.client.ApiClient
    _procs: list[_Proc] = field(default_factory=list, repr=False)

    def env(self) -> dict[str, str]:
        env = dict(os.environ)
        env["KUBECONFIG"] = str(self.kubeconfig)
        env["PATH"] = f"{self.bin_dir}{os.pathsep}{env.get('PATH', '')}"
        # Helm keeps its state out of the user's home directory.
        for kind in ("cache", "config", "data"):
            env[f"HELM_{kind.upper()}_HOME"] = str(self.workdir / "helm" / kind)
        return env

    def run(
        self, tool: str, *args: str, check: bool = True, input_text: str | None = None, timeout: float = 120
    ) -> subprocess.CompletedProcess[str]:
        """Run kubectl or helm against this cluster; with check=True a failure raises with its output."""
        cmd = [str(self.bin_dir / tool), *args]
        proc = subprocess.run(
            cmd, env=self.env(), capture_output=True, text=True, input=input_text, timeout=timeout
        )
        if check and proc.returncode != 0:
            raise AssertionError(
                f"{' '.join(cmd)} exited {proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
            )
        return proc

    def kubectl(
        self, *args: str, check: bool = True, input_text: str | None = None, timeout: float = 120
    ) -> subprocess.CompletedProcess[str]:
        return self.run("kubectl", *args, check=check, input_text=input_text, timeout=timeout)

    def helm(
        self, *args: str, check: bool = True, input_text: str | None = None, timeout: float = 300
    ) -> subprocess.CompletedProcess[str]:
        return self.run(
            "helm", "--kubeconfig", str(self.kubeconfig), *args, check=check, input_text=input_text,
            timeout=timeout,
        )  # fmt: skip

    def stop(self) -> None:
        for proc in reversed(self._procs):
            proc.stop()
        self._procs.clear()


def _wait_ready(url: str, ca: Path, token: str, procs: Sequence[_Proc], timeout: float) -> None:
    ctx = ssl.create_default_context(cafile=str(ca))
    deadline = time.monotonic() + timeout
    last = ""
    while time.monotonic() < deadline:
        for p in procs:
            if p.popen.poll() is not None:
                raise ClusterError(f"{p.name} exited with {p.popen.returncode}; its log ends:\n{p.tail()}")
        req = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"})
        try:
            with urllib.request.urlopen(req, context=ctx, timeout=5) as resp:
                if resp.status == 200:
                    return
        except urllib.error.HTTPError as exc:
            last = f"HTTP {exc.code}: {exc.read()[:2000].decode(errors='replace')}"
        except (urllib.error.URLError, OSError) as exc:
            last = str(exc)
        time.sleep(0.5)
    raise ClusterError(f"{url} not ready after {timeout:.0f} s (last answer: {last})")


def _wait_etcd(port: int, proc: _Proc, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.popen.poll() is not None:
            raise ClusterError(f"etcd exited with {proc.popen.returncode}; its log ends:\n{proc.tail()}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as resp:
                if b'"true"' in resp.read():
                    return
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(0.2)
    raise ClusterError(f"etcd not healthy after {timeout:.0f} s; its log ends:\n{proc.tail()}")


def write_kubeconfig(path: Path, server: str, ca: Path, token: str, namespace: str = "default") -> None:
    path.write_text(
        f"""apiVersion: v1
kind: Config
clusters:
- name: fluxjoin-test
  cluster:
    server: {server}
    certificate-authority: {ca}
users:
- name: admin
  user:
    token: {token}
contexts:
- name: fluxjoin-test
  context:
    cluster: fluxjoin-test
    user: admin
    namespace: {namespace}
current-context: fluxjoin-test
"""
    )
    path.chmod(0o600)


def start_cluster(workdir: Path, bin_dir: Path, ready_timeout: float = 90) -> KubeCluster:
    """Start etcd and kube-apiserver under `workdir`; the caller must call `stop()`."""
    missing = missing_tools(bin_dir)
    if missing:
        raise ClusterError(
            f"Kubernetes test tools missing in {bin_dir}: {', '.join(missing)}. "
            f"Run `{ENSURE_SCRIPT.relative_to(REPO)}` once (it builds them from the Go module proxy, "
            "several minutes cold, instant afterwards)."
        )
    if shutil.which("openssl") is None:
        raise ClusterError("openssl makes the test cluster's certificates: apt-get install openssl")
    pki = workdir / "pki"
    make_pki(pki)
    (workdir / "tokens.csv").write_text(f'{ADMIN_TOKEN},admin,admin-uid,"system:masters"\n')

    procs: list[_Proc] = []

    def spawn(name: str, args: list[str]) -> _Proc:
        log = workdir / f"{name}.log"
        with log.open("wb") as fh:
            popen = subprocess.Popen(
                [str(bin_dir / name), *args], stdout=fh, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL
            )
        proc = _Proc(name, popen, log)
        procs.append(proc)
        return proc

    try:
        etcd_client, etcd_peer = free_port(), free_port()
        etcd = spawn(
            "etcd",
            [
                "--name=default",
                f"--data-dir={workdir / 'etcd'}",
                f"--listen-client-urls=http://127.0.0.1:{etcd_client}",
                f"--advertise-client-urls=http://127.0.0.1:{etcd_client}",
                f"--listen-peer-urls=http://127.0.0.1:{etcd_peer}",
                f"--initial-advertise-peer-urls=http://127.0.0.1:{etcd_peer}",
                f"--initial-cluster=default=http://127.0.0.1:{etcd_peer}",
                "--unsafe-no-fsync=true",
                "--log-level=warn",
            ],
        )
        _wait_etcd(etcd_client, etcd, timeout=30)

        port = free_port()
        server = f"https://127.0.0.1:{port}"
        spawn(
            "kube-apiserver",
            [
                f"--etcd-servers=http://127.0.0.1:{etcd_client}",
                "--bind-address=127.0.0.1",
                "--advertise-address=127.0.0.1",
                f"--secure-port={port}",
                f"--cert-dir={workdir / 'apiserver-certs'}",
                f"--tls-cert-file={pki / 'apiserver.crt'}",
                f"--tls-private-key-file={pki / 'apiserver.key'}",
                f"--client-ca-file={pki / 'ca.crt'}",
                f"--token-auth-file={workdir / 'tokens.csv'}",
                "--authorization-mode=RBAC",
                f"--service-account-key-file={pki / 'sa.pub'}",
                f"--service-account-signing-key-file={pki / 'sa.key'}",
                "--service-account-issuer=https://kubernetes.default.svc.cluster.local",
                "--service-cluster-ip-range=10.96.0.0/16",
                "--allow-privileged=true",
                "--profiling=false",
                "--v=1",
            ],
        )
        _wait_ready(f"{server}/readyz", pki / "ca.crt", ADMIN_TOKEN, procs, timeout=ready_timeout)

        kubeconfig = workdir / "kubeconfig"
        write_kubeconfig(kubeconfig, server, pki / "ca.crt", ADMIN_TOKEN)
        api_client = kubernetes.config.new_client_from_config(config_file=str(kubeconfig))
        return KubeCluster(workdir, bin_dir, server, kubeconfig, api_client, procs)
    except BaseException:
        for proc in reversed(procs):
            proc.stop()
        raise


def pipeline_manifest(name: str, **spec: object) -> str:
    """A JoinPipeline as YAML, on an external Kafka, with `spec` fields added."""
    import yaml

    body = {
        "apiVersion": f"{GROUP}/{VERSION}",
        "kind": "JoinPipeline",
        "metadata": {"name": name},
        "spec": {"kafka": {"bootstrapServers": "kafka.kafka.svc:9092"}, **spec},
    }
    return yaml.safe_dump(body)
