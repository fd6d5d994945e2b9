"""Carries out pid moves through the control protocol (`pipeline/protocol.py`) on Kafka.

`plan_step` is the whole protocol driver as a pure function: from the control view (newest assignment,
acknowledgements, requests), the live instances and the requested moves, it computes the next assignment
to publish, or None when nothing changes. It is level-triggered: the control log holds all the state, so
a controller killed in the middle of a move continues it after a restart, and running a step twice
publishes nothing new. `KafkaPidMover` wraps it with the Kafka reads and writes.

Per move: (1) the pid goes in transit (no owner, `moving`), (2) once the source's `Released` is in the
log (a replay's as soon as the source has planned the batch that releases it) it goes to the target with
a `Handoff` (cutoff, snapshot), (3) once the target's `Acquired` is in the
log the handoff is dropped. A `parallel_track` move also lists the pid in `tracks` from step (2) until
the source's `TrackDone` (its old tuples expired); no other move of the pid starts meanwhile. Dead
instances (no heartbeat for the timeout) lose their pids to live ones by `replay` from their last
committed offsets, and are listed as evicted until they return empty.
"""

from __future__ import annotations

import json
import time
import uuid
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from controller.arrivals import InputTail
from controller.assignment import Assignment, FinishedMove, Move
from controller.policies.base import InstanceStats, Snapshot
from controller.rounds import busy_fraction, described_by, shortest_empty_s, snapshot_of
from pipeline.config import Config
from pipeline.control import ControlLog, publish
from pipeline.protocol import (
    AssignmentMsg,
    ControlView,
    Handoff,
    Mode,
    MoveRequestMsg,
    MoveSpec,
)

DEFAULT_HEARTBEAT_TIMEOUT_S = 10.0
TICK_S = 0.1
"""The longest wait between two steps of the moves in flight; a control message (a move's
acknowledgement) ends the wait when it arrives: on the pause of a moved pid, every tick counts
(decisions 0034, 0038)."""


@dataclass(frozen=True, slots=True)
class Liveness:
    """Which instances heartbeat (name -> incarnation), as the observer saw them."""

    live: Mapping[str, str]
    # Instances whose silence is confirmed (past the timeout, and past the controller's own start grace).
    dead: frozenset[str]
    # The last incarnation heard from each instance, live or dead (eviction names it).
    incarnations: Mapping[str, str] = field(default_factory=dict)


