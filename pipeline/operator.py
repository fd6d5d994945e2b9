"""The stateful join operator: Spark's `applyInPandasWithState` grouped by pid around `join.join_step`.

Why grouped by pid: a pid's window is the unit that moves between instances, and one state-store entry
per pid keeps every state call to one round trip. The window is stored as one raw-column blob
(`join.window_to_bytes`), not one row per tuple (measured 2-2.5x faster in state-store round trips).

The operator emits one row stream with a `kind` column, because a streaming query has one sink:

=========  =====  ===============  =================  ===============  ====================  ==========
kind       code   key              ts                 aux              id0                   id1..
=========  =====  ===============  =================  ===============  ====================  ==========
result     0      results          0                  0                0                     0
late       1      tuple key        event time         stream index     tuple id              0
malformed  2      stream index     reason code        0                Kafka offset          0
stats      3      window tuples    newest event time  state bytes      tuples in (batch)     results
state      4      tuple key        event time         stream index     tuple id              0
released   5      exported tuples  0                  0                stream_max[0]         stream_max[j]
track done 6      0                0                  side (1 old/2 new) 0                     0
watermark  7      0                0                  0                stream_max[0]         stream_max[j]
cleaned    8      tuples re-read   0                  results made     0                     0
=========  =====  ===============  =================  ===============  ====================  ==========

A `stats` row's `payload` (`encode_stats_payload`) counts the combinations of the batch's own tuples
that share a key (how many results the batch could make within itself, for the source to plan the
pid's next batches by) and names the pid's hottest key of the batch: the key with the most results and
their number (`HotKey`), for the sink to warn about a hot key by name.

A `result` row carries up to RESULTS_PER_MESSAGE of a pid's results in its `payload` column, already
encoded as the results topic's message (`codec.encode_results`), which the sink produces as is; every
other kind leaves `payload` null. One row per result cost the instance's JVM and Python worker a
conversion per result twice (Arrow to Spark rows and back), and a batch carries about ten results per
input tuple (decision 0044).

`state` rows are a released pid's window, exported for its new owner (handoff mode `transfer`); the
`released` row closes every release, exported or not, and the beginning of a parallel-track overlap on
the sender (whose largest event time per stream, `stream_max`, the receiver starts from). `track done`:
in this batch the sender's last old tuple left the window, or no new tuple can join an old one any more
on the receiver. `watermark`: the window's `stream_max` as this batch leaves it, for each pid the
instance keeps; the sink notes them, so that a parallel track can start from the batch's plan, before
the batch that begins it has run. `cleaned`: a spilled pid's clean-up ran in this batch (`pipeline.spill`):
how many of its new generation's tuples it re-read and how many results spanning the generations it made.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import numpy.typing as npt
import pandas as pd

from pipeline.codec import encode_results
from pipeline.config import MAX_STREAMS
from pipeline.join import (
    PROGRESS_ID,
    Part,
    Results,
    WindowState,
    begin_new_track,
    begin_old_track,
    install,
    join_step,
    key_combinations,
    window_from_bytes,
    window_to_bytes,
)
from pipeline.rows import (
    CROSS_ROW,
    DROP_ROW,
    MALFORMED_STREAM,
    RELEASE_ROW,
    SILENT_ROW,
    SPILL_ROW,
    TRACK_NEW,
    TRACK_OLD,
    TRACK_ROW,
    WATERMARK_ROW,
    WINDOW_ROW,
    cross_row,
)

(
    KIND_RESULT,
    KIND_LATE,
    KIND_MALFORMED,
    KIND_STATS,
    KIND_STATE,
    KIND_RELEASED,
    KIND_TRACK_DONE,
    KIND_WATERMARK,
    KIND_CLEANED,
) = range(9)
STATE_SCHEMA = "window binary"
RESULTS_PER_MESSAGE = 8_000
"""Results per `result` row, and so per results message: 256 KB for a 2-way join, well under Kafka's
1 MB default message size."""


@dataclass(slots=True)
class HotKey:
    """Results per key over a pid's batch, counted chunk by chunk: which key made the most."""

    counts: dict[int, int] = field(default_factory=dict)

    def count(self, keys: npt.NDArray[np.int64]) -> None:
        found, n = np.unique(keys, return_counts=True)
        for k, c in zip(found.tolist(), n.tolist(), strict=True):
            self.counts[k] = self.counts.get(k, 0) + c

    def hottest(self) -> tuple[int, int] | None:
        """(key, results) of the key with the most results; None for a batch without results."""
        if not self.counts:
            return None
        key = max(self.counts, key=self.counts.__getitem__)
        return key, self.counts[key]


