"""The generator: Poisson tuple streams produced to the pipeline's input topics, keyed by pid.

Two halves. The pure half knows nothing of Kafka or clocks: `generator.tuples` (`TupleSource`) turns a
configuration into per-stream tuple columns for successive slices of event time, and
`generator.messages` (`MessagePlanner`, `HeldBack`) turns those into the messages to write, in order.
`run_generator`, here, owns the clock and the producer: it slices time into real-time ticks or max-rate
chunks and produces each slice's messages in one transaction; a broker away is waited out
(`_Sender.commit`), so the generator falls behind its schedule and catches up.

Tuple ids are unique per stream across runs on one pipeline: a run numbers its tuples from one past
the largest id already in the stream's topic (`largest_ids`), its `id_base`.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable
from typing import Any

from confluent_kafka import Consumer, KafkaError, KafkaException, Producer, TopicPartition

from generator.messages import HeldBack, MessagePlanner, Record
from generator.tuples import StreamSlice, TupleSource
from pipeline.codec import MalformedRecord, decode_tuple_columns, progress_of
from pipeline.config import Config
from pipeline.kafka_client import CONSUMER_GROUP, kafka_config
from pipeline.topics import (
    BOUNDED_READ,
    KAFKA_LOG,
    admin_client,
    await_settled,
    consume_ready,
    ensure_topics,
    partition_offsets,
)

log = logging.getLogger(__name__)

# Real-time mode produces at the end of each tick, so event time trails produce time by at most a tick.
TICK_S = 0.05
# Max-rate mode advances all streams together by at most this much event time per chunk, so no stream
# runs ahead of the others by more than that...
MAX_CHUNK_S = 0.5
# ...and by less when rates are high, to bound the memory of one chunk.
CHUNK_TUPLES = 200_000

# Max-rate mode commits once its open transaction holds this much: a commit waits for every message's
# acknowledgement, which stalls producing (one per chunk ran at a third of the speed; measured in
# docs/benchmarks.md), and the open transaction's messages are kept to be written again.
MAX_RATE_TRANSACTION_BYTES = 32_000_000

# `largest_ids` first reads back this many messages per partition, 8 times more each round in which it
# found only progress records (or transaction markers).
ID_SCAN_MESSAGES = 8

PRODUCER_CONFIG: dict[str, Any] = {
    "acks": "all",
    # Throughput: let librdkafka fill ~1 MB batches (the broker's default cap on a record batch).
    "linger.ms": 10,
    "batch.size": 1_000_000,
    "batch.num.messages": 100_000,
    "queue.buffering.max.messages": 1_000_000,
    "queue.buffering.max.kbytes": 262_144,
    "compression.type": "none",
    # Only failures call back into Python: no per-message interpreter work for the common case.
    "delivery.report.only.error": True,
    # The broker aborts a transaction open longer; the sender then writes it again in a new one.
    "transaction.timeout.ms": 60_000,
}
"""Transactional, not merely idempotent: an idempotent producer that loses a request to a silent broker
bumps its epoch and sends again what the broker may already hold, a duplicate input tuple (seen: 1,340 of
them after a 20 s pause of the broker). A transaction that meets an error is aborted and written again,
and every reader of the inputs reads committed (decision 0061)."""

TRANSACTION_ATTEMPTS = 8
"""A transaction that fails for a reason other than an outage is written again up to this many times in
a row; an outage is waited out however long it lasts."""


class DeliveryError(RuntimeError):
    """Messages could not be written: the run was stopped, or the producer was fenced."""


def generator_transactional_id(cfg: Config) -> str:
    """One per pipeline: a second generator fences the first (two at once would repeat ids)."""
    return f"{cfg.pipeline}/generator"


def largest_ids(cfg: Config, bootstrap: str, timeout_s: float = 60.0) -> list[int]:
    """Per stream, the largest tuple id in its input topic (-1 when it holds no tuple).

    A run's ids increase in production order per stream, so a partition's last tuple record holds its
    largest id, and the topic's largest is the largest over partitions. Reads back the last
    ID_SCAN_MESSAGES messages of each partition (read_committed) and takes the largest id of the tuple
    records among them; a partition where it found none (only progress records, transaction markers,
    or records that do not decode) is read back 8 times further, until one is found or the partition's
    start is reached. The high watermark may point past transaction markers, which is why it reads a
    window rather than one message. Written by other producers in another order, a partition's largest
    id may lie further back: not found.
    """
    topics = cfg.input_topics
    parts = [(t, p) for t in topics for p in range(cfg.partitions)]
    admin = admin_client(bootstrap)
    low = partition_offsets(admin, parts, latest=False, timeout_s=timeout_s)
    high = partition_offsets(admin, parts, latest=True, timeout_s=timeout_s)
    largest = dict.fromkeys(topics, -1)
    window = {tp: ID_SCAN_MESSAGES for tp in parts if high[tp] > low[tp]}
    if not window:
        return [-1] * len(topics)
    consumer = Consumer(
        {
            **kafka_config(bootstrap),
            "group.id": CONSUMER_GROUP,  # nothing is committed
            "enable.auto.commit": False,
            "enable.partition.eof": True,
            "isolation.level": "read_committed",
        }
        | BOUNDED_READ,
        logger=KAFKA_LOG,
    )
    try:
        while window:
            ranges = {tp: (max(low[tp], high[tp] - w), high[tp]) for tp, w in window.items()}
            found = _largest_in(consumer, ranges, timeout_s)
            wider = {}
            for tp, w in window.items():
                if tp in found:
                    largest[tp[0]] = max(largest[tp[0]], found[tp])
                elif ranges[tp][0] > low[tp]:
                    wider[tp] = w * 8
            window = wider
    finally:
        consumer.close()
    return [largest[t] for t in topics]


def _largest_in(
    consumer: Consumer, ranges: dict[tuple[str, int], tuple[int, int]], timeout_s: float
) -> dict[tuple[str, int], int]:
    """(topic, partition) -> largest tuple id in its offsets [start, end), for those holding a tuple."""
    consumer.assign([TopicPartition(t, p, start) for (t, p), (start, _) in ranges.items()])
    pending = set(ranges)
    found: dict[tuple[str, int], int] = {}
    deadline = time.monotonic() + timeout_s
    while pending:
        if time.monotonic() > deadline:
            raise TimeoutError(f"could not read back the input topics' ends within {timeout_s:g} s")
        for msg in consume_ready(consumer, 10_000, 0.5):
            topic, partition = msg.topic(), msg.partition()
            assert topic is not None and partition is not None
            tp = (topic, partition)
            err = msg.error()
            if err is not None:
                if err.code() == KafkaError._PARTITION_EOF:
                    pending.discard(tp)  # the rest before the end were transaction markers
                    continue
                raise RuntimeError(f"reading {topic}[{partition}]: {err}")
            offset = msg.offset()
            assert offset is not None
            if tp not in pending or offset >= ranges[tp][1]:
                pending.discard(tp)  # written since the ends were looked up: not this run's concern
                continue
            if offset + 1 >= ranges[tp][1]:
                pending.discard(tp)
            value = msg.value()
            try:
                if value is None or progress_of(value) is not None:
                    continue
                ids = decode_tuple_columns(value)[0]
            except MalformedRecord:
                continue
            if len(ids):
                found[tp] = max(found.get(tp, -1), int(ids.max()))
    consumer.unassign()
    return found


class _Sender:
    """A transactional confluent-kafka producer: `send` adds messages to the open transaction, `commit`
    ends it, writing it again in a new transaction while the broker aborts it or is away."""

    def __init__(
        self, bootstrap: str, transactional_id: str, stop: threading.Event, overrides: dict[str, Any]
    ) -> None:
        self._conf = {
            **PRODUCER_CONFIG,
            **overrides,
            **kafka_config(bootstrap),
            "transactional.id": transactional_id,
            "logger": KAFKA_LOG,
        }
        self._stop = stop
        self._open: list[tuple[str, int, bytes, bytes, int]] = []
        """The open transaction's messages, to write again if it is aborted."""
        self._refused: KafkaError | None = None
        """Why the producer refused a message of the open transaction, if it did."""
        self._begun = time.monotonic()
        self.open_bytes = 0
        self.messages = 0
        self.bytes = 0
        self._keys: dict[int, bytes] = {}
        self.producer = self._new_producer()

    def _new_producer(self) -> Producer:
        producer = Producer(self._conf)
        self._waiting(producer.init_transactions, "start the generator's transactions")
        producer.begin_transaction()
        return producer

    def send(self, topic: str, pid: int, value: bytes, timestamp_ms: int) -> None:
        key = self._keys.get(pid)
        if key is None:
            key = self._keys[pid] = str(pid).encode()
        if not self._open:
            self._begun = time.monotonic()
        self._open.append((topic, pid, value, key, timestamp_ms))
        self.open_bytes += len(value)
        self._produce(topic, pid, value, key, timestamp_ms)
        self.messages += 1
        self.bytes += len(value)

    def _produce(self, topic: str, pid: int, value: bytes, key: bytes, timestamp_ms: int) -> None:
        while True:
            try:
                self.producer.produce(topic, value, key, partition=pid, timestamp=timestamp_ms)
                return
            except BufferError:
                # librdkafka's queue is full: serve delivery reports to make room, then retry.
                self.producer.poll(0.05)
            except KafkaException as exc:
                # The transaction failed meanwhile (a message timed out in an outage, the broker
                # aborted it): the message is kept with the others, which `commit` writes again.
                self._refused = exc.args[0]
                return

    def commit(self) -> None:
        """Commit the open transaction (if it holds anything) and begin the next. A broker away is
        waited out however long it is away, saying so in the log every `LOG_EVERY_S`. A transaction
        that fails otherwise is written again (`_start_over`), up to TRANSACTION_ATTEMPTS times in a
        row."""
        if not self._open:
            return
        attempts = 0
        while True:
            try:
                if self._refused is not None:  # never committed without the messages it refused
                    raise KafkaException(self._refused)
                self._waiting(self.producer.commit_transaction, f"commit {len(self._open):,} messages")
                break
            except KafkaException as exc:
                error: KafkaError = exc.args[0]
                attempts += 1
                if attempts > TRANSACTION_ATTEMPTS:
                    raise DeliveryError(f"the generator cannot write its input: {error.str()}") from exc
                self._start_over(error)
                log.warning("generator: a transaction was not committed (%s); writing it again", error.str())
                self._begun, self._refused = time.monotonic(), None
                for message in self._open:
                    self._produce(*message)
        self._open.clear()
        self.open_bytes = 0
        self.producer.begin_transaction()

    def _start_over(self, error: KafkaError) -> None:
        """Leave a failed transaction for a new one: abort it, or, once the producer is fenced after the
        transaction timeout (the broker aborted the transaction while away), make a new producer. A
        fence sooner means another generator took over, and this one stops (`DeliveryError`)."""
        if error.fatal():
            open_s = time.monotonic() - self._begun
            if open_s <= PRODUCER_CONFIG["transaction.timeout.ms"] / 1000:
                raise DeliveryError(f"another generator took over this pipeline's input ({error.str()})")
            self.producer = self._new_producer()
            return
        try:
            self._waiting(self.producer.abort_transaction, "abort a transaction")
        except KafkaException as exc:
            if not exc.args[0].fatal():
                raise DeliveryError(f"the generator cannot write its input: {exc.args[0].str()}") from exc
            self._start_over(exc.args[0])
            return
        self.producer.begin_transaction()

    def _waiting(self, call: Callable[[float], None], what: str) -> None:
        """`call(timeout)` again while the broker answers that it may yet succeed (it is away), however
        long that takes, until `stop`."""
        started = time.monotonic()
        while True:
            tried = time.monotonic()
            try:
                call(LOG_EVERY_S)
                return
            except KafkaException as exc:
                if not exc.args[0].retriable():
                    raise
                if self._stop.is_set():
                    raise DeliveryError(f"stopped before the broker let the generator {what}") from exc
                log.warning(
                    "generator: waiting for the broker to %s (%.0f s; %s)",
                    what,
                    time.monotonic() - started,
                    exc.args[0].str(),
                )
                time.sleep(max(0.0, 1.0 - (time.monotonic() - tried)))  # an answer at once: not a busy loop


