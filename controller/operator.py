"""The JoinPipeline operator: reconciles every pipeline in one namespace, one leader at a time.

For each JoinPipeline it owns an instance StatefulSet (a checkpoint volume per pod), the ConfigMap its
pods read their configuration from, its headless Service and a PodDisruptionBudget, and it keeps the
number of instances at spec.replicas without ever leaving a pid without an owner: on scale-out it grows
the StatefulSet first and moves pids onto the new instances once they report ready; on scale-in it moves
every pid off the highest ordinals first and shrinks the StatefulSet only when they own nothing. What to
do next is decided by the pure `controller.scaling.plan_step` and the objects are rendered by the pure
`controller.workload`; this module observes, acts and records.

The reconcile loop is level-triggered: `reconcile_once` reads the pipelines, the owned objects and the
mover's state, computes one plan per pipeline, carries it out, and writes status only when it differs, so
running it again with nothing changed writes nothing. Moves themselves are carried out by a `PidMover`
per pipeline (the Kafka control-topic protocol in production), which keeps this module free of Kafka.
Only the holder of a coordination.k8s.io Lease reconciles (`LeaseElector`), so several replicas are safe.
"""

from __future__ import annotations

import logging
import signal
import socket
import threading
import time
import uuid
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timezone
from functools import partial
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, Protocol

import kubernetes
from kubernetes.client import ApiException

from controller.assignment import Assignment, FinishedMove, Move
from controller.policies.base import InstanceStats, Snapshot
from controller.rounds import PolicyRounds
from controller.scaling import Plan, StepKind, plan_step
from controller.workload import (
    API_VERSION,
    FIELD_MANAGER,
    FINALIZER,
    GROUP,
    KIND,
    PLURAL,
    SPEC_HASH_ANNOTATION,
    VERSION,
    InstanceSettings,
    Observed,
    PipelineSpec,
    checkpoint_claim_ordinal,
    config_map,
    failure_status,
    pod_disruption_budget,
    render_status,
    restarting_instances,
    selector_string,
    service,
    statefulset,
    stopping_instances,
)

log = logging.getLogger(__name__)

SERVICE_ACCOUNT_NAMESPACE = Path("/var/run/secrets/kubernetes.io/serviceaccount/namespace")
OWNED_KINDS = ("StatefulSet", "Service", "ConfigMap", "PodDisruptionBudget")
"""What the operator creates per pipeline, each named after it and owned by it (ownerReferences), so the
garbage collector deletes them with the pipeline; the StatefulSet's checkpoint volumes go with it
(`persistentVolumeClaimRetentionPolicy.whenDeleted: Delete`)."""


class PidMover(Protocol):
    """Carries out pid moves for one pipeline (the Kafka control-topic protocol in production).

    After `start` returns, `assignment()` returns the published assignment (or a later one); after
    `request` returns, `in_flight()` lists the requested moves until each completes, and a completed move
    shows in `assignment()` at the next epoch. The operator relies on both to stay idempotent.
    """

    def assignment(self) -> Assignment | None:
        """The assignment of record, None before the first."""
        ...

    def start(self, initial: Assignment) -> None:
        """Publish the first assignment (epoch 0)."""
        ...

    def request(self, moves: Sequence[Move]) -> None:
        """Ask for moves; idempotent for moves already in flight."""
        ...

    def in_flight(self) -> Sequence[Move]:
        """Moves requested and not yet complete."""
        ...

    def releasing(self) -> Sequence[Move]:
        """Moves of `in_flight()` whose pid its source has not released yet."""
        ...

    def finished(self) -> Sequence[FinishedMove]:
        """Moves that left `in_flight()` since the last call, each returned once."""
        ...

    def ready_instances(self) -> set[str]:
        """Instances that heartbeat and whose query has run a batch: ready to take pids."""
        ...

    def pods(self, ready: Collection[str] | None, restarting: Collection[str], grace_s: float) -> None:
        """What Kubernetes says of the wanted instance pods: only `ready` ones may take pids (None: no
        pod is seen, heartbeats alone decide); the `restarting` ones may be silent up to `grace_s`
        before they are dead."""
        ...

    def instance_stats(self) -> Mapping[str, InstanceStats]:
        """The latest statistics per instance id (for status); instances that reported nothing are absent."""
        ...

    def step(self) -> object:
        """Advance the moves in flight (called every round before the mover's state is read, and
        between rounds while moves are in flight)."""
        ...

    def await_news(self) -> bool:
        """Wait briefly (at most a tenth of a second) for the pipeline's next control message."""
        ...

    def snapshot(self, interval_s: float, now_s: float, last_adaptation_s: float | None) -> Snapshot | None:
        """The pipeline's statistics of the last `interval_s` seconds for the policy, None before epoch 0."""
        ...

    def close(self) -> None:
        """Release the mover's connections when the operator drops it."""
        ...


