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
"""

from __future__ import annotations

from dataclasses import dataclass

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
    """A pid's window: one Part per stream (configured order) and the pid's watermark."""

    parts: tuple[Part, ...]
    watermark: int = int(NO_WATERMARK)

    @staticmethod
    def empty(streams: int) -> WindowState:
        return WindowState(tuple(Part.empty() for _ in range(streams)))

    @property
    def tuples(self) -> int:
        return sum(len(p) for p in self.parts)


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


def join_step(state: WindowState, new: list[Part], window_ms: int, allowed_lateness_ms: int) -> StepOutput:
    """Process one micro-batch of one pid: reject late tuples, emit new results, insert, purge."""
    m = len(state.parts)
    wm = state.watermark
    late: list[Part] = []
    accepted: list[Part] = []
    for part in new:
        is_late = part.ts < wm
        if is_late.any():
            late.append(part.take(is_late))
            accepted.append(part.take(~is_late))
        else:
            late.append(Part.empty())
            accepted.append(part)

    chunks = []
    for i in range(m):
        if not len(accepted[i]):
            continue
        operands = [
            accepted[i] if j == i else (state.parts[j].concat(accepted[j]) if j < i else state.parts[j])
            for j in range(m)
        ]
        chunks.append(join_parts(operands, window_ms))
    results = _concat_results(chunks, m)

    max_seen = max((int(p.ts.max()) for p in accepted if len(p)), default=None)
    new_wm = wm if max_seen is None else max(wm, max_seen - allowed_lateness_ms)
    horizon = new_wm - window_ms if new_wm != NO_WATERMARK else NO_WATERMARK
    parts = []
    for j in range(m):
        merged = state.parts[j].concat(accepted[j])
        parts.append(merged.take(merged.ts >= horizon) if horizon != NO_WATERMARK else merged)
    return StepOutput(WindowState(tuple(parts), int(new_wm)), results, tuple(late))


_STATE_HEADER = np.dtype("<i8")


def window_to_bytes(state: WindowState) -> bytes:
    """Serialize a window as raw little-endian columns: [m, wm, n_0..n_{m-1}] then ids|keys|ts per part.

    Raw columns beat Arrow IPC here: the state store round-trips every pid's window every batch.
    """
    header = np.array([len(state.parts), state.watermark, *(len(p) for p in state.parts)], dtype="<i8")
    chunks = [header.tobytes()]
    for p in state.parts:
        chunks += [
            p.ids.astype("<i8").tobytes(),
            p.keys.astype("<i8").tobytes(),
            p.ts.astype("<i8").tobytes(),
        ]
    return b"".join(chunks)


def window_from_bytes(blob: bytes) -> WindowState:
    m = int(np.frombuffer(blob, dtype="<i8", count=1)[0])
    header = np.frombuffer(blob, dtype="<i8", count=2 + m)
    wm, counts = int(header[1]), header[2:]
    offset = 8 * (2 + m)
    parts = []
    for n in counts:
        cols = np.frombuffer(blob, dtype="<i8", count=3 * int(n), offset=offset).reshape(3, int(n))
        offset += 24 * int(n)
        parts.append(Part(cols[0], cols[1], cols[2]))
    return WindowState(tuple(parts), wm)


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