LOG_EVERY_S = 30.0
"""How often the generator logs how far it has got when its stderr is no terminal (a pod's log)."""


class _Progress:
    """A one-line rich progress display on stderr (tuples produced, tuples/s); on a stderr that is no
    terminal, a plain line in the log every `LOG_EVERY_S`; or nothing."""

    def __init__(self, enabled: bool, total: int | None) -> None:
        self._progress: Any = None
        self._lines_due: float | None = None
        if not enabled:
            return
        from rich.console import Console
        from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

        if not Console(stderr=True).is_terminal:
            self._lines_due = LOG_EVERY_S
            return

        self._progress = Progress(
            SpinnerColumn(),
            TextColumn("generating"),
            TextColumn("{task.completed:>12,.0f} tuples"),
            TextColumn("{task.fields[rate]:>10,.0f} tuples/s"),
            TimeElapsedColumn(),
            console=Console(stderr=True),
            transient=False,
        )
        self._task = self._progress.add_task("generate", total=total, rate=0.0)
        self._progress.start()

    def update(self, tuples: int, seconds: float) -> None:
        if self._lines_due is not None and seconds >= self._lines_due:
            self._lines_due += LOG_EVERY_S
            rate = tuples / seconds if seconds > 0 else 0.0
            log.info("generator: %s tuples in %.0f s (%s tuples/s)", f"{tuples:,}", seconds, f"{rate:,.0f}")
        if self._progress is not None:
            self._progress.update(self._task, completed=tuples, rate=tuples / seconds if seconds > 0 else 0.0)

    def close(self) -> None:
        if self._progress is not None:
            self._progress.stop()