def plan_step(
    view: ControlView,
    liveness: Liveness,
    requested: Sequence[MoveSpec],
    committed: Callable[[str, int], Mapping[str, int] | None],
    earliest: Callable[[int], Mapping[str, int]],
) -> tuple[AssignmentMsg | None, list[str]]:
    """The next assignment (None: nothing to publish) and what happened, as lines for the log.

    `committed(instance, pid)` is the end offset the instance's newest commit marker records for the pid
    (None if it never committed it); `earliest(pid)` the log start offsets, for pids nobody processed.
    """
    a = view.assignment
    if a is None:
        return None, []
    owners = dict(a.owners)
    moving = dict(a.moving)
    handoffs = dict(a.handoffs)
    tracks = dict(a.tracks)
    track_handoffs = dict(a.track_handoffs)
    evicted = list(a.evicted)
    said: list[str] = []

    for p, h in list(handoffs.items()):
        if h.move_id in view.acquired:
            del handoffs[p]
            said.append(f"move {h.move_id}: pid {p} now processed by {owners.get(p)}")
    for p, h in list(track_handoffs.items()):
        if h.move_id in view.acquired:
            del track_handoffs[p]
    for p, m in list(moving.items()):
        released = view.released.get(m.move_id)
        if released is not None:
            del moving[p]
            owners[p] = m.target
            handoffs[p] = Handoff(
                move_id=m.move_id,
                mode=m.mode,
                cutoff=released.cutoff,
                snapshot=released.snapshot,
                stream_max=released.stream_max,
            )
            if m.mode is Mode.PARALLEL_TRACK:
                tracks[p] = m
                said.append(f"move {m.move_id}: pid {p} runs on {m.source} (old tuples) and {m.target}")
            else:
                said.append(f"move {m.move_id}: pid {p} released by {m.source}, handed to {m.target}")
    for p, m in list(tracks.items()):
        old_done, new_done = (view.track_ended(m.move_id, side) for side in ("old", "new"))
        if old_done and new_done:
            del tracks[p]
            track_handoffs.pop(p, None)
            said.append(f"move {m.move_id}: pid {p}'s parallel track is over")
        elif old_done and m.source:
            tracks[p] = replace(m, source="")
            track_handoffs.pop(p, None)
            said.append(f"move {m.move_id}: pid {p}'s old tuples expired on {m.source}, which lets it go")

    # Instances that return after eviction (a new incarnation) are members again, with no pids.
    for entry in list(evicted):
        name, _, incarnation = entry.partition("@")
        if name in liveness.live and liveness.live[name] != incarnation:
            evicted.remove(entry)
            said.append(f"{name} rejoined as a new, empty instance")

    # Every dead instance not yet evicted, with pids or without: on return it must start empty either way.
    already = {e.partition("@")[0] for e in evicted}
    dead = sorted(i for i in liveness.dead if i not in already)
    if dead:
        survivors = sorted(i for i in liveness.live if i not in dead and not _is_evicted(i, evicted))
        if not survivors:
            return _publish(a, owners, moving, handoffs, tracks, track_handoffs, evicted, said)
        load = {i: sum(1 for o in owners.values() if o == i) for i in survivors}

        def least_loaded(avoid: str = "") -> str:
            target = min(survivors, key=lambda i: (i == avoid, load[i], i))
            load[target] += 1
            return target

        for d in dead:
            # An overlap's two sides need two instances: a side recovers on any survivor but the other.
            others = {m.target for m in tracks.values() if m.source == d}
            others |= {m.source for p, m in tracks.items() if owners.get(p) == d and m.source}
            if any(all(i == o for i in survivors) for o in others):
                said.append(f"{d} is dead: waiting for it or another instance (a parallel track needs two)")
                continue
            for p, m in list(moving.items()):
                if m.target == d:  # retarget: the source may release at any moment
                    moving[p] = replace(m, target=least_loaded(m.source))
            lost = sorted(p for p, o in owners.items() if o == d)
            lost += sorted(p for p, m in moving.items() if m.source == d)
            for p in lost:
                move = moving.pop(p, None)
                track = tracks.get(p)
                # Never onto the overlap's old side, even once the new side's part is over: one
                # instance holds one window per pid.
                target = least_loaded(track.source if track else "")
                if track is not None:
                    tracks[p] = replace(track, target=target)
                if track is not None and not view.track_ended(track.move_id, "new"):
                    if p not in handoffs:  # the overlap's new side: its tuples since the cutoff, re-read
                        handoffs[p] = _resume(view, track, committed(d, p))
                elif p not in handoffs:  # a handoff never taken stays: the new target starts where it said
                    # (after the new side's part of an overlap, too, a plain replay rebuilds its window)
                    cutoff = committed(d, p) or earliest(p)
                    move_id = f"recover-{uuid.uuid4().hex[:8]}"
                    handoffs[p] = Handoff(move_id=move_id, mode=Mode.REPLAY, cutoff=cutoff)
                owners[p] = target
                why = f" (its move {move.move_id} is abandoned)" if move else ""
                said.append(f"{d} is dead: pid {p} recovered on {target} by replay{why}")
            for p, m in sorted(tracks.items()):
                if m.source == d:  # the overlap's old side: its window rebuilt, then re-read since the cutoff
                    holder = least_loaded(m.target)
                    if p not in track_handoffs:
                        track_handoffs[p] = _resume(view, m, committed(d, p))
                    tracks[p] = replace(m, source=holder)
                    said.append(f"{d} is dead: pid {p}'s old tuples recovered on {holder} by replay")
            evicted.append(f"{d}@{liveness.incarnations.get(d, '?')}")

    for m in requested:
        p = m.pid
        busy = p in moving or p in handoffs or p in tracks
        if owners.get(p) != m.source or busy or m.move_id in view.started:
            continue
        if m.target in liveness.dead or m.target not in liveness.live:
            said.append(f"move of pid {p} to {m.target} refused: {m.target} is not live")
            continue
        del owners[p]
        moving[p] = m
        said.append(f"move {m.move_id}: pid {p} {m.source} -> {m.target} ({m.mode.value}) started")
    return _publish(a, owners, moving, handoffs, tracks, track_handoffs, evicted, said)


def _resume(view: ControlView, track: MoveSpec, committed: Mapping[str, int] | None) -> Handoff:
    """Where a side of a parallel track whose instance died resumes: at its newest committed offsets,
    after re-reading silently from the overlap's cutoff (both known from the sender's `Released`)."""
    released = view.released[track.move_id]
    return Handoff(
        move_id=f"recover-{uuid.uuid4().hex[:8]}",
        mode=Mode.PARALLEL_TRACK,
        cutoff=committed or released.cutoff,
        stream_max=released.stream_max,
        since=released.cutoff,
    )


