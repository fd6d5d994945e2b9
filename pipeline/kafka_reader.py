"""Reading a batch's input in Spark's read tasks: the pid ranges of a batch, the range reader with its
kept consumer, and the download of the window snapshots that come with a pid's handoff.

Apart from the source (`pipeline/source.py`), which plans the batches and hands Spark their
partitions: this reads what a partition names. Its classes and functions stay at module level, where
Spark's Python workers find them when they unpickle a partition.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from enum import IntEnum
from typing import Any

import numpy as np
import pyarrow as pa

from pipeline.join import PROGRESS_ID
from pipeline.kafka_client import CONSUMER_GROUP, kafka_config
from pipeline.protocol import Snapshot
from pipeline.rows import (
    ARROW_SCHEMA,
    CODE,
    CROSS_ROW,
    MALFORMED_STREAM,
    RELEASE_ROW,
    SILENT_ROW,
    WATERMARK_ROW,
    WINDOW_ROW,
    cross_row,
    pid_rows,
)

log = logging.getLogger(__name__)

_READ_TIMEOUT_S = 60.0


class RangeKind(IntEnum):
    """What a range's rows are, as the base of their `stream` code: new input, joined; input re-read to
    rebuild a taken-over pid's window (replay), installed, never joined or dead-lettered; input a dead
    instance processed before the cutoff (`Handoff.since`), processed again silently; a spilled pid's
    new generation re-read at its clean-up, joined with the old generation only (`pipeline.spill`)."""

    INPUT = 0
    WINDOW = WINDOW_ROW
    SILENT = SILENT_ROW
    CROSS = CROSS_ROW


@dataclass(frozen=True, slots=True)
class PidRange:
    """One pid's slice of one stream for a batch: Kafka offsets [start, end)."""

    stream_index: int
    topic: str
    pid: int
    start: int
    end: int
    kind: RangeKind = RangeKind.INPUT
    generation: int = 0
    """For a CROSS range, which later generation of a spilled pid it is (0: the first after the spill)."""


@dataclass(frozen=True, slots=True)
class HandoffWork:
    """The non-data part of a batch: pids to release (and whether to export their window) and windows
    to install from snapshots."""

    releases: tuple[tuple[int, bool], ...] = ()
    snapshots: tuple[tuple[int, Snapshot], ...] = ()
    markers: tuple[tuple[int, int, int, int, int], ...] = ()  # (pid, stream code, id, key, ts): track rows


def handoff_rows(bootstrap: str, work: HandoffWork, streams: int) -> Iterator[pa.RecordBatch]:
    """Marker rows for released pids; the window rows and `stream_max` rows of each snapshot."""
    from pipeline.join import window_from_bytes

    for pid, export in work.releases:
        yield pid_rows(pid, np.array([RELEASE_ROW], CODE), [0], [int(export)], [0])
    for pid, snapshot in work.snapshots:
        window = window_from_bytes(read_snapshot(bootstrap, snapshot))
        if window.parts and len(window.parts) != streams:
            raise ValueError(f"snapshot of pid {pid} has {len(window.parts)} streams, expected {streams}")
        for j, part in enumerate(window.parts):
            if len(part):
                kinds = np.full(len(part), WINDOW_ROW + j, CODE)
                yield pid_rows(pid, kinds, part.ids, part.keys, part.ts)
        n = len(window.stream_max)
        yield pid_rows(pid, np.full(n, WATERMARK_ROW, CODE), np.arange(n), np.zeros(n), window.stream_max)
    for pid, code, i, key, ts in work.markers:
        yield pid_rows(pid, np.array([code], CODE), [i], [key], [ts])


def read_snapshot(bootstrap: str, snapshot: Snapshot) -> bytes:
    """The exported window's bytes, checked against the checksum the sender committed with them."""
    import hashlib

    from confluent_kafka import Consumer, TopicPartition

    from pipeline.topics import BOUNDED_READ

    consumer = Consumer(
        {
            **kafka_config(bootstrap),
            "group.id": CONSUMER_GROUP,
            "isolation.level": "read_committed",
            "auto.offset.reset": "error",
        }
        | BOUNDED_READ
    )
    chunks = []
    try:
        for offset in snapshot.offsets:
            consumer.assign([TopicPartition(snapshot.topic, snapshot.partition, offset)])
            got = consumer.consume(num_messages=1, timeout=30)
            if not got or got[0].error() is not None or got[0].offset() != offset:
                why = f": {got[0].error()}" if got and got[0].error() is not None else ""
                raise RuntimeError(
                    f"snapshot chunk {snapshot.topic}[{snapshot.partition}]@{offset} unreadable{why}"
                )
            chunks.append(got[0].value() or b"")
    finally:
        consumer.close()
    blob = b"".join(chunks)
    if hashlib.sha256(blob).hexdigest() != snapshot.sha256:
        raise RuntimeError(f"snapshot at {snapshot.topic}@{snapshot.offsets} fails its checksum")
    return blob