def encode_stats_payload(within: int, hot: tuple[int, int] | None) -> bytes:
    """A `stats` row's payload: little-endian int64s, the batch's own key combinations (`within`,
    `join.key_combinations` of its new tuples), then the hot key and its results when it has one."""
    return np.array([within, *(hot or ())], dtype="<i8").tobytes()


def decode_stats_payload(payload: bytes) -> tuple[int, tuple[int, int] | None]:
    """(within, hot key) from `encode_stats_payload`'s bytes."""
    values = np.frombuffer(payload, dtype="<i8").tolist()
    return int(values[0]), (int(values[1]), int(values[2])) if len(values) == 3 else None


def output_schema(streams: int) -> str:
    ids = ", ".join(f"id{j} long" for j in range(streams))
    return f"kind byte, pid int, key long, ts long, aux long, {ids}, payload binary"


def _rows(
    kind: int,
    pid: int,
    key: Any,
    ts: Any,
    aux: Any,
    ids: list[Any],
    n: int,
    payload: list[bytes] | None = None,
) -> dict[str, Any]:
    """`n` output rows of one kind, as columns (`_data_frame` makes them a frame)."""
    cols: dict[str, Any] = {
        "kind": np.full(n, kind, dtype=np.int8),
        "pid": np.full(n, pid, dtype=np.int32),
        "key": np.broadcast_to(np.asarray(key, dtype=np.int64), (n,)),
        "ts": np.broadcast_to(np.asarray(ts, dtype=np.int64), (n,)),
        "aux": np.broadcast_to(np.asarray(aux, dtype=np.int64), (n,)),
    }
    for j, col in enumerate(ids):
        cols[f"id{j}"] = np.broadcast_to(np.asarray(col, dtype=np.int64), (n,))
    cols["payload"] = payload if payload is not None else [None] * n
    return cols


def _data_frame(rows: list[dict[str, Any]]) -> pd.DataFrame:
    """One frame of several `_rows`: a pid's rows other than its results leave the worker together,
    as a frame costs a fraction of a millisecond to make whatever its size and a batch made a few per pid
    (docs/benchmarks.md, "Where a batch's time goes")."""
    if len(rows) == 1:
        return pd.DataFrame(rows[0])
    columns: dict[str, Any] = {
        c: np.concatenate([np.asarray(r[c]) for r in rows]) for c in rows[0] if c != "payload"
    }
    columns["payload"] = [p for r in rows for p in r["payload"]]
    return pd.DataFrame(columns)


def _result_frame(pid: int, results: Results, streams: int) -> pd.DataFrame:
    """The `result` rows of one pid's batch: each its share of the results, encoded as one message."""
    n = len(results)
    chunks = [(a, min(a + RESULTS_PER_MESSAGE, n)) for a in range(0, n, RESULTS_PER_MESSAGE)]
    payload = [encode_results(results.ids[:, a:b], results.keys[a:b], results.max_ts[a:b]) for a, b in chunks]
    counts = [b - a for a, b in chunks]
    return pd.DataFrame(_rows(KIND_RESULT, pid, counts, 0, 0, [0] * streams, len(chunks), payload))


