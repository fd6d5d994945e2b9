"""The generator's messages: what it writes to the input topics, in order, for the tuples
`generator.tuples` hands out; pure (no Kafka, no clock).

Message layout: value = `codec.encode_tuples` of tuples of one stream and one pid, in arrival order;
partition = pid; key = the pid as a decimal ASCII string (b"17"), readable in any Kafka tool and
redundant with the partition by design (design.md section 2: Kafka message key == pid).

Lateness is a property of the input (decision 0047): a tuple is late when its event time is below the
largest event time of the tuples and progress records before it in its input partition (stream, pid),
minus allowed_lateness_ms. Each injected late tuple gets a message of its own, right after the tuple it
is late against. `MessagePlanner` turns slices into the messages to write and adds a progress record to
every partition idle for `progress_interval_ms` of event time, at an event time no later tuple of the
partition is below. `HeldBack` holds a lagged stream's messages back (`stream_lag_ms`, real time): the
caller says what time it is.
"""

from __future__ import annotations

import bisect
import itertools
import math
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from generator.tuples import StreamSlice
from pipeline.codec import HEADER_BYTES, encode_progress, encode_tuples
from pipeline.config import Config
from pipeline.partitioning import pids_of

# Kafka's default max message size is ~1 MB (broker message.max.bytes, client message.max.bytes);
# messages are split to stay under it whatever tuples_per_message says.
MAX_MESSAGE_BYTES = 960_000

_NO_EVENT = np.iinfo(np.int64).min  # a partition's largest event time before anything is written to it


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