MoverFactory = Callable[[PipelineSpec], PidMover]


def make_mover(spec: PipelineSpec) -> PidMover:
    """The production mover for one pipeline: `controller.moves.KafkaPidMover` on its control topic."""

    def say(line: str) -> None:
        log.info("%s/%s: %s", spec.namespace, spec.name, line)

    from controller.moves import KafkaPidMover

    return KafkaPidMover(
        spec.to_config(), spec.bootstrap_servers, heartbeat_timeout_s=spec.heartbeat_timeout_s, say=say
    )


def _of_pipeline(uid: str, key: tuple[str, str]) -> bool:
    """Whether a mover's key (pipeline uid, bootstrap servers) is of the pipeline `uid`."""
    return key[0] == uid


def default_namespace() -> str:
    """The namespace of the pod's service account, or "default" outside a cluster."""
    try:
        return SERVICE_ACCOUNT_NAMESPACE.read_text().strip() or "default"
    except OSError:
        return "default"


def _utc_now() -> datetime:
    return datetime.now(timezone.utc)


def _rfc3339(moment: datetime) -> str:
    return moment.astimezone(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def _micro_time(moment: datetime) -> str:
    """A MicroTime as the API server parses it (always six fractional digits)."""
    return moment.astimezone(timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def _as_dict(api_client: kubernetes.client.ApiClient, value: object) -> dict[str, Any]:
    """A custom-object answer, or a typed model turned into the plain dict the API sent."""
    plain = api_client.sanitize_for_serialization(value)
    if not isinstance(plain, dict):
        raise TypeError(f"expected an object from the API server, got {type(value).__name__}")
    return plain


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
    wall: Callable[[], datetime] = _utc_now
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
        return self._stamp(_as_dict(self.coordination.api_client, created), acquired=True, first=True)

    def _stamp(self, lease: Mapping[str, Any], *, acquired: bool, first: bool = False) -> bool:
        """Write this candidate as holder with a fresh renewTime (and acquireTime when it just got the
        Lease), guarded by the resourceVersion read; False when someone else wrote in between."""
        now = _micro_time(self.wall())
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
        self._observe(_as_dict(self.coordination.api_client, written).get("spec") or {})
        return True

    def _read(self) -> dict[str, Any]:
        lease = self.coordination.read_namespaced_lease(self.name, self.namespace)
        return _as_dict(self.coordination.api_client, lease)

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


RETRY_MAX_S = 300.0
"""A pipeline whose reconcile failed is tried again after 1, 2, 4 ... seconds, at most this long, or at
once when its spec changes: one pipeline with an unreachable broker (each attempt waiting on Kafka's
timeouts) must not slow every other pipeline's round."""


@dataclass
class OperatorMetrics:
    """Counters served on /metrics (Prometheus text format)."""

    leader: bool = False
    reconciles: int = 0
    failures: int = 0
    pipelines: int = 0
    last_loop: float = field(default_factory=time.monotonic)

    def render(self) -> str:
        return (
            "# HELP fluxjoin_operator_leader 1 when this replica holds the Lease.\n"
            "# TYPE fluxjoin_operator_leader gauge\n"
            f"fluxjoin_operator_leader {int(self.leader)}\n"
            "# HELP fluxjoin_operator_pipelines JoinPipelines seen in the last round.\n"
            "# TYPE fluxjoin_operator_pipelines gauge\n"
            f"fluxjoin_operator_pipelines {self.pipelines}\n"
            "# HELP fluxjoin_operator_reconciles_total Pipeline reconciles run.\n"
            "# TYPE fluxjoin_operator_reconciles_total counter\n"
            f"fluxjoin_operator_reconciles_total {self.reconciles}\n"
            "# HELP fluxjoin_operator_reconcile_failures_total Pipeline reconciles that failed.\n"
            "# TYPE fluxjoin_operator_reconcile_failures_total counter\n"
            f"fluxjoin_operator_reconcile_failures_total {self.failures}\n"
        )


def _failure_message(exc: Exception) -> str:
    if isinstance(exc, ApiException):
        return f"Kubernetes API: {exc.status} {exc.reason}: {(exc.body or '')[:500]}".strip()
    return f"{type(exc).__name__}: {exc}"


class Operator:
    """Reconciles the JoinPipelines of one namespace; `step()` is one round, `run()` loops until stopped."""

    def __init__(
        self,
        api_client: kubernetes.client.ApiClient,
        namespace: str,
        movers: MoverFactory,
        settings: InstanceSettings,
        *,
        elector: LeaseElector | None = None,
        identity: str = FIELD_MANAGER,
        wall: Callable[[], datetime] = _utc_now,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.namespace = namespace
        self.metrics = OperatorMetrics()
        self._api = api_client
        self._custom = kubernetes.client.CustomObjectsApi(api_client)
        self._apps = kubernetes.client.AppsV1Api(api_client)
        self._core = kubernetes.client.CoreV1Api(api_client)
        self._policy = kubernetes.client.PolicyV1Api(api_client)
        self._make_mover = movers
        self._settings = settings
        self._elector = elector
        self._identity = identity
        self._wall = wall
        self._clock = clock
        self._movers: dict[tuple[str, str], PidMover] = {}
        self._retry: dict[str, tuple[int, float, int]] = {}
        """uid -> (failures in a row, clock time before which the pipeline waits, its generation then)."""
        self._rounds: dict[tuple[str, str], PolicyRounds] = {}
        self._wake = threading.Event()
        self._stopping = threading.Event()
        self._watching: kubernetes.watch.Watch | None = None

    # --- the loop ---

    def step(self) -> bool:
        """One round: keep or take the Lease, and reconcile every pipeline if this replica leads."""
        leader = self._elector.acquire_or_renew() if self._elector is not None else True
        if leader != self.metrics.leader:
            log.info("%s: %s", self._identity, "leading" if leader else "not leading")
        self.metrics.leader = leader
        if leader:
            self.reconcile_once()
        else:
            self._drop_movers(lambda _: True)
        self.metrics.last_loop = time.monotonic()
        return leader

    def run(self, period_s: float = 2.0) -> None:
        """Reconcile on every JoinPipeline change and at least every `period_s`, until `request_stop()`.

        Between rounds the moves in flight are stepped as their control messages arrive
        (`_follow_moves`), and a completed move brings the next round forward; the periodic round is
        what notices the mover's other changes (heartbeats, statistics), which no Kubernetes event
        announces. A round that keeps failing stops refreshing `healthy()`, so the liveness probe
        restarts the pod.
        """
        watcher = threading.Thread(target=self._watch, name="fluxjoin-watch", daemon=True)
        watcher.start()
        try:
            while not self._stopping.is_set():
                try:
                    self.step()
                except Exception as exc:  # the API server is unreachable or the like: retry next round
                    log.warning("round failed: %s", exc)
                self._follow_moves(period_s)
                self._wake.clear()
        finally:
            if self._elector is not None and self.metrics.leader:
                self._elector.release()
            self.metrics.leader = False
            watcher.join(timeout=5)

    def _follow_moves(self, period_s: float) -> None:
        """Wait for the next round, stepping the movers that have moves in flight whenever their control
        log has news, as the local controller does (decisions 0038, 0042).

        The next round comes after `period_s`, on a JoinPipeline event, or as soon as a move completes,
        so that its event, the status and the scaling plan's next step do not wait for the period. A
        step between rounds can publish an assignment, so it is taken only while the Lease is surely
        still held (`LeaseElector.holds`); a mover that fails waits for the next round, which reports
        the failure on its pipeline.
        """
        deadline = time.monotonic() + period_s
        # Only a round adds movers or moves, so the counts taken here are carried from step to step.
        moving = [(mover, count) for mover in self._movers.values() if (count := len(mover.in_flight()))]
        while (
            moving
            and not self._wake.is_set()
            and time.monotonic() < deadline
            and (self._elector is None or self._elector.holds())
        ):
            try:
                moving[0][0].await_news()  # the other pipelines' moves are stepped after every wait too
                still = []
                for mover, count in moving:
                    mover.step()
                    left = len(mover.in_flight())
                    if left < count:
                        self._wake.set()
                    if left:
                        still.append((mover, left))
                moving = still
            except Exception as exc:
                log.warning("stepping moves between rounds failed: %s", exc)
                break
        self._wake.wait(max(0.0, deadline - time.monotonic()))

    def request_stop(self) -> None:
        self._stopping.set()
        self._wake.set()
        watching = self._watching
        if watching is not None:
            watching.stop()  # also shuts the open connection down, so the watch thread ends now

    def _watch(self) -> None:
        """Wake the loop on any JoinPipeline event; the loop re-reads everything (level-triggered)."""
        while not self._stopping.is_set():
            watch = self._watching = kubernetes.watch.Watch()
            try:
                for _ in watch.stream(
                    self._custom.list_namespaced_custom_object, GROUP, VERSION, self.namespace, PLURAL,
                    timeout_seconds=30,
                ):  # fmt: skip
                    self._wake.set()
                    if self._stopping.is_set():
                        watch.stop()
            except Exception as exc:  # the loop's resync covers any gap; retry the watch shortly
                log.debug("JoinPipeline watch ended: %s", exc)
                self._stopping.wait(1.0)

    # --- one round ---

    def reconcile_once(self) -> None:
        """Reconcile every JoinPipeline in the namespace once; one pipeline's failure does not stop others."""
        listed = _as_dict(
            self._api, self._custom.list_namespaced_custom_object(GROUP, VERSION, self.namespace, PLURAL)
        )
        items: list[dict[str, Any]] = listed.get("items", [])
        self.metrics.pipelines = len(items)
        for obj in items:
            meta = obj["metadata"]
            uid, generation = meta["uid"], int(meta.get("generation", 0))
            failed, retry_at, failed_generation = self._retry.get(uid, (0, 0.0, generation))
            waiting = self._clock() < retry_at and generation == failed_generation
            if waiting and not meta.get("deletionTimestamp"):
                continue  # a pipeline that keeps failing (its broker away) waits its turn, not the others
            self.metrics.reconciles += 1
            try:
                self.reconcile(obj)
                self._retry.pop(uid, None)
            except Exception as exc:  # reported on the pipeline itself; the other pipelines go on
                self._retry[uid] = (failed + 1, self._clock() + min(RETRY_MAX_S, 2.0**failed), generation)
                self.metrics.failures += 1
                log.warning("reconcile of %s failed: %s", obj["metadata"]["name"], exc, exc_info=True)
                self._report_failure(obj, _failure_message(exc))
                from controller.moves import ControllerFenced
                from pipeline.topics import broker_away

                # The next round's mover fences the other writer; or, after an outage, starts over from
                # the control log instead of going on from a step cut short (decision 0052).
                if isinstance(exc, ControllerFenced) or broker_away(exc):
                    self._drop_movers(partial(_of_pipeline, obj["metadata"]["uid"]))
        live = {obj["metadata"]["uid"] for obj in items}
        self._drop_movers(lambda key: key[0] not in live)

    def reconcile(self, obj: dict[str, Any]) -> None:
        """Bring one pipeline one step closer to its spec and record where it stands."""
        meta = obj["metadata"]
        if meta.get("deletionTimestamp"):
            if FINALIZER in meta.get("finalizers", []):
                self._let_go(obj)
            return
        spec = PipelineSpec.from_object(obj)
        mover = self._mover(spec)
        # Before the StatefulSet: its pods mount the ConfigMap, and a pod started without it waits.
        for desired in (config_map(spec), service(spec, self._settings), pod_disruption_budget(spec)):
            self._apply(self._read(desired["kind"], spec.name), desired)

        current = self._read("StatefulSet", spec.name)
        pods = self._pods(spec.name)
        wanted = spec.instances(current["spec"]["replicas"] if current is not None else 0)
        if pods:
            restarting = restarting_instances(pods, wanted)
            mover.pods(set(wanted) - restarting, restarting, spec.restart_grace_s)
        else:  # instances that are not pods of this namespace (run elsewhere): heartbeats alone decide
            mover.pods(None, (), spec.restart_grace_s)
        # Under a `drain` planned restart, the pids of a terminating pod move away while it waits.
        terminating = frozenset(stopping_instances(pods)) if spec.drain_timeout_s > 0 else frozenset()
        mover.step()
        self._report_finished_moves(obj, mover.finished())
        previous: dict[str, Any] = obj.get("status") or {}
        plan = self._plan(spec, mover, terminating)
        decided = self._act(obj, mover, plan)
        if (
            decided is None
            and self._plan(spec, mover, terminating, mover.releasing()).kind is StepKind.STEADY
        ):
            decided = self._policy_round(obj, spec, mover)  # a released pid holds up no round

        before = current["spec"]["replicas"] if current is not None else None
        if self._apply(current, statefulset(spec, self._settings, plan.width)):
            if before is None:
                self._event(obj, "Created", f"StatefulSet {spec.name} with {plan.width} instances")
            elif before < plan.width:
                self._event(obj, "ScaledOut", f"StatefulSet {spec.name}: {before} -> {plan.width} instances")
            elif before > plan.width:
                self._event(obj, "ScaledIn", f"StatefulSet {spec.name}: {before} -> {plan.width} instances")
            else:
                self._event(obj, "Updated", f"StatefulSet {spec.name}: instance pod template changed")
        self._delete_claims(obj, spec.name, keep_below=plan.width)

        # Status shows where the pipeline stands after this round's action, so that the next round,
        # seeing nothing new, renders the same status and writes nothing.
        settled = self._plan(spec, mover, terminating) if decided else plan
        assignment, in_flight = mover.assignment(), tuple(mover.in_flight())
        observed = Observed(
            spec=spec,
            plan=settled,
            decision=decided,
            statefulset_replicas=plan.width,
            assignment=assignment,
            in_flight=in_flight,
            ready=mover.ready_instances(),
            stats=mover.instance_stats(),
        )
        self._write_status(obj, render_status(observed, previous, _rfc3339(self._wall())))

    def _plan(
        self,
        spec: PipelineSpec,
        mover: PidMover,
        stopping: Collection[str],
        in_flight: Sequence[Move] | None = None,
    ) -> Plan:
        """The scaling step, with the mover's moves in flight unless given others."""
        return plan_step(
            pipeline=spec.name,
            partitions=spec.partitions,
            replicas=spec.replicas,
            assignment=mover.assignment(),
            in_flight=tuple(mover.in_flight() if in_flight is None else in_flight),
            ready=mover.ready_instances(),
            mode=spec.handoff_mode,
            stopping=stopping,
        )

    def _act(self, obj: dict[str, Any], mover: PidMover, plan: Plan) -> str | None:
        """Hand the plan's action to the mover, with events: what was done, None when nothing was."""
        if plan.kind is StepKind.START and plan.initial is not None:
            mover.start(plan.initial)
            self._event(obj, "Started", plan.reason)
            return plan.reason
        if plan.kind in (StepKind.DRAIN, StepKind.SPREAD):
            mover.request(plan.moves)
            self._announce(
                obj, plan.moves, "Draining" if plan.kind is StepKind.DRAIN else "Spreading", plan.reason
            )
            return plan.reason
        return None

    def _policy_round(self, obj: dict[str, Any], spec: PipelineSpec, mover: PidMover) -> str | None:
        """Run the pipeline's policy if a round is due (only while no scaling step is under way):
        what it moved, None when it moved nothing. A changed policy or setting starts over."""
        key, params, now = (spec.uid, spec.bootstrap_servers), spec.policy_params(), self._clock()
        rounds = self._rounds.get(key)
        if rounds is None or rounds.policy.name != spec.policy or rounds.params != params:
            rounds = self._rounds[key] = PolicyRounds.begin(spec.policy, params, now)
        decision = rounds.tick(mover, now)
        if decision is None or not decision.moves:
            return None
        reason = f"policy {spec.policy}: {decision.reason}"
        self._announce(obj, decision.moves, "Rebalancing", reason)
        return reason

    def _announce(self, obj: dict[str, Any], moves: Sequence[Move], reason: str, message: str) -> None:
        """Events for requested moves: one for the step (`reason`, `message`), one per move."""
        self._event(obj, reason, message)
        for move in moves:
            text = f"pid {move.pid}: {move.source} -> {move.target} ({move.mode.value})"
            self._event(obj, "MoveRequested", text)

    def _mover(self, spec: PipelineSpec) -> PidMover:
        key = (spec.uid, spec.bootstrap_servers)
        if key not in self._movers:
            self._drop_movers(lambda k: k[0] == spec.uid)
            self._movers[key] = self._make_mover(spec)
        return self._movers[key]

    def _drop_movers(self, which: Callable[[tuple[str, str]], bool]) -> None:
        """Forget (and close) the movers of pipelines that are gone or no longer led by this replica."""
        for key in [key for key in self._movers if which(key)]:
            self._movers.pop(key).close()
            self._rounds.pop(key, None)

    def _report_finished_moves(self, obj: dict[str, Any], finished: Sequence[FinishedMove]) -> None:
        """An event for each move that left the moves in flight, as the mover's steps saw it happen
        (not by comparing the status with what is in flight: one failed status write would lose one)."""
        for done in finished:
            move = done.move
            text = f"pid {move.pid}: {move.source} -> {move.target}"
            if done.completed:
                self._event(obj, "MoveCompleted", f"{text} (epoch {done.epoch})")
            else:
                self._event(obj, "MoveAborted", f"{text} ended with owner {done.owner}", "Warning")

    # --- cleanup ---

    def _let_go(self, obj: dict[str, Any]) -> None:
        """Remove the finalizer earlier operators added to each pipeline; the garbage collector deletes
        what the pipeline owns (a finalizer held `helm uninstall` when the operator went first)."""
        uid = obj["metadata"]["uid"]
        self._drop_movers(lambda key: key[0] == uid)
        self._set_finalizers(obj, [f for f in obj["metadata"].get("finalizers", []) if f != FINALIZER])

    def _delete_claims(self, obj: dict[str, Any], pipeline: str, *, keep_below: int) -> int:
        """Delete the checkpoint volumes of ordinals >= keep_below: a removed instance's checkpoint holds
        offsets of pids it no longer owns and must never be picked up by a later pod of that ordinal."""
        claims = _as_dict(
            self._api,
            self._core.list_namespaced_persistent_volume_claim(
                self.namespace, label_selector=selector_string(pipeline)
            ),
        )
        count = 0
        for claim in claims.get("items", []):
            name = claim["metadata"]["name"]
            ordinal = checkpoint_claim_ordinal(pipeline, name)
            if ordinal is None or ordinal < keep_below or claim["metadata"].get("deletionTimestamp"):
                continue
            try:
                self._core.delete_namespaced_persistent_volume_claim(name, self.namespace)
            except ApiException as exc:
                if exc.status != 404:
                    raise
                continue
            count += 1
            self._event(obj, "VolumeDeleted", f"checkpoint volume {name} of a removed instance")
        return count

    # --- Kubernetes reads and writes ---

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

    def _pods(self, pipeline: str) -> list[dict[str, Any]]:
        found = self._core.list_namespaced_pod(self.namespace, label_selector=selector_string(pipeline))
        return list(_as_dict(self._api, found).get("items", []))

    def _read(self, kind: str, name: str) -> dict[str, Any] | None:
        read, _ = self._calls(kind)
        try:
            found = read(name, self.namespace)
        except ApiException as exc:
            if exc.status == 404:
                return None
            raise
        return _as_dict(self._api, found)

    def _apply(self, current: Mapping[str, Any] | None, desired: dict[str, Any]) -> bool:
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

    def _set_finalizers(self, obj: dict[str, Any], finalizers: list[str]) -> None:
        """Change metadata.finalizers, guarded by the resourceVersion read (a conflict retries next round)."""
        meta = obj["metadata"]
        patch = {"metadata": {"finalizers": finalizers, "resourceVersion": meta["resourceVersion"]}}
        updated = _as_dict(
            self._api,
            self._custom.patch_namespaced_custom_object(
                GROUP, VERSION, self.namespace, PLURAL, meta["name"], patch,
                _content_type="application/merge-patch+json",
            )
        )  # fmt: skip
        meta["finalizers"] = finalizers
        meta["resourceVersion"] = updated["metadata"]["resourceVersion"]

    def _write_status(self, obj: dict[str, Any], status: Mapping[str, Any]) -> None:
        previous: Mapping[str, Any] = obj.get("status") or {}
        if all(previous.get(key) == value for key, value in status.items()):
            return
        self._custom.patch_namespaced_custom_object_status(
            GROUP, VERSION, self.namespace, PLURAL, obj["metadata"]["name"], {"status": status},
            _content_type="application/merge-patch+json",
        )  # fmt: skip

    def _report_failure(self, obj: dict[str, Any], message: str) -> None:
        """Record a failed reconcile in the Ready condition, with one Warning event per new message."""
        previous: Mapping[str, Any] = obj.get("status") or {}
        status = failure_status(
            int(obj["metadata"].get("generation", 0)), message, previous, _rfc3339(self._wall())
        )
        if all(previous.get(key) == value for key, value in status.items()):
            return
        try:
            self._write_status(obj, status)
            self._event(obj, "ReconcileFailed", message, "Warning")
        except ApiException as exc:
            log.warning("cannot record the failure on %s: %s", obj["metadata"]["name"], exc.reason)

    def _event(self, obj: Mapping[str, Any], reason: str, message: str, kind: str = "Normal") -> None:
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
            "firstTimestamp": _rfc3339(now),
            "lastTimestamp": _rfc3339(now),
            "count": 1,
        }
        log.info("%s/%s %s: %s", self.namespace, meta["name"], reason, message)
        try:
            self._core.create_namespaced_event(
                self.namespace, kubernetes.client.CoreV1Event.model_validate(body)
            )
        except ApiException as exc:
            log.warning("cannot record event %s on %s: %s", reason, meta["name"], exc.reason)

    def healthy(self, max_silence_s: float = 60.0) -> bool:
        """False when the loop has not completed a round for `max_silence_s` (the liveness probe)."""
        return time.monotonic() - self.metrics.last_loop < max_silence_s


def serve_health(operator: Operator, port: int, host: str = "0.0.0.0") -> ThreadingHTTPServer:
    """Serve /healthz and /metrics in a daemon thread (the chart's probes and scrape annotations)."""

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            if self.path == "/healthz":
                ok = operator.healthy()
                self._send(200 if ok else 503, "ok\n" if ok else "reconcile loop stalled\n")
            elif self.path == "/metrics":
                self._send(200, operator.metrics.render(), "text/plain; version=0.0.4")
            else:
                self._send(404, "not found\n")

        def _send(self, code: int, text: str, content_type: str = "text/plain") -> None:
            data = text.encode()
            self.send_response(code)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, format: str, *args: Any) -> None:
            log.debug("health: " + format, *args)

    server = ThreadingHTTPServer((host, port), Handler)
    threading.Thread(target=server.serve_forever, name="fluxjoin-health", daemon=True).start()
    return server


@dataclass(frozen=True, slots=True, kw_only=True)
class OperatorOptions:
    """Everything `fluxjoin operator` is started with (flags or the chart's FLUXJOIN_* variables)."""

    namespace: str
    identity: str = field(default_factory=socket.gethostname)
    leader_election: bool = True
    lease_name: str = "fluxjoin-operator"
    kubeconfig: Path | None = None
    metrics_port: int = 9108
    instance: InstanceSettings = field(default_factory=InstanceSettings)


class OperatorConfigError(RuntimeError):
    """The operator cannot reach the API server with the configuration it was given."""


def _api_client(kubeconfig: Path | None) -> kubernetes.client.ApiClient:
    try:
        if kubeconfig is not None:
            return kubernetes.config.new_client_from_config(config_file=str(kubeconfig))
        kubernetes.config.load_incluster_config()
    except kubernetes.config.ConfigException as exc:
        where = f"kubeconfig {kubeconfig}" if kubeconfig else "the in-cluster service account"
        raise OperatorConfigError(f"cannot configure the Kubernetes client from {where}: {exc}") from exc
    return kubernetes.client.ApiClient()


def run_operator(options: OperatorOptions) -> None:
    """Run the operator until SIGTERM or SIGINT, with `make_mover` for every pipeline.

    Raises OperatorConfigError when the API server cannot be configured.
    """
    api_client = _api_client(options.kubeconfig)
    elector = (
        LeaseElector(
            kubernetes.client.CoordinationV1Api(api_client),
            options.namespace,
            options.lease_name,
            options.identity,
        )
        if options.leader_election
        else None
    )
    operator = Operator(
        api_client,
        options.namespace,
        make_mover,
        options.instance,
        elector=elector,
        identity=options.identity,
    )
    server = serve_health(operator, options.metrics_port)
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: operator.request_stop())
    log.info("reconciling JoinPipelines in namespace %s as %s", options.namespace, options.identity)
    try:
        operator.run()
    finally:
        server.shutdown()
