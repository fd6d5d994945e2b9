"""The m-way sliding-window equi-join kernel: pure functions on columnar numpy data, no Spark, no I/O.

One call of `join_step` is one micro-batch of one pid: the pid's window state and the new tuples go in,
the new state, the results and the late tuples come out. The operator (`pipeline/operator.py`) only
moves bytes in and out of Spark's state store around it; the oracle reuses `join_parts`.

Semantics. A result is one tuple per stream, all with the same key, with every pair of event times
within W of each other (equivalently max - min <= W; ties at exactly W join). Each pid keeps a
watermark wm = max event time seen - allowed lateness. A new tuple with ts < wm is *late*: some of
its partners may already be purged, so it is not joined but reported (dead-letter topic). Window state
keeps tuples with ts >= wm - W, which is exactly what any future non-late tuple can still match.
Each result is produced once, by the batch that delivers its last part (symmetric delta join:
new_i x (old_j + new_j for j < i) x (old_j for j > i)).

Parallel track (PTLB, D-CAPE). While a pid moves in mode `parallel-track`, two instances process its
tuples from the cutoff on: the sender, whose window holds the tuples from before the cutoff (*old*), and
the receiver, which starts empty. The sender emits only results with at least one old tuple, the
receiver those with none, so the two sets are disjoint and together complete. Both must judge every
new tuple's lateness alike although their micro-batches differ, so during the overlap the rule is one
that does not depend on batch boundaries: a tuple of stream j is late when its event time is below
(the largest event time before it in stream j, at least the sender's watermark at the cutoff plus the
lateness) minus the allowed lateness, and a window purges below the smallest such threshold minus W.
Only the receiver reports late tuples (the sender would report the same ones). The sender is done once
every old tuple has left its window; the receiver returns to the plain rule once every stream's threshold
has passed the newest possible old tuple by W (from then on no new tuple can join an old one, so the
sender emits nothing the receiver's rule could contradict). Both decisions depend only on the input
processed so far, so a side re-processing a dead side's input reaches the same state.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np
import numpy.typing as npt
import pandas as pd

NO_WATERMARK = np.iinfo(np.int64).min
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
    """A pid's window: one Part per stream (configured order) and the pid's watermark.

    During a parallel-track overlap, `stream_max` holds the per-stream largest event time that the
    overlap's lateness rule uses (both sides), and `old` (sender side only) the number of leading tuples
    of each part that arrived before the cutoff.
    """

    parts: tuple[Part, ...]
    watermark: int = int(NO_WATERMARK)
    stream_max: tuple[int, ...] | None = None
    old: tuple[int, ...] | None = None
    old_max: int | None = None  # receiver side: the newest event time an old tuple can have

    @staticmethod
    def empty(streams: int) -> WindowState:
        return WindowState(tuple(Part.empty() for _ in range(streams)))

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
    results: Results
    late: tuple[Part, ...]  # per stream: tuples rejected as late


def join_parts(parts: list[Part], window_ms: int) -> Results:
    """All combinations of one tuple per part with equal keys and max(ts) - min(ts) <= window_ms.

    Parts are joined smallest first so intermediate results stay small; the output columns are
    returned in the parts' given order.
    """
    m = len(parts)
    if any(len(p) == 0 for p in parts):
        return Results(np.empty((m, 0), dtype=np.int64), np.empty(0, np.int64), np.empty(0, np.int64))
    order = sorted(range(m), key=lambda j: len(parts[j]))
    first = parts[order[0]]
    acc = pd.DataFrame({"key": first.keys, "lo": first.ts, "hi": first.ts, f"id{order[0]}": first.ids})
    for j in order[1:]:
        p = parts[j]
        right = pd.DataFrame({"key": p.keys, "t": p.ts, f"id{j}": p.ids})
        acc = acc.merge(right, on="key", how="inner", sort=False, copy=False)
        if acc.empty:
            break
        lo = np.minimum(acc["lo"].to_numpy(), acc["t"].to_numpy())
        hi = np.maximum(acc["hi"].to_numpy(), acc["t"].to_numpy())
        keep = (hi - lo) <= window_ms
        acc = pd.DataFrame(
            {"key": acc["key"].to_numpy()[keep], "lo": lo[keep], "hi": hi[keep]}
            | {c: acc[c].to_numpy()[keep] for c in acc.columns if c.startswith("id")}
        )
    if acc.empty:
        return Results(np.empty((m, 0), dtype=np.int64), np.empty(0, np.int64), np.empty(0, np.int64))
    ids = np.vstack([acc[f"id{j}"].to_numpy(dtype=np.int64) for j in range(m)])
    return Results(ids, acc["key"].to_numpy(dtype=np.int64), acc["hi"].to_numpy(dtype=np.int64))


def _concat_results(chunks: list[Results], m: int) -> Results:
    chunks = [c for c in chunks if len(c)]
    if not chunks:
        return Results(np.empty((m, 0), dtype=np.int64), np.empty(0, np.int64), np.empty(0, np.int64))
    if len(chunks) == 1:
        return chunks[0]
    return Results(
        np.hstack([c.ids for c in chunks]),
        np.concatenate([c.keys for c in chunks]),
        np.concatenate([c.max_ts for c in chunks]),
    )


def _minus(t: int, lateness_ms: int) -> int:
    return t if t == NO_WATERMARK else t - lateness_ms


def _split_late(state: WindowState, new: list[Part], lateness_ms: int) -> tuple[list[Part], list[Part]]:
    """(accepted, late) per stream, by the pid's watermark or, during an overlap, the per-stream rule."""
    accepted: list[Part] = []
    late: list[Part] = []
    for j, part in enumerate(new):
        if not len(part):
            accepted.append(part)
            late.append(Part.empty())
            continue
        if state.stream_max is None:
            is_late = part.ts < state.watermark
        else:
            before = np.maximum.accumulate(np.concatenate(([state.stream_max[j]], part.ts)))[:-1]
            threshold = np.where(before == NO_WATERMARK, NO_WATERMARK, before - lateness_ms)
            is_late = part.ts < threshold
        accepted.append(part.take(~is_late) if is_late.any() else part)
        late.append(part.take(is_late) if is_late.any() else Part.empty())
    return accepted, late


