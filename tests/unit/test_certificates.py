"""Which instance pod the operator certifies a key for (decision 0064), and how a pod is rendered to ask."""

from __future__ import annotations

from typing import Any

import pytest

from controller.k8s.certificates import POD_NAME_CLAIM, POD_UID_CLAIM, Refused, Subject, subject_of
from controller.k8s.manifests import CONTROLLER_KEY_FILE, PIPELINE_LABEL, config_map, statefulset
from controller.k8s.spec import InstanceSettings, PipelineSpec
from pipeline.signing import ISSUER_ENV, TOKEN_AUDIENCE, TOKEN_ENV, TRUST_ENV

PREFIXES = {"orders": "shop.orders"}


def _review(
    pod: str = "orders-1", uid: str = "uid-1", namespace: str = "shop", **over: Any
) -> dict[str, Any]:
    user = {
        "username": f"system:serviceaccount:{namespace}:default",
        "extra": {POD_NAME_CLAIM: [pod], POD_UID_CLAIM: [uid]},
    }
    return {"authenticated": True, "user": user} | over


def _pod(
    name: str = "orders-1", uid: str = "uid-1", pipeline: str = "orders", owner: str = "orders"
) -> dict[str, Any]:
    return {
        "metadata": {
            "name": name,
            "uid": uid,
            "labels": {PIPELINE_LABEL: pipeline},
            "ownerReferences": [{"kind": "StatefulSet", "name": owner}],
        }
    }


def test_an_instance_pod_is_certified_as_itself_for_its_pipelines_topics() -> None:
    assert subject_of(_review(), "shop", _pod(), PREFIXES) == Subject("shop.orders", "orders-1")


@pytest.mark.parametrize(
    ("review", "pod", "status", "reason"),
    [
        ({"authenticated": False, "error": "audience mismatch"}, _pod(), 401, "not valid for the audience"),
        (_review(namespace="other"), _pod(), 403, "not a service account of namespace shop"),
        (_review() | {"user": {"username": "system:serviceaccount:shop:default"}}, _pod(), 403, "not bound"),
        (_review(), None, 403, "not running"),
        (_review(uid="uid-0"), _pod(), 403, "not running"),  # a token of an earlier pod of that name
        (_review(), _pod(pipeline="payments"), 403, "no instance of a JoinPipeline"),
        (_review(), _pod(owner="impostor"), 403, "no instance of a JoinPipeline"),
    ],
)
def test_a_token_that_does_not_prove_an_instance_pod_gets_nothing(
    review: dict[str, Any], pod: dict[str, Any] | None, status: int, reason: str
) -> None:
    with pytest.raises(Refused, match=reason) as refused:
        subject_of(review, "shop", pod, PREFIXES)
    assert refused.value.status == status


def _spec() -> PipelineSpec:
    return PipelineSpec.from_object(
        {
            "metadata": {"name": "orders", "namespace": "shop", "uid": "u-1", "generation": 1},
            "spec": {"kafka": {"bootstrapServers": "kafka:9092"}, "streams": ["A", "B"]},
        }
    )


def test_with_signing_an_instance_pod_has_a_token_for_fluxjoin_the_issuer_and_the_controllers_key() -> None:
    settings = InstanceSettings(
        image="fluxjoin:test", signing_issuer="http://op.shop.svc:9108", controller_public_key="PEM"
    )
    pod = statefulset(_spec(), settings, 2)["spec"]["template"]["spec"]
    env = {e["name"]: e.get("value") for e in pod["containers"][0]["env"]}
    assert env[ISSUER_ENV] == "http://op.shop.svc:9108"
    assert env[TRUST_ENV].endswith(f"/{CONTROLLER_KEY_FILE}")
    (token,) = [v for v in pod["volumes"] if v["name"] == "signing-token"]
    (source,) = token["projected"]["sources"]
    assert source["serviceAccountToken"]["audience"] == TOKEN_AUDIENCE
    mounts = {m["name"]: m["mountPath"] for m in pod["containers"][0]["volumeMounts"]}
    assert env[TOKEN_ENV] == f"{mounts['signing-token']}/token"
    assert pod["automountServiceAccountToken"] is False, "only the fluxjoin-audience token, no API access"
    assert config_map(_spec(), "PEM")["data"][CONTROLLER_KEY_FILE] == "PEM"


def test_without_signing_an_instance_pod_has_no_token_at_all() -> None:
    pod = statefulset(_spec(), InstanceSettings(image="fluxjoin:test"), 2)["spec"]["template"]["spec"]
    assert not {ISSUER_ENV, TOKEN_ENV, TRUST_ENV} & {e["name"] for e in pod["containers"][0]["env"]}
    assert [v["name"] for v in pod["volumes"] if "projected" in v] == []
    assert CONTROLLER_KEY_FILE not in config_map(_spec())["data"]
