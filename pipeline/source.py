"""The instance's streaming source: a PySpark Python data source reading its assigned pids from Kafka.

Why a custom source: Spark's built-in Kafka source fixes its partition set when the query starts, so an
instance could not gain or lose a pid without a restart. Here the source's offset *is* the assignment:
`{"epoch": e, "offsets": {stream: {pid: next_offset}}}`. The assigned pid set is read from the instance's
assignment file at every batch boundary (`latestOffset`), so the set changes between micro-batches while
the query runs, and Spark's offset log makes a restarted query replay exactly the same batches.

A pid that joins the set enters the offset map at its start offset and is read from the next batch on;
a pid that leaves is dropped from the map and never read again.

Rows: (pid, stream, id, key, ts). A record that does not decode becomes one row with stream = -1,
id = its Kafka offset, key = the stream index, ts = the `Malformation` code, so it reaches the
dead-letter topic through the same exactly-once sink instead of failing the query or vanishing.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
from pyspark.sql.datasource import DataSource, DataSourceStreamReader, InputPartition
from pyspark.sql.streaming.datasource import ReadAllAvailable, ReadLimit, ReadMaxRows

SOURCE_NAME = "fluxjoin"
SOURCE_SCHEMA = "pid int, stream byte, id long, key long, ts long"
_ARROW_SCHEMA = pa.schema(
    [("pid", pa.int32()), ("stream", pa.int8()), ("id", pa.int64()), ("key", pa.int64()), ("ts", pa.int64())]
)
MALFORMED_STREAM = -1
_READ_TIMEOUT_S = 60.0


# --- the assignment file: written by the instance (and later the controller), read at batch boundaries ---


@dataclass(frozen=True, slots=True)
class OwnedPids:
    epoch: int
    pids: frozenset[int]
    # Where to start reading a pid that is new to this instance (stream -> offset); absent: earliest.
    start_offsets: dict[int, dict[str, int]]


def write_assignment(path: Path, owned: OwnedPids) -> None:
    """Atomically replace the assignment file (readers never see a half-written file)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    body = {
        "epoch": owned.epoch,
        "pids": sorted(owned.pids),
        "start_offsets": {str(p): o for p, o in sorted(owned.start_offsets.items())},
    }
    tmp.write_text(json.dumps(body))
    os.replace(tmp, path)


def read_assignment(path: Path) -> OwnedPids:
    body = json.loads(path.read_text())
    return OwnedPids(
        epoch=int(body["epoch"]),
        pids=frozenset(int(p) for p in body["pids"]),
        start_offsets={int(p): {s: int(o) for s, o in v.items()} for p, v in body["start_offsets"].items()},
    )


# --- offsets ---

Offsets = dict[str, dict[str, int]]  # stream -> str(pid) -> next offset to read


@dataclass(frozen=True, slots=True)
class PidRange:
    """One pid's slice of one stream for a batch: Kafka offsets [start, end)."""

    stream_index: int
    topic: str
    pid: int
    start: int
    end: int


class KafkaPidPartition(InputPartition):
    def __init__(self, ranges: list[PidRange], partitions: int) -> None:
        super().__init__(ranges)
        self.ranges = ranges
        self.partitions = partitions


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


def limit_offsets(start: Offsets, latest: Offsets, max_messages: int) -> Offsets:
    """Cap a batch at `max_messages`, shared in proportion to each pid's backlog so all streams and
    pids advance together in event time (the window join needs its inputs roughly aligned)."""
    backlog = {
        (s, p): latest[s][p] - start.get(s, {}).get(p, latest[s][p]) for s in latest for p in latest[s]
    }
    total = sum(backlog.values())
    if total <= max_messages:
        return latest
    scale = max_messages / total
    out: Offsets = {s: {} for s in latest}
    for s in latest:
        for p, end in latest[s].items():
            begin = start.get(s, {}).get(p, end)
            out[s][p] = begin + max(1 if backlog[(s, p)] else 0, int(backlog[(s, p)] * scale))
    return out


# --- Spark wiring ---


