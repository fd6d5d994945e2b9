"""The test control plane itself: reachable from Python, kubectl and helm, with RBAC enforced."""

from __future__ import annotations

import kubernetes

from tests.k8s.cluster import KubeCluster


def test_api_server_answers_python_and_kubectl(kube: KubeCluster, namespace: str) -> None:
    version = kubernetes.client.VersionApi(kube.api_client).get_code()
    assert version.major == "1"
    listed = kubernetes.client.CoreV1Api(kube.api_client).list_namespace().items
    names = [n.metadata.name for n in listed if n.metadata is not None]
    assert namespace in names
    out = kube.kubectl("get", "namespace", namespace, "-o", "jsonpath={.metadata.name}")
    assert out.stdout == namespace


def test_rbac_is_enforced(kube: KubeCluster, namespace: str) -> None:
    sa = f"system:serviceaccount:{namespace}:nobody"
    denied = kube.kubectl("auth", "can-i", "list", "pods", "-n", namespace, f"--as={sa}", check=False)
    assert denied.stdout.strip() == "no"
    allowed = kube.kubectl("auth", "can-i", "list", "pods", "-n", namespace)
    assert allowed.stdout.strip() == "yes"