def _is_evicted(instance: str, evicted: list[str]) -> bool:
    return any(e.partition("@")[0] == instance for e in evicted)


def _publish(
    a: AssignmentMsg,
    owners: dict[int, str],
    moving: dict[int, MoveSpec],
    handoffs: dict[int, Handoff],
    tracks: dict[int, MoveSpec],
    track_handoffs: dict[int, Handoff],
    evicted: list[str],
    said: list[str],
) -> tuple[AssignmentMsg | None, list[str]]:
    same = (
        owners == dict(a.owners)
        and moving == dict(a.moving)
        and handoffs == dict(a.handoffs)
        and tracks == dict(a.tracks)
        and track_handoffs == dict(a.track_handoffs)
        and tuple(evicted) == a.evicted
    )
    if same:
        return None, said
    return AssignmentMsg(
        epoch=a.epoch + 1,
        owners=owners,
        moving=moving,
        handoffs=handoffs,
        tracks=tracks,
        track_handoffs=track_handoffs,
        evicted=tuple(evicted),
    ), said


def moves_releasing(view: ControlView) -> list[Move]:
    """Moves whose pid its source has not released yet: until then the pid is the source's in the
    assignment of record; from then on its new owner's, though the owner may not have read it yet."""
    a = view.assignment
    return [] if a is None else [Move(p, m.source, m.target, m.mode) for p, m in a.moving.items()]


def moves_cutting_over(view: ControlView) -> list[Move]:
    """Moves whose pid has not reached its new owner yet: being released, or handed off and not yet
    acquired. A handoff's source is the instance that released the pid, or "?" for the recovery of a
    dead instance (nothing was released)."""
    a = view.assignment
    if a is None:
        return []
    moves = moves_releasing(view)
    for p, h in a.handoffs.items():
        if p in a.owners:
            released = view.released.get(h.move_id)
            moves.append(Move(p, released.instance if released else "?", a.owners[p], h.mode))
    return moves


def moves_in_flight(view: ControlView) -> list[Move]:
    """`moves_cutting_over` and the parallel tracks whose source still holds the pid's old tuples."""
    moves = moves_cutting_over(view)
    if view.assignment is None:
        return moves
    listed = {m.pid for m in moves}
    tracks = view.assignment.tracks.items()
    return moves + [Move(p, m.source, m.target, m.mode) for p, m in tracks if p not in listed]


def finished_moves(before: Sequence[Move], after: ControlView) -> list[FinishedMove]:
    """The moves of `before` (in flight under an earlier view) that `after` no longer has in flight."""
    if after.assignment is None:
        return []
    a, still = after.assignment, {(m.pid, m.source, m.target) for m in moves_in_flight(after)}
    return [
        FinishedMove(m, a.epoch, a.owners.get(m.pid))
        for m in before
        if (m.pid, m.source, m.target) not in still
    ]


