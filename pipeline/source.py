"""The instance's streaming source: a PySpark Python data source reading its assigned pids from Kafka.

Why a custom source: Spark's built-in Kafka source fixes its partition set when the query starts, so an
instance could not gain or lose a pid without a restart. Here the source's offset *is* the assignment:
`{"epoch": e, "offsets": {stream: {pid: next_offset}}}`. The assigned pid set is read from the instance's
assignment file at every batch boundary (`latestOffset`), so the set changes between micro-batches while
the query runs, and Spark's offset log makes a restarted query replay exactly the same batches.

A pid that joins the set enters the offset map at its start offset and is read from the next batch on;
a pid that leaves is dropped from the map and never read again.

The rows it yields and their codes are in `pipeline/rows.py`, what its plan asks of the input
(`InputFacts`) in `pipeline/input_facts.py`, the reading of a batch's ranges in
`pipeline/kafka_reader.py`, the sizing of a batch in `pipeline/batch_sizing.py`, and the assignment
file's format in `pipeline/instance_files.py`.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import pyarrow as pa
from pyspark.sql.datasource import DataSource, DataSourceStreamReader, InputPartition
from pyspark.sql.streaming.datasource import ReadAllAvailable, ReadLimit, ReadMaxRows

from pipeline.batch_plan import Release, acquired_of, markers_of, released_of, tracking_of
from pipeline.batch_sizing import RESULTS_HEADROOM, ArrivalMeter, BatchBound, Offsets, pids_within
from pipeline.epoch_change import change_epoch
from pipeline.input_facts import KafkaInputFacts
from pipeline.instance_files import (
    SpillRequests,
    move_steps,
    read_assignment,
    read_recent_yields,
    read_spill_requests,
    read_watermarks,
    stream_max_at,
)
from pipeline.join import PROGRESS_ID
from pipeline.kafka_client import kafka_config
from pipeline.kafka_reader import (
    HandoffWork,
    PidRange,
    RangeKind,
    drop_consumer,
    handoff_rows,
    read_ranges,
)
from pipeline.protocol import ReleasedMsg
from pipeline.rows import DROP_ROW, MAX_SPILLS, SOURCE_SCHEMA, SPILL_ROW, WATERMARK_ROW, WINDOW_ROW
from pipeline.signing import produce_signed
from pipeline.spill import (
    Cleanup,
    CleanupWhen,
    Spill,
    cleanups_of,
    deferred,
    old_generation_gone,
    spilled_of,
)

log = logging.getLogger(__name__)

SOURCE_NAME = "fluxjoin"
SAMPLE_EVERY_S = 30.0
# An instance is behind when more input waits than arrives in this many trigger intervals (and at least
# MIN_BEHIND_S seconds' worth, for triggers of a fraction of a second).
BEHIND_TRIGGERS = 2
MIN_BEHIND_S = 2.0
# A pid's input has paused once its end has not moved for this many trigger intervals, and at least
# MIN_PAUSE_S seconds: a spilled pid with results left for its clean-up is cleaned up then.
PAUSE_TRIGGERS = 4
MIN_PAUSE_S = 5.0


@dataclass(frozen=True, slots=True)
class ReadReport:
    """Where a read task reports what it read: the metrics topic, under the instance's name."""

    topic: str
    instance: str


class KafkaPidPartition(InputPartition):
    def __init__(
        self,
        ranges: list[PidRange],
        partitions: int,
        handoff: HandoffWork | None = None,
        report: ReadReport | None = None,
    ) -> None:
        super().__init__(ranges)
        self.ranges = ranges
        self.partitions = partitions
        self.handoff = handoff or HandoffWork()
        self.report = report


def plan_partitions(ranges: Sequence[PidRange], max_tasks: int) -> list[list[PidRange]]:
    """Spread non-empty ranges over at most `max_tasks` tasks, largest first onto the lightest task."""
    work = sorted((r for r in ranges if r.end > r.start), key=lambda r: (r.start - r.end, r.topic, r.pid))
    if not work:
        return []
    tasks: list[list[PidRange]] = [[] for _ in range(min(max_tasks, len(work)))]
    loads = [0] * len(tasks)
    for r in work:
        i = loads.index(min(loads))
        tasks[i].append(r)
        loads[i] += r.end - r.start
    return tasks


