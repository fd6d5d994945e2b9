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
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from controller.arrivals import InputTail
from controller.assignment import Assignment, FinishedMove, Move
from controller.policies.base import InstanceStats, Snapshot
from controller.rounds import busy_fraction, described_by, shortest_empty_s, snapshot_of
from pipeline.config import Config
from pipeline.control import ControlLog, publish
from pipeline.kafka_client import CONSUMER_GROUP, kafka_config
from pipeline.protocol import (
    AcquiredMsg,
    AssignmentMsg,
    ControlView,
    Handoff,
    Mode,
    MoveRequestMsg,
    MoveSpec,
    ReleasedMsg,
    TrackDoneMsg,
    track_key,
)

DEFAULT_HEARTBEAT_TIMEOUT_S = 10.0
PROGRESS_TIMEOUT_S = 120.0
"""How long a serving instance's query may go without completing a batch or waiting between triggers
before the instance counts as dead although it heartbeats (a query hung in a task). Well above the
heartbeat timeout: one batch through a backlog legitimately runs for tens of seconds."""
HEARING_CHECK_S = 1.0
HEARING_TIMEOUT_S = 2.0
"""How often, and how long, a controller step asks the broker where the metrics topic ends: whether it can
hear the instances at all (`Observer._check_hearing`)."""
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
    # The newest epoch each instance's control follower had read at its last heartbeat.
    epochs: Mapping[str, int] = field(default_factory=dict)


Markers = Mapping[str, Mapping[int, Mapping[str, int]]]
"""Each instance's newest commit marker: pid -> stream -> the end offset of its newest committed batch."""


