"""A batch's output as the messages its transaction carries: its results, its dead letters, and the
handoff acknowledgements its plan and its rows call for.

Handoffs ride the batch's transaction: a batch that releases pids writes their exported windows to the
handoff topic and `Released` to the control log; a batch that installs taken-over pids writes
`Acquired`, and the end of a parallel-track overlap `TrackDone`. So a move's step is acknowledged
exactly when the batch that made it commits, and never by an attempt the broker aborted.

`BatchOutput` writes into a transaction the sink (`pipeline.sink.ExactlyOnceSink`) has begun, and the
sink commits or aborts it: it holds no transaction of its own.
"""

from __future__ import annotations

import hashlib
import json
import time
from typing import Any

import numpy as np
from confluent_kafka import KafkaError, KafkaException, Producer

from pipeline.batch_plan import acquired_of, released_of, tracking_of
from pipeline.codec import Malformation
from pipeline.config import Config
from pipeline.control import publish
from pipeline.join import Part, WindowState, window_to_bytes
from pipeline.operator import KIND_RELEASED, KIND_STATE, KIND_TRACK_DONE
from pipeline.protocol import AcquiredMsg, ReleasedMsg, Snapshot, TrackDoneMsg
from pipeline.rows import TRACK_OLD

LATE_REASON = "late: event time below its input partition's newest before it minus the allowed lateness"
SNAPSHOT_CHUNK_BYTES = 900_000  # keeps each exported-window message under Kafka's 1 MB default


def stream_max_columns(
    columns: dict[str, np.ndarray], rows: np.ndarray, streams: int
) -> list[tuple[int, ...]]:
    """The `stream_max` each of `rows` carries in its id columns (`released` and `watermark` rows)."""
    return list(zip(*(columns[f"id{j}"][rows].tolist() for j in range(streams)), strict=True))


def _released_stream_max(
    columns: dict[str, np.ndarray], kind: np.ndarray, pid: int, streams: int
) -> tuple[int, ...]:
    """The `stream_max` the operator's `released` row reports for `pid` (a release or an overlap's start)."""
    closing = (kind == KIND_RELEASED) & (columns["pid"] == pid)
    return tuple(int(t) for t in stream_max_columns(columns, closing, streams)[0])