class Observer:
    """Tails the metrics topic: heartbeats (liveness), per-batch records and the read reports of batches
    in flight (load), from a minute ago."""

    def __init__(
        self, cfg: Config, bootstrap: str, heartbeat_timeout_s: float, clock: Callable[[], float]
    ) -> None:
        from confluent_kafka import Consumer, TopicPartition

        from pipeline.topics import admin_client, partition_offsets

        self.clock = clock
        self.timeout_s = heartbeat_timeout_s
        self.started = clock()
        self.seen: dict[str, tuple[float, str]] = {}  # instance -> (last heartbeat, incarnation)
        self.serving: set[str] = set()  # instances whose last heartbeat says their query has run a batch
        self.batches: list[dict[str, Any]] = []
        self.readings: list[dict[str, Any]] = []  # what batches in flight have read (`report_reading`)
        self.empty_s: dict[str, float] = {}  # instance -> its shortest batch that read nothing, ever
        # read_uncommitted: heartbeats are not transactional, and a dead instance's open transaction on
        # this topic must not hide the others' heartbeats (load figures from aborted batches are harmless).
        self._consumer = Consumer(
            {
                "bootstrap.servers": bootstrap,
                "group.id": "fluxjoin-unused",
                "enable.auto.commit": False,
                "isolation.level": "read_uncommitted",
            }
        )
        admin, metrics = admin_client(bootstrap), [(cfg.metrics_topic, 0)]
        start = partition_offsets(admin, metrics, at_ms=int(time.time() * 1000) - 60_000)[metrics[0]]
        if start < 0:  # nothing in the last minute
            start = partition_offsets(admin, metrics)[metrics[0]]
        self._consumer.assign([TopicPartition(cfg.metrics_topic, 0, start)])

    def poll(self, wait_s: float = 0.0) -> None:
        """Take in what has arrived, waiting up to `wait_s` for it (a controller step does not wait)."""
        now_ms = time.time() * 1000
        for msg in self._consumer.consume(num_messages=10_000, timeout=wait_s):
            if msg.error() is not None or msg.value() is None:
                continue
            record = json.loads(msg.value() or b"{}")
            age_s = max(0.0, (now_ms - record.get("time_ms", now_ms)) / 1000)
            if record.get("kind") == "heartbeat":
                self.seen[record["instance"]] = (self.clock() - age_s, record["incarnation"])
                # An instance of a version before decision 0043 says nothing: it counts as serving.
                if record.get("serving", True):
                    self.serving.add(record["instance"])
                else:
                    self.serving.discard(record["instance"])
            elif record.get("kind") == "batch":
                self.batches.append(record)
                empty = shortest_empty_s([record])
                if empty is not None:
                    name = record["instance"]
                    self.empty_s[name] = min(self.empty_s.get(name, empty), empty)
            elif record.get("kind") == "reading":
                self.readings.append(record)
        cutoff = now_ms - 120_000
        if self.batches and self.batches[0]["time_ms"] < cutoff:
            self.batches = [b for b in self.batches if b["time_ms"] >= cutoff]
        if self.readings and self.readings[0]["time_ms"] < cutoff:
            self.readings = [r for r in self.readings if r["time_ms"] >= cutoff]

    def liveness(self) -> Liveness:
        now = self.clock()
        live = {i: inc for i, (t, inc) in self.seen.items() if now - t <= self.timeout_s}
        grace_over = now - self.started > self.timeout_s
        dead = frozenset(i for i in self.seen if i not in live) if grace_over else frozenset()
        return Liveness(live, dead, {i: inc for i, (_, inc) in self.seen.items()})

    def close(self) -> None:
        self._consumer.close()


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
        self._producer = Producer({"bootstrap.servers": bootstrap, "enable.idempotence": True})
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
        if self.log.catch_up().assignment is None:
            self._publish(AssignmentMsg(epoch=0, owners=dict(initial.owners)))
            self.say(f"epoch 0: {len(initial.owners)} pids over {len(initial.instances)} instances")

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

    def ready_instances(self) -> set[str]:
        """Live instances whose query has run a batch: pids moved onto them pause no longer than onto
        any other (decision 0043)."""
        self.observer.poll()
        return set(self.observer.liveness().live) & self.observer.serving

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
                state_bytes=sum(p["state_bytes"] for p in h[-1]["pids"].values()),
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
        owners = view.assignment.owners if view.assignment else {}
        requested = list(self._requested.values())
        for request, pid in view.pending_requests():
            source = owners.get(pid)
            if source is not None and source != request.target:
                requested.append(
                    MoveSpec(
                        move_id=request.move_id(pid),
                        pid=pid,
                        source=source,
                        target=request.target,
                        mode=request.mode,
                    )
                )
        markers = self._newest_markers()

        def committed(instance: str, pid: int) -> Mapping[str, int] | None:
            offsets = markers.get(instance, {}).get("offsets", {})
            if str(pid) not in offsets.get(self.cfg.streams[0], {}):
                return None
            return {s: int(offsets[s][str(pid)]) for s in self.cfg.streams}

        msg, said = plan_step(view, self.observer.liveness(), requested, committed, self._earliest)
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

    def _publish(self, msg: AssignmentMsg) -> None:
        publish(self._producer, self.cfg.control_topic, msg)
        if self._producer.flush(30):
            raise RuntimeError("control message not acknowledged within 30 s")
        self.log.add_own(msg)
        self.log.catch_up()

    def _newest_markers(self) -> dict[str, dict[str, Any]]:
        """Each instance's newest commit marker (only read when an instance is dead)."""
        from pipeline.sink import newest_markers

        if not self.observer.liveness().dead:
            return {}
        return newest_markers(self.cfg, self.bootstrap)

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


def request_moves(
    cfg: Config, bootstrap: str, pids: Sequence[int], target: str, mode: Mode
) -> MoveRequestMsg:
    """Ask the running controller for moves (what `fluxjoin move` does)."""
    from confluent_kafka import Producer

    msg = MoveRequestMsg(request_id=f"req-{uuid.uuid4().hex[:8]}", pids=tuple(pids), target=target, mode=mode)
    producer = Producer({"bootstrap.servers": bootstrap})
    publish(producer, cfg.control_topic, msg)
    if producer.flush(30):
        raise RuntimeError("the move request was not acknowledged by Kafka within 30 s")
    return msg
