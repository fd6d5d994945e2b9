"""The m-way sliding-window equi-join kernel: pure functions on columnar numpy data, no Spark, no I/O.

One call of `join_step` is one micro-batch of one pid: the pid's window state and the new tuples go in,
the new state, the results and the late tuples come out. The operator (`pipeline/operator.py`) only
moves bytes in and out of Spark's state store around it; the oracle applies the same rule offline.

Semantics. A result is one tuple per stream, all with the same key, with every pair of event times
within W of each other (equivalently max - min <= W; ties at exactly W join). Lateness depends on the
input alone (decision 0047): a tuple of stream j is *late* when its event time is below the largest
event time before it in its own input partition (stream j, this pid), tuples and progress records
alike, minus the allowed lateness. A late tuple is not joined but reported (dead-letter topic). The
window keeps, per stream, the largest event time seen (`stream_max`), and a tuple of stream i while a
non-late tuple of some other stream could still match it: ts >= min over j != i of (stream_max[j] -
lateness) - W. Each result is produced once, by the batch that delivers its last part (symmetric
delta join: new_i x (old_j + new_j for j < i) x (old_j for j > i)).

Progress records travel as tuples with id `PROGRESS_ID`: they raise their stream's largest event time
in their place in the partition's order and are never joined, inserted or reported.

Parallel track (PTLB, D-CAPE). While a pid moves in mode `parallel-track`, two instances process its
tuples from the cutoff on: the sender, whose window holds the tuples from before the cutoff (*old*), and
the receiver, which starts empty with the sender's `stream_max` at the cutoff. The sender emits only
results with at least one old tuple, the receiver those with none, so the two sets are disjoint and
together complete; both judge lateness by the one rule, which does not depend on their batches. Only
the receiver reports late tuples (the sender would report the same ones). The sender is done once
every old tuple has left its window; the receiver once the sender's newest possible old tuple of each
stream would have left it (no new tuple can join an old one any more). Both
decisions depend only on the input processed so far, so a side re-processing a dead side's input
reaches the same state.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, replace

import numpy as np
import numpy.typing as npt

NO_WATERMARK = np.iinfo(np.int64).min
RESULTS_PER_CHUNK = 250_000
"""At most this many results in memory at once per join (plus the merge that makes them): 8 MB of ids
for a 2-way join. A hot key's results come out chunk after chunk instead of all at once."""
PROGRESS_ID = -1
"""The id of a progress record's row: tuple ids are never negative (the source refuses them)."""
I64 = npt.NDArray[np.int64]


@dataclass(frozen=True, slots=True)
class Part:
    """Tuples of one stream: ids, keys and event times, parallel arrays."""

    ids: I64
    keys: I64
    ts: I64

    @staticmethod
    def empty() -> Part:
        e = np.empty(0, dtype=np.int64)
        return Part(e, e, e)

    def __len__(self) -> int:
        return len(self.ids)

    def take(self, mask: npt.NDArray[np.bool_]) -> Part:
        return Part(self.ids[mask], self.keys[mask], self.ts[mask])

    def slice(self, start: int, stop: int | None = None) -> Part:
        return Part(self.ids[start:stop], self.keys[start:stop], self.ts[start:stop])

    def concat(self, other: Part) -> Part:
        if not len(other):
            return self
        if not len(self):
            return other
        return Part(
            np.concatenate([self.ids, other.ids]),
            np.concatenate([self.keys, other.keys]),
            np.concatenate([self.ts, other.ts]),
        )


@dataclass(frozen=True, slots=True)
class WindowState:
    """A pid's window: one Part per stream (configured order) and, per stream, the largest event time
    seen in its input partition (`NO_WATERMARK` before the first).

    During a parallel-track overlap, `old` (sender side only) holds the number of leading tuples of
    each part that arrived before the cutoff, and `old_max` (receiver side only), per stream, the newest
    event time an old tuple can have (the sender's `stream_max` at the cutoff).
    """

    parts: tuple[Part, ...]
    stream_max: tuple[int, ...]
    old: tuple[int, ...] | None = None
    old_max: tuple[int, ...] | None = None

    @staticmethod
    def empty(streams: int) -> WindowState:
        return WindowState(tuple(Part.empty() for _ in range(streams)), (int(NO_WATERMARK),) * streams)

    @property
    def tuples(self) -> int:
        return sum(len(p) for p in self.parts)

    @property
    def old_tuples(self) -> int:
        return sum(self.old) if self.old is not None else 0


@dataclass(frozen=True, slots=True)
class Results:
    """Join results: ids[j] is the id column of part j; key and max event time per result."""

    ids: npt.NDArray[np.int64]  # shape (m, n)
    keys: I64
    max_ts: I64

    def __len__(self) -> int:
        return len(self.keys)