# One consumer per Python worker process and cluster, kept between batches: Spark reuses its Python
# workers, and a new consumer costs a connection, a metadata round trip and a fetch session per task.
_CONSUMERS: dict[str, Any] = {}


def _range_consumer(bootstrap: str) -> Any:
    from confluent_kafka import Consumer

    from pipeline.topics import BOUNDED_READ

    consumer = _CONSUMERS.get(bootstrap)
    if consumer is None:
        consumer = Consumer(
            {
                **kafka_config(bootstrap),
                "group.id": CONSUMER_GROUP,  # offsets are never committed to Kafka; Spark owns them
                "enable.auto.commit": False,
                "enable.partition.eof": True,
                "isolation.level": "read_committed",
                "auto.offset.reset": "error",  # an offset retention deleted fails, never skips to the end
                "fetch.max.bytes": 64 * 1024 * 1024,
                "max.partition.fetch.bytes": 16 * 1024 * 1024,
            }
            | BOUNDED_READ
        )
        _CONSUMERS[bootstrap] = consumer
    return consumer


def drop_consumer(bootstrap: str) -> None:
    """Close and forget this process's range consumer of `bootstrap` (after a read that did not end
    cleanly, or before the cluster goes away)."""
    consumer = _CONSUMERS.pop(bootstrap, None)
    if consumer is not None:
        consumer.close()