class BatchOutput:
    """Writes a batch's output and acknowledgements with the sink's transactional producer."""

    def __init__(self, producer: Producer, cfg: Config, instance: str) -> None:
        self.producer, self.cfg, self.instance = producer, cfg, instance
        self.streams = cfg.streams
        self._delivered: dict[int, int] = {}
        self._undelivered: dict[int, KafkaError] = {}

    def produce_results(self, columns: dict[str, np.ndarray], mask: np.ndarray) -> int:
        """Each `result` row's payload is a results message already (`operator.RESULTS_PER_MESSAGE`)."""
        if not mask.any():
            return 0
        for pid, payload in zip(columns["pid"][mask], columns["payload"][mask], strict=True):
            self._produce(self.cfg.results_topic, int(pid), payload)
        return int(columns["key"][mask].sum())

    def produce_dead_letters(self, columns: dict[str, np.ndarray], mask: np.ndarray, what: str) -> int:
        """A JSON record per `late` or `malformed` row, saying why its tuple went to no window."""
        for i in np.flatnonzero(mask):
            pid = int(columns["pid"][i])
            if what == "late":
                stream = self.streams[int(columns["aux"][i])]
                record = {
                    "reason": LATE_REASON,
                    "stream": stream,
                    "pid": pid,
                    "id": int(columns["id0"][i]),
                    "key": int(columns["key"][i]),
                    "event_time_ms": int(columns["ts"][i]),
                }
            else:
                stream = self.streams[int(columns["key"][i])]
                record = {
                    "reason": f"malformed: {Malformation(int(columns['ts'][i])).name.lower()}",
                    "stream": stream,
                    "pid": pid,
                    "topic": self.cfg.input_topic(stream),
                    "partition": pid,
                    "offset": int(columns["id0"][i]),
                }
            self._produce(self.cfg.dead_letter_topic, None, json.dumps(record).encode())
        return int(mask.sum())

    def _produce(self, topic: str, partition: int | None, value: bytes) -> None:
        """Produce, serving delivery reports while librdkafka's queue is full."""
        kwargs: dict[str, Any] = {"value": value}
        if partition is not None:
            kwargs.update(partition=partition, key=str(partition))
        while True:
            try:
                self.producer.produce(topic, **kwargs)
                return
            except BufferError:
                self.producer.poll(0.05)

    def acknowledge_handoffs(
        self, offsets: dict[str, Any], columns: dict[str, np.ndarray], kind: np.ndarray, deadline: float
    ) -> None:
        """Released (with the exported window) and Acquired messages for this batch's epoch change;
        `deadline` (monotonic s) is when the transaction's time runs out."""
        epoch = int(offsets["epoch"])
        for p, released in released_of(offsets).items():
            if released.move_id is None:
                continue
            snapshot = self.export(p, columns, kind, deadline) if released.export else None
            stream_max = _released_stream_max(columns, kind, p, len(self.streams)) if released.track else None
            announced = released.stream_max
            if announced is not None and tuple(announced) != stream_max:
                raise RuntimeError(
                    f"pid {p}'s parallel track began at stream_max {stream_max}, not at the {announced} "
                    "its plan announced"
                )
            msg = ReleasedMsg(
                instance=self.instance,
                epoch=epoch,
                pid=p,
                move_id=released.move_id,
                cutoff=released.cutoff,
                snapshot=snapshot,
                stream_max=stream_max,
            )
            publish(self.producer, self.cfg.control_topic, msg)
        ended = kind == KIND_TRACK_DONE
        tracking = tracking_of(offsets)
        for p, side in zip(columns["pid"][ended].tolist(), columns["aux"][ended].tolist(), strict=True):
            done = TrackDoneMsg(
                instance=self.instance,
                epoch=epoch,
                pid=int(p),
                move_id=tracking[int(p)].move_id,
                side="old" if side == TRACK_OLD else "new",
            )
            publish(self.producer, self.cfg.control_topic, done)
        for p, acquired in acquired_of(offsets).items():
            msg2 = AcquiredMsg(instance=self.instance, epoch=epoch, pid=p, move_id=acquired.handoff.move_id)
            publish(self.producer, self.cfg.control_topic, msg2)

    def export(self, pid: int, columns: dict[str, np.ndarray], kind: np.ndarray, deadline: float) -> Snapshot:
        """Write a released pid's window to the handoff topic in chunks; flush to learn their offsets
        (inside the transaction: readers see them only once it commits). Chunks the broker has not taken
        while the transaction lasts fail the attempt, for another to produce them again: `Released` must
        not name a snapshot whose checksum its receiver would reject for ever."""
        rows = (kind == KIND_STATE) & (columns["pid"] == pid)
        stream = columns["aux"][rows]
        parts = tuple(
            Part(
                columns["id0"][rows][stream == j],
                columns["key"][rows][stream == j],
                columns["ts"][rows][stream == j],
            )
            for j in range(len(self.streams))
        )
        stream_max = _released_stream_max(columns, kind, pid, len(self.streams))
        blob = window_to_bytes(WindowState(parts, stream_max))
        topic = self.cfg.handoff_topic
        self._delivered, self._undelivered = {}, {}
        starts = range(0, max(1, len(blob)), SNAPSHOT_CHUNK_BYTES)
        for i, start in enumerate(starts):
            chunk = blob[start : start + SNAPSHOT_CHUNK_BYTES]
            self.producer.produce(topic, value=chunk, partition=0, on_delivery=self._on_chunk(i))
        self.producer.flush(max(0.0, deadline - time.monotonic()))
        missing = [i for i in range(len(starts)) if i not in self._delivered]
        if missing:
            failed = next(iter(self._undelivered.values()), None)
            reason = failed.str() if failed is not None else "the transaction's time ran out"
            raise KafkaException(
                KafkaError(
                    failed.code() if failed is not None else KafkaError._MSG_TIMED_OUT,
                    f"pid {pid}'s snapshot: {len(missing)} of {len(starts)} chunks not delivered ({reason})",
                    txn_requires_abort=True,
                )
            )
        offsets = tuple(self._delivered[i] for i in range(len(starts)))
        return Snapshot(topic=topic, partition=0, offsets=offsets, sha256=hashlib.sha256(blob).hexdigest())

    def _on_chunk(self, index: int) -> Any:
        """The delivery callback of chunk `index`: its offset, or why the broker did not take it."""

        def record(err: KafkaError | None, msg: Any) -> None:
            if err is not None:
                self._undelivered[index] = err
            else:
                self._delivered[index] = msg.offset()

        return record