@dataclass(frozen=True, slots=True)
class StepOutput:
    state: WindowState
    results: Iterator[Results]
    """The batch's results, lazily, in chunks of at most the step's `chunk` results each."""
    late: tuple[Part, ...]  # per stream: tuples rejected as late


def join_parts(parts: list[Part], window_ms: int) -> Results:
    """All combinations of one tuple per part with equal keys and max(ts) - min(ts) <= window_ms.

    Parts are joined smallest first so intermediate results stay small; the output columns are
    returned in the parts' given order. Each step pairs equal keys by sorting and binary search
    (`equal_key_pairs`): a pandas merge cost about a millisecond a call whatever its size, and an
    instance makes two calls per pid per batch (docs/benchmarks.md, "Where a batch's time goes").
    """
    m = len(parts)
    if any(len(p) == 0 for p in parts):
        return _no_results(m)
    order = sorted(range(m), key=lambda j: len(parts[j]))
    first = parts[order[0]]
    keys, lo, hi = first.keys, first.ts, first.ts
    ids = {order[0]: first.ids}
    for j in order[1:]:
        p = parts[j]
        left, right = equal_key_pairs(keys, p.keys)
        t = p.ts[right]
        pair_lo, pair_hi = np.minimum(lo[left], t), np.maximum(hi[left], t)
        keep = (pair_hi - pair_lo) <= window_ms
        left, right = left[keep], right[keep]
        if not len(left):
            return _no_results(m)
        keys, lo, hi = keys[left], pair_lo[keep], pair_hi[keep]
        ids = {k: v[left] for k, v in ids.items()} | {j: p.ids[right]}
    return Results(
        np.vstack([ids[j] for j in range(m)]).astype(np.int64), keys.astype(np.int64), hi.astype(np.int64)
    )


def equal_key_pairs(left: I64, right: I64) -> tuple[npt.NDArray[np.intp], npt.NDArray[np.intp]]:
    """Indices (i, k) of every pair with left[i] == right[k], grouped by i in left's order."""
    order = np.argsort(right, kind="stable")
    ordered = right[order]
    start = np.searchsorted(ordered, left, side="left")
    counts = np.searchsorted(ordered, left, side="right") - start
    total = int(counts.sum())
    i = np.repeat(np.arange(len(left)), counts)
    # the k-th pair of left[i] is ordered[start[i] + k]
    within = np.arange(total) - np.repeat(np.cumsum(counts) - counts, counts)
    return i, order[np.repeat(start, counts) + within]


def _no_results(m: int) -> Results:
    return Results(np.empty((m, 0), dtype=np.int64), np.empty(0, np.int64), np.empty(0, np.int64))


def _combinations_so_far(keys: list[I64]) -> Iterator[float]:
    """After each part from the second on, how many combinations of one tuple of every part so far
    share a key, counted from the parts' keys alone; ends at the first part that leaves none."""
    common, combos = np.unique(keys[0], return_counts=True)
    combos = combos.astype(np.float64)
    for k in keys[1:]:
        other, counts = np.unique(k, return_counts=True)
        common, mine, theirs = np.intersect1d(common, other, assume_unique=True, return_indices=True)
        combos = combos[mine] * counts[theirs]
        yield float(combos.sum())
        if not len(common):
            return


def key_combinations(parts: list[Part], window_ms: int) -> int:
    """How many combinations of one tuple per part share a key and may lie within W: the most results
    these tuples could make among themselves (an upper bound, from keys and event times).

    Where the tuples span at most W, every combination sharing a key is one: the count is exact for a
    hot key. Where they span more (a backlog of many windows), a combination within W lies in two
    consecutive buckets of width W, so it is also counted per key and pair of buckets (one inside a
    single bucket counts twice), and the smaller count is taken: counted per key alone, a backlog of
    100 windows was judged to make about 50 times the results it made (decision 0072).
    """
    if any(len(p) == 0 for p in parts):
        return 0
    *_, combinations = _combinations_so_far([p.keys for p in parts])
    span = max(int(p.ts.max()) for p in parts) - min(int(p.ts.min()) for p in parts)
    if span > window_ms:  # both counts bound the results; the smaller is the closer
        *_, bucketed = _combinations_so_far([_per_bucket_pair(p, window_ms) for p in parts])
        combinations = min(combinations, bucketed)
    return int(min(combinations, np.iinfo(np.int64).max))


def _per_bucket_pair(part: Part, window_ms: int) -> I64:
    """Each tuple twice, keyed by its key and each of the two pairs of consecutive W-buckets it lies in.
    Keys and buckets are mixed into one int64 (wrapping); two groups mixed into one only count more."""
    bucket = part.ts // max(window_ms, 1)
    with np.errstate(over="ignore"):
        mixed = part.keys * np.int64(1_000_003)
        return np.concatenate([mixed + bucket, mixed + (bucket - 1)])