def _delta_join(state: WindowState, accepted: list[Part], window_ms: int) -> Results:
    """Results whose last part is in `accepted`; on a sender, only those with an old tuple."""
    m = len(state.parts)
    chunks = []
    for i in range(m):
        if not len(accepted[i]):
            continue
        operands = [
            accepted[i] if j == i else (state.parts[j].concat(accepted[j]) if j < i else state.parts[j])
            for j in range(m)
        ]
        if state.old is None:
            chunks.append(join_parts(operands, window_ms))
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
            chunks.append(join_parts(ops, window_ms))
    return _concat_results(chunks, m)


def join_step(state: WindowState, new: list[Part], window_ms: int, allowed_lateness_ms: int) -> StepOutput:
    """Process one micro-batch of one pid: reject late tuples, emit new results, insert, purge."""
    m = len(state.parts)
    accepted, late = _split_late(state, new, allowed_lateness_ms)
    results = _delta_join(state, accepted, window_ms)

    max_seen = max((int(p.ts.max()) for p in accepted if len(p)), default=None)
    wm = state.watermark
    new_wm = wm if max_seen is None else max(wm, max_seen - allowed_lateness_ms)
    stream_max = state.stream_max
    if stream_max is None:
        floor = new_wm
    else:
        stream_max = tuple(
            max(stream_max[j], int(accepted[j].ts.max())) if len(accepted[j]) else stream_max[j]
            for j in range(m)
        )
        floor = min(_minus(t, allowed_lateness_ms) for t in stream_max)
    horizon = floor - window_ms if floor != NO_WATERMARK else NO_WATERMARK
    parts = []
    old = []
    for j in range(m):
        merged = state.parts[j].concat(accepted[j])
        keep = merged.ts >= horizon
        parts.append(merged.take(keep))
        if state.old is not None:
            old.append(int(keep[: state.old[j]].sum()))
    if state.old is not None:
        late = [Part.empty() for _ in range(m)]  # the receiver reports them
    old_max = state.old_max
    if old_max is not None and (old_max == NO_WATERMARK or (horizon != NO_WATERMARK and horizon > old_max)):
        stream_max, old_max = None, None  # the receiver's overlap is over: back to the plain rule
    new_state = WindowState(
        tuple(parts), int(new_wm), stream_max, tuple(old) if state.old is not None else None, old_max
    )
    return StepOutput(new_state, results, tuple(late))


