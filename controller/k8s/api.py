"""The operator's calls to the API server in its namespace: JoinPipelines, the objects they own, their
pods and checkpoint volumes, finalizers, status writes and events (`KubeApi`), and the forms answers
and times take on the wire (`as_dict`, `rfc3339`, `micro_time`), which the Lease elector shares.

Apart from the reconciler so that what a round decides and how it is written to Kubernetes read
separately: the `Operator` holds one `KubeApi` and calls the API server only through it.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Callable, Iterator, Mapping
from datetime import datetime, timezone
from typing import Any

import kubernetes
from kubernetes.client import ApiException

from controller.k8s.manifests import SPEC_HASH_ANNOTATION, selector_string
from controller.k8s.spec import API_VERSION, FIELD_MANAGER, GROUP, KIND, PLURAL, VERSION
from controller.k8s.status import failure_status

log = logging.getLogger(__name__)

OWNED_KINDS = ("StatefulSet", "Service", "ConfigMap", "PodDisruptionBudget")
"""What the operator creates per pipeline, each named after it and owned by it (ownerReferences), so the
garbage collector deletes them with the pipeline; the StatefulSet's checkpoint volumes go with it
(`persistentVolumeClaimRetentionPolicy.whenDeleted: Delete`)."""


def utc_now() -> datetime:
    return datetime.now(timezone.utc)


def rfc3339(moment: datetime) -> str:
    return moment.astimezone(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def micro_time(moment: datetime) -> str:
    """A MicroTime as the API server parses it (always six fractional digits)."""
    return moment.astimezone(timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def as_dict(api_client: kubernetes.client.ApiClient, value: object) -> dict[str, Any]:
    """A custom-object answer, or a typed model turned into the plain dict the API sent."""
    plain = api_client.sanitize_for_serialization(value)
    if not isinstance(plain, dict):
        raise TypeError(f"expected an object from the API server, got {type(value).__name__}")
    return plain


def failure_message(exc: Exception) -> str:
    """What a failed reconcile records on its pipeline: an API server's answer, or the exception."""
    if isinstance(exc, ApiException):
        return f"Kubernetes API: {exc.status} {exc.reason}: {(exc.body or '')[:500]}".strip()
    return f"{type(exc).__name__}: {exc}"