def merge_size(parts: list[Part]) -> int:
    """The most rows `join_parts` holds at once for these parts: the largest of its merges' outputs
    before the window filter, counted from the keys alone (an upper bound of the results)."""
    ordered = sorted(parts, key=len)  # as `join_parts` merges them
    largest = max([float(len(ordered[0])), *_combinations_so_far([p.keys for p in ordered])])
    return int(min(largest, np.iinfo(np.int64).max))


def join_bounded(parts: list[Part], window_ms: int, chunk: int) -> Iterator[Results]:
    """`join_parts` in pieces of at most about `chunk` rows each (merges included): the largest part is
    halved until a piece's merges fit. Every result has exactly one row of each part, so the pieces'
    results are the whole's, each once."""
    if any(len(p) == 0 for p in parts):
        return
    if merge_size(parts) <= chunk or all(len(p) == 1 for p in parts):
        results = join_parts(parts, window_ms)
        if len(results):
            yield results
        return
    j = max(range(len(parts)), key=lambda i: len(parts[i]))
    half = len(parts[j]) // 2
    for piece in (parts[j].slice(0, half), parts[j].slice(half)):
        yield from join_bounded([piece if i == j else p for i, p in enumerate(parts)], window_ms, chunk)


def _minus(t: int, lateness_ms: int) -> int:
    return t if t == NO_WATERMARK else t - lateness_ms


def split_late(
    stream_max: tuple[int, ...], new: list[Part], lateness_ms: int
) -> tuple[list[Part], list[Part], tuple[int, ...]]:
    """(accepted, late, new stream_max): each stream's new rows in partition order against the
    largest event time before them in the same stream; progress rows are neither."""
    accepted: list[Part] = []
    late: list[Part] = []
    maxima = []
    for j, part in enumerate(new):
        if not len(part):
            accepted.append(part)
            late.append(Part.empty())
            maxima.append(stream_max[j])
            continue
        running = np.maximum.accumulate(np.concatenate(([stream_max[j]], part.ts)))
        before = running[:-1]
        threshold = np.where(before == NO_WATERMARK, NO_WATERMARK, before - lateness_ms)
        progress = part.ids == PROGRESS_ID
        is_late = (part.ts < threshold) & ~progress
        keep = ~(is_late | progress)
        accepted.append(part if keep.all() else part.take(keep))
        late.append(part.take(is_late) if is_late.any() else Part.empty())
        maxima.append(int(running[-1]))
    return accepted, late, tuple(maxima)


def horizons(stream_max: tuple[int, ...], window_ms: int, lateness_ms: int) -> list[int]:
    """Per stream i, the oldest event time a kept tuple can have: W before the lowest event time a
    non-late tuple of another stream can still bring (no purge while another stream is unseen)."""
    floors = [_minus(t, lateness_ms) for t in stream_max]
    out = []
    for i in range(len(stream_max)):
        others = [f for j, f in enumerate(floors) if j != i]
        low = min(others)
        out.append(int(NO_WATERMARK) if low == NO_WATERMARK else low - window_ms)
    return out


def _delta_join(state: WindowState, accepted: list[Part], window_ms: int, chunk: int) -> Iterator[Results]:
    """Results whose last part is in `accepted`; on a sender, only those with an old tuple."""
    m = len(state.parts)
    for i in range(m):
        if not len(accepted[i]):
            continue
        operands = [
            accepted[i] if j == i else (state.parts[j].concat(accepted[j]) if j < i else state.parts[j])
            for j in range(m)
        ]
        if state.old is None:
            yield from join_bounded(operands, window_ms, chunk)
            continue
        # At least one old tuple: split by the first operand (in stream order) that contributes one.
        old = state.old
        for k in (j for j in range(m) if j != i and old[j]):
            ops = [
                operands[j]
                if j == i or j > k
                else state.parts[k].slice(0, old[k])
                if j == k
                else state.parts[j].slice(old[j]).concat(accepted[j] if j < i else Part.empty())
                for j in range(m)
            ]
            yield from join_bounded(ops, window_ms, chunk)