def run_generator(
    cfg: Config,
    bootstrap: str,
    progress: bool = False,
    stop: threading.Event | None = None,
    producer_overrides: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Create the topics, then produce the configured streams until duration, max_tuples or `stop`.

    Returns {"tuples", "per_stream", "messages", "bytes", "seconds", "tuples_per_s", "start_ms",
    "progress_records", "late_injected", "id_base", "commit_delay_s"}: `tuples` and `per_stream` count
    every tuple written (injected late ones included), `messages` progress records too, `id_base` is the
    first id of each stream's run, `commit_delay_s` (real time only) how long after its tick's end each
    tick's transaction was committed (p50, p99, max): input readable that late counts in every result
    latency measured from event time, whichever engine reads it. Raises DeliveryError when `stop` ends
    a wait for the broker or another generator took over, BrokerUnreachable / TopicError from topic
    creation.

    The messages of each real-time tick, or max-rate chunk, are written in one transaction: readers of
    the inputs read committed, so a tuple is read once however often the broker made the generator
    write it (`_Sender.commit`).

    Held-back messages of lagged streams are produced when due; when `stop` ends the run, at once (no
    message is lost).
    """
    ensure_topics(cfg, bootstrap)
    stop = stop or threading.Event()
    g = cfg.generator
    # Ids continue after the largest in each stream's topic: unique per stream across runs.
    id_base = [largest + 1 for largest in largest_ids(cfg, bootstrap)]
    source = TupleSource(cfg, id_base=id_base)
    topics = cfg.input_topics
    # Real time: a tick's messages are all produced at its end, so lingering only adds latency.
    linger = {"linger.ms": 5} if g.mode == "real_time" else {}
    overrides = {**linger, **(producer_overrides or {})}
    sender = _Sender(bootstrap, generator_transactional_id(cfg), stop, overrides)
    display = _Progress(progress, g.max_tuples)
    started = time.monotonic()
    start_ms = time.time_ns() // 1_000_000
    planner = MessagePlanner(cfg, start_ms)
    held = HeldBack({i: g.stream_lag_ms.get(s, 0) / 1000.0 for i, s in enumerate(cfg.streams)})
    tuples = 0
    commit_delays: list[float] = []  # real time: how long after its tick's end each tick was readable

    def send(records: list[Record]) -> None:
        nonlocal tuples
        for r in records:
            sender.send(topics[r.stream], r.pid, r.value, r.timestamp_ms)
            tuples += r.tuples
        display.update(tuples, time.monotonic() - started)

    def emit(slices: list[StreamSlice]) -> None:
        send(held.hold(planner.plan(slices, source.end_s), source.end_s))

    try:
        if g.mode == "real_time":
            # Produce at the end of each tick what arrived during it: event time <= produce time. Once
            # the source is done, tick on while lagged streams still hold messages back.
            while not (source.done and not len(held)) and not stop.is_set():
                now_s = time.monotonic() - started
                next_tick = (math.floor(now_s / TICK_S) + 1) * TICK_S
                if stop.wait(max(0.0, next_tick - now_s)):
                    break
                now_s = time.monotonic() - started
                if not source.done:
                    emit(source.take(now_s))
                send(held.release(now_s))
                sender.commit()  # what arrived in the tick becomes readable at its end
                commit_delays.append(time.monotonic() - started - next_tick)
        else:
            # Virtual clock: all streams advance together chunk by chunk, as fast as the producer goes.
            while not source.done and not stop.is_set():
                t0 = max(source.end_s, source.next_arrival_s())
                if math.isinf(t0):
                    break
                rate = source.total_rate_at(t0)
                chunk = min(MAX_CHUNK_S, CHUNK_TUPLES / rate) if rate > 0 else MAX_CHUNK_S
                emit(source.take(t0 + chunk))
                if sender.open_bytes >= MAX_RATE_TRANSACTION_BYTES:
                    sender.commit()
        send(held.release(math.inf))
        sender.commit()
        # The commit returns before the broker has written its markers: until then a reader finds the
        # partitions' ends short of the last transaction. Returning after them, what was written is read.
        await_settled(admin_client(bootstrap), [(t, p) for t in topics for p in range(cfg.partitions)])
    finally:
        display.close()
    seconds = time.monotonic() - started
    return {
        "tuples": tuples,
        "per_stream": dict(zip(cfg.streams, source.produced, strict=True)),
        "messages": sender.messages,
        "bytes": sender.bytes,
        "seconds": round(seconds, 3),
        "tuples_per_s": round(tuples / seconds, 1) if seconds > 0 else 0.0,
        "start_ms": start_ms,
        "progress_records": planner.progress_records,
        "late_injected": planner.late_written,
        "id_base": dict(zip(cfg.streams, id_base, strict=True)),
        "commit_delay_s": _percentiles(commit_delays),
    }


def _percentiles(values: list[float]) -> dict[str, float] | None:
    """p50, p99 and max of `values`, in seconds rounded to milliseconds; None without values."""
    if not values:
        return None
    ordered = sorted(values)
    at = lambda q: ordered[min(len(ordered) - 1, int(q * len(ordered)))]  # noqa: E731
    return {"p50": round(at(0.5), 3), "p99": round(at(0.99), 3), "max": round(ordered[-1], 3)}