def plan_step(
    view: ControlView,
    liveness: Liveness,
    requested: Sequence[MoveSpec],
    markers: Markers,
    earliest: Callable[[int], Mapping[str, int]],
) -> tuple[AssignmentMsg | None, list[str]]:
    """The next assignment (None: nothing to publish) and what happened, as lines for the log.

    `markers` are the instances' newest commit markers (read once the dead ones are fenced);
    `earliest(pid)` the log start offsets, for the pids of a dead instance that never committed anything.
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

    # An acknowledgement counts only from the instance the step waits for: a late one from an instance
    # declared dead (its transaction committed before it was fenced) must not end its successor's step.
    for p, h in list(handoffs.items()):
        if _from(view.acquired.get(h.move_id), owners.get(p)):
            del handoffs[p]
            said.append(f"move {h.move_id}: pid {p} now processed by {owners.get(p)}")
    for p, h in list(track_handoffs.items()):
        if _from(view.acquired.get(h.move_id), tracks[p].source if p in tracks else None):
            del track_handoffs[p]
    for p, m in list(moving.items()):
        released = view.released.get(m.move_id)
        if _from(released, m.source):
            assert released is not None
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
        # the old side's end counts once: the track's source is "" from then on
        old_done = not m.source or _from(view.track_done.get(track_key(m.move_id, "old")), m.source)
        new_done = _from(view.track_done.get(track_key(m.move_id, "new")), m.target)
        if old_done and new_done:
            del tracks[p]
            track_handoffs.pop(p, None)
            said.append(f"move {m.move_id}: pid {p}'s parallel track is over")
        elif old_done and m.source:
            tracks[p] = replace(m, source="")
            track_handoffs.pop(p, None)
            said.append(f"move {m.move_id}: pid {p}'s old tuples expired on {m.source}, which lets it go")

    # Instances that return after eviction (a new incarnation) are members again, with no pids, once
    # their evicted incarnation holds nothing (until then, its pids are recovered below).
    held = _holders(owners, moving, tracks)
    for entry in list(evicted):
        name = entry.partition("@")[0]
        if _rejoined(entry, liveness, a.epoch) and name not in held:
            evicted.remove(entry)
            said.append(f"{name} rejoined as a new, empty instance")

    # The dead not yet evicted, with pids or without (on return it must start empty either way), and the
    # evicted that still hold pids: whether they still run, rejoined empty or died, nobody reads those.
    dead = to_recover(a, liveness)
    members = {i for i in liveness.live if not _is_evicted(i, evicted)}
    if dead:
        survivors = sorted(members - set(dead))
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
                if m.target != d:
                    continue
                if any(i != m.source for i in survivors):  # the source may release at any moment
                    moving[p] = replace(m, target=least_loaded(m.source))
                else:  # its release may be committed unseen: the pid returns to it by a handoff
                    said.append(f"move {m.move_id}: target {d} is dead, no other instance: waiting")
            lost = sorted(p for p, o in owners.items() if o == d)
            lost += sorted(p for p, m in moving.items() if m.source == d)
            for p in lost:
                track = tracks.get(p)
                resumed = track is not None and not view.track_ended(track.move_id, "new")
                handoff = handoffs.get(p)
                cutoff = markers.get(d, {}).get(p)
                if handoff is None and not resumed and cutoff is None:
                    if d in markers:
                        said.append(
                            f"{d} is dead: waiting for its committed offsets of pid {p} (its newest commit "
                            "marker lacks the pid, and the log start would repeat every result)"
                        )
                        continue
                    cutoff = earliest(p)  # it never committed anything, so nothing of the pid either
                move = moving.pop(p, None)
                # Never onto the overlap's old side, even once the new side's part is over: one
                # instance holds one window per pid.
                target = least_loaded(track.source if track else "")
                if track is not None:
                    tracks[p] = replace(track, target=target)
                if resumed:
                    if handoff is None and track is not None:  # the overlap's new side: its tuples
                        handoffs[p] = _resume(view, track, cutoff)  # since the cutoff, re-read
                elif cutoff is not None:  # what it committed (a handoff it took, unseen, included)
                    handoffs[p] = Handoff(move_id=_recovery_id(), mode=Mode.REPLAY, cutoff=cutoff)
                elif handoff is not None:  # a handoff never taken: the new owner starts where it said,
                    # under an id of its own, which a late acknowledgement of the dead one cannot end
                    handoffs[p] = replace(handoff, move_id=_recovery_id())
                owners[p] = target
                why = f" (its move {move.move_id} is abandoned)" if move else ""
                said.append(f"{d} is dead: pid {p} recovered on {target} by replay{why}")
            for p, m in sorted(tracks.items()):
                if m.source == d:  # the overlap's old side: its window rebuilt, then re-read since the cutoff
                    holder = least_loaded(m.target)
                    if p not in track_handoffs:
                        track_handoffs[p] = _resume(view, m, markers.get(d, {}).get(p))
                    tracks[p] = replace(m, source=holder)
                    said.append(f"{d} is dead: pid {p}'s old tuples recovered on {holder} by replay")
            if not _is_evicted(d, evicted):
                evicted.append(f"{d}@{liveness.incarnations.get(d, '?')}")

    for m in requested:
        p = m.pid
        busy = p in moving or p in handoffs or p in tracks
        if owners.get(p) != m.source or m.source == m.target or busy or m.move_id in view.started:
            continue
        if m.target not in members or m.target in dead:
            said.append(f"move of pid {p} to {m.target} refused: {m.target} is not live")
            continue
        del owners[p]
        moving[p] = m
        said.append(f"move {m.move_id}: pid {p} {m.source} -> {m.target} ({m.mode.value}) started")
    return _publish(a, owners, moving, handoffs, tracks, track_handoffs, evicted, said)


def to_recover(a: AssignmentMsg, liveness: Liveness) -> list[str]:
    """The instances whose pids a step recovers: the dead not yet evicted, and the evicted (under any
    incarnation, dead or alive) that the assignment still gives pids, moves or a side of an overlap."""
    listed = {e.partition("@")[0] for e in a.evicted}
    held = _holders(a.owners, a.moving, a.tracks)
    return sorted({i for i in liveness.dead if i not in listed} | (listed & held))


def _rejoined(entry: str, liveness: Liveness, epoch: int) -> bool:
    """Whether the instance evicted as `entry` ("name@incarnation") runs again under a new incarnation.
    "name@?" (evicted unheard) names no incarnation: the one heard must have read an assignment that
    lists the eviction (`epoch`, the newest, does), since one that ran before it stops on reading it
    without another heartbeat, and one that starts after it begins empty."""
    name, _, incarnation = entry.partition("@")
    heard = liveness.live.get(name)
    if heard is None or heard == incarnation:
        return False
    return incarnation != "?" or liveness.epochs.get(name, -1) >= epoch


def _holders(
    owners: Mapping[int, str], moving: Mapping[int, MoveSpec], tracks: Mapping[int, MoveSpec]
) -> set[str]:
    """Every instance the assignment gives a pid, a move (either end) or a side of an overlap."""
    ends = {i for m in [*moving.values(), *tracks.values()] for i in (m.source, m.target)}
    return (set(owners.values()) | ends) - {""}


def _from(ack: ReleasedMsg | AcquiredMsg | TrackDoneMsg | None, expected: str | None) -> bool:
    return ack is not None and ack.instance == expected


def _recovery_id() -> str:
    return f"recover-{uuid.uuid4().hex[:8]}"


def _resume(view: ControlView, track: MoveSpec, committed: Mapping[str, int] | None) -> Handoff:
    """Where a side of a parallel track whose instance died resumes: at its newest committed offsets,
    after re-reading silently from the overlap's cutoff (both known from the sender's `Released`)."""
    released = view.released[track.move_id]
    return Handoff(
        move_id=_recovery_id(),
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


def requested_moves(view: ControlView, now_ms: float) -> tuple[list[MoveSpec], list[str]]:
    """The moves `fluxjoin move` asked for that no assignment has started, from their pids' owners now;
    a request past its expiry (its caller stopped waiting) is dropped with a line saying so."""
    owners = view.assignment.owners if view.assignment else {}
    moves: list[MoveSpec] = []
    said: list[str] = []
    for request, pid in view.pending_requests():
        if request.expires_ms is not None and request.expires_ms < now_ms:
            said.append(f"move request {request.request_id} of pid {pid} expired unserved: dropped")
            continue
        source = owners.get(pid)
        if source is not None and source != request.target:
            moves.append(
                MoveSpec(
                    move_id=request.move_id(pid),
                    pid=pid,
                    source=source,
                    target=request.target,
                    mode=request.mode,
                )
            )
    return moves, said


def moves_releasing(view: ControlView) -> list[Move]:
    """Moves whose pid its source has not released yet: until then the pid is the source's in the
    assignment of record; from then on its new owner's, though the owner may not have read it yet."""
    a = view.assignment
    if a is None:
        return []
    # a move of an instance to itself (written by an older controller) is none: the pid stays put
    return [Move(p, m.source, m.target, m.mode) for p, m in a.moving.items() if m.source != m.target]


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
            source = released.instance if released and released.instance != a.owners[p] else "?"
            moves.append(Move(p, source, a.owners[p], h.mode))
    return moves


