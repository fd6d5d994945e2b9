"""The join kernel against a brute-force reference, over batches split arbitrarily."""

from __future__ import annotations

import itertools

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from pipeline.join import (
    NO_WATERMARK,
    Part,
    WindowState,
    join_parts,
    join_step,
    window_from_bytes,
    window_to_bytes,
)

Tuple3 = tuple[int, int, int]  # (id, key, ts)


def brute_force(streams: list[list[Tuple3]], window: int) -> set[tuple[int, ...]]:
    out = set()
    for combo in itertools.product(*streams):
        keys = {t[1] for t in combo}
        times = [t[2] for t in combo]
        if len(keys) == 1 and max(times) - min(times) <= window:
            out.add(tuple(t[0] for t in combo))
    return out


def as_part(tuples: list[Tuple3]) -> Part:
    if not tuples:
        return Part.empty()
    a = np.array(tuples, dtype=np.int64).reshape(-1, 3)
    return Part(a[:, 0].copy(), a[:, 1].copy(), a[:, 2].copy())


def result_set(ids: np.ndarray) -> list[tuple[int, ...]]:
    return [tuple(int(x) for x in col) for col in ids.T]


stream_tuples = st.lists(
    st.tuples(st.integers(0, 3), st.integers(0, 40)),  # (key, ts); ids assigned by position
    max_size=25,
)


@settings(max_examples=150, deadline=None)
@given(
    m=st.integers(2, 3),
    data=st.data(),
    window=st.integers(0, 12),
    batches=st.integers(1, 4),
)
def test_incremental_join_equals_brute_force_when_nothing_is_late(
    m: int, data: st.DataObject, window: int, batches: int
) -> None:
    raw = [data.draw(stream_tuples) for _ in range(m)]
    streams = [[(i, k, t) for i, (k, t) in enumerate(s)] for s in raw]
    # Arbitrary (out-of-order) arrival, split into batches at arbitrary points.
    cuts = [
        sorted(data.draw(st.lists(st.integers(0, len(s)), min_size=batches - 1, max_size=batches - 1)))
        for s in streams
    ]
    state = WindowState.empty(m)
    produced: list[tuple[int, ...]] = []
    for b in range(batches):
        new = []
        for j, s in enumerate(streams):
            bounds = [0, *cuts[j], len(s)]
            new.append(as_part(s[bounds[b] : bounds[b + 1]]))
        # An allowed lateness that covers every possible disorder: nothing is late.
        out = join_step(state, new, window, allowed_lateness_ms=100)
        assert all(len(p) == 0 for p in out.late)
        produced += result_set(out.results.ids)
        state = window_from_bytes(window_to_bytes(out.state))
    assert sorted(produced) == sorted(brute_force(streams, window))
    assert len(produced) == len(set(produced)), "a result was produced twice"


def test_ties_at_exactly_w_join_and_beyond_w_do_not() -> None:
    a = as_part([(0, 7, 100), (1, 7, 111)])
    b = as_part([(0, 7, 110)])
    assert sorted(result_set(join_parts([a, b], 10).ids)) == [(0, 0), (1, 0)]  # |100-110| = 10 = W
    assert result_set(join_parts([a, b], 9).ids) == [(1, 0)]


def test_late_tuples_are_reported_not_joined() -> None:
    state = WindowState.empty(2)
    out = join_step(state, [as_part([(0, 1, 1000)]), as_part([])], window_ms=50, allowed_lateness_ms=10)
    assert out.state.watermark == 990
    late_b = as_part([(5, 1, 989), (6, 1, 990)])
    out2 = join_step(out.state, [as_part([]), late_b], window_ms=50, allowed_lateness_ms=10)
    assert result_set(out2.results.ids) == [(0, 6)]
    assert out2.late[1].ids.tolist() == [5]


def test_purge_keeps_exactly_what_future_tuples_can_match() -> None:
    state = WindowState.empty(2)
    out = join_step(state, [as_part([(0, 1, 0), (1, 1, 50), (2, 1, 100)]), as_part([])], 30, 20)
    # watermark = 100 - 20 = 80; keep ts >= 80 - 30 = 50
    assert out.state.parts[0].ts.tolist() == [50, 100]
    assert NO_WATERMARK < out.state.watermark == 80