class KubeApi:
    """The operator's reads and writes in one namespace; its events name `identity` as their reporter."""

    def __init__(
        self,
        api_client: kubernetes.client.ApiClient,
        namespace: str,
        *,
        identity: str,
        wall: Callable[[], datetime],
    ) -> None:
        self.namespace = namespace
        self._api = api_client
        self._custom = kubernetes.client.CustomObjectsApi(api_client)
        self._apps = kubernetes.client.AppsV1Api(api_client)
        self._core = kubernetes.client.CoreV1Api(api_client)
        self._policy = kubernetes.client.PolicyV1Api(api_client)
        self._identity = identity
        self._wall = wall

    def pipelines(self) -> list[dict[str, Any]]:
        """Every JoinPipeline of the namespace."""
        listed = as_dict(
            self._api, self._custom.list_namespaced_custom_object(GROUP, VERSION, self.namespace, PLURAL)
        )
        items: list[dict[str, Any]] = listed.get("items", [])
        return items

    def pipeline_events(self, watch: kubernetes.watch.Watch) -> Iterator[Any]:
        """The namespace's JoinPipeline events through `watch` (whose `stop()` ends them), for up to 30 s."""
        return watch.stream(
            self._custom.list_namespaced_custom_object, GROUP, VERSION, self.namespace, PLURAL,
            timeout_seconds=30,
        )  # fmt: skip

    def _calls(self, kind: str) -> tuple[Callable[..., Any], Callable[..., Any]]:
        """The read and patch calls of an owned kind (`OWNED_KINDS`)."""
        apps, core, policy = self._apps, self._core, self._policy
        calls: dict[str, tuple[Callable[..., Any], Callable[..., Any]]] = {
            "StatefulSet": (apps.read_namespaced_stateful_set, apps.patch_namespaced_stateful_set),
            "Service": (core.read_namespaced_service, core.patch_namespaced_service),
            "ConfigMap": (core.read_namespaced_config_map, core.patch_namespaced_config_map),
            "PodDisruptionBudget": (
                policy.read_namespaced_pod_disruption_budget,
                policy.patch_namespaced_pod_disruption_budget,
            ),
        }
        return calls[kind]

    def pods(self, pipeline: str) -> list[dict[str, Any]]:
        found = self._core.list_namespaced_pod(self.namespace, label_selector=selector_string(pipeline))
        return list(as_dict(self._api, found).get("items", []))

    def claims(self, pipeline: str) -> list[dict[str, Any]]:
        """The pipeline's PersistentVolumeClaims (its instances' checkpoint volumes)."""
        found = self._core.list_namespaced_persistent_volume_claim(
            self.namespace, label_selector=selector_string(pipeline)
        )
        return list(as_dict(self._api, found).get("items", []))

    def delete_claim(self, name: str) -> bool:
        """Delete a PersistentVolumeClaim; False when it was gone already."""
        try:
            self._core.delete_namespaced_persistent_volume_claim(name, self.namespace)
        except ApiException as exc:
            if exc.status != 404:
                raise
            return False
        return True

    def read(self, kind: str, name: str) -> dict[str, Any] | None:
        read, _ = self._calls(kind)
        try:
            found = read(name, self.namespace)
        except ApiException as exc:
            if exc.status == 404:
                return None
            raise
        return as_dict(self._api, found)

    def apply(self, current: Mapping[str, Any] | None, desired: dict[str, Any]) -> bool:
        """Server-side apply `desired` unless `current` already matches it; True when it wrote."""
        if current is not None:
            annotations = current["metadata"].get("annotations") or {}
            same_hash = (
                annotations.get(SPEC_HASH_ANNOTATION)
                == desired["metadata"]["annotations"][SPEC_HASH_ANNOTATION]
            )
            replicas = (current.get("spec") or {}).get("replicas")
            if same_hash and replicas == (desired.get("spec") or {}).get("replicas"):
                return False
        _, patch = self._calls(desired["kind"])
        patch(
            desired["metadata"]["name"], self.namespace, desired,
            field_manager=FIELD_MANAGER, force=True, _content_type="application/apply-patch+yaml",
        )  # fmt: skip
        return True

    def set_finalizers(self, obj: dict[str, Any], finalizers: list[str]) -> None:
        """Change metadata.finalizers, guarded by the resourceVersion read (a conflict retries next round)."""
        meta = obj["metadata"]
        patch = {"metadata": {"finalizers": finalizers, "resourceVersion": meta["resourceVersion"]}}
        updated = as_dict(
            self._api,
            self._custom.patch_namespaced_custom_object(
                GROUP, VERSION, self.namespace, PLURAL, meta["name"], patch,
                _content_type="application/merge-patch+json",
            )
        )  # fmt: skip
        meta["finalizers"] = finalizers
        meta["resourceVersion"] = updated["metadata"]["resourceVersion"]

    def write_status(self, obj: dict[str, Any], status: Mapping[str, Any]) -> None:
        previous: Mapping[str, Any] = obj.get("status") or {}
        if all(previous.get(key) == value for key, value in status.items()):
            return
        self._custom.patch_namespaced_custom_object_status(
            GROUP, VERSION, self.namespace, PLURAL, obj["metadata"]["name"], {"status": status},
            _content_type="application/merge-patch+json",
        )  # fmt: skip

    def report_failure(self, obj: dict[str, Any], message: str) -> None:
        """Record a failed reconcile in the Ready condition, with one Warning event per new message."""
        previous: Mapping[str, Any] = obj.get("status") or {}
        status = failure_status(
            int(obj["metadata"].get("generation", 0)), message, previous, rfc3339(self._wall())
        )
        if all(previous.get(key) == value for key, value in status.items()):
            return
        try:
            self.write_status(obj, status)
            self.event(obj, "ReconcileFailed", message, "Warning")
        except ApiException as exc:
            log.warning("cannot record the failure on %s: %s", obj["metadata"]["name"], exc.reason)

    def event(self, obj: Mapping[str, Any], reason: str, message: str, kind: str = "Normal") -> None:
        """A core/v1 Event on the pipeline (shown by `kubectl describe jp`); failing to send one is logged."""
        meta = obj["metadata"]
        now = self._wall()
        body = {
            "apiVersion": "v1",
            "kind": "Event",
            "metadata": {"name": f"{meta['name']}.{uuid.uuid4().hex[:16]}", "namespace": self.namespace},
            "involvedObject": {
                "apiVersion": API_VERSION,
                "kind": KIND,
                "name": meta["name"],
                "namespace": self.namespace,
                "uid": meta["uid"],
            },
            "reason": reason,
            "message": message[:1024],
            "type": kind,
            "source": {"component": FIELD_MANAGER},
            "reportingComponent": FIELD_MANAGER,
            "reportingInstance": self._identity,
            "firstTimestamp": rfc3339(now),
            "lastTimestamp": rfc3339(now),
            "count": 1,
        }
        log.info("%s/%s %s: %s", self.namespace, meta["name"], reason, message)
        try:
            self._core.create_namespaced_event(
                self.namespace, kubernetes.client.CoreV1Event.model_validate(body)
            )
        except ApiException as exc:
            log.warning("cannot record event %s on %s: %s", reason, meta["name"], exc.reason)