class FluxjoinSource(DataSource):
    """Options: `bootstrap`, `streams` (comma separated, configured order), `topics` (same order),
    `assignment` (path of the assignment file), `partitions` (P), `max_rows` (tuples per batch, about:
    the source's default read limit), `max_results` and `recent_yields` (about how many results a
    batch may make, and the path of the file the sink notes recent batches' tuples and results in),
    `tasks` (read parallelism), `window_ms` and
    `lateness_ms` (how far back a replayed window reaches), `trigger_ms` (the time between batches:
    how much waiting input makes the instance behind), `poll_ms` (the query's trigger when shorter: how
    soon a move step gets its batch), `watermarks` (path of the file the sink notes
    windows' `stream_max` in), `control_topic` (where a replay's or a parallel track's `Released`
    goes at the plan) and `commits_topic` (the sink's commit markers: which pids this instance committed
    before, `KafkaInputFacts.refuse_unprocessed`)."""

    @classmethod
    def name(cls) -> str:
        return SOURCE_NAME

    def schema(self) -> str:
        return SOURCE_SCHEMA

    def streamReader(self, schema: Any) -> DataSourceStreamReader:
        return FluxjoinStreamReader(dict(self.options))


class FluxjoinStreamReader(DataSourceStreamReader):
    """Offsets: `{"epoch", "offsets": {stream: {pid: next}}, "released": {pid: ...}, "acquired": {pid: ...},
    "from": {stream: {pid: first}}}`.

    A batch that changes the epoch reads input like any other: a released pid up to its cutoff (then a
    marker row, so the operator exports or drops the window after joining that input), an acquired pid
    from its cutoff (its window installed first), every other pid as usual, so an epoch change costs no
    pid a micro-batch. `from` holds where the pids entering in the batch begin (they are not in the
    batch's start offset); `released` and `acquired` tell the sink which acknowledgements to commit with
    it. All of it is decided in `latestOffset` and logged by Spark, so a restarted query replays the very
    same batch.

    Except when the instance is behind (more input waits than arrives in two trigger intervals): then a
    batch whose releases wait for it to commit reads no new input, and the moved pids' cutoffs are where
    the last batch stopped. Read as usual, that batch would join the instance's whole backlog before the
    release commits with it, on the very instance a move relieves; this way the release costs one
    batch's fixed cost, and the receiver reads the moved pids' part of the backlog.

    A replay, and a parallel track whose window `stream_max` the sink noted at the start of the batch
    (`stream_max_at`), need no batch to release them: the cutoff is where the batch begins, the batch
    reads nothing of the pid, and the `Released` goes out as soon as the batch is planned
    (`partitions`; decisions 0023, 0035, 0037). The batch reads its other pids as usual.

    Paced (a trigger longer than the poll interval, decision 0027): Spark asks for a batch every
    `poll_ms`, and the source plans one a trigger after the last, or at once when the assignment gives
    the instance a move step it has not planned (`move_steps`); otherwise it answers with the start
    offset, and Spark runs no batch. A move's step thus waits for the batch in flight, not for the next
    trigger as well.
    """

    def __init__(self, options: dict[str, str]) -> None:
        self.bootstrap = options["bootstrap"]
        self.streams = options["streams"].split(",")
        self.topics = options["topics"].split(",")
        self.assignment_path = Path(options["assignment"])
        self.partition_count = int(options["partitions"])
        self.max_rows = int(options.get("max_rows", "200000"))
        self.max_results = int(options.get("max_results", "4000000"))
        path = options.get("recent_yields")
        self.recent_yields_path = Path(path) if path else None
        self.tasks = int(options["tasks"])
        trigger_s = int(options.get("trigger_ms", "0")) / 1000
        self.behind_horizon_s = max(BEHIND_TRIGGERS * trigger_s, MIN_BEHIND_S)
        poll_s = int(options.get("poll_ms", "0")) / 1000
        # Polls fall on multiples of poll_s, so a batch a trigger after the last may be asked for up to
        # half a poll early: it still counts as due.
        self.pace_s = trigger_s - poll_s / 2 if trigger_s > poll_s > 0 else 0.0
        self._planned_at: float | None = None
        self._planned_steps: frozenset[tuple[str, int, str]] = frozenset()
        self._arrivals = ArrivalMeter()
        metrics, instance = options.get("metrics_topic"), options.get("instance")
        self.report = ReadReport(metrics, instance) if metrics and instance else None
        self.instance = instance or ""
        self.control_topic = options.get("control_topic")
        self.facts = KafkaInputFacts(
            bootstrap=self.bootstrap,
            streams=self.streams,
            topics=self.topics,
            instance=self.instance,
            window_ms=int(options.get("window_ms", "0")),
            lateness_ms=int(options.get("lateness_ms", "0")),
            watermarks_path=Path(options["watermarks"]) if "watermarks" in options else None,
            control_topic=self.control_topic,
            commits_topic=options.get("commits_topic"),
        )
        self._per_message: float | None = None
        self._sampled_at = 0.0
        path = options.get("spill_requests")
        self.spill_requests_path = Path(path) if path else None
        self.spill_cleanup = CleanupWhen(options.get("spill_cleanup", CleanupWhen.ACTIVE.value))
        self._latest: Offsets = {}
        """The input's end offsets when the batch being planned was sized."""
        self._input_at: dict[str, float] = {}
        """Per pid, when its input's end last moved (monotonic s): whether its input has paused."""
        self.pause_s = max(PAUSE_TRIGGERS * trigger_s, MIN_PAUSE_S)

    def initialOffset(self) -> dict:
        """Epoch -1 and no pids: the first batch enters the assignment like any later epoch change."""
        return {"epoch": -1, "offsets": {s: {} for s in self.streams}}

    def latestOffset(self, start: dict, limit: ReadLimit) -> dict:
        owned = read_assignment(self.assignment_path)
        steps, now = move_steps(owned), time.monotonic()
        if (
            self._planned_at is not None
            and now - self._planned_at < self.pace_s
            and steps <= self._planned_steps
        ):
            return start  # not due: the same offset means no batch
        self._planned_at, self._planned_steps = now, steps
        path = self.spill_requests_path
        asked = read_spill_requests(path) if path else SpillRequests()
        if owned.epoch == start["epoch"]:
            end, next_pid = self._read_up_to(
                start["offsets"], limit, int(start.get("next_pid", 0)), room=asked.room_tuples
            )
            carried = {k: start.get(k, {}) for k in ("tracking", "taken")}
            plan = {"epoch": owned.epoch, **carried, "offsets": end} | next_pid
            return self._with_spills(start, plan, asked.pids)
        if start["epoch"] == -1:
            self.facts.probe()  # connected before a replay needs it: a first read is slow (decision 0034)
        change = change_epoch(start, owned, self.streams, self.facts)
        self._announce_releases(change.epoch, change.released, tracks=False)
        held = change.offsets
        leaving = self._read_to_cutoff(start, change.released)
        begin = {
            s: {**held[s], **{str(p): start["offsets"][s][str(p)] for p in leaving}} for s in self.streams
        }
        moves_out = any(r.move_id and not r.announce for r in change.released.values())
        end, next_pid = self._read_up_to(
            begin, limit, int(start.get("next_pid", 0)), moves_out, room=asked.room_tuples
        )
        for p in leaving:  # read on in this batch: its output up to the cutoff commits with it
            change.released[p].cutoff = {s: end[s][str(p)] for s in self.streams}
        change.begins = {  # pids entering where the start offset does not say (a returning one: elsewhere)
            s: {p: o for p, o in held[s].items() if start["offsets"].get(s, {}).get(p) != o} for s in held
        }
        change.offsets = {s: {p: end[s][p] for p in held[s]} for s in self.streams}
        return self._with_spills(start, change.to_json() | next_pid, asked.pids)

    def _with_spills(self, start: dict, plan: dict[str, Any], asked: Mapping[int, int]) -> dict[str, Any]:
        """`plan` with its spills and clean-ups (`pipeline.spill`): the spilled pids carried on but those
        whose clean-up is due, and the pids the sink asks to spill (`asked`, with their windows' bytes;
        their input in this batch is the first of a new generation). Decided here, in the plan Spark
        logs, so a restarted query replays the same spills and clean-ups."""
        spilled = spilled_of(start)
        if not spilled and not asked:
            return plan
        first, before = self.streams[0], start["offsets"]
        held = plan["offsets"].get(first, {})
        busy = {*released_of(plan), *tracking_of(plan), *acquired_of(plan)}
        path = self.facts.watermarks_path
        noted = read_watermarks(path) if path else {}
        markers = markers_of(plan)
        carried: dict[int, Spill] = {}
        cleanups: dict[int, Cleanup] = {}
        for p, spill in sorted(spilled.items()):
            begin = {s: before[s][str(p)] for s in self.streams}
            if not self._cleanup_due(p, spill, begin, p in busy or str(p) not in held, noted):
                carried[p] = spill
                continue
            replay_from = self.facts.replay_from(p, spill.cutoffs[0])
            cleanups[p] = Cleanup(replay_from, spill.cutoffs, begin)
            markers.append((p, DROP_ROW, 0, 0, 0))  # the new generation: the clean-up rebuilds it whole
            if spill.stream_max is not None:
                markers.extend((p, WATERMARK_ROW, j, 0, t) for j, t in enumerate(spill.stream_max))
        for p, state_bytes in sorted(asked.items()):
            if p in cleanups or p in busy or str(p) not in held or str(p) not in before.get(first, {}):
                continue
            cutoff = {s: before[s][str(p)] for s in self.streams}
            at = stream_max_at(noted, p, cutoff)
            stream_max = list(at) if at is not None else None
            if p not in carried:
                carried[p] = Spill((cutoff,), state_bytes, stream_max)
            elif len(carried[p].cutoffs) < MAX_SPILLS and cutoff not in carried[p].cutoffs:
                carried[p] = carried[p].again(cutoff, state_bytes, stream_max)  # its newest generation too
            else:
                continue
            markers.append((p, SPILL_ROW, 0, 0, 0))
        out = {k: v for k, v in plan.items() if k not in ("spilled", "cleanups")} | {"markers": markers}
        if carried:
            out["spilled"] = {str(p): spill.to_json() for p, spill in carried.items()}
        if cleanups:
            out["cleanups"] = {str(p): cleanup.to_json() for p, cleanup in cleanups.items()}
        return out

    def _idle(self, p: int, begin: Mapping[str, int]) -> bool:
        """Whether pid `p`'s input has paused: nothing beyond `begin`, where the batch being planned
        begins it, and no new input for `pause_s` (a pid of a real-time input often has no message
        waiting when a batch is planned, a trigger after the last read it all)."""
        caught_up = all(self._latest.get(s, {}).get(str(p)) == begin[s] for s in self.streams)
        return caught_up and time.monotonic() - self._input_at.get(str(p), time.monotonic()) >= self.pause_s

    def _cleanup_due(
        self, p: int, spill: Spill, begin: Mapping[str, int], leaving: bool, noted: Mapping[str, Any]
    ) -> bool:
        """Whether a spilled pid is cleaned up in the batch being planned: always before it leaves (a
        spill point never travels with a handoff); once its input pauses, or with active clean-up as
        soon as the generations before its newest have left the window (the clean-up then brings
        nothing back into memory; `pipeline.spill.CleanupWhen`), if it read anything since its first
        spill. A pid that did not is parked: its window is in the log, no result waits for a
        clean-up, and a paused pid spilled to free memory stays out of it."""
        if leaving:
            return True
        if not deferred(spill, begin):
            return False
        if self._idle(p, begin):
            return True
        last = spill.last_max
        if self.spill_cleanup is CleanupWhen.LAZY or last is None:
            return False
        now = stream_max_at(noted, p, begin)
        window_ms, lateness_ms = self.facts.window_ms, self.facts.lateness_ms
        return now is not None and old_generation_gone(last, now, window_ms, lateness_ms)

    def _read_to_cutoff(self, start: dict, released: Mapping[int, Release]) -> list[int]:
        """The released pids this batch reads on up to their cutoff, like every held pid: transfers
        that the batch's start offset has, whose window must hold that input when it is exported.

        A replay's cutoff is where the batch begins (decision 0037): its receiver rebuilds the window
        from the log and reads on from there, so the sender has nothing to finish, and the receiver
        never waits for the sender's batch, which on a loaded sender is the longest."""
        read = start["offsets"].get(self.streams[0], {})
        return [p for p, r in released.items() if r.export and str(p) in read]

    def _read_up_to(
        self,
        begin: Offsets,
        limit: ReadLimit,
        first_pid: int,
        moves_out: bool = False,
        room: int | None = None,
    ) -> tuple[Offsets, dict[str, int]]:
        """End offsets of a batch starting at `begin`: every pid's latest offsets, or whole pids round
        robin from `first_pid` when the backlog exceeds the read limit or the `room` (in tuples) the
        state budget leaves (`SpillRequests.room_tuples`; then also `{"next_pid": ...}`); `begin`
        itself for a batch that moves pids out of an instance that is behind."""
        pids = sorted(int(p) for p in begin[self.streams[0]])
        if not pids:
            return begin, {}
        latest = self.facts.offsets(pids, latest=True)
        now = time.monotonic()
        for p in begin[self.streams[0]]:
            if any(latest[s].get(p) != self._latest.get(s, {}).get(p) for s in self.streams):
                self._input_at[p] = now
        self._latest = latest
        self._arrivals.observe(latest, time.monotonic())
        backlog = sum(latest[s][p] - begin[s][p] for s in latest for p in latest[s])
        if moves_out and self._arrivals.behind(backlog, self.behind_horizon_s):
            return begin, {"next_pid": first_pid}
        if isinstance(limit, ReadAllAvailable) or not backlog:
            return latest, {}  # nothing to bound (and no sample of an empty backlog to keep for 30 s)
        rows = limit.max_rows if isinstance(limit, ReadMaxRows) else self.max_rows
        if room is not None:
            rows = max(1, min(rows, room))
        path = self.recent_yields_path
        per_message = self._tuples_per_message(begin, latest)
        bound = BatchBound(
            messages=max(1.0, rows / per_message),
            results=self.max_results / RESULTS_HEADROOM,
            per_message=per_message,
            streams=len(self.streams),
            yields=read_recent_yields(path) if path else {},
        )
        cut, next_pid = pids_within(begin, latest, bound, first_pid)
        return cut, {} if next_pid is None else {"next_pid": next_pid}

    def _tuples_per_message(self, start: Offsets, latest: Offsets, samples: int = 4) -> float:
        """Tuples per message, from the middle message of the backlogs of the partitions with the largest
        ones: real-time producing packs a few tuples per message, a pre-loaded topic hundreds (and its
        newest message may be a partial one of a few tuples, which would make the cap far too large).
        Sampled again every SAMPLE_EVERY_S seconds, not every batch (each sample is a fetch)."""
        now = time.monotonic()
        if self._per_message is None or now - self._sampled_at > SAMPLE_EVERY_S:
            self._per_message = self._sample_tuples_per_message(start, latest, samples)
            self._sampled_at = now
        return self._per_message

    def _sample_tuples_per_message(self, start: Offsets, latest: Offsets, samples: int) -> float:
        from confluent_kafka import TopicPartition

        from pipeline.codec import MalformedRecord, tuple_count

        topic_of = dict(zip(self.streams, self.topics, strict=True))
        largest = sorted(
            (
                (latest[s][p] - start[s][p], s, p)
                for s in latest
                for p in latest[s]
                if latest[s][p] > start[s][p]
            ),
            reverse=True,
        )[:samples]
        consumer = self.facts.probe()
        counts = []
        for _, s, p in largest:
            middle = (start[s][p] + latest[s][p]) // 2
            consumer.assign([TopicPartition(topic_of[s], int(p), middle)])
            for msg in consumer.consume(num_messages=1, timeout=5):
                value = msg.value() if msg.error() is None else None
                if value is not None:
                    try:
                        counts.append(tuple_count(value))
                    except MalformedRecord:
                        continue
        consumer.unassign()  # an assigned consumer would go on fetching
        return max(1.0, sum(counts) / len(counts)) if counts else 1.0

    def getDefaultReadLimit(self) -> ReadLimit:
        """Batches are capped at about `max_rows` tuples (whole pids at a time), fewer by `max_results`."""
        return ReadMaxRows(self.max_rows)

    def partitions(self, start: dict, end: dict) -> Sequence[InputPartition]:
        released, acquired = released_of(end), acquired_of(end)
        self._announce_releases(int(end["epoch"]), released, tracks=True)
        begin = {s: {**start["offsets"].get(s, {}), **end.get("from", {}).get(s, {})} for s in self.streams}
        ranges = [
            PidRange(i, self.topics[i], int(p), begin[s][p], e)
            for i, s in enumerate(self.streams)
            for p, e in end["offsets"].get(s, {}).items()
            if p in begin[s]
        ]
        for p in self._read_to_cutoff(start, released):  # then let go
            for i, s in enumerate(self.streams):
                ranges.append(
                    PidRange(i, self.topics[i], p, start["offsets"][s][str(p)], released[p].cutoff[s])
                )
        tasks = [
            KafkaPidPartition(t, self.partition_count, report=self.report)
            for t in plan_partitions(ranges, self.tasks)
        ]
        # a kept window's sender (an overlap's old side) neither exports nor drops it
        releases = tuple((p, r.export) for p, r in released.items() if not r.track)
        snapshots = []
        replays = []
        for p, a in acquired.items():
            handoff = a.handoff
            if handoff.snapshot is not None:
                snapshots.append((p, handoff.snapshot))
            # a dead owner's spilled pid: its generations; else after the window, the input a dead
            # old side processed, processed again silently
            if handoff.spilled:
                assert a.replay_from is not None, "a dead owner's spilled pid is replayed"
                replays += self._generations(p, Cleanup(a.replay_from, handoff.spilled, handoff.cutoff))
                continue
            window_end = handoff.since or handoff.cutoff
            for i, s in enumerate(self.streams):
                pid_range = partial(PidRange, i, self.topics[i], p)
                if a.replay_from is not None and a.replay_from[s] < window_end[s]:
                    replays.append(pid_range(a.replay_from[s], window_end[s], RangeKind.WINDOW))
                if window_end[s] < handoff.cutoff[s]:
                    replays.append(pid_range(window_end[s], handoff.cutoff[s], RangeKind.SILENT))
        for p, c in cleanups_of(end).items():  # a spilled pid's generations, before its new input
            replays += self._generations(p, c)
        markers = tuple(markers_of(end))
        if releases or snapshots or replays or markers:  # with the first task's reads: a task is a round trip
            first = tasks[0].ranges if tasks else []
            work = HandoffWork(releases, tuple(snapshots), markers)
            tasks[:1] = [KafkaPidPartition([*first, *replays], self.partition_count, work, self.report)]
        return tasks

    def _generations(self, p: int, c: Cleanup) -> list[PidRange]:
        """The ranges that rebuild spilled pid `p` (`pipeline.spill`): its window at the first spill
        point, installed, then each later generation, joined with the ones before it only."""
        ranges = []
        for i, s in enumerate(self.streams):
            pid_range = partial(PidRange, i, self.topics[i], p)
            if c.replay_from[s] < c.cutoffs[0][s]:
                ranges.append(pid_range(c.replay_from[s], c.cutoffs[0][s], RangeKind.WINDOW))
            for g, (a, b) in enumerate(c.generations(s)):
                if a < b:
                    ranges.append(pid_range(a, b, RangeKind.CROSS, g))
        return ranges

    def _announce_releases(self, epoch: int, released: Mapping[int, Release], tracks: bool) -> None:
        """Publish `Released` for the moves out this plan makes, before the batch commits: replays as
        soon as the plan has their cutoff (`tracks` false, from `latestOffset`), parallel tracks whose
        `stream_max` the plan knows once Spark has logged the plan (`tracks` true, from `partitions`).

        Both cutoffs are where this batch begins: the end of the last batch, which has committed
        before Spark asks for the next one's offsets. A replay's is certain before Spark logs the
        plan: a query that stops before logging it plans the release again from the same offsets, or,
        once the pid is handed over, reads nothing of it (decision 0040). The batch reads nothing of a
        replayed pid, so whether it ever commits changes nothing the receiver does (decision 0037). A
        parallel track's old side lives in the logged plan (its `tracking` role): replanned after a
        restart under the handoff's assignment, it would be lost while the receiver runs the new side.
        The sink publishes the same message again with the batch, as for every release; the
        controller's view keeps one per move."""
        announced = [(p, r) for p, r in released.items() if r.announce and r.move_id and r.track == tracks]
        if not announced or self.control_topic is None:
            return
        from pipeline.control import publish

        producer = _producer(self.bootstrap)
        for p, r in announced:
            assert r.move_id is not None
            msg = ReleasedMsg(
                instance=self.instance,
                epoch=epoch,
                pid=p,
                move_id=r.move_id,
                cutoff=r.cutoff,
                snapshot=None,
                stream_max=tuple(r.stream_max) if r.stream_max is not None else None,
                announced=True,
            )
            publish(producer, self.control_topic, msg)
        if producer.flush(30):
            raise RuntimeError(f"{self.instance}: Released of pids {[p for p, _ in announced]} not delivered")

    def read(self, partition: InputPartition) -> Iterator[pa.RecordBatch]:
        assert isinstance(partition, KafkaPidPartition)
        yield from handoff_rows(self.bootstrap, partition.handoff, len(self.streams))
        read: dict[tuple[int, int], tuple[int, int]] = {}  # (pid, stream) -> (tuples, newest event time)
        for batch in read_ranges(self.bootstrap, partition.ranges, partition.partitions):
            yield batch
            code, ts = batch.column("stream").to_numpy(), batch.column("ts").to_numpy()
            data = (code >= 0) & (code < WINDOW_ROW) & (batch.column("id").to_numpy() != PROGRESS_ID)
            if data.any():  # one range: one pid, one stream
                key = (int(batch.column("pid")[0].as_py()), int(code[data][0]))
                n, newest = read.get(key, (0, 0))
                read[key] = (n + int(data.sum()), max(newest, int(ts[data].max())))
        if partition.report is not None and read:
            report_reading(self.bootstrap, partition.report, read)

    def commit(self, end: dict) -> None:
        """Nothing to do: progress lives in Spark's offset log and the sink's commit topic."""

    def stop(self) -> None:
        self.facts.close()


