"""The generator: Poisson tuple streams produced to the pipeline's input topics, keyed by pid.

Two halves. `TupleSource` is pure: it turns a configuration into per-stream tuple columns for
successive slices of event time (arrivals from the rate schedule, keys from the key sampler, ids,
payloads) and knows nothing of Kafka or clocks. `run_generator` owns the clock and the producer: it
slices time into real-time ticks or max-rate chunks, groups each slice's tuples by pid and produces
one message per (stream, pid, <= tuples_per_message tuples).

Determinism: a tuple's id, key, event-time offset and payload depend only on the configuration and
seed, never on how time was sliced (see `schedules.ArrivalProcess` and `keys`), so a real-time run
and a max-rate run of one configuration carry the same tuples; only `start_ms` differs.

Message layout: value = `codec.encode_tuples` of tuples of one stream and one pid, in arrival order;
partition = pid; key = the pid as a decimal ASCII string (b"17"), readable in any Kafka tool and
redundant with the partition by design (design.md section 2: Kafka message key == pid).
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt
from confluent_kafka import KafkaError, Message, Producer

from generator.keys import KeySampler, stream_rng
from generator.schedules import ArrivalProcess, rate_at
from pipeline.codec import HEADER_BYTES, encode_tuples
from pipeline.config import Config
from pipeline.partitioning import pids_of, stable_hash
from pipeline.topics import KAFKA_LOG, ensure_topics

I64 = npt.NDArray[np.int64]
U8 = npt.NDArray[np.uint8]

# spawn_key purposes under (seed, stream index); keys.py uses 1 for key draws.
_ARRIVALS = 0
_PAYLOAD = 2

# Real-time mode produces at the end of each tick, so event time trails produce time by at most a tick.
TICK_S = 0.05
# Max-rate mode advances all streams together by at most this much event time per chunk, so no stream
# runs ahead of the others by more than that...
MAX_CHUNK_S = 0.5
# ...and by less when rates are high, to bound the memory of one chunk.
CHUNK_TUPLES = 200_000
# Kafka's default max message size is ~1 MB (broker message.max.bytes, client message.max.bytes);
# messages are split to stay under it whatever tuples_per_message says.
MAX_MESSAGE_BYTES = 960_000

PRODUCER_CONFIG: dict[str, Any] = {
    "acks": "all",
    "enable.idempotence": True,
    # Throughput: let librdkafka fill ~1 MB batches (the broker's default cap on a record batch).
    "linger.ms": 10,
    "batch.size": 1_000_000,
    "batch.num.messages": 100_000,
    "queue.buffering.max.messages": 1_000_000,
    "queue.buffering.max.kbytes": 262_144,
    "compression.type": "none",
    "delivery.timeout.ms": 120_000,
    # Only failures call back into Python: no per-message interpreter work for the common case.
    "delivery.report.only.error": True,
}


class DeliveryError(RuntimeError):
    """Some messages were not acknowledged by the broker."""


@dataclass(frozen=True, slots=True)
class StreamSlice:
    """Tuples of one stream in one slice of event time, in arrival order."""

    stream: int
    ids: I64
    keys: I64
    offsets_ms: I64  # event time minus the run's start_ms
    payload: U8  # shape (n, payload_bytes)

    def __len__(self) -> int:
        return len(self.ids)


def payload_salt(seed: int, stream: int) -> int:
    """Per-stream constant mixed into payloads, so equal ids of two streams carry different bytes."""
    state = np.random.SeedSequence(seed % 2**64, spawn_key=(stream, _PAYLOAD)).generate_state(1, np.uint64)
    return int(state[0].astype(np.int64))


def payloads(ids: I64, salt: int, nbytes: int) -> U8:
    """Payload bytes of each tuple: splitmix64 of (id, word index) xor salt, cut to `nbytes`.

    A pure function of (seed, stream, id) rather than a random draw, so it costs no random stream
    state (determinism under any slicing) and a reader can recompute any tuple's payload.
    """
    n = len(ids)
    if nbytes == 0:
        return np.empty((n, 0), dtype=np.uint8)
    words = -(-nbytes // 8)
    with np.errstate(over="ignore"):
        x = (ids.astype(np.int64)[:, None] * words + np.arange(words, dtype=np.int64)) ^ np.int64(salt)
    h = stable_hash(x.reshape(-1)).view(np.uint8).reshape(n, words * 8)
    return h[:, :nbytes] if nbytes != words * 8 else h


class TupleSource:
    """All streams' tuples, handed out in successive slices of event time; pure (no I/O, no clock).

    Stops at `duration_s` of event time or after `max_tuples` tuples in total. The max_tuples cut keeps
    the earliest tuples across all streams (by event time, then stream index), so it, too, does not
    depend on slicing.
    """

    def __init__(self, cfg: Config) -> None:
        g = cfg.generator
        self.streams = list(cfg.streams)
        self.payload_bytes = g.payload_bytes
        self.duration_s = g.duration_s if g.duration_s is not None else math.inf
        self._remaining = g.max_tuples if g.max_tuples is not None else math.inf
        self._schedules = [cfg.rate_for(s) for s in cfg.streams]
        self._arrivals = [
            ArrivalProcess(cfg.rate_for(s), stream_rng(g.seed, i, _ARRIVALS))
            for i, s in enumerate(cfg.streams)
        ]
        self._keys = [KeySampler(g.keys, g.seed, i, cfg.partitions) for i in range(len(cfg.streams))]
        self._salts = [payload_salt(g.seed, i) for i in range(len(cfg.streams))]
        self.produced = [0] * len(cfg.streams)
        self.end_s = 0.0  # event time up to which slices have been handed out
        self.done = False

    def next_arrival_s(self) -> float:
        """Earliest arrival not yet handed out (+inf when every schedule has run dry)."""
        return min(a.next_time() for a in self._arrivals)

    def total_rate_at(self, t_s: float) -> float:
        return sum(rate_at(s, t_s) for s in self._schedules)

    def take(self, end_s: float) -> list[StreamSlice]:
        """Tuples with event time in [previous end, end_s), one slice per stream (empty ones omitted)."""
        if self.done:
            return []
        end_s = min(end_s, self.duration_s)
        times = [a.take_until(end_s) for a in self._arrivals]
        self.end_s = max(self.end_s, end_s)
        total = sum(len(t) for t in times)
        if total >= self._remaining:
            times = self._cut(times, int(self._remaining))
            total = int(self._remaining)
            self.done = True
        self._remaining -= total
        if end_s >= self.duration_s or math.isinf(self.next_arrival_s()):
            self.done = True
        slices = []
        for i, t in enumerate(times):
            n = len(t)
            if n == 0:
                continue
            ids = np.arange(self.produced[i], self.produced[i] + n, dtype=np.int64)
            self.produced[i] += n
            slices.append(
                StreamSlice(
                    stream=i,
                    ids=ids,
                    keys=self._keys[i].sample(n, t),
                    offsets_ms=np.floor(t * 1000.0).astype(np.int64),
                    payload=payloads(ids, self._salts[i], self.payload_bytes),
                )
            )
        return slices

    @staticmethod
    def _cut(times: list[npt.NDArray[np.float64]], keep: int) -> list[npt.NDArray[np.float64]]:
        """The first `keep` arrivals over all streams by (time, stream); a prefix of each stream."""
        all_t = np.concatenate(times)
        all_s = np.concatenate([np.full(len(t), i, dtype=np.int64) for i, t in enumerate(times)])
        kept = np.lexsort((all_s, all_t))[:keep]
        counts = np.bincount(all_s[kept], minlength=len(times))
        return [t[: counts[i]] for i, t in enumerate(times)]


def encode_slice(
    sl: StreamSlice, start_ms: int, partitions: int, tuples_per_message: int
) -> Iterator[tuple[int, bytes, int]]:
    """(pid, message value, first event time) for one stream slice: grouped by pid, arrival order kept.

    The first (smallest) event time becomes the Kafka message timestamp, so a pid's input can be found
    by event time (`offsets_for_times`), which the `replay` handoff relies on in both generator modes.
    Vectorized grouping (one stable sort by pid), then per-message work only.
    """
    pids = pids_of(sl.keys, partitions)
    # int16 keys take numpy's radix sort (partitions <= 4096 by configuration).
    order = np.argsort(pids.astype(np.int16), kind="stable")
    ids = sl.ids[order]
    keys = sl.keys[order]
    event_times = sl.offsets_ms[order] + start_ms
    payload = sl.payload[order]
    counts = np.bincount(pids, minlength=partitions)
    bounds = np.concatenate(([0], np.cumsum(counts))).tolist()
    per_message = max_tuples_per_message(tuples_per_message, sl.payload.shape[1])
    for pid in np.flatnonzero(counts).tolist():
        hi = bounds[pid + 1]
        for lo in range(bounds[pid], hi, per_message):
            up = min(lo + per_message, hi)
            value = encode_tuples(ids[lo:up], keys[lo:up], event_times[lo:up], payload[lo:up])
            yield pid, value, int(event_times[lo])


def max_tuples_per_message(tuples_per_message: int, payload_bytes: int) -> int:
    """tuples_per_message, lowered if needed so a message stays under MAX_MESSAGE_BYTES."""
    return max(1, min(tuples_per_message, (MAX_MESSAGE_BYTES - HEADER_BYTES) // (24 + payload_bytes)))


class _Sender:
    """A confluent-kafka producer plus delivery accounting (errors are counted, raised at the end)."""

    def __init__(self, bootstrap: str, overrides: dict[str, Any] | None = None) -> None:
        conf = {**PRODUCER_CONFIG, **(overrides or {}), "bootstrap.servers": bootstrap}
        conf["on_delivery"] = self._on_delivery
        conf["logger"] = KAFKA_LOG
        self.producer = Producer(conf)
        self.messages = 0
        self.bytes = 0
        self.failed = 0
        self.first_error: KafkaError | None = None
        self._keys: dict[int, bytes] = {}

    def _on_delivery(self, err: KafkaError | None, _msg: Message) -> None:
        if err is not None:
            self.failed += 1
            if self.first_error is None:
                self.first_error = err

    def send(self, topic: str, pid: int, value: bytes, timestamp_ms: int) -> None:
        key = self._keys.get(pid)
        if key is None:
            key = self._keys[pid] = str(pid).encode()
        while True:
            try:
                self.producer.produce(topic, value, key, partition=pid, timestamp=timestamp_ms)
                break
            except BufferError:
                # librdkafka's queue is full: serve delivery reports to make room, then retry.
                self.producer.poll(0.05)
        self.messages += 1
        self.bytes += len(value)

    def finish(self, timeout_s: float = 120.0) -> None:
        remaining = self.producer.flush(timeout_s)
        if remaining:
            raise DeliveryError(f"{remaining} messages still unacknowledged after {timeout_s:g} s")
        if self.failed:
            raise DeliveryError(
                f"{self.failed} of {self.messages} messages failed delivery; first error: {self.first_error}"
            )


class _Progress:
    """A one-line rich progress display on stderr (tuples produced, tuples/s), or nothing."""

    def __init__(self, enabled: bool, total: int | None) -> None:
        self._progress: Any = None
        if not enabled:
            return
        from rich.console import Console
        from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

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

    Returns {"tuples", "per_stream", "messages", "bytes", "seconds", "tuples_per_s", "start_ms"};
    raises DeliveryError if any message was not acknowledged, BrokerUnreachable / TopicError from
    topic creation.
    """
    ensure_topics(cfg, bootstrap)
    stop = stop or threading.Event()
    g = cfg.generator
    source = TupleSource(cfg)
    topics = cfg.input_topics
    # Real time: a tick's messages are all produced at its end, so lingering only adds latency.
    linger = {"linger.ms": 5} if g.mode == "real_time" else {}
    sender = _Sender(bootstrap, {**linger, **(producer_overrides or {})})
    display = _Progress(progress, g.max_tuples)
    started = time.monotonic()
    start_ms = time.time_ns() // 1_000_000
    tuples = 0

    def emit(slices: list[StreamSlice]) -> None:
        nonlocal tuples
        for sl in slices:
            topic = topics[sl.stream]
            for pid, value, first_ms in encode_slice(sl, start_ms, cfg.partitions, g.tuples_per_message):
                sender.send(topic, pid, value, first_ms)
            tuples += len(sl)
        sender.producer.poll(0)
        display.update(tuples, time.monotonic() - started)

    try:
        if g.mode == "real_time":
            # Produce at the end of each tick what arrived during it: event time <= produce time.
            while not source.done and not stop.is_set():
                now_s = time.monotonic() - started
                next_tick = (math.floor(now_s / TICK_S) + 1) * TICK_S
                if stop.wait(max(0.0, next_tick - now_s)):
                    break
                emit(source.take(time.monotonic() - started))
        else:
            # Virtual clock: all streams advance together chunk by chunk, as fast as the producer goes.
            while not source.done and not stop.is_set():
                t0 = max(source.end_s, source.next_arrival_s())
                if math.isinf(t0):
                    break
                rate = source.total_rate_at(t0)
                chunk = min(MAX_CHUNK_S, CHUNK_TUPLES / rate) if rate > 0 else MAX_CHUNK_S
                emit(source.take(t0 + chunk))
        sender.finish()
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
    }