def read_ranges(bootstrap: str, ranges: Sequence[PidRange], partitions: int) -> Iterator[pa.RecordBatch]:
    """Read every range [start, end) exactly (all at once), decode in bulk, yield one batch per range.

    A partition may carry several ranges (a recovered parallel track's window rows, then its silent
    rows, back to back): it is read once, from the first range's start to the last one's end, and each
    message goes to the range that holds its offset.
    """
    from confluent_kafka import KafkaError, TopicPartition

    from pipeline.codec import Malformation, MalformedRecord, decode_tuple_columns, progress_of
    from pipeline.partitioning import pids_of
    from pipeline.topics import broker_answers, consume_ready

    ranges = list(dict.fromkeys(ranges))
    by_tp: dict[tuple[str, int], list[PidRange]] = {}
    for r in sorted((r for r in ranges if r.end > r.start), key=lambda r: r.start):
        by_tp.setdefault((r.topic, r.pid), []).append(r)
    for (name, pid), rs in by_tp.items():
        if any(a.end > b.start for a, b in itertools.pairwise(rs)):
            raise ValueError(f"overlapping ranges of {name}[{pid}]: {rs}")
    next_offset = {tp: rs[0].start for tp, rs in by_tp.items()}
    last_end = {tp: rs[-1].end for tp, rs in by_tp.items()}
    cols: dict[PidRange, list[tuple[np.ndarray, np.ndarray, np.ndarray]]] = {r: [] for r in ranges}
    bad: dict[PidRange, list[tuple[int, int]]] = {r: [] for r in ranges}
    pending = set(by_tp)
    consumer = _range_consumer(bootstrap)
    clean = False
    try:
        consumer.assign([TopicPartition(t, p, next_offset[(t, p)]) for t, p in pending])
        deadline = time.monotonic() + _READ_TIMEOUT_S
        while pending:
            if time.monotonic() > deadline:
                if not broker_answers(consumer, TopicPartition(*min(pending))):
                    # An outage is waited out however long it lasts (decision 0052); the consumer
                    # reconnects by itself and reads on from where it was.
                    log.warning("reading ranges: Kafka at %s is away, waiting", bootstrap)
                    deadline = time.monotonic() + _READ_TIMEOUT_S
                    continue
                late = [f"{t}[{p}] {next_offset[(t, p)]}-{last_end[(t, p)]}" for t, p in sorted(pending)[:5]]
                raise TimeoutError(
                    f"offsets not readable within {_READ_TIMEOUT_S:.0f} s (not committed yet: an upstream "
                    f"transaction still open?), e.g. {', '.join(late)}"
                )
            for msg in consume_ready(consumer, 10_000, 0.5):
                topic, partition, off, value = msg.topic(), msg.partition(), msg.offset(), msg.value()
                err = msg.error()
                if topic is None or partition is None:
                    # Not about a partition: the client's own report of a lost connection, which it
                    # re-establishes itself; the deadline above tells an outage from a stuck range.
                    continue
                tp = (topic, partition)
                if err is not None:
                    if err.code() == KafkaError._AUTO_OFFSET_RESET:
                        raise _input_gone(consumer, topic, partition, next_offset[tp], last_end[tp])
                    if err.code() != KafkaError._PARTITION_EOF:
                        raise RuntimeError(f"reading {tp}: {err}")
                    # The committed end: past the range, only transaction markers were left in it; short
                    # of it, a transaction the range was planned into is still open (read on).
                    if (off or 0) >= last_end[tp]:
                        pending.discard(tp)
                    continue
                assert off is not None
                if tp not in pending or off >= last_end[tp]:
                    pending.discard(tp)
                    continue
                if off < next_offset[tp]:
                    continue  # never twice, whatever a reused consumer may still deliver
                next_offset[tp] = off + 1
                if off + 1 >= last_end[tp]:
                    pending.discard(tp)
                into = next((r for r in by_tp[tp] if r.start <= off < r.end), None)
                if into is None:
                    continue  # between two ranges
                progress = progress_of(value)
                if progress is not None:  # counts for lateness in its place, joins nothing
                    cols[into].append((np.array([PROGRESS_ID]), np.zeros(1, np.int64), np.array([progress])))
                    continue
                try:
                    ids, keys, ts = decode_tuple_columns(value)
                    if len(keys) and (pids_of(keys, partitions) != into.pid).any():
                        raise MalformedRecord(Malformation.WRONG_PARTITION, "key of another pid")
                    if len(ids) and (ids < 0).any():
                        raise MalformedRecord(Malformation.NEGATIVE_ID, "a negative tuple id")
                    cols[into].append((ids, keys, ts))
                except MalformedRecord as exc:
                    if into.kind is RangeKind.INPUT:  # a re-read was reported when first read
                        bad[into].append((off, int(exc.reason)))
        consumer.unassign()  # drops whatever was fetched beyond the ranges
        clean = True
    finally:
        if not clean:
            drop_consumer(bootstrap)
    for r in ranges:
        if cols[r] or bad[r]:
            yield _to_arrow(r, cols[r], bad[r])


class InputGone(RuntimeError):
    """Input a batch or a replay must read is no longer in its topic: retention or a deletion moved the
    log start past it. Fatal, naming what is gone: reading on from elsewhere would lose it unnoticed."""


def _input_gone(consumer: Any, topic: str, partition: int, start: int, end: int) -> InputGone:
    from confluent_kafka import TopicPartition

    from pipeline.topics import watermark_offsets

    low, _ = watermark_offsets(consumer, TopicPartition(topic, partition))
    return InputGone(
        f"{topic}[{partition}]: offsets from {start} (reading up to {end}) are gone, the log starts at "
        f"{low} now; the input below it was deleted before it was read"
    )


def _to_arrow(
    r: PidRange, cols: list[tuple[np.ndarray, np.ndarray, np.ndarray]], bad: list[tuple[int, int]]
) -> pa.RecordBatch:
    ids = [c[0] for c in cols] + [np.array([o for o, _ in bad], dtype=np.int64)]
    keys = [c[1] for c in cols] + [np.full(len(bad), r.stream_index, dtype=np.int64)]
    ts = [c[2] for c in cols] + [np.array([code for _, code in bad], dtype=np.int64)]
    n_good = sum(len(c[0]) for c in cols)
    code = cross_row(r.generation, r.stream_index) if r.kind is RangeKind.CROSS else r.stream_index + r.kind
    stream = np.full(n_good + len(bad), code, dtype=CODE)
    stream[n_good:] = MALFORMED_STREAM
    return pa.RecordBatch.from_arrays(
        [
            pa.array(np.full(len(stream), r.pid, dtype=np.int32)),
            pa.array(stream),
            pa.array(np.concatenate(ids)),
            pa.array(np.concatenate(keys)),
            pa.array(np.concatenate(ts)),
        ],
        schema=ARROW_SCHEMA,
    )
