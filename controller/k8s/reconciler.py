"""The `Operator`: its loop (rounds, the moves in flight followed between them, the JoinPipeline watch)
and its rounds, each reconciling every pipeline once.

The reconcile loop is level-triggered: `reconcile_once` reads the pipelines, the owned objects and the
mover's state, computes one plan per pipeline, carries it out, and writes status only when it differs, so
running it again with nothing changed writes nothing. What to do next is decided by the pure
`controller.scaling.plan_step`, the objects are rendered by the pure `controller.k8s.manifests` and sent
by `controller.k8s.api`; this module observes, acts and records. Moves themselves are carried out by a
`PidMover` per pipeline (the Kafka control-topic protocol in production), which keeps this module free
of Kafka. Only the holder of a coordination.k8s.io Lease reconciles (`LeaseElector`), so several
replicas are safe.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Collection, Sequence
from datetime import datetime
from functools import partial
from typing import Any

import kubernetes

from controller.assignment import FinishedMove, Move
from controller.k8s.api import KubeApi, failure_message, rfc3339, utc_now
from controller.k8s.health import OperatorMetrics
from controller.k8s.lease import LeaseElector
from controller.k8s.manifests import (
    checkpoint_claim_ordinal,
    config_map,
    pod_disruption_budget,
    service,
    statefulset,
)
from controller.k8s.ports import MoverFactory, PidMover
from controller.k8s.spec import FIELD_MANAGER, FINALIZER, InstanceSettings, PipelineSpec
from controller.k8s.status import Observed, render_status, restarting_instances, stopping_instances
from controller.rounds import PolicyRounds
from controller.scaling import Plan, StepKind, plan_step

log = logging.getLogger(__name__)


def _of_pipeline(uid: str, key: tuple[str, str]) -> bool:
    """Whether a mover's key (pipeline uid, bootstrap servers) is of the pipeline `uid`."""
    return key[0] == uid


RETRY_MAX_S = 300.0
"""A pipeline whose reconcile failed is tried again after 1, 2, 4 ... seconds, at most this long, or at
once when its spec changes: one pipeline with an unreachable broker (each attempt waiting on Kafka's
timeouts) must not slow every other pipeline's round."""


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
        wall: Callable[[], datetime] = utc_now,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.namespace = namespace
        self.metrics = OperatorMetrics()
        self._api = KubeApi(api_client, namespace, identity=identity, wall=wall)
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
                for _ in self._api.pipeline_events(watch):
                    self._wake.set()
                    if self._stopping.is_set():
                        watch.stop()
            except Exception as exc:  # the loop's resync covers any gap; retry the watch shortly
                log.debug("JoinPipeline watch ended: %s", exc)
                self._stopping.wait(1.0)

    # --- one round ---

    def reconcile_once(self) -> None:
        """Reconcile every JoinPipeline in the namespace once; one pipeline's failure does not stop others."""
        items = self._api.pipelines()
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
                self._api.report_failure(obj, failure_message(exc))
                from controller.moves.kafka_mover import ControllerFenced
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
        owned = (
            config_map(spec, self._settings.controller_public_key, self._settings.pull_secrets),
            service(spec, self._settings),
        )
        for desired in (*owned, pod_disruption_budget(spec)):
            self._api.apply(self._api.read(desired["kind"], spec.name), desired)

        current = self._api.read("StatefulSet", spec.name)
        pods = self._api.pods(spec.name)
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
        if self._api.apply(current, statefulset(spec, self._settings, plan.width)):
            if before is None:
                self._api.event(obj, "Created", f"StatefulSet {spec.name} with {plan.width} instances")
            elif before < plan.width:
                self._api.event(
                    obj, "ScaledOut", f"StatefulSet {spec.name}: {before} -> {plan.width} instances"
                )
            elif before > plan.width:
                self._api.event(
                    obj, "ScaledIn", f"StatefulSet {spec.name}: {before} -> {plan.width} instances"
                )
            else:
                self._api.event(obj, "Updated", f"StatefulSet {spec.name}: instance pod template changed")
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
        self._api.write_status(obj, render_status(observed, previous, rfc3339(self._wall())))

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
            self._api.event(obj, "Started", plan.reason)
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
        self._api.event(obj, reason, message)
        for move in moves:
            text = f"pid {move.pid}: {move.source} -> {move.target} ({move.mode.value})"
            self._api.event(obj, "MoveRequested", text)

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
                self._api.event(obj, "MoveCompleted", f"{text} (epoch {done.epoch})")
            else:
                self._api.event(obj, "MoveAborted", f"{text} ended with owner {done.owner}", "Warning")

    # --- cleanup ---

    def _let_go(self, obj: dict[str, Any]) -> None:
        """Remove the finalizer earlier operators added to each pipeline; the garbage collector deletes
        what the pipeline owns (a finalizer held `helm uninstall` when the operator went first)."""
        uid = obj["metadata"]["uid"]
        self._drop_movers(lambda key: key[0] == uid)
        self._api.set_finalizers(obj, [f for f in obj["metadata"].get("finalizers", []) if f != FINALIZER])

    def _delete_claims(self, obj: dict[str, Any], pipeline: str, *, keep_below: int) -> int:
        """Delete the checkpoint volumes of ordinals >= keep_below: a removed instance's checkpoint holds
        offsets of pids it no longer owns and must never be picked up by a later pod of that ordinal."""
        count = 0
        for claim in self._api.claims(pipeline):
            name = claim["metadata"]["name"]
            ordinal = checkpoint_claim_ordinal(pipeline, name)
            if ordinal is None or ordinal < keep_below or claim["metadata"].get("deletionTimestamp"):
                continue
            if not self._api.delete_claim(name):
                continue
            count += 1
            self._api.event(obj, "VolumeDeleted", f"checkpoint volume {name} of a removed instance")
        return count

    def healthy(self, max_silence_s: float = 60.0) -> bool:
        """False when the loop has not completed a round for `max_silence_s` (the liveness probe)."""
        return time.monotonic() - self.metrics.last_loop < max_silence_s
