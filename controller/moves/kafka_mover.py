"""The move driver on Kafka: `KafkaPidMover` reads the control log and the metrics topic, plans with
`controller.moves.driver.plan_step`, and publishes the next assignment in the controller's transaction.

Apart from the driver because everything here does I/O: the controller's transactional id and its
fencing (`ControllerFenced`), the fencing of dead instances' transactional ids (`fence_instance`), the
ids minted for moves and recoveries, and `fluxjoin move`'s requests (`request_moves`, `await_request`).
"""

from __future__ import annotations

import time
import uuid
from collections import deque
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import replace
from typing import Any

from controller.arrivals import InputTail
from controller.assignment import Assignment, FinishedMove, Move
from controller.moves.driver import Markers, SpillPoints, holders, plan_step, to_recover
from controller.moves.views import (
    finished_moves,
    moves_in_flight,
    moves_releasing,
    request_outcome,
    requested_moves,
)
from controller.observation.estimates import busy_fraction, described_by
from controller.observation.liveness import DEFAULT_HEARTBEAT_TIMEOUT_S, Liveness
from controller.observation.observer import Observer
from controller.observation.snapshot import snapshot_of
from controller.policies.base import InstanceStats, Snapshot
from pipeline.config import Config
from pipeline.control import ControlLog, publish
from pipeline.kafka_client import kafka_config
from pipeline.protocol import AssignmentMsg, Mode, MoveRequestMsg, MoveSpec, SpillGateMsg

TICK_S = 0.1
"""The longest wait between two steps of the moves in flight; a control message (a move's
acknowledgement) ends the wait when it arrives: on the pause of a moved pid, every tick counts
(decisions 0034, 0038)."""


class ControllerFenced(RuntimeError):
    """Another controller of the pipeline started after this one: only the newest publishes."""