def make_join_function(
    streams: int, window_ms: int, allowed_lateness_ms: int
) -> Callable[[tuple[Any, ...], Iterator[pd.DataFrame], Any], Iterator[pd.DataFrame]]:
    """Build the function Spark calls once per pid per micro-batch."""

    def join_pid(key: tuple[Any, ...], batches: Iterator[pd.DataFrame], state: Any) -> Iterator[pd.DataFrame]:
        pid = int(key[0])
        small: list[dict[str, Any]] = []  # every row but the results, out in one frame at the end
        frames = list(batches)
        rows = pd.concat(frames, ignore_index=True) if len(frames) > 1 else frames[0]
        window = window_from_bytes(state.get[0]) if state.exists else WindowState.empty(streams)
        stream_col = rows["stream"].to_numpy()
        ids, keys, ts = (rows[c].to_numpy().astype(np.int64) for c in ("id", "key", "ts"))

        def rows_of(code: int) -> list[Part]:
            """Per stream j, the rows whose `stream` column is code + j."""
            return [Part(ids[m], keys[m], ts[m]) for m in (stream_col == code + j for j in range(streams))]

        if (stream_col == DROP_ROW).any():  # a returning pid: the window of its ended old track goes
            window = WindowState.empty(streams)

        def stream_max_of(rows: npt.NDArray[np.bool_]) -> tuple[int, ...] | None:
            """A shipped `stream_max`: one row per stream, id = the stream's index, ts = its value."""
            if not rows.any():
                return None
            found = dict(zip(ids[rows].tolist(), ts[rows].tolist(), strict=True))
            return tuple(int(found[j]) for j in range(streams))

        if ((stream_col >= WINDOW_ROW) & (stream_col < SILENT_ROW)).any() or (
            stream_col == WATERMARK_ROW
        ).any():
            shipped = stream_max_of(stream_col == WATERMARK_ROW)
            window = install(window, rows_of(WINDOW_ROW), shipped, window_ms, allowed_lateness_ms)

        if (stream_col == SPILL_ROW).any():  # the old generation leaves memory; lateness goes on as before
            window = replace(WindowState.empty(streams), stream_max=window.stream_max)
        cross = stream_col >= CROSS_ROW
        if cross.any():  # a clean-up: the window at the first spill point, installed above, then each
            cleaned = 0  # later generation joined with the ones before it only: the rest were produced
            for g in sorted({int(c) for c in (stream_col[cross] - CROSS_ROW) // MAX_STREAMS}):
                gen = rows_of(cross_row(g, 0))
                old_side = join_step(begin_old_track(window), gen, window_ms, allowed_lateness_ms)
                for chunk in old_side.results:
                    cleaned += len(chunk)
                    yield _result_frame(pid, chunk, streams)
                window = replace(old_side.state, old=None)  # the generations up to g, as one window
            small.append(_rows(KIND_CLEANED, pid, int(cross.sum()), 0, cleaned, [0] * streams, 1))

        zeros = [0] * (streams - 1)
        track = stream_col == TRACK_ROW
        roles = set(keys[track].tolist())
        if TRACK_NEW in roles:
            sender_max = stream_max_of(track & (keys == TRACK_NEW))
            assert sender_max is not None
            window = begin_new_track(sender_max)
        if TRACK_OLD in roles:
            window = begin_old_track(window)
            small.append(_rows(KIND_RELEASED, pid, 0, 0, 0, list(window.stream_max), 1))
        receiving = window.old_max is not None
        if ((stream_col >= SILENT_ROW) & (stream_col < CROSS_ROW)).any():  # as the dead instance did
            window = join_step(window, rows_of(SILENT_ROW), window_ms, allowed_lateness_ms).state

        new = rows_of(0)
        out = join_step(window, new, window_ms, allowed_lateness_ms)
        if (
            out.state.old is not None
            and out.state.old_tuples == 0
            and (TRACK_OLD in roles or window.old_tuples)
        ):
            small.append(_rows(KIND_TRACK_DONE, pid, 0, 0, TRACK_OLD, [0, *zeros], 1))
        if receiving and out.state.old_max is None:
            small.append(_rows(KIND_TRACK_DONE, pid, 0, 0, TRACK_NEW, [0, *zeros], 1))
        released = stream_col == RELEASE_ROW
        produced = 0
        hot = HotKey()
        for chunk in out.results:  # bounded chunks, each out of the worker before the next is made
            produced += len(chunk)
            hot.count(chunk.keys)
            yield _result_frame(pid, chunk, streams)
        for j, late in enumerate(out.late):
            if len(late):
                small.append(_rows(KIND_LATE, pid, late.keys, late.ts, j, [late.ids, *zeros], len(late)))
        bad = stream_col == MALFORMED_STREAM
        if bad.any():
            small.append(
                _rows(KIND_MALFORMED, pid, keys[bad], ts[bad], 0, [ids[bad], *zeros], int(bad.sum()))
            )

        if released.any():
            exported = 0
            if keys[released].any():  # export for a transfer
                for j, part in enumerate(out.state.parts):
                    if len(part):
                        small.append(
                            _rows(KIND_STATE, pid, part.keys, part.ts, j, [part.ids, *zeros], len(part))
                        )
                        exported += len(part)
            small.append(_rows(KIND_RELEASED, pid, exported, 0, 0, list(out.state.stream_max), 1))
            state.remove()
            blob, final = b"", WindowState.empty(streams)
        else:
            blob, final = window_to_bytes(out.state), out.state
            state.update((blob,))
            small.append(_rows(KIND_WATERMARK, pid, 0, 0, 0, list(final.stream_max), 1))
        accepted = int(sum((p.ids != PROGRESS_ID).sum() for p in new))
        # The newest event time read: successive batches' values bound the event time their tuples
        # arrived over, so the controller can tell a pid's arrival rate from a backlog's size.
        newest = max((int(p.ts.max()) for p in new if len(p)), default=0)
        extra = [0] * (streams - 2)
        stats = _rows(KIND_STATS, pid, final.tuples, newest, len(blob), [accepted, produced, *extra], 1)
        stats["payload"] = [encode_stats_payload(key_combinations(new, window_ms), hot.hottest())]
        small.append(stats)
        yield _data_frame(small)

    return join_pid
