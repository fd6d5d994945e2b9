"""The join kernel against a brute-force reference, over batches split arbitrarily."""

from __future__ import annotations

import itertools

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from pipeline.join import (
    PROGRESS_ID,
    Part,
    StepOutput,
    WindowState,
    begin_new_track,
    begin_old_track,
    join_bounded,
    join_parts,
    join_step,
    key_combinations,
    merge_size,
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


def step_results(out: StepOutput) -> list[tuple[int, ...]]:
    return [r for chunk in out.results for r in result_set(chunk.ids)]


stream_tuples = st.lists(
    st.tuples(st.integers(0, 3), st.integers(0, 40)),  # (key, ts); ids assigned by position
    max_size=25,
)


def _run(
    state: WindowState,
    streams: list[list[Tuple3]],
    cuts: list[list[int]],
    window: int,
    lateness: int,
    chunk: int = 1_000_000,
):
    """Feed `streams` in batches cut at `cuts`, results in chunks of `chunk`; returns the final state,
    results and late ids."""
    produced: list[tuple[int, ...]] = []
    late: list[set[int]] = [set() for _ in streams]
    batches = len(cuts[0]) + 1
    for b in range(batches):
        new = []
        for j, s in enumerate(streams):
            bounds = [0, *cuts[j], len(s)]
            new.append(as_part(s[bounds[b] : bounds[b + 1]]))
        out = join_step(state, new, window, lateness, chunk)
        chunks = list(out.results)
        assert all(len(c) <= chunk for c in chunks)
        produced += [r for c in chunks for r in result_set(c.ids)]
        for j, p in enumerate(out.late):
            late[j] |= set(p.ids.tolist())
        state = window_from_bytes(window_to_bytes(out.state))
    return state, produced, late


@settings(max_examples=150, deadline=None)
@given(
    m=st.integers(2, 3),
    data=st.data(),
    window=st.integers(0, 12),
    batches=st.integers(1, 4),
    chunk=st.sampled_from([1, 2, 5, 1_000_000]),
)
def test_incremental_join_equals_brute_force_when_nothing_is_late(
    m: int, data: st.DataObject, window: int, batches: int, chunk: int
) -> None:
    raw = [data.draw(stream_tuples) for _ in range(m)]
    streams = [[(i, k, t) for i, (k, t) in enumerate(s)] for s in raw]
    # Arbitrary (out-of-order) arrival, split into batches at arbitrary points.
    cuts = [
        sorted(data.draw(st.lists(st.integers(0, len(s)), min_size=batches - 1, max_size=batches - 1)))
        for s in streams
    ]
    # An allowed lateness that covers every possible disorder: nothing is late.
    _, produced, late = _run(WindowState.empty(m), streams, cuts, window, lateness=100, chunk=chunk)
    assert all(not ids for ids in late)
    assert sorted(produced) == sorted(brute_force(streams, window))
    assert len(produced) == len(set(produced)), "a result was produced twice"


def test_ties_at_exactly_w_join_and_beyond_w_do_not() -> None:
    a = as_part([(0, 7, 100), (1, 7, 111)])
    b = as_part([(0, 7, 110)])
    assert sorted(result_set(join_parts([a, b], 10).ids)) == [(0, 0), (1, 0)]  # |100-110| = 10 = W
    assert result_set(join_parts([a, b], 9).ids) == [(1, 0)]


def test_late_tuples_are_reported_not_joined() -> None:
    state = WindowState.empty(2)
    out = join_step(
        state, [as_part([(0, 1, 1000)]), as_part([(9, 1, 995)])], window_ms=50, allowed_lateness_ms=10
    )
    assert out.state.stream_max == (1000, 995)
    late_a = as_part([(5, 1, 989), (6, 1, 990)])
    out2 = join_step(out.state, [late_a, as_part([])], window_ms=50, allowed_lateness_ms=10)
    assert step_results(out2) == [(6, 9)]
    assert out2.late[0].ids.tolist() == [5]


def test_a_stream_is_never_late_because_another_stream_is_ahead() -> None:
    """B arrives 60 s of event time behind A, as after an uneven catch-up: none of B is late."""
    ahead = join_step(WindowState.empty(2), [as_part([(0, 1, 60_000)]), as_part([])], 1_000, 2_000)
    behind = join_step(ahead.state, [as_part([]), as_part([(0, 1, 100), (1, 1, 59_500)])], 1_000, 2_000)
    assert not any(len(p) for p in behind.late)
    assert step_results(behind) == [(0, 1)]


def test_purge_keeps_exactly_what_future_tuples_can_match() -> None:
    state = WindowState.empty(2)
    out = join_step(state, [as_part([(0, 1, 0), (1, 1, 50), (2, 1, 100)]), as_part([(0, 1, 100)])], 30, 20)
    # B can still bring ts >= 100 - 20 = 80, so A keeps ts >= 80 - 30 = 50; A's own tuples do not purge A
    assert out.state.parts[0].ts.tolist() == [50, 100]
    assert out.state.parts[1].ts.tolist() == [100]


def test_a_progress_record_raises_its_stream_and_purges_the_others() -> None:
    a = as_part([(0, 1, 0), (1, 1, 100)])
    silent_b = as_part([(PROGRESS_ID, 0, 100)])
    out = join_step(WindowState.empty(2), [a, silent_b], 30, 20)
    assert out.state.parts[0].ts.tolist() == [100] and len(out.state.parts[1]) == 0
    assert out.state.stream_max == (100, 100) and not step_results(out)
    late_b = join_step(out.state, [as_part([]), as_part([(3, 1, 79)])], 30, 20)
    assert late_b.late[1].ids.tolist() == [3], "after the progress record at 100, 79 is late"


def late_by_the_rule(stream: list[Tuple3], lateness: int) -> set[int]:
    """A partition's late tuple ids, straight from the rule: below the largest earlier event time minus
    the lateness (progress records, id PROGRESS_ID, count and are never late)."""
    late, newest = set(), None
    for i, _, t in stream:
        if i != PROGRESS_ID and newest is not None and t < newest - lateness:
            late.add(i)
        newest = t if newest is None else max(newest, t)
    return late


with_progress = st.lists(
    st.tuples(st.integers(0, 3), st.integers(0, 60), st.booleans()),  # (key, ts, is a progress record)
    max_size=25,
)


@settings(max_examples=300, deadline=None)
@given(
    m=st.integers(2, 3),
    data=st.data(),
    window=st.integers(0, 12),
    lateness=st.integers(0, 8),
    batches=st.integers(1, 5),
)
def test_output_and_late_set_depend_on_the_input_alone(
    m: int, data: st.DataObject, window: int, lateness: int, batches: int
) -> None:
    """Any split of the streams into micro-batches, each stream cut on its own (every interleaving of the
    streams' reads), gives the join of the tuples the rule calls on time, and reports exactly the late."""
    raw = [data.draw(with_progress) for _ in range(m)]
    streams = [[(PROGRESS_ID if progress else i, k, t) for i, (k, t, progress) in enumerate(s)] for s in raw]
    late = [late_by_the_rule(s, lateness) for s in streams]
    on_time = [[x for x in s if x[0] != PROGRESS_ID and x[0] not in late[j]] for j, s in enumerate(streams)]
    expected = sorted(brute_force(on_time, window))
    for _ in range(2):
        cuts = [
            sorted(data.draw(st.lists(st.integers(0, len(s)), min_size=batches - 1, max_size=batches - 1)))
            for s in streams
        ]
        _, produced, reported = _run(WindowState.empty(m), streams, cuts, window, lateness)
        assert sorted(produced) == expected
        assert reported == late


@settings(max_examples=300, deadline=None)
@given(
    m=st.integers(2, 3),
    data=st.data(),
    window=st.integers(0, 12),
    lateness=st.integers(0, 6),
)
def test_parallel_track_sender_and_receiver_emit_disjoint_complete_results(
    m: int, data: st.DataObject, window: int, lateness: int
) -> None:
    """Before the cutoff one instance runs the pid; after it, the sender (old window) and the receiver
    (empty) both read the rest in different micro-batches. Together, and with what came before, they emit
    exactly the join of every tuple nobody reported late, and they agree on which tuples are late."""
    raw = [data.draw(stream_tuples) for _ in range(m)]
    streams = [[(i, k, t) for i, (k, t) in enumerate(s)] for s in raw]
    cutoff = [data.draw(st.integers(0, len(s))) for s in streams]
    before = [s[:c] for s, c in zip(streams, cutoff, strict=True)]
    after = [s[c:] for s, c in zip(streams, cutoff, strict=True)]

    def draw_cuts(parts: list[list[Tuple3]], n: int) -> list[list[int]]:
        return [sorted(data.draw(st.lists(st.integers(0, len(p)), min_size=n, max_size=n))) for p in parts]

    sender, produced, late = _run(WindowState.empty(m), before, draw_cuts(before, 2), window, lateness)
    sender = begin_old_track(sender)
    receiver = begin_new_track(sender.stream_max)
    sender, from_sender, sender_late = _run(sender, after, draw_cuts(after, 3), window, lateness)
    receiver, from_receiver, receiver_late = _run(receiver, after, draw_cuts(after, 2), window, lateness)
    assert all(not s for s in sender_late), "only the receiver reports"

    kept = [[t for t in s if t[0] not in late[j] | receiver_late[j]] for j, s in enumerate(streams)]
    everything = produced + from_sender + from_receiver
    assert sorted(everything) == sorted(brute_force(kept, window))
    assert len(everything) == len(set(everything)), "a result was produced twice"
    assert receiver.old is None and sender.old is not None
    if receiver.old_max is None:
        assert sender.old_tuples == 0, "the receiver ended its overlap while the sender held old tuples"


def test_sender_lets_go_once_every_stream_passed_its_old_tuples() -> None:
    out = join_step(WindowState.empty(2), [as_part([(0, 1, 100)]), as_part([(0, 1, 100)])], 10, 5)
    sender = begin_old_track(out.state)
    assert sender.old_tuples == 2
    only_a = join_step(sender, [as_part([(1, 1, 200)]), as_part([])], 10, 5)
    assert only_a.state.old == (1, 0), "B may still bring partners of A's 100; A can no longer bring B's"
    both = join_step(only_a.state, [as_part([]), as_part([(1, 1, 200)])], 10, 5)
    assert both.state.old_tuples == 0
    receiver = begin_new_track(sender.stream_max)
    assert receiver.old_max == (100, 100)
    receiver = join_step(receiver, [as_part([(1, 1, 200)]), as_part([(1, 1, 112)])], 10, 5).state
    assert receiver.old_max == (100, 100), "B's threshold 107 is within W of an old tuple at 100"
    receiver = join_step(receiver, [as_part([]), as_part([(2, 1, 200)])], 10, 5).state
    assert receiver.old_max is None
    assert window_from_bytes(window_to_bytes(receiver)) == receiver


def test_a_hot_keys_results_come_out_in_bounded_chunks_and_all_of_them() -> None:
    """One key, 1,000 tuples in each stream, all within W: a million results, none of the chunks (nor
    the merges making them) over the bound."""
    n = 1_000
    a = Part(np.arange(n, dtype=np.int64), np.zeros(n, dtype=np.int64), np.arange(n, dtype=np.int64))
    b = Part(np.arange(n, dtype=np.int64), np.zeros(n, dtype=np.int64), np.arange(n, dtype=np.int64))
    out = join_step(WindowState.empty(2), [a, b], window_ms=10_000, allowed_lateness_ms=0, chunk=50_000)
    sizes = [len(c) for c in out.results]
    assert max(sizes) <= 50_000
    assert sum(sizes) == n * n


def test_the_merge_size_counts_a_merge_that_a_later_part_empties() -> None:
    """Key 1 is in the two small parts 100 x 100 times but not in the third: the first merge still
    holds 10,000 rows, which the bound must count although no result has key 1."""
    ones = as_part([(i, 1, 0) for i in range(100)])
    other = as_part([(i, 2, 0) for i in range(200)])
    assert merge_size([ones, ones, other]) == 10_000
    assert list(join_bounded([ones, ones, other], 10, chunk=5_000)) == []


@settings(max_examples=200, deadline=None)
@given(m=st.integers(2, 3), data=st.data(), window=st.integers(0, 12))
def test_key_combinations_bound_the_results_of_tuples_among_themselves(m: int, data, window: int) -> None:
    streams = [[(i, k, t) for i, (k, t) in enumerate(data.draw(stream_tuples))] for _ in range(m)]
    bound = key_combinations([as_part(s) for s in streams], window)
    assert bound >= len(brute_force(streams, window))
    plain = sum(1 for c in itertools.product(*streams) if len({t[1] for t in c}) == 1)
    assert bound <= plain, "never above the count from the keys alone"


def test_key_combinations_of_a_hot_key_within_w_are_exact_and_of_a_long_backlog_near_the_results() -> None:
    hot = as_part([(i, 7, i) for i in range(100)])
    assert key_combinations([hot, hot], window_ms=1_000) == 100 * 100
    # 100 windows of W = 10: each tuple of A meets the 21 of B within 10 of it (fewer at the ends).
    a = as_part([(i, 7, i) for i in range(1_000)])
    results = len(brute_force([[(i, 7, i) for i in range(1_000)]] * 2, 10))
    bound = key_combinations([a, a], window_ms=10)
    assert results <= bound <= 3 * results, (results, bound)
    assert bound < 1_000 * 1_000 / 20, "the keys alone would count every pair of the backlog"
