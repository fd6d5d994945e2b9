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

Lateness is a property of the input (decision 0047): a tuple is late when its event time is below the
largest event time of the tuples and progress records before it in its input partition (stream, pid),
minus allowed_lateness_ms. The generator writes every partition in nondecreasing event time, so none
of its tuples is late, except the `late_tuples` it injects on purpose (each in its own message, right
after the tuple it is late against). `MessagePlanner` (pure) turns slices into the messages to write
and adds a progress record to every partition idle for `progress_interval_ms` of event time, at an
event time no later tuple of the partition is below. `silences` drop tuples at the source;
`stream_lag_ms` (real time) holds a stream's messages back.

Tuple ids are unique per stream across runs on one pipeline: a run numbers its tuples from one past
the largest id already in the stream's topic (`largest_ids`), its `id_base`.
"""

from __future__ import annotations

import bisect
import itertools
import logging
import math
import threading
import time
from collections import deque
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import numpy as np
import numpy.typing as npt
from confluent_kafka import Consumer, KafkaError, Message, Producer, TopicPartition

from generator.keys import KeySampler, stream_rng
from generator.schedules import ArrivalProcess, rate_at, time_of_count
from pipeline.codec import (
    HEADER_BYTES,
    MalformedRecord,
    decode_tuple_columns,
    encode_progress,
    encode_tuples,
    progress_of,
)
from pipeline.config import Config
from pipeline.kafka_client import CONSUMER_GROUP, kafka_config
from pipeline.partitioning import pids_of, stable_hash
from pipeline.topics import BOUNDED_READ, KAFKA_LOG, admin_client, ensure_topics, partition_offsets

log = logging.getLogger(__name__)

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

# Late tuples are spread evenly over this share of the run's expected length, so each finds tuples to
# follow even when the run ends a little earlier than expected...
LATE_SPAN = 0.8
# ...and each is this much below the bound, plus 0..LATE_JITTER_MS - 1 ms (by its number), so late tuples
# do not all sit exactly one ms below it.
LATE_JITTER_MS = 8
# `largest_ids` first reads back this many messages per partition, 8 times more each round in which it
# found only progress records (or transaction markers).
ID_SCAN_MESSAGES = 8

_NO_EVENT = np.iinfo(np.int64).min

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
    # A broker outage of any length is weather: messages wait in the queue (idempotence keeps their
    # order and drops retried duplicates) and a full queue blocks `send`, so the generator falls behind
    # its schedule and catches up, instead of failing messages after a fixed time (0 = no limit).
    "delivery.timeout.ms": 0,
    # Only failures call back into Python: no per-message interpreter work for the common case.
    "delivery.report.only.error": True,
}


class DeliveryError(RuntimeError):
    """Some messages were not acknowledged by the broker."""


def _no_late() -> I64:
    return np.empty(0, dtype=np.int64)


@dataclass(frozen=True, slots=True)
class StreamSlice:
    """Tuples of one stream in one slice of event time, in arrival order (ids increasing).

    `late` holds the positions of injected late tuples: each follows the tuple it is late against
    (same key, so same pid) and is the only tuple that breaks the nondecreasing event-time order.
    """

    stream: int
    ids: I64
    keys: I64
    offsets_ms: I64  # event time minus the run's start_ms
    payload: U8  # shape (n, payload_bytes)
    late: I64 = field(default_factory=_no_late)

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

    Ids: stream i numbers its arrivals id_base[i], id_base[i] + 1, ... in arrival order; a silenced
    arrival keeps its number and is dropped (the others' ids do not change), and an injected late tuple
    takes the number after the tuple it follows (the later ones move up by one). So ids increase in
    arrival order, hence in each partition's offset order, which `largest_ids` relies on.

    Late tuples: number j (of `late_tuples`) belongs to stream j mod S and is due at event-time offset
    LATE_SPAN x expected length x (j + 1/2) / late_tuples. It follows the stream's first tuple at or
    after that offset, with its key and an event time `allowed_lateness_ms` + 1 + (j mod LATE_JITTER_MS)
    ms below that tuple's. The generator writes each partition in nondecreasing event time (progress
    records included), so that tuple's event time is the partition's largest so far and the late tuple
    is late by the rule. Which tuple it follows depends on the tuples alone, not on slicing. A late
    tuple whose stream has no tuple left after its due offset is not injected (`late_injected` says).
    """

    def __init__(self, cfg: Config, id_base: Sequence[int] | None = None) -> None:
        g = cfg.generator
        self.streams = list(cfg.streams)
        self.partitions = cfg.partitions
        self.payload_bytes = g.payload_bytes
        self.lateness_ms = cfg.allowed_lateness_ms
        self.duration_s = g.duration_s if g.duration_s is not None else math.inf
        self._remaining = g.max_tuples if g.max_tuples is not None else math.inf
        self._schedules = [cfg.rate_for(s) for s in cfg.streams]
        self._arrivals = [
            ArrivalProcess(cfg.rate_for(s), stream_rng(g.seed, i, _ARRIVALS))
            for i, s in enumerate(cfg.streams)
        ]
        self._keys = [KeySampler(g.keys, g.seed, i, cfg.partitions) for i in range(len(cfg.streams))]
        self._salts = [payload_salt(g.seed, i) for i in range(len(cfg.streams))]
        self.id_base = list(id_base) if id_base is not None else [0] * len(cfg.streams)
        if len(self.id_base) != len(cfg.streams) or min(self.id_base) < 0:
            raise ValueError(f"id_base needs one non-negative base per stream, got {self.id_base}")
        self._next_id = list(self.id_base)
        # Per stream: (from_ms, to_ms, pids) of its silences.
        self._silences: list[list[tuple[float, float, I64]]] = [[] for _ in cfg.streams]
        for silence in g.silences:
            pids = np.array(sorted(set(silence.pids)), dtype=np.int64)
            rule = (silence.from_s * 1000.0, silence.to_s * 1000.0, pids)
            self._silences[cfg.streams.index(silence.stream)].append(rule)
        # Per stream: (late tuple number, due offset in s), in due order.
        self._late_due: list[deque[tuple[int, float]]] = [deque() for _ in cfg.streams]
        if g.late_tuples:
            expected_s = self.duration_s
            if g.max_tuples is not None:
                expected_s = min(expected_s, time_of_count(self._schedules, g.max_tuples))
            for j in range(g.late_tuples):
                due = LATE_SPAN * expected_s * (j + 0.5) / g.late_tuples
                self._late_due[j % len(cfg.streams)].append((j, due))
        self.produced = [0] * len(cfg.streams)  # tuples handed out per stream, late ones included
        self.late_injected = 0
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
        keys = [self._keys[i].sample(len(t), t) for i, t in enumerate(times)]
        # Arrival numbers (within this take) of the tuples that exist: all but the silenced.
        kept = [self._not_silenced(i, keys[i], t) for i, t in enumerate(times)]
        survivors = [t[k] for t, k in zip(times, kept, strict=True)]
        total = sum(len(t) for t in survivors)
        if total >= self._remaining:
            survivors = self._cut(survivors, int(self._remaining))
            kept = [k[: len(t)] for k, t in zip(kept, survivors, strict=True)]
            total = int(self._remaining)
            self.done = True
        self._remaining -= total
        if end_s >= self.duration_s or math.isinf(self.next_arrival_s()):
            self.done = True
        slices = []
        for i, t in enumerate(survivors):
            sl = self._slice(i, t, kept[i], keys[i][kept[i]])
            self._next_id[i] += len(times[i]) + len(sl.late)
            if len(sl):
                slices.append(sl)
        return slices

    def _not_silenced(self, stream: int, keys: I64, times: npt.NDArray[np.float64]) -> I64:
        """Positions of the arrivals no silence of `stream` covers."""
        rules = self._silences[stream]
        if not rules or len(times) == 0:
            return np.arange(len(times), dtype=np.int64)
        offsets = np.floor(times * 1000.0)
        pids = pids_of(keys, self.partitions)
        drop = np.zeros(len(times), dtype=bool)
        for from_ms, to_ms, silent in rules:
            span = (offsets >= from_ms) & (offsets < to_ms)
            if span.any():
                drop |= span & np.isin(pids, silent)
        return np.flatnonzero(~drop).astype(np.int64)

    def _slice(self, stream: int, times: npt.NDArray[np.float64], arrival: I64, keys: I64) -> StreamSlice:
        """The slice of the surviving arrivals (their times, numbers, keys), late tuples inserted."""
        base = self._next_id[stream]
        offsets = np.floor(times * 1000.0).astype(np.int64)
        after: list[int] = []  # survivor position each due late tuple follows (nondecreasing)
        numbers: list[int] = []
        due = self._late_due[stream]
        while due:
            pos = int(np.searchsorted(times, due[0][1], side="left"))
            if pos >= len(times):
                break  # no tuple at or after its due offset yet: a later slice gets it
            numbers.append(due.popleft()[0])
            after.append(pos)
        if not after:
            ids = base + arrival
            late = _no_late()
        else:
            at = np.array(after, dtype=np.int64)
            m = len(at)
            # A survivor's id counts the late tuples before it; late tuple r follows survivor at[r].
            ids = base + arrival + np.searchsorted(at, np.arange(len(arrival)), side="left")
            late_ids = base + arrival[at] + 1 + np.arange(m, dtype=np.int64)
            jitter = np.array(numbers, dtype=np.int64) % LATE_JITTER_MS
            late_offsets = offsets[at] - self.lateness_ms - 1 - jitter
            ids = np.insert(ids, at + 1, late_ids)
            keys = np.insert(keys, at + 1, keys[at])
            offsets = np.insert(offsets, at + 1, late_offsets)
            late = at + 1 + np.arange(m, dtype=np.int64)
            self.late_injected += m
        ids = ids.astype(np.int64, copy=False)
        self.produced[stream] += len(ids)
        return StreamSlice(
            stream=stream,
            ids=ids,
            keys=keys,
            offsets_ms=offsets,
            payload=payloads(ids, self._salts[stream], self.payload_bytes),
            late=late,
        )

    @staticmethod
    def _cut(times: list[npt.NDArray[np.float64]], keep: int) -> list[npt.NDArray[np.float64]]:
        """The first `keep` arrivals over all streams by (time, stream); a prefix of each stream."""
        all_t = np.concatenate(times)
        all_s = np.concatenate([np.full(len(t), i, dtype=np.int64) for i, t in enumerate(times)])
        kept = np.lexsort((all_s, all_t))[:keep]
        counts = np.bincount(all_s[kept], minlength=len(times))
        return [t[: counts[i]] for i, t in enumerate(times)]


