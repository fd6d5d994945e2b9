"""What the instance's plan asks of the input, answered from Kafka: the `InputFacts` port of
`pipeline.epoch_change.change_epoch`, and the input offsets a batch is planned up to.

The source (`pipeline.source.FluxjoinStreamReader`) plans batches and announces releases; the lookups
a plan makes (log starts and ends, where a replay re-reads from, the sink's noted `stream_max`, which
pids this instance committed before) are here, behind the port a model-based test answers from a
simulated log instead.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pipeline.batch_sizing import Offsets
from pipeline.instance_files import read_watermarks, stream_max_at
from pipeline.kafka_client import CONSUMER_GROUP, kafka_config
from pipeline.protocol_codec import marker_author, marker_from_json

log = logging.getLogger(__name__)


@dataclass(slots=True, kw_only=True)
class KafkaInputFacts:
    """One instance's view of its input topics (`topics[i]` holds stream `streams[i]`), its sink's
    `stream_max` notes (`watermarks_path`) and its commit markers (`commits_topic`). Its Kafka clients
    are made on first use and kept (`close`)."""

    bootstrap: str
    streams: Sequence[str]
    topics: Sequence[str]
    instance: str
    window_ms: int
    lateness_ms: int
    watermarks_path: Path | None = None
    control_topic: str | None = None
    commits_topic: str | None = None
    _admin: Any = field(default=None, repr=False)
    _consumer: Any = field(default=None, repr=False)

    def offsets(self, pids: Sequence[int], latest: bool) -> Offsets:
        """Each stream's earliest or (`latest`) latest offsets of `pids`. The latest are the last stable
        offsets: the ranges are read `read_committed`, which ends there, and a batch planned up to the high
        watermark would skip for ever what an upstream transaction open at the plan later commits."""
        from confluent_kafka import KafkaException
        from confluent_kafka.admin import AdminClient

        from pipeline.topics import broker_away, partition_offsets

        if self._admin is None:
            self._admin = AdminClient(kafka_config(self.bootstrap))
        wanted = [(t, p) for t in self.topics for p in pids]
        while True:  # a broker that is away is waited for, however long (decision 0052)
            try:
                found = partition_offsets(self._admin, wanted, latest, committed=True)
                break
            except KafkaException as exc:
                if not broker_away(exc):
                    raise
                log.warning(
                    "%s: input offsets unknown, the broker is away (%s); asking again", self.instance, exc
                )
                time.sleep(2.0)
        topic_to_stream = dict(zip(self.topics, self.streams, strict=True))
        out: dict[str, dict[str, int]] = {s: {} for s in self.streams}
        for (topic, pid), offset in found.items():
            out[topic_to_stream[topic]][str(pid)] = offset
        return out

    def earliest(self, pids: Sequence[int]) -> Offsets:
        return self.offsets(pids, latest=False)

    def stream_maxes(self, cutoffs: Mapping[int, Mapping[str, int]]) -> dict[int, tuple[int, ...]]:
        if self.watermarks_path is None or self.control_topic is None:
            return {}
        noted = read_watermarks(self.watermarks_path)
        found = {p: stream_max_at(noted, p, cutoff) for p, cutoff in cutoffs.items()}
        return {p: stream_max for p, stream_max in found.items() if stream_max is not None}

    def refuse_unprocessed(self, query_epoch: int, epoch: int, pids: Sequence[int]) -> None:
        """Refuse `pids`, owned in `epoch` with no handoff and new to this query, unless nobody has
        processed them: read from the log start with an empty window, they would emit every retained
        result again. A running query gains pids only by handoffs. A fresh one starts its pipeline's
        first assignment, or an instance that starts after the first epochs, and takes such pids only
        if this instance never committed them: a checkpoint wiped while the instance kept its pids (it
        rejoined after an eviction it outlived, or lost its disk) must not start them over.
        """
        if query_epoch != -1:
            why = f"new to a query that runs since epoch {query_epoch}"
        elif self.commits_topic is None:
            return
        else:
            committed = self._committed_pids(self.commits_topic)
            pids = [p for p in pids if p in committed]
            why = "committed by this instance before, under a checkpoint it no longer has"
        if pids:
            raise RuntimeError(
                f"{self.instance}: pid {', '.join(map(str, pids))} owned in epoch {epoch} with no handoff, "
                f"{why}: read from the log start it would emit every retained result again"
            )

    def _committed_pids(self, commits_topic: str) -> frozenset[int]:
        """The pids of this instance's newest commit marker, whatever its incarnation."""
        from pipeline.topics import read_topic

        pids: frozenset[int] = frozenset()
        for _, _, value in read_topic(self.bootstrap, commits_topic, signed_by=marker_author):
            marker = marker_from_json(json.loads(value))
            if marker.instance == self.instance:
                pids = marker.pids()
        return pids

    def replay_from(self, pid: int, cutoff: Mapping[str, int]) -> dict[str, int]:
        """Offsets from which re-reading the input rebuilds the window the previous owner had at the
        cutoff. A tuple of stream i stays in a window while another stream can still bring a partner:
        down to W below the lowest of the other streams' newest event times (minus the lateness), and
        stream i's own newest event time must be re-read for the lateness rule (decision 0047). The
        newest event time of each stream is its last record's timestamp before the cutoff (a record's
        timestamp is its first event time; each target reaches back twice the lateness more for the
        disorder between records). A stream that has nothing before the cutoff keeps every tuple of the
        others in the window: they are re-read from the start. The install drops what is too old.

        Timestamps find the first record stamped at or after a target, but a record holds tuples from
        its stamp on, as far as its producer packed them (the generator: half a second), so the records
        before it that still hold a tuple at or after the target are re-read too (`_reach_back`)."""
        from confluent_kafka import TopicPartition

        newest: dict[str, int] = {}
        for topic, stream in zip(self.topics, self.streams, strict=True):
            record = self._record_before(topic, pid, cutoff[stream])
            if record is not None:
                newest[topic] = record.timestamp()[1]
        if not newest:
            return dict(cutoff)
        targets = []
        for topic in self.topics:
            others = [newest.get(t) for t in self.topics if t != topic]
            own = newest.get(topic)
            if own is None or None in others:
                targets.append(0)  # nothing to re-read before the cutoff, or every tuple is still held
                continue
            lowest = min(t for t in others if t is not None) - self.lateness_ms - self.window_ms
            targets.append(max(0, min(lowest, own) - 2 * self.lateness_ms))
        found = self.probe().offsets_for_times(
            [TopicPartition(t, pid, target) for t, target in zip(self.topics, targets, strict=True)], 30
        )
        by_topic = {tp.topic: tp.offset for tp in found}
        out = {}
        for topic, stream, target in zip(self.topics, self.streams, targets, strict=True):
            offset = by_topic[topic]
            first = cutoff[stream] if offset < 0 else min(offset, cutoff[stream])
            out[stream] = self._reach_back(topic, pid, first, target)
        return out

    def _reach_back(self, topic: str, pid: int, start: int, target: int) -> int:
        """`start`, moved back over the records just before it that hold an event time at or after
        `target` (a tuple's or a progress record's): whatever their stamp, the window holds their
        later tuples."""
        while (record := self._record_before(topic, pid, start)) is not None:
            newest = newest_event_time(record.value())
            if newest is None or newest < target:
                break
            start = record.offset()
        return start

    def _record_before(self, topic: str, pid: int, offset: int) -> Any:
        """The last record of topic[pid] before `offset`, over transaction markers and aborted records;
        None when there is none (the log starts at `offset` or later)."""
        from confluent_kafka import KafkaError, TopicPartition

        consumer = self.probe()
        deadline = time.monotonic() + 30
        at = offset - 1
        try:
            while at >= 0:
                consumer.assign([TopicPartition(topic, pid, at)])
                got = None
                while got is None:
                    if time.monotonic() > deadline:
                        raise TimeoutError(f"{topic}[{pid}]@{at} not readable within 30 s")
                    for msg in consumer.consume(num_messages=1, timeout=1):
                        ours = (msg.topic(), msg.partition()) == (topic, pid)
                        if ours and (msg.error() is not None or (msg.offset() or 0) >= at):
                            got = msg  # else a message a reused consumer still held
                err = got.error()
                if err is not None and err.code() == KafkaError._AUTO_OFFSET_RESET:
                    return None  # below the log start
                if err is not None and err.code() != KafkaError._PARTITION_EOF:
                    raise RuntimeError(f"reading {topic}[{pid}]@{at}: {err}")
                if err is None and got.offset() == at:
                    return got
                at -= 1  # a transaction marker or an aborted record: nothing to read there
            return None
        finally:
            consumer.unassign()  # an assigned consumer would go on fetching

    def probe(self) -> Any:
        """The consumer of single messages: the source's samples of a message's size, the records
        before a replay's cutoff (`BOUNDED_READ`: each had waited behind the broker's long poll,
        decision 0034)."""
        from confluent_kafka import Consumer

        from pipeline.topics import BOUNDED_READ

        if self._consumer is None:
            self._consumer = Consumer(
                {
                    **kafka_config(self.bootstrap),
                    "group.id": CONSUMER_GROUP,
                    "isolation.level": "read_committed",  # what the ranges read
                    "enable.partition.eof": True,  # a transaction marker at the end: an answer, not a wait
                    "auto.offset.reset": "error",  # below the log start: an answer, not the end's record
                }
                | BOUNDED_READ
            )
            self._consumer.list_topics(timeout=10)  # connected and knowing the leaders before it is needed
        return self._consumer

    def close(self) -> None:
        self._admin = None
        if self._consumer is not None:
            self._consumer.close()
            self._consumer = None


def newest_event_time(value: bytes | None) -> int | None:
    """The largest event time of a record: its tuples' or its progress record's; None for a record that
    holds none or does not decode (dead-lettered, never in a window)."""
    from pipeline.codec import MalformedRecord, decode_tuple_columns, progress_of

    progress = progress_of(value)
    if progress is not None:
        return progress
    try:
        ts = decode_tuple_columns(value)[2]
    except MalformedRecord:
        return None
    return int(ts.max()) if len(ts) else None
