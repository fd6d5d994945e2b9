"""The single-node cluster of scripts/cluster.sh, driven as a user drives it: kubectl, helm, images loaded.

The e2e test installs the chart, changes the pipeline with kubectl and helm, injects faults on the node,
and asks the oracle (`fluxjoin verify`, run as a Job in the cluster) whether the results are exact.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
CLUSTER_SCRIPT = REPO / "scripts" / "cluster.sh"
STATE = Path(os.environ.get("FLUXJOIN_CLUSTER_DIR", "/var/lib/fluxjoin-cluster"))
RUN = Path("/run/fluxjoin-cluster")


class E2EError(AssertionError):
    """A step of the e2e did not happen in time; the message says which and what the cluster showed."""


def say(line: str) -> None:
    print(f"[e2e {time.strftime('%H:%M:%S')}] {line}", flush=True)


def cluster_running() -> bool:
    """Whether scripts/cluster.sh's API server runs (the e2e then leaves the cluster running after it)."""
    out = subprocess.run(["bash", str(CLUSTER_SCRIPT), "status"], capture_output=True, text=True)
    return "kube-apiserver: running" in out.stdout


def cluster_down() -> None:
    subprocess.run(["bash", str(CLUSTER_SCRIPT), "down"], check=True, capture_output=True)


def cluster_up() -> Path:
    """Start the cluster unless it runs (idempotent); its admin kubeconfig."""
    out = subprocess.run(["bash", str(CLUSTER_SCRIPT), "up"], capture_output=True, text=True)
    if out.returncode != 0:
        raise E2EError(f"scripts/cluster.sh up failed:\n{out.stderr[-4000:]}")
    return Path(out.stdout.strip().splitlines()[-1])


def load_images(*images: str) -> None:
    subprocess.run(["bash", str(CLUSTER_SCRIPT), "load", *images], check=True, capture_output=True)


def wait_until(what: str, timeout_s: float, check: Callable[[], bool], explain: Callable[[], str]) -> float:
    """Poll `check` every second; the seconds it took. On timeout, fail with `explain()`."""
    t0 = time.monotonic()
    while not check():
        if time.monotonic() - t0 > timeout_s:
            raise E2EError(f"{what}: not within {timeout_s:.0f} s\n{explain()}")
        time.sleep(1)
    return time.monotonic() - t0


@dataclass
class Kube:
    """kubectl and helm against the cluster, in one namespace."""

    kubeconfig: Path
    namespace: str
    bin_dir: Path

    def env(self) -> dict[str, str]:
        env = dict(os.environ)
        env["KUBECONFIG"] = str(self.kubeconfig)
        env["PATH"] = f"{self.bin_dir}{os.pathsep}{env.get('PATH', '')}"
        home = STATE / "helm"
        for kind in ("cache", "config", "data"):
            env[f"HELM_{kind.upper()}_HOME"] = str(home / kind)
        return env

    def run(self, tool: str, *args: str, check: bool = True, timeout: float = 300) -> str:
        out = subprocess.run(
            [tool, *args], env=self.env(), capture_output=True, text=True, timeout=timeout, check=False
        )
        if check and out.returncode != 0:
            raise E2EError(f"{tool} {' '.join(args)} failed ({out.returncode}):\n{out.stdout}\n{out.stderr}")
        return out.stdout

    def kubectl(self, *args: str, check: bool = True, timeout: float = 300) -> str:
        return self.run("kubectl", "-n", self.namespace, *args, check=check, timeout=timeout)

    def helm(self, *args: str, timeout: float = 600) -> str:
        return self.run("helm", "-n", self.namespace, *args, timeout=timeout)

    def get(self, *args: str) -> dict[str, Any]:
        return dict(json.loads(self.kubectl("get", *args, "-o", "json")))

    def pods(self, selector: str) -> list[dict[str, Any]]:
        return list(self.get("pods", "-l", selector)["items"])

    def overview(self) -> str:
        """What a user would look at when something hangs."""
        parts = [
            self.kubectl("get", "jp,sts,pods,pvc,jobs", "-o", "wide", check=False),
            self.kubectl("get", "events", "--sort-by=.lastTimestamp", check=False)[-3000:],
        ]
        return "\n".join(parts)


def kubelet_pid() -> int:
    return int((RUN / "kubelet.pid").read_text())


def stop_kubelet() -> None:
    """The node's kubelet goes away (its pods keep running, as on a real node whose kubelet restarts)."""
    pid = kubelet_pid()
    os.kill(pid, signal.SIGTERM)
    for _ in range(60):
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.5)
    os.kill(pid, signal.SIGKILL)


def run_job(kube: Kube, name: str, manifest: dict[str, Any], timeout_s: float) -> tuple[bool, str]:
    """Create a Job, wait until it ends; (succeeded, its pod's log)."""
    kube.kubectl("delete", "job", name, "--ignore-not-found", "--wait=true")
    subprocess.run(
        ["kubectl", "-n", kube.namespace, "create", "-f", "-"],
        input=json.dumps(manifest),
        env=kube.env(),
        text=True,
        capture_output=True,
        check=True,
    )

    def ended() -> bool:
        status = kube.get("job", name).get("status", {})
        return bool(status.get("succeeded") or status.get("failed"))

    wait_until(f"job {name}", timeout_s, ended, kube.overview)
    status = kube.get("job", name)["status"]
    log = kube.kubectl("logs", f"job/{name}", check=False)
    return bool(status.get("succeeded")), log


def last_json_line(text: str) -> dict[str, Any]:
    for line in reversed(text.splitlines()):
        line = line.strip()
        if line.startswith("{"):
            return dict(json.loads(line))
    raise E2EError(f"no JSON line in:\n{text[-3000:]}")


def helm_values(values: Sequence[tuple[str, str]]) -> list[str]:
    args: list[str] = []
    for key, value in values:
        args += ["--set", f"{key}={value}"]
    return args