def moves_in_flight(view: ControlView) -> list[Move]:
    """`moves_cutting_over` and the parallel tracks whose source still holds the pid's old tuples."""
    moves = moves_cutting_over(view)
    if view.assignment is None:
        return moves
    listed = {m.pid for m in moves}
    tracks = view.assignment.tracks.items()
    return moves + [
        Move(p, m.source, m.target, m.mode) for p, m in tracks if p not in listed and m.source != m.target
    ]


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


def judge_liveness(
    now: float,
    *,
    started: float,
    heard: Mapping[str, float],
    expected: Collection[str],
    stalled_s: Mapping[str, float],
    timeout_s: float,
    progress_timeout_s: float,
    restarting: Collection[str],
    restart_grace_s: float,
) -> tuple[frozenset[str], frozenset[str]]:
    """(live, dead) among the instances heard from (`heard`: instance -> time of its last heartbeat) or
    expected. Live: heard within `timeout_s`, its query not stalled past `progress_timeout_s` (its pids
    would wait forever). Dead: stalled, or silent past `timeout_s`, or past `restart_grace_s` while its
    pod is being (re)started (`restarting`): until then a restarting instance is neither. One never heard
    from is silent since `started`; nobody is dead before the first `timeout_s` (nobody was heard yet)."""
    live = frozenset(
        i for i, t in heard.items() if now - t <= timeout_s and stalled_s.get(i, 0.0) <= progress_timeout_s
    )
    if now - started <= timeout_s:
        return live, frozenset()

    def dead_now(instance: str) -> bool:
        if stalled_s.get(instance, 0.0) > progress_timeout_s:
            return True
        allowed = max(timeout_s, restart_grace_s) if instance in restarting else timeout_s
        return now - heard.get(instance, started) > allowed

    return live, frozenset(i for i in (set(expected) | heard.keys()) - live if dead_now(i))


def appended_ms(timestamp: tuple[int, int]) -> int | None:
    """When the broker appended a message, by the broker's clock (the metrics topic's timestamps are
    `LogAppendTime`, decision 0054), from the message's `timestamp()`. None on a topic whose messages
    carry their producer's clock (one created before): then the record's own `time_ms` serves, as
    before, and a step of an instance's wall clock ages its heartbeats by as much."""
    from confluent_kafka import TIMESTAMP_LOG_APPEND_TIME

    kind, ms = timestamp
    return ms if kind == TIMESTAMP_LOG_APPEND_TIME else None


def query_stalled_s(heartbeat: Mapping[str, Any]) -> float | None:
    """How long an instance's query had gone without progress at its heartbeat, or None for a record
    that does not say. `stalled_ms` is timed on the instance's monotonic clock, which no step of its
    wall clock moves; an instance that does not send it is judged, as before, by its wall-clock time
    less its `progress_ms`, a difference a step of its clock between the two fakes."""
    if heartbeat.get("kind") != "heartbeat":
        return None
    if "stalled_ms" in heartbeat:
        return max(0.0, heartbeat["stalled_ms"] / 1000)
    if "progress_ms" in heartbeat and "time_ms" in heartbeat:
        return max(0.0, (heartbeat["time_ms"] - heartbeat["progress_ms"]) / 1000)
    return None