class Encoded(NamedTuple):
    """One message of a stream slice: its pid, value, first and largest event time, tuple count, and
    whether it is an injected late tuple (such a message holds that one tuple)."""

    pid: int
    value: bytes
    first_ms: int
    max_ms: int
    tuples: int
    late: bool


def encode_slice(
    sl: StreamSlice, start_ms: int, partitions: int, tuples_per_message: int
) -> Iterator[Encoded]:
    """The messages of one stream slice: grouped by pid, arrival order kept.

    The first (smallest) event time becomes the Kafka message timestamp, so a pid's input can be found
    by event time (`offsets_for_times`), which the `replay` handoff relies on in both generator modes.
    A late tuple gets a message of its own, right after the message ending with the tuple it follows:
    so every message's first event time is its smallest, and the late tuple comes after (in offset
    order) the event time it is late against.
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
    late: set[int] = set()
    cuts: list[int] = []  # sorted positions (after grouping) where a message must end
    if len(sl.late):
        rank = np.empty(len(order), dtype=np.int64)
        rank[order] = np.arange(len(order), dtype=np.int64)
        late = set(rank[sl.late].tolist())
        cuts = sorted(late | {p + 1 for p in late})
    for pid in np.flatnonzero(counts).tolist():
        first, hi = bounds[pid], bounds[pid + 1]
        edges = [first, hi]
        if cuts:
            inner = cuts[bisect.bisect_right(cuts, first) : bisect.bisect_left(cuts, hi)]
            edges = [first, *inner, hi]
        for a, b in itertools.pairwise(edges):
            for lo in range(a, b, per_message):
                up = min(lo + per_message, b)
                value = encode_tuples(ids[lo:up], keys[lo:up], event_times[lo:up], payload[lo:up])
                # Tuples of a message other than a late one are in nondecreasing event time.
                yield Encoded(pid, value, int(event_times[lo]), int(event_times[up - 1]), up - lo, lo in late)


def max_tuples_per_message(tuples_per_message: int, payload_bytes: int) -> int:
    """tuples_per_message, lowered if needed so a message stays under MAX_MESSAGE_BYTES."""
    return max(1, min(tuples_per_message, (MAX_MESSAGE_BYTES - HEADER_BYTES) // (24 + payload_bytes)))


@dataclass(frozen=True, slots=True)
class Record:
    """One message to produce: to partition `pid` of stream number `stream`'s topic."""

    stream: int
    pid: int
    value: bytes
    timestamp_ms: int  # the Kafka message timestamp: its first event time
    tuples: int  # 0 for a progress record
    late: bool = False  # an injected late tuple (alone in its message)