def begin_old_track(state: WindowState, allowed_lateness_ms: int) -> WindowState:
    """The sender at the cutoff: every tuple it holds is old; the overlap's lateness rule starts from
    its watermark (the receiver starts from the same value, shipped in `Released`)."""
    start = _plus(state.watermark, allowed_lateness_ms)
    return replace(state, stream_max=(start,) * len(state.parts), old=tuple(len(p) for p in state.parts))


def begin_new_track(streams: int, watermark: int, allowed_lateness_ms: int) -> WindowState:
    """The receiver at the cutoff: an empty window under the overlap's lateness rule."""
    start = _plus(watermark, allowed_lateness_ms)
    return WindowState(
        tuple(Part.empty() for _ in range(streams)), watermark, (start,) * streams, None, start
    )


def _plus(t: int, lateness_ms: int) -> int:
    return t if t == NO_WATERMARK else t + lateness_ms


_STATE_HEADER = np.dtype("<i8")


def window_to_bytes(state: WindowState) -> bytes:
    """Serialize a window as raw little-endian columns: [m, wm, flags, n_0..n_{m-1}, stream_max?, old?]
    then ids|keys|ts per part (flags: 1 = stream_max present, 2 = old present, 4 = old_max follows).

    Raw columns beat Arrow IPC here: the state store round-trips every pid's window every batch.
    """
    flags = (
        (1 if state.stream_max is not None else 0)
        | (2 if state.old is not None else 0)
        | (4 if state.old_max is not None else 0)
    )
    header = np.array(
        [
            len(state.parts),
            state.watermark,
            flags,
            *(len(p) for p in state.parts),
            *(state.stream_max or ()),
            *(state.old or ()),
            *((state.old_max,) if state.old_max is not None else ()),
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
    m, _, flags = (int(x) for x in np.frombuffer(blob, dtype="<i8", count=3))
    size = 3 + m + (m if flags & 1 else 0) + (m if flags & 2 else 0) + (1 if flags & 4 else 0)
    header = np.frombuffer(blob, dtype="<i8", count=size)
    wm, counts = int(header[1]), header[3 : 3 + m]
    extra = [int(x) for x in header[3 + m :]]
    stream_max = tuple(extra[:m]) if flags & 1 else None
    old = tuple(extra[m : 2 * m] if flags & 1 else extra[:m]) if flags & 2 else None
    old_max = extra[-1] if flags & 4 else None
    offset = 8 * size
    parts = []
    for n in counts:
        cols = np.frombuffer(blob, dtype="<i8", count=3 * int(n), offset=offset).reshape(3, int(n))
        offset += 24 * int(n)
        parts.append(Part(cols[0], cols[1], cols[2]))
    return WindowState(tuple(parts), wm, stream_max, old, old_max)


def install(
    state: WindowState, parts: list[Part], watermark: int | None, window_ms: int, allowed_lateness_ms: int
) -> WindowState:
    """Take over a moved pid's window: merge its tuples into `state` without probing (their results were
    produced by the previous owner), then purge as `join_step` would.

    `watermark` is the sender's when it was shipped (transfer); for a window rebuilt from the input log
    (replay) it is None and derived from the tuples, as the sender derived its own.
    """
    merged = [state.parts[j].concat(parts[j]) for j in range(len(state.parts))]
    max_seen = max((int(p.ts.max()) for p in parts if len(p)), default=None)
    wm = state.watermark
    if watermark is not None:
        wm = max(wm, watermark)
    elif max_seen is not None:
        wm = max(wm, max_seen - allowed_lateness_ms)
    if wm == NO_WATERMARK:
        return WindowState(tuple(merged), wm)
    return WindowState(tuple(p.take(p.ts >= wm - window_ms) for p in merged), int(wm))