class KafkaPidMover:
    """The controller's hands: publishes assignments, requests moves, recovers dead instances.

    Creates the pipeline's topics if they are missing (the controller or operator of a new pipeline
    starts before its instances), and fails clearly if existing ones have the wrong partition count.
    """

    def __init__(
        self,
        cfg: Config,
        bootstrap: str,
        heartbeat_timeout_s: float = DEFAULT_HEARTBEAT_TIMEOUT_S,
        clock: Callable[[], float] = time.monotonic,
        say: Callable[[str], None] = print,
    ) -> None:
        from confluent_kafka import Producer

        from pipeline.topics import ensure_topics

        ensure_topics(cfg, bootstrap)
        self.cfg, self.bootstrap, self.say = cfg, bootstrap, say
        self.log = ControlLog(bootstrap, cfg.control_topic)
        self.observer = Observer(cfg, bootstrap, heartbeat_timeout_s, clock)
        self.input_tail = InputTail(cfg, bootstrap)
        self._producer = Producer(
            {
                **kafka_config(bootstrap),
                # One writer of assignments: a controller's `init_transactions` fences every earlier
                # controller of the pipeline (its next commit fails) and aborts what a killed one left
                # open; the log is read only after it, so this one plans from everything they published.
                "transactional.id": controller_transactional_id(cfg),
                "transaction.timeout.ms": 15_000,
            }
        )
        self._producer.init_transactions(60)
        self._fenced: set[str] = set()  # "instance@incarnation" whose transactional id was fenced
        self._pods_ready: frozenset[str] | None = None  # Ready instance pods, when on Kubernetes (`pods`)
        self._requested: dict[str, MoveSpec] = {}
        self._said_before: set[str] = set()
        # Read by the operator every round; a local controller reports moves by its log lines and never
        # reads it, so only the newest are kept.
        self._finished: deque[FinishedMove] = deque(maxlen=1000)

    # --- the PidMover protocol of the Kubernetes operator ---

    def assignment(self) -> Assignment | None:
        a = self.log.catch_up().assignment
        if a is None:
            return None
        return Assignment(epoch=a.epoch, owners={**a.owners, **{p: m.target for p, m in a.moving.items()}})

    def start(self, initial: Assignment) -> None:
        """Publish epoch 0 if the log has no assignment yet, then a snapshot of the log (the state a
        reader takes if the records before it are ever deleted)."""
        if self.log.catch_up().assignment is None:
            self._publish(AssignmentMsg(epoch=0, owners=dict(initial.owners)))
            self.say(f"epoch 0: {len(initial.owners)} pids over {len(initial.instances)} instances")
        self._publish(None)

    def request(self, moves: Sequence[Move]) -> None:
        for move in moves:
            spec = MoveSpec(
                move_id=f"m-{uuid.uuid4().hex[:8]}",
                pid=move.pid,
                source=move.source,
                target=move.target,
                mode=move.mode,
            )
            if not any(s.pid == move.pid for s in self._requested.values()):
                self._requested[spec.move_id] = spec
        self.step()

    def gate_spills(self, spill: bool) -> None:
        """Publish a `SpillGateMsg` when the log says otherwise (never said counts as spilling)."""
        if (self.log.catch_up().spill is not False) != spill:
            self._publish(SpillGateMsg(spill=spill))
            self.say(
                f"spill gate: instances spill {'at their threshold' if spill else 'only past their budget'}"
            )

    def in_flight(self) -> Sequence[Move]:
        return moves_in_flight(self.log.catch_up())

    def releasing(self) -> Sequence[Move]:
        return moves_releasing(self.log.catch_up())

    def finished(self) -> Sequence[FinishedMove]:
        """Moves that left `in_flight()` in this mover's steps since the last call, each returned once."""
        done = list(self._finished)
        self._finished.clear()
        return done

    def await_news(self) -> bool:
        """Wait for the next control message, at most `TICK_S`; True when one came."""
        return self.log.await_news(TICK_S)

    def pods(self, ready: Collection[str] | None, restarting: Collection[str], grace_s: float) -> None:
        """What Kubernetes says of the instance pods. Only instances whose pod is Ready (and wanted) may
        take pids: a heartbeat from the last minute also comes from an instance scaled in a moment ago,
        and a controller that has just started would move pids onto it. Instances whose pods are being
        (re)started may be silent for `grace_s` seconds before they count as dead (`Observer.liveness`)."""
        self._pods_ready = None if ready is None else frozenset(ready)
        self.observer.restarting, self.observer.restart_grace_s = frozenset(restarting), grace_s

    def ready_instances(self) -> set[str]:
        """Live instances whose query has run a batch: pids moved onto them pause no longer than onto
        any other (decision 0043). An instance evicted under the incarnation it runs is none."""
        self.observer.poll()
        a = self.log.catch_up().assignment
        evicted = set(a.evicted) if a is not None else set()
        live = self.observer.liveness().live
        ready = {i for i, inc in live.items() if f"{i}@{inc}" not in evicted} & self.observer.serving
        return ready if self._pods_ready is None else ready & self._pods_ready

    def instance_stats(self, window_s: float = 10.0) -> Mapping[str, InstanceStats]:
        """Busy fraction of the batches that ended in the last `window_s` seconds (`described_by`) and
        the state held, per reporting instance."""
        since = time.time() * 1000 - window_s * 1000
        history: dict[str, list[dict[str, Any]]] = {}
        for b in self.observer.batches:
            history.setdefault(b["instance"], []).append(b)
        return {
            i: InstanceStats(
                instance=i,
                busy_fraction=busy_fraction(described_by(h, since)),
                state_bytes=int(h[-1].get("state_bytes", 0)),
                memory_limit_bytes=int(h[-1].get("state_budget_bytes", 0)),
                tuples_per_s=sum(b.get("tuples_in", 0) for b in h if b["time_ms"] >= since) / window_s,
                lag=sum(h[-1].get("lag", {}).values()),
            )
            for i, h in sorted(history.items())
        }

    def snapshot(self, interval_s: float, now_s: float, last_adaptation_s: float | None) -> Snapshot | None:
        """The policy's view of the last `interval_s` seconds (`controller.rounds.PolicyMover`)."""
        current = self.assignment()
        if current is None:
            return None
        in_flight = frozenset(m.pid for m in self.in_flight())
        # Ready, not only live: an instance whose query has not run a batch reports no batch, and the
        # statistics would read it as idle and send it pids that pause until it serves (decision 0043).
        live = sorted(self.ready_instances())
        batches, now_ms = self.observer.batches, time.time() * 1000
        return snapshot_of(
            batches,
            live,
            current,
            in_flight,
            now_ms,
            interval_s,
            now_s,
            last_adaptation_s,
            self.observer.readings,
            len(self.cfg.streams),
            self.input_tail.rates(now_ms),
            self.observer.empty_s,
        )

    # --- driving ---

    def step(self) -> list[str]:
        """Read the log and the metrics, publish the next assignment if anything changed."""
        self.observer.poll()
        view = self.log.catch_up()
        if view.assignment is not None:
            a = view.assignment
            self.observer.expect(holders(a.owners, a.moving, a.tracks))
        liveness = self.observer.liveness()  # once: one step acts on one answer
        markers: Markers = {}
        spilled: SpillPoints = {}
        if view.assignment is not None and (dying := to_recover(view.assignment, liveness)):
            self._fence(view.assignment, dying, liveness)
            markers, spilled, incarnations = self._newest_markers()
            liveness = replace(liveness, incarnations={**incarnations, **liveness.incarnations})
            view = self.log.catch_up()  # what the fenced committed before the fence
        requested, said = requested_moves(view, time.time() * 1000)
        msg, planned = plan_step(
            view,
            liveness,
            [*self._requested.values(), *requested],
            markers,
            self._earliest,
            _recovery_id,
            spilled,
        )
        said += planned
        if msg is not None:
            self._publish(msg)
            self._finished.extend(finished_moves(moves_in_flight(view), self.log.view))
        started = {m.move_id for m in msg.moving.values()} if msg else set()
        self._requested = {
            k: v for k, v in self._requested.items() if k not in started and k not in view.started
        }
        fresh = [line for line in said if line not in self._said_before]
        self._said_before = set(said)  # a refusal repeats every step while it holds; say it once
        for line in fresh:
            self.say(line)
        return fresh

    def _publish(self, msg: AssignmentMsg | SpillGateMsg | None) -> None:
        """Publish `msg` (None: only a snapshot) in a transaction of the controller's transactional id: it
        commits only while no other controller of the pipeline has started since this one
        (`ControllerFenced` otherwise). A failed publication is not in this controller's view, so its
        next step plans from the log as it is. A snapshot of the log rides along when one is due."""
        from confluent_kafka import KafkaException

        try:
            self._producer.begin_transaction()
            if msg is None or self.log.snapshot_due():
                self.log.write_snapshot(self._producer)  # the view before `msg`, which follows it
            if msg is not None:
                publish(self._producer, self.cfg.control_topic, msg)
            self._producer.commit_transaction(30)
        except KafkaException as exc:
            error = exc.args[0]
            if error.fatal():
                raise ControllerFenced(
                    f"another controller of pipeline {self.cfg.pipeline} started: this one stops "
                    f"publishing ({error.str()})"
                ) from None
            if error.txn_requires_abort():
                self._producer.abort_transaction(30)
            raise
        if msg is not None:
            self.log.add_own(msg)
        self.log.catch_up()

    def _fence(self, a: AssignmentMsg, instances: Sequence[str], liveness: Liveness) -> None:
        """Fence the instances whose pids are about to be recovered, in Kafka: whatever they still do,
        no transaction of theirs commits from now on. An instance that rejoined under a new
        incarnation is not fenced: its own start fenced the old one."""
        evicted_as = dict(e.partition("@")[::2] for e in a.evicted)
        for i in instances:
            live_as = liveness.live.get(i)
            if live_as is not None and i in evicted_as and live_as != evicted_as[i]:
                continue
            key = f"{i}@{liveness.incarnations.get(i, '?')}"
            if key not in self._fenced:
                fence_instance(self.cfg, self.bootstrap, i)
                self._fenced.add(key)
                self.say(f"{i} fenced: no transaction of it commits any more")

    def _newest_markers(self) -> tuple[Markers, SpillPoints, dict[str, str]]:
        """Each instance's newest commit marker: its cutoffs and spill points per pid, and the
        incarnation that wrote it."""
        from pipeline.commits import newest_markers

        newest = newest_markers(self.cfg, self.bootstrap)
        markers = {instance: marker.cutoffs() for instance, marker in newest.items()}
        spilled = {instance: marker.spilled for instance, marker in newest.items()}
        return markers, spilled, {instance: marker.incarnation for instance, marker in newest.items()}

    def _earliest(self, pid: int) -> Mapping[str, int]:
        from pipeline.topics import admin_client, partition_offsets

        wanted = [(self.cfg.input_topic(s), pid) for s in self.cfg.streams]
        found = partition_offsets(admin_client(self.bootstrap), wanted, latest=False)
        return {s: found[(self.cfg.input_topic(s), pid)] for s in self.cfg.streams}

    def close(self) -> None:
        self.observer.close()
        self.input_tail.close()
        self.log.close()
        self._producer.flush(10)