def report_reading(
    bootstrap: str, report: ReadReport, read: Mapping[tuple[int, int], tuple[int, int]]
) -> None:
    """Publish what a read task read, per (pid, stream): tuples and their newest event time, as soon as
    its reading ends. The join, the long part of a loaded instance's batch, comes after, and the batch
    record only at its end. The controller counts this in-flight input in the pids' arrival rates
    (`controller.observation.rates.in_flight_reading`), so a hot set that arrived at a loaded instance
    shows a batch earlier. Not transactional, like a heartbeat: a task that runs again reports again, and the
    newest report of a (pid, stream) wins (a pid's streams may be read by different tasks)."""
    record = {
        "kind": "reading",
        "instance": report.instance,
        "time_ms": int(time.time() * 1000),
        "ranges": [
            {"pid": p, "stream": j, "in": n, "newest_ms": t} for (p, j), (n, t) in sorted(read.items())
        ],
    }
    producer = _producer(bootstrap)
    produce_signed(producer, report.topic, report.instance, json.dumps(record).encode())
    producer.flush(5)


_PRODUCERS: dict[str, Any] = {}


def _producer(bootstrap: str) -> Any:
    """This process's producer outside transactions (read reports, parallel tracks announced at the plan)."""
    from confluent_kafka import Producer

    producer = _PRODUCERS.get(bootstrap)
    if producer is None:
        producer = _PRODUCERS[bootstrap] = Producer({**kafka_config(bootstrap), "linger.ms": 0})
    return producer


def close_clients(bootstrap: str) -> None:
    """Close this process's kept Kafka clients of `bootstrap` (the range consumer, the read-report
    producer), before the cluster goes away: left open, they retry its address until the process
    exits, one error line every 50 ms."""
    drop_consumer(bootstrap)
    producer = _PRODUCERS.pop(bootstrap, None)
    if producer is not None:
        producer.flush(5)