class MessagePlanner:
    """What the generator writes, in order: a slice's messages, then progress records; pure.

    Keeps per input partition (stream, pid) the largest event time written to it (tuples and progress
    records). After each slice, a partition whose largest is `progress_interval_ms` or more below the
    slice's end (or the run's start, if nothing was written to it yet) gets a progress record at the
    slice's end: the next slice starts there and no later tuple's event time is below it (arrival times
    only grow, and floor to ms keeps the order), so the record never makes a later tuple late. A busy
    partition gets none; an idle one, one per interval: cheap even for many partitions.

    The largest event time written is also what makes an injected late tuple late: it is checked here
    against the partition's largest, where the rule judges it. Other producers writing to the same
    partitions can only raise that largest, so the tuple stays late whatever they write.
    """

    def __init__(self, cfg: Config, start_ms: int) -> None:
        g = cfg.generator
        self.start_ms = start_ms
        self.partitions = cfg.partitions
        self.tuples_per_message = g.tuples_per_message
        self.lateness_ms = cfg.allowed_lateness_ms
        self.interval_ms = g.progress_interval_ms
        self.largest = np.full((len(cfg.streams), cfg.partitions), _NO_EVENT, dtype=np.int64)
        self.progress_records = 0
        self.late_written = 0

    def plan(self, slices: list[StreamSlice], end_s: float) -> list[Record]:
        """The messages of `slices` (tuples with event time < end_s), then the progress records due."""
        out: list[Record] = []
        for sl in slices:
            largest = self.largest[sl.stream]
            for e in encode_slice(sl, self.start_ms, self.partitions, self.tuples_per_message):
                if e.late:
                    bound = int(largest[e.pid]) - self.lateness_ms
                    if not (largest[e.pid] != _NO_EVENT and e.max_ms < bound):
                        raise RuntimeError(
                            f"generator bug: a late tuple at {e.max_ms} is not below {bound} in pid {e.pid}"
                        )
                    self.late_written += e.tuples
                elif e.max_ms > largest[e.pid]:
                    largest[e.pid] = e.max_ms
                out.append(Record(sl.stream, e.pid, e.value, e.first_ms, e.tuples, e.late))
        now_ms = self.start_ms + math.floor(end_s * 1000.0)
        idle = np.maximum(self.largest, self.start_ms) <= now_ms - self.interval_ms
        if idle.any():
            value = encode_progress(now_ms)
            for stream, pid in zip(*np.nonzero(idle), strict=True):
                out.append(Record(int(stream), int(pid), value, now_ms, 0))
            self.largest[idle] = now_ms
            self.progress_records += int(idle.sum())
        return out


