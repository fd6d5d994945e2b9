"""The operator as the certificate authority of its instance pods' signing keys (decision 0064).

A StatefulSet's pods share one template, so no Secret can hold one pod's key and not the others'. What
tells pods apart is the service account token the kubelet projects into each, bound to the pod (its
name and uid are in the token, and the token dies with the pod). An instance pod makes a key at its
start and sends its public half with that token (`pipeline.signing.request_certificate`); the operator
asks the API server who the token belongs to (a TokenReview, audience `fluxjoin`), and certifies the
key as the instance that pod is, for the pipeline whose StatefulSet owns it. The certificate is signed
with the controller's key, which every reader trusts.

`subject_of` is the rule, pure; `Issuer` gathers what it judges (the review, the pod, the pipelines).
"""

from __future__ import annotations

import base64
import binascii
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import kubernetes

from controller.k8s.api import as_dict
from controller.k8s.manifests import PIPELINE_LABEL
from controller.k8s.spec import GROUP, PLURAL, VERSION, PipelineSpec
from pipeline.signing import TOKEN_AUDIENCE, Certificate, Signer

POD_NAME_CLAIM = "authentication.kubernetes.io/pod-name"
POD_UID_CLAIM = "authentication.kubernetes.io/pod-uid"


class Refused(Exception):
    """A certificate request the operator turns down: `status` is the HTTP status it answers with."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


@dataclass(frozen=True, slots=True)
class Subject:
    """Whom a certificate names: an instance (named as its pod) of the pipeline with topics `pipeline.*`."""

    pipeline: str
    instance: str


def subject_of(
    review: Mapping[str, Any], namespace: str, pod: Mapping[str, Any] | None, prefixes: Mapping[str, str]
) -> Subject:
    """Whom the token reviewed in `review` (a TokenReview's status) may be certified as: the instance
    pod it is bound to, in `namespace`, which must be `pod` (as the API server has it now, None if there
    is none) and belong to a pipeline of `prefixes` (pipeline name -> its topic prefix) through the
    pipeline's StatefulSet. Refused otherwise, with the reason."""
    if not review.get("authenticated"):
        raise Refused(
            401, f"the token is not valid for the audience {TOKEN_AUDIENCE!r}: {review.get('error', '')}"
        )
    user = review.get("user") or {}
    parts = str(user.get("username", "")).split(":")
    if len(parts) != 4 or parts[:2] != ["system", "serviceaccount"] or parts[2] != namespace:
        raise Refused(403, f"{user.get('username')} is not a service account of namespace {namespace}")
    extra = user.get("extra") or {}
    names, uids = extra.get(POD_NAME_CLAIM) or [], extra.get(POD_UID_CLAIM) or []
    if len(names) != 1 or len(uids) != 1:
        raise Refused(403, "the token is not bound to a pod")
    meta = (pod or {}).get("metadata") or {}
    if pod is None or meta.get("name") != names[0] or meta.get("uid") != uids[0]:
        raise Refused(403, f"pod {names[0]} is not running in namespace {namespace}")
    pipeline = str((meta.get("labels") or {}).get(PIPELINE_LABEL, ""))
    owners = {(o.get("kind"), o.get("name")) for o in meta.get("ownerReferences") or []}
    if pipeline not in prefixes or ("StatefulSet", pipeline) not in owners:
        raise Refused(403, f"pod {names[0]} is no instance of a JoinPipeline in namespace {namespace}")
    return Subject(prefixes[pipeline], names[0])


class Issuer:
    """Answers an instance pod's certificate request (POST /certificates on the operator's port)."""

    def __init__(self, api_client: kubernetes.client.ApiClient, namespace: str, controller: Signer) -> None:
        self._api = api_client
        self._auth = kubernetes.client.AuthenticationV1Api(api_client)
        self._core = kubernetes.client.CoreV1Api(api_client)
        self._custom = kubernetes.client.CustomObjectsApi(api_client)
        self.namespace, self.controller = namespace, controller

    def issue(self, token: str, request: Mapping[str, Any]) -> bytes:
        """The certificate (`pipeline.signing.Certificate`, as bytes) of the key in `request` for the
        pod `token` is bound to; Refused when it may not have one."""
        try:
            key = base64.b64decode(str(request.get("key", "")), validate=True)
        except binascii.Error:
            key = b""
        if len(key) != 32:
            raise Refused(400, "the request names no Ed25519 public key ({'key': base64 of its 32 bytes})")
        review = kubernetes.client.V1TokenReview(
            spec=kubernetes.client.V1TokenReviewSpec(token=token, audiences=[TOKEN_AUDIENCE])
        )
        status = as_dict(self._api, self._auth.create_token_review(review)).get("status") or {}
        names = ((status.get("user") or {}).get("extra") or {}).get(POD_NAME_CLAIM) or []
        pod = self._pod(names[0]) if status.get("authenticated") and len(names) == 1 else None
        subject = subject_of(status, self.namespace, pod, self._prefixes())
        return Certificate.issue(self.controller.key, subject.pipeline, subject.instance, key).to_bytes()

    def _pod(self, name: str) -> dict[str, Any] | None:
        found = self._core.list_namespaced_pod(self.namespace, field_selector=f"metadata.name={name}")
        items = as_dict(self._api, found).get("items") or []
        return dict(items[0]) if items else None

    def _prefixes(self) -> dict[str, str]:
        listed = self._custom.list_namespaced_custom_object(GROUP, VERSION, self.namespace, PLURAL)
        prefixes = {}
        for obj in as_dict(self._api, listed).get("items") or []:
            try:
                spec = PipelineSpec.from_object(obj)
            except ValueError:
                continue  # an invalid pipeline has no instances to certify
            prefixes[spec.name] = spec.topic_prefix
        return prefixes