def join_step(
    state: WindowState,
    new: list[Part],
    window_ms: int,
    allowed_lateness_ms: int,
    chunk: int = RESULTS_PER_CHUNK,
) -> StepOutput:
    """Process one micro-batch of one pid: reject late tuples, emit new results (lazily, in chunks of
    at most about `chunk`), insert, purge."""
    m = len(state.parts)
    accepted, late, stream_max = split_late(state.stream_max, new, allowed_lateness_ms)
    results = _delta_join(state, accepted, window_ms, chunk)
    keep_from = horizons(stream_max, window_ms, allowed_lateness_ms)
    parts = []
    old = []
    for j in range(m):
        merged = state.parts[j].concat(accepted[j])
        keep = merged.ts >= keep_from[j]
        parts.append(merged.take(keep) if not keep.all() else merged)
        if state.old is not None:
            old.append(int(keep[: state.old[j]].sum()))
    if state.old is not None:
        late = [Part.empty() for _ in range(m)]  # the receiver reports them
    old_max = state.old_max
    if old_max is not None and all(
        t == NO_WATERMARK or t < h for t, h in zip(old_max, keep_from, strict=True)
    ):
        old_max = None  # the receiver's overlap is over: the sender purged every old tuple by this input
    new_state = WindowState(tuple(parts), stream_max, tuple(old) if state.old is not None else None, old_max)
    return StepOutput(new_state, results, tuple(late))


def begin_old_track(state: WindowState) -> WindowState:
    """The sender at the cutoff: every tuple it holds is old (the receiver starts from its `stream_max`,
    shipped in `Released`)."""
    return replace(state, old=tuple(len(p) for p in state.parts))


def begin_new_track(stream_max: tuple[int, ...]) -> WindowState:
    """The receiver at the cutoff: an empty window that goes on from the sender's `stream_max`."""
    return WindowState(tuple(Part.empty() for _ in stream_max), stream_max, None, stream_max)


_STATE_HEADER = np.dtype("<i8")


def window_to_bytes(state: WindowState) -> bytes:
    """Serialize a window as raw little-endian columns: [m, flags, n_0..n_{m-1}, stream_max_0..m-1, old?,
    old_max?] then ids|keys|ts per part (flags: 2 = old present, 4 = old_max present; m values each).

    Raw columns beat Arrow IPC here: the state store round-trips every pid's window every batch.
    """
    flags = (2 if state.old is not None else 0) | (4 if state.old_max is not None else 0)
    header = np.array(
        [
            len(state.parts),
            flags,
            *(len(p) for p in state.parts),
            *state.stream_max,
            *(state.old or ()),
            *(state.old_max or ()),
        ],
        dtype="<i8",
    )
    chunks = [header.tobytes()]
    for p in state.parts:
        chunks += [
            p.ids.astype("<i8").tobytes(),
            p.keys.astype("<i8").tobytes(),
            p.ts.astype("<i8").tobytes(),
        ]
    return b"".join(chunks)


def window_from_bytes(blob: bytes) -> WindowState:
    m, flags = (int(x) for x in np.frombuffer(blob, dtype="<i8", count=2))
    size = 2 + 2 * m + (m if flags & 2 else 0) + (m if flags & 4 else 0)
    header = [int(x) for x in np.frombuffer(blob, dtype="<i8", count=size)]
    counts = header[2 : 2 + m]
    stream_max = tuple(header[2 + m : 2 + 2 * m])
    old = tuple(header[2 + 2 * m : 2 + 3 * m]) if flags & 2 else None
    old_max = tuple(header[size - m : size]) if flags & 4 else None
    offset = 8 * size
    parts = []
    for n in counts:
        cols = np.frombuffer(blob, dtype="<i8", count=3 * n, offset=offset).reshape(3, n)
        offset += 24 * n
        parts.append(Part(cols[0], cols[1], cols[2]))
    return WindowState(tuple(parts), stream_max, old, old_max)


def install(
    state: WindowState,
    parts: list[Part],
    stream_max: tuple[int, ...] | None,
    window_ms: int,
    allowed_lateness_ms: int,
) -> WindowState:
    """Take over a moved pid's window: merge its tuples into `state` without probing (their results were
    produced by the previous owner), then purge as `join_step` would.

    `parts` are a shipped window's tuples (transfer) or the partitions' records from a replay's start,
    in their order: both are judged by the lateness rule from there, which drops the late ones of a
    replay (their owner reported them) and nothing of a window (each of its tuples passed the rule
    against at least these). `stream_max` is the sender's where it is known (a transfer, a resumed
    parallel track); a replay derives it from the records.
    """
    parts, _, derived = split_late(state.stream_max, parts, allowed_lateness_ms)
    if stream_max is not None:
        derived = tuple(max(a, b) for a, b in zip(derived, stream_max, strict=True))
    stream_max = derived
    keep_from = horizons(stream_max, window_ms, allowed_lateness_ms)
    merged = [state.parts[j].concat(parts[j]) for j in range(len(state.parts))]
    return WindowState(tuple(p.take(p.ts >= keep_from[j]) for j, p in enumerate(merged)), stream_max)
