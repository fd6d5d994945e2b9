"""The generator's tuples: per-stream tuple columns for successive slices of event time, from a
configuration and where each stream's ids start; pure (no Kafka, no clock), so they are tested as
functions.

`TupleSource` draws arrivals from the rate schedule (`schedules`), keys from the key sampler (`keys`),
numbers ids and computes payloads. Determinism: a tuple's id, key, event-time offset and payload depend
only on the configuration and seed, never on how time was sliced (see `schedules.ArrivalProcess` and
`keys`), so a real-time run and a max-rate run of one configuration carry the same tuples; only
`start_ms` differs. `silences` drop tuples here, at the source.

Lateness is a property of the input (decision 0047). The generator writes every partition in
nondecreasing event time, so none of its tuples is late, except the `late_tuples` it injects on
purpose: `TupleSource` inserts each right after the tuple it is late against (`generator.messages`
gives it a message of its own and checks it is late).

Tuple ids are unique per stream across runs on one pipeline: a run numbers its tuples from its
`id_base`, one past the largest id already in the stream's topic (`generator.producer.largest_ids`).
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt

from generator.keys import KeySampler, stream_rng
from generator.schedules import ArrivalProcess, rate_at, time_of_count
from pipeline.config import Config
from pipeline.partitioning import pids_of, stable_hash

I64 = npt.NDArray[np.int64]
U8 = npt.NDArray[np.uint8]

# spawn_key purposes under (seed, stream index); keys.py uses 1 for key draws.
_ARRIVALS = 0
_PAYLOAD = 2

# Late tuples are spread evenly over this share of the run's expected length, so each finds tuples to
# follow even when the run ends a little earlier than expected...
LATE_SPAN = 0.8
# ...and each is this much below the bound, plus 0..LATE_JITTER_MS - 1 ms (by its number), so late tuples
# do not all sit exactly one ms below it.
LATE_JITTER_MS = 8


def _no_late() -> I64:
    """No late tuple: a slice's default, a fresh array each (a frozen dataclass's field default)."""
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
