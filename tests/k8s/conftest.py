"""Fixtures for tests against a real kube-apiserver (see tests/k8s/cluster.py).

The session starts one control plane; each test gets its own namespace. Missing binaries are an error,
not a skip: `scripts/ensure-k8s-tools.sh` builds them.
"""

from __future__ import annotations

import re
import uuid
from collections.abc import Iterator
from pathlib import Path

import kubernetes
import pytest

from tests.k8s.cluster import CRD_FILE, ClusterError, KubeCluster, missing_tools, start_cluster, tools_bin

K8S_DIR = Path(__file__).resolve().parent


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if K8S_DIR in Path(str(item.path)).parents:
            item.add_marker(pytest.mark.k8s)


@pytest.fixture(scope="session")
def k8s_bin() -> Path:
    """The directory holding kubectl and helm (for tests that need no API server)."""
    bin_dir = tools_bin()
    missing = missing_tools(bin_dir)
    if missing:
        pytest.fail(
            f"Kubernetes test tools missing in {bin_dir}: {', '.join(missing)}. "
            "Run `scripts/ensure-k8s-tools.sh` once.",
            pytrace=False,
        )
    return bin_dir


@pytest.fixture(scope="session")
def kube(tmp_path_factory: pytest.TempPathFactory) -> Iterator[KubeCluster]:
    """etcd + kube-apiserver for the whole session; torn down at the end."""
    workdir = tmp_path_factory.mktemp("kube")
    problem = ""
    try:
        cluster = start_cluster(workdir, tools_bin())
    except ClusterError as exc:
        problem = str(exc)
    if problem:
        pytest.fail(problem, pytrace=False)
    try:
        yield cluster
    finally:
        cluster.stop()


@pytest.fixture
def namespace(kube: KubeCluster, request: pytest.FixtureRequest) -> Iterator[str]:
    """A fresh namespace named after the test (deleted afterwards; without a controller-manager it only
    reaches Terminating, which is fine for a throwaway control plane)."""
    base = re.sub(r"[^a-z0-9-]+", "-", request.node.name.lower()).strip("-")[:40].strip("-")
    name = f"{base}-{uuid.uuid4().hex[:6]}"
    core = kubernetes.client.CoreV1Api(kube.api_client)
    core.create_namespace(kubernetes.client.V1Namespace(metadata=kubernetes.client.V1ObjectMeta(name=name)))
    try:
        yield name
    finally:
        core.delete_namespace(name)


@pytest.fixture(scope="session")
def crd(kube: KubeCluster) -> Iterator[None]:
    """The JoinPipeline CRD, installed and established (helm install skips an existing CRD)."""
    kube.kubectl("apply", "--server-side", "-f", str(CRD_FILE))
    kube.kubectl("wait", "--for=condition=Established", "crd/joinpipelines.fluxjoin.io", "--timeout=60s")
    yield
