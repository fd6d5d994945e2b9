"""Leader election among operator replicas on a coordination.k8s.io Lease (`LeaseElector`).

Apart from the reconciler because it is a protocol of its own with the API server (client-go's), which
the loop only asks whether this replica leads; `fluxjoin operator --no-leader-election` runs without it.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

import kubernetes
from kubernetes.client import ApiException

from controller.k8s.api import as_dict, micro_time, utc_now

log = logging.getLogger(__name__)


@dataclass
class LeaseElector:
    """Leader election on a coordination.k8s.io Lease, as client-go does it.

    The holder renews the Lease every round; another candidate takes it over only when it has seen the
    same Lease record unchanged for leaseDurationSeconds on its own monotonic clock (so clock skew
    between nodes does not matter). Writes carry the resourceVersion they read, so two candidates
    racing for a free Lease cannot both win.
    """

    coordination: kubernetes.client.CoordinationV1Api
    namespace: str
    name: str
    identity: str
    duration_s: int = 15
    clock: Callable[[], float] = time.monotonic
    wall: Callable[[], datetime] = utc_now
    _observed: tuple[Any, ...] | None = field(default=None, init=False)
    _observed_at: float = field(default=0.0, init=False)
    _renewed_at: float | None = field(default=None, init=False)

    def acquire_or_renew(self) -> bool:
        """True when this candidate holds the Lease after the call."""
        asked_at = self.clock()
        held = self._acquire_or_renew()
        self._renewed_at = asked_at if held else None
        return held

    def holds(self) -> bool:
        """True while the last renewal, timed from before it was asked for, is younger than two thirds
        of the Lease's duration. Another candidate takes over only after seeing the renewed record
        unchanged for a whole duration, so until then this one still holds it (client-go's renew
        deadline leaves the same margin)."""
        return self._renewed_at is not None and self.clock() - self._renewed_at < self.duration_s * 2 / 3

    def _acquire_or_renew(self) -> bool:
        try:
            lease = self._read()
        except ApiException as exc:
            if exc.status != 404:
                log.warning("cannot read Lease %s: %s", self.name, exc.reason)
                return False
            return self._create()
        spec = lease.get("spec") or {}
        self._observe(spec)
        holder = spec.get("holderIdentity")
        duration = spec.get("leaseDurationSeconds") or self.duration_s
        if holder and holder != self.identity and self.clock() - self._observed_at < duration:
            return False
        taken = self._stamp(lease, acquired=holder != self.identity)
        if taken and holder != self.identity:
            log.info("%s took Lease %s/%s over from %s", self.identity, self.namespace, self.name, holder)
        return taken

    def _create(self) -> bool:
        """Create the Lease held by this candidate; its times are stamped right after, by a patch.

        The typed client writes a whole-second MicroTime without its fraction, which the API server
        refuses, so the times never go through a `V1Lease`.
        """
        lease = kubernetes.client.V1Lease.model_validate(
            {
                "metadata": {"name": self.name, "namespace": self.namespace},
                "spec": {
                    "holderIdentity": self.identity,
                    "leaseDurationSeconds": self.duration_s,
                    "leaseTransitions": 0,
                },
            }
        )
        try:
            created = self.coordination.create_namespaced_lease(self.namespace, lease)
        except ApiException as exc:
            if exc.status != 409:
                log.warning("cannot create Lease %s: %s", self.name, exc.reason)
            return False
        log.info("%s created Lease %s/%s", self.identity, self.namespace, self.name)
        return self._stamp(as_dict(self.coordination.api_client, created), acquired=True, first=True)

    def _stamp(self, lease: Mapping[str, Any], *, acquired: bool, first: bool = False) -> bool:
        """Write this candidate as holder with a fresh renewTime (and acquireTime when it just got the
        Lease), guarded by the resourceVersion read; False when someone else wrote in between."""
        now = micro_time(self.wall())
        spec = lease.get("spec") or {}
        changes: dict[str, Any] = {
            "holderIdentity": self.identity,
            "leaseDurationSeconds": self.duration_s,
            "renewTime": now,
        }
        if acquired:
            changes["acquireTime"] = now
            if not first:
                changes["leaseTransitions"] = int(spec.get("leaseTransitions") or 0) + 1
        patch = {"metadata": {"resourceVersion": lease["metadata"]["resourceVersion"]}, "spec": changes}
        try:
            written = self.coordination.patch_namespaced_lease(
                self.name, self.namespace, patch, _content_type="application/merge-patch+json"
            )
        except ApiException as exc:
            if exc.status != 409:
                log.warning("cannot renew Lease %s: %s", self.name, exc.reason)
            return False
        self._observe(as_dict(self.coordination.api_client, written).get("spec") or {})
        return True

    def _read(self) -> dict[str, Any]:
        lease = self.coordination.read_namespaced_lease(self.name, self.namespace)
        return as_dict(self.coordination.api_client, lease)

    def _observe(self, spec: Mapping[str, Any]) -> None:
        record = (spec.get("holderIdentity"), spec.get("renewTime"), spec.get("leaseTransitions"))
        if record != self._observed:
            self._observed, self._observed_at = record, self.clock()

    def release(self) -> None:
        """Give the Lease up (on shutdown) so that another replica takes over at once."""
        self._renewed_at = None
        try:
            lease = self._read()
            if (lease.get("spec") or {}).get("holderIdentity") != self.identity:
                return
            patch = {
                "metadata": {"resourceVersion": lease["metadata"]["resourceVersion"]},
                "spec": {"holderIdentity": None, "leaseDurationSeconds": 1},
            }
            self.coordination.patch_namespaced_lease(
                self.name, self.namespace, patch, _content_type="application/merge-patch+json"
            )
        except ApiException as exc:
            log.warning("cannot release Lease %s: %s", self.name, exc.reason)