class HeldBack:
    """The messages of lagged streams (`stream_lag_ms`, real time), each stream in its own order.

    Pure: the caller says what time it is. A batch planned when event time reached `event_s` is due at
    `event_s` + the stream's lag (seconds since the run's start), so its messages are produced at least
    the lag after the event times they carry.
    """

    def __init__(self, lag_s: dict[int, float]) -> None:
        self._lag = {stream: lag for stream, lag in lag_s.items() if lag > 0}
        self._queues: dict[int, deque[tuple[float, list[Record]]]] = {s: deque() for s in self._lag}

    def hold(self, records: list[Record], event_s: float) -> list[Record]:
        """Keep the records of lagged streams; return the others (to produce now)."""
        if not self._lag:
            return records
        now: list[Record] = []
        held: dict[int, list[Record]] = {}
        for r in records:
            if r.stream in self._lag:
                held.setdefault(r.stream, []).append(r)
            else:
                now.append(r)
        for stream, rs in held.items():
            self._queues[stream].append((event_s + self._lag[stream], rs))
        return now

    def release(self, now_s: float) -> list[Record]:
        """The held records due by `now_s`, in order per stream (all of them for +inf)."""
        out: list[Record] = []
        for queue in self._queues.values():
            while queue and queue[0][0] <= now_s:
                out.extend(queue.popleft()[1])
        return out

    def __len__(self) -> int:
        return sum(len(rs) for q in self._queues.values() for _, rs in q)


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
        for msg in consumer.consume(num_messages=10_000, timeout=0.5):
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
    """A confluent-kafka producer plus delivery accounting (errors are counted, raised at the end)."""

    def __init__(self, bootstrap: str, overrides: dict[str, Any] | None = None) -> None:
        conf = {**PRODUCER_CONFIG, **(overrides or {}), **kafka_config(bootstrap)}
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

    def finish(self, stop: threading.Event) -> None:
        """Wait until the broker has acknowledged every message. A broker away is waited out however
        long it is away, as `delivery.timeout.ms` 0 says (a fixed limit of 120 s here ended the
        generator during a longer outage), saying in the log every `LOG_EVERY_S` how many still wait;
        `stop` ends the wait."""
        waited_s = 0.0
        while remaining := self.producer.flush(LOG_EVERY_S):
            waited_s += LOG_EVERY_S
            if stop.is_set():
                raise DeliveryError(f"stopped with {remaining} messages unacknowledged by the broker")
            log.warning("generator: %s messages wait for the broker (%.0f s)", f"{remaining:,}", waited_s)
        if self.failed:
            raise DeliveryError(
                f"{self.failed} of {self.messages} messages failed delivery; first error: {self.first_error}"
            )


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
    "progress_records", "late_injected", "id_base"}: `tuples` and `per_stream` count every tuple
    written (injected late ones included), `messages` progress records too, `id_base` is the first id
    of each stream's run. Raises DeliveryError if any message was not acknowledged, BrokerUnreachable /
    TopicError from topic creation.

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
    sender = _Sender(bootstrap, {**linger, **(producer_overrides or {})})
    display = _Progress(progress, g.max_tuples)
    started = time.monotonic()
    start_ms = time.time_ns() // 1_000_000
    planner = MessagePlanner(cfg, start_ms)
    held = HeldBack({i: g.stream_lag_ms.get(s, 0) / 1000.0 for i, s in enumerate(cfg.streams)})
    tuples = 0

    def send(records: list[Record]) -> None:
        nonlocal tuples
        for r in records:
            sender.send(topics[r.stream], r.pid, r.value, r.timestamp_ms)
            tuples += r.tuples
        sender.producer.poll(0)
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
        else:
            # Virtual clock: all streams advance together chunk by chunk, as fast as the producer goes.
            while not source.done and not stop.is_set():
                t0 = max(source.end_s, source.next_arrival_s())
                if math.isinf(t0):
                    break
                rate = source.total_rate_at(t0)
                chunk = min(MAX_CHUNK_S, CHUNK_TUPLES / rate) if rate > 0 else MAX_CHUNK_S
                emit(source.take(t0 + chunk))
        send(held.release(math.inf))
        sender.finish(stop)
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
    }