class FluxjoinSource(DataSource):
    """Options: `bootstrap`, `streams` (comma separated, configured order), `topics` (same order),
    `assignment` (path of the assignment file), `partitions` (P), `max_messages` (Kafka messages per
    batch, the source's default read limit), `tasks` (read parallelism)."""

    @classmethod
    def name(cls) -> str:
        return SOURCE_NAME

    def schema(self) -> str:
        return SOURCE_SCHEMA

    def streamReader(self, schema: Any) -> DataSourceStreamReader:
        return FluxjoinStreamReader(dict(self.options))


class FluxjoinStreamReader(DataSourceStreamReader):
    def __init__(self, options: dict[str, str]) -> None:
        self.bootstrap = options["bootstrap"]
        self.streams = options["streams"].split(",")
        self.topics = options["topics"].split(",")
        self.assignment_path = Path(options["assignment"])
        self.partition_count = int(options["partitions"])
        self.max_messages = int(options.get("max_messages", "1000"))
        self.tasks = int(options.get("tasks", "2"))
        self._admin: Any = None

    def _watermarks(self, pids: Sequence[int], spec: str) -> dict[str, dict[str, int]]:
        from confluent_kafka import TopicPartition
        from confluent_kafka.admin import AdminClient, OffsetSpec

        if self._admin is None:
            self._admin = AdminClient({"bootstrap.servers": self.bootstrap})
        wanted = OffsetSpec.latest() if spec == "latest" else OffsetSpec.earliest()
        request = {TopicPartition(t, p): wanted for t in self.topics for p in pids}
        out: dict[str, dict[str, int]] = {s: {} for s in self.streams}
        if not request:
            return out
        futures = self._admin.list_offsets(request, request_timeout=30)
        topic_to_stream = dict(zip(self.topics, self.streams, strict=True))
        for tp, fut in futures.items():
            out[topic_to_stream[tp.topic]][str(tp.partition)] = fut.result().offset
        return out

    def initialOffset(self) -> dict:
        owned = read_assignment(self.assignment_path)
        return self._enter_new_pids({"epoch": owned.epoch, "offsets": {s: {} for s in self.streams}}, owned)

    def _enter_new_pids(self, offset: dict, owned: OwnedPids) -> dict:
        """Drop released pids; add acquired ones at their start offsets (earliest if none given)."""
        current: Offsets = offset["offsets"]
        keep: Offsets = {
            s: {p: o for p, o in current.get(s, {}).items() if int(p) in owned.pids} for s in self.streams
        }
        new = sorted(p for p in owned.pids if str(p) not in keep[self.streams[0]])
        earliest = self._watermarks(new, "earliest") if new else {}
        for p in new:
            given = owned.start_offsets.get(p, {})
            for s in self.streams:
                keep[s][str(p)] = given.get(s, earliest[s][str(p)])
        return {"epoch": owned.epoch, "offsets": keep}

    def latestOffset(self, start: dict, limit: ReadLimit) -> dict:
        owned = read_assignment(self.assignment_path)
        if owned.epoch != start["epoch"]:
            # The pid set changed: this batch only moves the offset map to the new epoch.
            return self._enter_new_pids(start, owned)
        pids = sorted(int(p) for p in start["offsets"][self.streams[0]])
        latest = self._watermarks(pids, "latest")
        if isinstance(limit, ReadAllAvailable):
            return {"epoch": owned.epoch, "offsets": latest}
        cap = limit.max_rows if isinstance(limit, ReadMaxRows) else self.max_messages
        return {"epoch": owned.epoch, "offsets": limit_offsets(start["offsets"], latest, cap)}

    def getDefaultReadLimit(self) -> ReadLimit:
        """Batches are capped in Kafka messages (each carries up to `tuples_per_message` tuples)."""
        return ReadMaxRows(self.max_messages)

    def partitions(self, start: dict, end: dict) -> Sequence[InputPartition]:
        ranges = [
            PidRange(i, self.topics[i], int(p), start["offsets"].get(s, {})[p], e)
            for i, s in enumerate(self.streams)
            for p, e in end["offsets"].get(s, {}).items()
            if p in start["offsets"].get(s, {})
        ]
        return [KafkaPidPartition(t, self.partition_count) for t in plan_partitions(ranges, self.tasks)]

    def read(self, partition: InputPartition) -> Iterator[pa.RecordBatch]:
        assert isinstance(partition, KafkaPidPartition)
        return read_ranges(self.bootstrap, partition.ranges, partition.partitions)

    def commit(self, end: dict) -> None:
        """Nothing to do: progress lives in Spark's offset log and the sink's commit topic."""

    def stop(self) -> None:
        self._admin = None