class Observer:
    """Tails the metrics topic: heartbeats (liveness), per-batch records and the read reports of batches
    in flight (load), from a minute ago.

    Every record's `time_ms` is replaced by the time the broker appended it (`appended_ms`), and ages
    and windows are measured from it: the one clock all instances' records share, right for the records
    a controller that has just started reads from a minute back, and never an instance's own, whose
    host's clock may run wrong or step (decision 0054)."""

    def __init__(
        self,
        cfg: Config,
        bootstrap: str,
        heartbeat_timeout_s: float,
        clock: Callable[[], float],
        progress_timeout_s: float = PROGRESS_TIMEOUT_S,
    ) -> None:
        from confluent_kafka import Consumer, TopicPartition

        from pipeline.topics import admin_client, partition_offsets

        self.clock = clock
        self.timeout_s = heartbeat_timeout_s
        self.progress_timeout_s = progress_timeout_s
        # instance -> seconds its query had gone without progress at its last heartbeat (timed by the
        # instance on its monotonic clock, `query_stalled_s`)
        self.stalled_s: dict[str, float] = {}
        self.started = clock()
        self.hearing_since = self.started
        """Since when the controller has reached the broker without a break (`poll`)."""
        self.deaf = False
        """Whether the broker failed to answer the last end-offset lookup (`_check_hearing`)."""
        self._hearing_checked = self._broker_answered = time.monotonic()
        self.seen: dict[str, tuple[float, str]] = {}  # instance -> (last heartbeat, incarnation)
        self.epochs: dict[str, int] = {}  # instance -> the newest epoch it had read at its last heartbeat
        # Instances the assignment names: one never heard from is dead once the start grace is over.
        self.expected: set[str] = set()
        # Instances whose pods the platform is (re)starting (a rolling update, a deleted pod): silent for
        # up to `restart_grace_s` before they count as dead, so that a restart resumes from the
        # instance's checkpoint instead of recovering its pids elsewhere (decision 0051).
        self.restarting: frozenset[str] = frozenset()
        self.restart_grace_s = 0.0
        self.serving: set[str] = set()  # instances whose last heartbeat says their query has run a batch
        self.batches: list[dict[str, Any]] = []
        self.readings: list[dict[str, Any]] = []  # what batches in flight have read (`report_reading`)
        self.empty_s: dict[str, float] = {}  # instance -> its shortest batch that read nothing, ever
        # read_uncommitted: heartbeats are not transactional, and a dead instance's open transaction on
        # this topic must not hide the others' heartbeats (load figures from aborted batches are harmless).
        self._consumer = Consumer(
            {
                **kafka_config(bootstrap),
                "group.id": CONSUMER_GROUP,
                "enable.auto.commit": False,
                "isolation.level": "read_uncommitted",
            }
        )
        admin, metrics = admin_client(bootstrap), [(cfg.metrics_topic, 0)]
        start = partition_offsets(admin, metrics, at_ms=int(time.time() * 1000) - 60_000)[metrics[0]]
        if start < 0:  # nothing in the last minute
            start = partition_offsets(admin, metrics)[metrics[0]]
        self._metrics = TopicPartition(cfg.metrics_topic, 0)
        self._consumer.assign([TopicPartition(cfg.metrics_topic, 0, start)])

    def _check_hearing(self) -> None:
        """Ask the broker for the metrics topic's end, about once a second. An answer means what the
        instances write reaches this controller; none (a broker stopped or frozen), or a gap since the
        last answer (this controller blocked on a silent broker, or frozen itself), means their silence
        meanwhile says nothing about them: hearing starts again with the next answer. Gaps are real
        time (`time.monotonic`), whatever clock the observer judges by."""
        from confluent_kafka import KafkaException

        asked = time.monotonic()
        if asked - self._hearing_checked < HEARING_CHECK_S:
            return
        self._hearing_checked = asked
        try:
            self._consumer.get_watermark_offsets(self._metrics, timeout=HEARING_TIMEOUT_S)
        except KafkaException:  # away, restarting, or not serving the partition yet: none reaches us
            self.deaf = True
            return
        answered = time.monotonic()
        if self.deaf or answered - self._broker_answered > HEARING_CHECK_S + 2 * HEARING_TIMEOUT_S:
            self.deaf, self.hearing_since = False, self.clock()
        self._broker_answered = answered

    def poll(self, wait_s: float = 0.0) -> None:
        """Take in what has arrived, waiting up to `wait_s` for it (a controller step does not wait)."""
        self._check_hearing()
        now_ms = time.time() * 1000
        for msg in self._consumer.consume(num_messages=10_000, timeout=wait_s):
            if msg.error() is not None or msg.value() is None:
                continue
            record = json.loads(msg.value() or b"{}")
            stalled = query_stalled_s(record)  # before `time_ms` is the broker's
            record["time_ms"] = appended_ms(msg.timestamp()) or record.get("time_ms", now_ms)
            age_s = max(0.0, (now_ms - record["time_ms"]) / 1000)
            if record.get("kind") == "heartbeat":
                self.seen[record["instance"]] = (self.clock() - age_s, record["incarnation"])
                self.epochs[record["instance"]] = record.get("epoch", -1)
                # An instance of a version before decision 0043 says nothing: it counts as serving.
                if record.get("serving", True):
                    self.serving.add(record["instance"])
                else:
                    self.serving.discard(record["instance"])
                if record.get("serving", True) and stalled is not None:
                    self.stalled_s[record["instance"]] = stalled
                else:  # not serving yet (starting up), or an instance that does not report progress
                    self.stalled_s.pop(record["instance"], None)
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

    def expect(self, instances: Iterable[str]) -> None:
        """Count these instances as heard from at this observer's start, never as live: one that never
        heartbeats (it never started, or died while no controller ran) is dead after the timeout."""
        self.expected.update(instances)

    def liveness(self) -> Liveness:
        """Who is live and who is dead now: read once per controller step, so that one step never
        acts on two answers (a silence crossing the timeout in between)."""
        self._check_hearing()  # a step may have waited on the broker since its `poll`
        now = self.clock()
        # Silence counts only while the controller could have heard: after it could not reach the
        # broker, every instance has a whole timeout from then on to be heard again (decision 0052).
        hearing = now if self.deaf else self.hearing_since
        live, dead = judge_liveness(
            now,
            started=hearing,
            heard={i: max(t, hearing) for i, (t, _) in self.seen.items()},
            expected=self.expected,
            stalled_s=self.stalled_s,
            timeout_s=self.timeout_s,
            progress_timeout_s=self.progress_timeout_s,
            restarting=self.restarting,
            restart_grace_s=self.restart_grace_s,
        )
        incarnations = {i: inc for i, (_, inc) in self.seen.items()}
        return Liveness({i: incarnations[i] for i in live}, dead, incarnations, dict(self.epochs))

    def close(self) -> None:
        self._consumer.close()


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
                state_bytes=sum(p["state_bytes"] for p in h[-1]["pids"].values()),
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
            self.observer.expect(_holders(a.owners, a.moving, a.tracks))
        liveness = self.observer.liveness()  # once: one step acts on one answer
        markers: Markers = {}
        if view.assignment is not None and (dying := to_recover(view.assignment, liveness)):
            self._fence(view.assignment, dying, liveness)
            markers, incarnations = self._newest_markers()
            liveness = replace(liveness, incarnations={**incarnations, **liveness.incarnations})
            view = self.log.catch_up()  # what the fenced committed before the fence
        requested, said = requested_moves(view, time.time() * 1000)
        msg, planned = plan_step(
            view, liveness, [*self._requested.values(), *requested], markers, self._earliest
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

    def _publish(self, msg: AssignmentMsg | None) -> None:
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

    def _newest_markers(self) -> tuple[Markers, dict[str, str]]:
        """Each instance's newest commit marker, per pid, and the incarnation that wrote it."""
        from pipeline.sink import newest_markers

        streams = self.cfg.streams
        markers: dict[str, dict[int, dict[str, int]]] = {}
        incarnations: dict[str, str] = {}
        for instance, marker in newest_markers(self.cfg, self.bootstrap).items():
            offsets = marker.get("offsets", {})
            markers[instance] = {
                int(p): {s: int(offsets[s][p]) for s in streams} for p in offsets.get(streams[0], {})
            }
            incarnations[instance] = marker.get("incarnation", "?")
        return markers, incarnations

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


def request_outcome(view: ControlView, request: MoveRequestMsg) -> dict[int, str] | None:
    """Each requested pid's owner of record once all the request's moves are over, None before: the
    target, or another instance when the target died during the move and the pid was recovered."""
    a = view.assignment
    if a is None:
        return None
    cutting_over = a.moving.keys() | a.handoffs.keys()
    if any(request.move_id(p) not in view.started or p in cutting_over for p in request.pids):
        return None
    return {p: a.owners[p] for p in request.pids}
