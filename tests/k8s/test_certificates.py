"""The operator certifies an instance pod's signing key by the pod's bound token, on a real API server.

An instance pod's request (`pipeline.signing.request_certificate`) goes over HTTP to the operator's
server (`controller.k8s.health.serve_health` with an `Issuer`), which asks the API server about the token
(TokenReview) and the pod. Pods are objects only here (no kubelet): the tokens are requested the way the
kubelet does for a projected volume, bound to the pod.
"""

from __future__ import annotations

import base64
import os
from pathlib import Path
from typing import Any

import kubernetes
import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from controller.k8s.certificates import Issuer, Refused
from controller.k8s.health import OperatorMetrics, serve_health
from controller.k8s.manifests import PIPELINE_LABEL
from pipeline import signing
from pipeline.signing import TOKEN_AUDIENCE, Signer, Trust, public_pem, raw_public, request_certificate
from tests.k8s.cluster import KubeCluster, free_port, pipeline_manifest

ACCOUNT = "orders-instance"


def _instance_pod(core: Any, apps: Any, namespace: str, pipeline: str, name: str) -> dict[str, str]:
    """A pod `name` of the StatefulSet `pipeline` (created if missing), as the StatefulSet controller
    would make it; its name and uid."""
    try:
        sts = apps.read_namespaced_stateful_set(pipeline, namespace)
    except kubernetes.client.ApiException:
        labels = {PIPELINE_LABEL: pipeline}
        sts = apps.create_namespaced_stateful_set(
            namespace,
            {
                "metadata": {"name": pipeline},
                "spec": {
                    "serviceName": pipeline,
                    "replicas": 0,
                    "selector": {"matchLabels": labels},
                    "template": {
                        "metadata": {"labels": labels},
                        "spec": {"containers": [{"name": "instance", "image": "fluxjoin:test"}]},
                    },
                },
            },
        )
    pod = core.create_namespaced_pod(
        namespace,
        {
            "metadata": {
                "name": name,
                "labels": {PIPELINE_LABEL: pipeline},
                "ownerReferences": [
                    {
                        "apiVersion": "apps/v1",
                        "kind": "StatefulSet",
                        "name": pipeline,
                        "uid": sts.metadata.uid,
                    }
                ],
            },
            "spec": {
                "serviceAccountName": ACCOUNT,
                "automountServiceAccountToken": False,
                "containers": [{"name": "instance", "image": "fluxjoin:test"}],
            },
        },
    )
    return {"name": pod.metadata.name, "uid": pod.metadata.uid}


def _token(core: Any, namespace: str, pod: dict[str, str], audience: str = TOKEN_AUDIENCE) -> str:
    """A token of the pod's service account bound to the pod, as the kubelet projects it."""
    request = kubernetes.client.AuthenticationV1TokenRequest(
        spec=kubernetes.client.V1TokenRequestSpec(
            audiences=[audience],
            expiration_seconds=600,
            bound_object_ref=kubernetes.client.V1BoundObjectReference(
                api_version="v1", kind="Pod", name=pod["name"], uid=pod["uid"]
            ),
        )
    )
    return str(core.create_namespaced_service_account_token(ACCOUNT, namespace, request).status.token)


def test_an_instance_pod_gets_a_certificate_for_itself_and_nothing_else(
    kube: KubeCluster, namespace: str, crd: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    core: Any = kubernetes.client.CoreV1Api(kube.api_client)
    apps: Any = kubernetes.client.AppsV1Api(kube.api_client)
    kube.kubectl(
        "apply", "-n", namespace, "-f", "-",
        input_text=pipeline_manifest("orders", streams=["A", "B"], kafka={"bootstrapServers": "kafka:9092"}),
    )  # fmt: skip
    core.create_namespaced_service_account(namespace, {"metadata": {"name": ACCOUNT}})
    pod = _instance_pod(core, apps, namespace, "orders", "orders-1")
    stray: Any = core.create_namespaced_pod(
        namespace,
        {
            "metadata": {"name": "stray", "labels": {PIPELINE_LABEL: "orders"}},
            "spec": {"serviceAccountName": ACCOUNT, "containers": [{"name": "c", "image": "fluxjoin:test"}]},
        },
    )

    controller_key = Ed25519PrivateKey.generate()
    issuer = Issuer(kube.api_client, namespace, Signer("controller", controller_key))
    port = free_port()
    server = serve_health(lambda: True, OperatorMetrics(), port, host="127.0.0.1", issuer=issuer)
    try:
        token_file = tmp_path / "token"
        token_file.write_text(_token(core, namespace, pod))
        trust_file = tmp_path / "controller.pub"
        trust_file.write_bytes(public_pem(controller_key))
        monkeypatch.setenv(signing.TRUST_ENV, str(trust_file))
        monkeypatch.delenv(signing.KEY_ENV, raising=False)
        signing.trust.cache_clear()
        try:
            signer = request_certificate(
                f"http://127.0.0.1:{port}", token_file, tmp_path / "key" / "orders-1.key"
            )
            assert signer.name == "orders-1"
            headers = signer.headers(f"{namespace}.orders.metrics", b"beat")
            assert Trust(controller_key.public_key()).signer(
                f"{namespace}.orders.metrics", b"beat", headers
            ) == ("orders-1"), "certified for the pipeline's topics (prefix <namespace>.<name>)"
        finally:
            os.environ.pop(signing.KEY_ENV, None)  # set by request_certificate, as in an instance process
            signing.trust.cache_clear()
            signing.signer.cache_clear()
    finally:
        server.shutdown()

    key = base64.b64encode(raw_public(Ed25519PrivateKey.generate())).decode()
    refusals: list[tuple[str, int]] = [
        (_token(core, namespace, pod, audience="elsewhere"), 401),  # a token for another audience
        (_token(core, namespace, {"name": "stray", "uid": stray.metadata.uid}), 403),  # no instance's pod
        ("not-a-token", 401),
    ]
    for token, status in refusals:
        with pytest.raises(Refused) as refused:
            issuer.issue(token, {"key": key})
        assert refused.value.status == status, refused.value
    core.delete_namespaced_pod("orders-1", namespace, grace_period_seconds=0)
    with pytest.raises(Refused) as refused:
        issuer.issue(token_file.read_text(), {"key": key})
    assert refused.value.status in (401, 403), "the token died with its pod"