def read_ranges(bootstrap: str, ranges: Sequence[PidRange], partitions: int) -> Iterator[pa.RecordBatch]:
    """Read every range [start, end) exactly (all at once), decode in bulk, yield one batch per range."""
    from confluent_kafka import Consumer, KafkaError, TopicPartition

    from pipeline.codec import Malformation, MalformedRecord, decode_tuple_columns
    from pipeline.partitioning import pids_of

    consumer = Consumer(
        {
            "bootstrap.servers": bootstrap,
            "group.id": "fluxjoin-unused",  # offsets are never committed to Kafka; Spark owns them
            "enable.auto.commit": False,
            "enable.partition.eof": True,
            "isolation.level": "read_committed",
            "fetch.max.bytes": 64 * 1024 * 1024,
            "max.partition.fetch.bytes": 16 * 1024 * 1024,
        }
    )
    by_tp = {(r.topic, r.pid): r for r in ranges}
    next_offset = {tp: r.start for tp, r in by_tp.items()}
    cols: dict[tuple[str, int], list[tuple[np.ndarray, np.ndarray, np.ndarray]]] = {tp: [] for tp in by_tp}
    bad: dict[tuple[str, int], list[tuple[int, int]]] = {tp: [] for tp in by_tp}
    pending = {tp for tp, r in by_tp.items() if r.end > r.start}
    try:
        consumer.assign([TopicPartition(t, p, by_tp[(t, p)].start) for t, p in pending])
        deadline = time.monotonic() + _READ_TIMEOUT_S
        while pending:
            if time.monotonic() > deadline:
                late = sorted(pending)[:5]
                raise TimeoutError(f"offsets not readable within {_READ_TIMEOUT_S:.0f} s, e.g. {late}")
            remaining = sum(by_tp[tp].end - next_offset[tp] for tp in pending)
            for msg in consumer.consume(num_messages=max(1, min(remaining, 10_000)), timeout=0.5):
                topic, partition, off, value = msg.topic(), msg.partition(), msg.offset(), msg.value()
                assert topic is not None and partition is not None
                tp = (topic, partition)
                err = msg.error()
                if err is not None:
                    if err.code() == KafkaError._PARTITION_EOF:
                        pending.discard(tp)  # only transaction markers were left before the end
                        continue
                    raise RuntimeError(f"reading {tp}: {err}")
                assert off is not None and value is not None
                r = by_tp[tp]
                if tp not in pending or off >= r.end:
                    pending.discard(tp)
                    continue
                next_offset[tp] = off + 1
                if off + 1 >= r.end:
                    pending.discard(tp)
                try:
                    ids, keys, ts = decode_tuple_columns(value)
                    if len(keys) and (pids_of(keys, partitions) != r.pid).any():
                        raise MalformedRecord(Malformation.WRONG_PARTITION, "key of another pid")
                    cols[tp].append((ids, keys, ts))
                except MalformedRecord as exc:
                    bad[tp].append((off, int(exc.reason)))
    finally:
        consumer.close()
    for tp, r in by_tp.items():
        if cols[tp] or bad[tp]:
            yield _to_arrow(r, cols[tp], bad[tp])


def _to_arrow(
    r: PidRange, cols: list[tuple[np.ndarray, np.ndarray, np.ndarray]], bad: list[tuple[int, int]]
) -> pa.RecordBatch:
    ids = [c[0] for c in cols] + [np.array([o for o, _ in bad], dtype=np.int64)]
    keys = [c[1] for c in cols] + [np.full(len(bad), r.stream_index, dtype=np.int64)]
    ts = [c[2] for c in cols] + [np.array([code for _, code in bad], dtype=np.int64)]
    n_good = sum(len(c[0]) for c in cols)
    stream = np.full(n_good + len(bad), r.stream_index, dtype=np.int8)
    stream[n_good:] = MALFORMED_STREAM
    return pa.RecordBatch.from_arrays(
        [
            pa.array(np.full(len(stream), r.pid, dtype=np.int32)),
            pa.array(stream),
            pa.array(np.concatenate(ids)),
            pa.array(np.concatenate(keys)),
            pa.array(np.concatenate(ts)),
        ],
        schema=_ARROW_SCHEMA,
    )