def controller_transactional_id(cfg: Config) -> str:
    """The controller's transactional id: one per pipeline, and no instance's (`pipeline.instance`)."""
    return f"{cfg.pipeline}/controller"


def fence_instance(cfg: Config, bootstrap: str, instance: str) -> None:
    """Initialise `instance`'s transactional id (its sink's, `pipeline.instance`): the broker aborts the
    transaction it has open and bumps the id's epoch, so a stalled instance that wakes up commits nothing
    more, and the commit markers read after this are all it will ever have committed."""
    from confluent_kafka import Producer

    producer = Producer({**kafka_config(bootstrap), "transactional.id": f"{cfg.pipeline}.{instance}"})
    producer.init_transactions(60)


def request_moves(
    cfg: Config, bootstrap: str, pids: Sequence[int], target: str, mode: Mode, wait_s: float = 0.0
) -> MoveRequestMsg:
    """Ask the running controller for moves (what `fluxjoin move` does). A caller that waits `wait_s`
    (above 0) gives the request that long: a controller that reads it later drops it."""
    from confluent_kafka import Producer

    expires_ms = int((time.time() + wait_s) * 1000) if wait_s > 0 else None
    msg = MoveRequestMsg(
        request_id=f"req-{uuid.uuid4().hex[:8]}",
        pids=tuple(pids),
        target=target,
        mode=mode,
        expires_ms=expires_ms,
    )
    producer = Producer(kafka_config(bootstrap))
    publish(producer, cfg.control_topic, msg)
    if producer.flush(30):
        raise RuntimeError("the move request was not acknowledged by Kafka within 30 s")
    return msg


def await_request(
    cfg: Config, bootstrap: str, request: MoveRequestMsg, wait_s: float
) -> dict[int, str] | None:
    """Each requested pid's owner of record once all of `request`'s moves are over (`request_outcome`,
    read from the control log every 0.5 s), or None when they are not over within `wait_s` seconds."""
    log = ControlLog(bootstrap, cfg.control_topic)
    try:
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline:
            owners = request_outcome(log.catch_up(), request)
            if owners is not None:  # the owners of record: the target may have died during a move
                return owners
            time.sleep(0.5)
        return None
    finally:
        log.close()


def _recovery_id() -> str:
    """A move id for a handoff that recovers a dead instance's pid (`plan_step`'s `new_id`)."""
    return f"recover-{uuid.uuid4().hex[:8]}"
