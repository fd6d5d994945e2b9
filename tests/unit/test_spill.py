"""Spilling and clean-up (`pipeline.spill`) through the operator's own per-pid function, against a
brute-force join of the tuples the lateness rule calls on time: a pid that spills and is cleaned up
later, or whose owner dies while it is spilled and is recovered elsewhere, emits every result once."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pandas as pd
from hypothesis import given, settings
from hypothesis import strategies as st

from pipeline.codec import decode_results
from pipeline.join import PROGRESS_ID
from pipeline.operator import KIND_CLEANED, KIND_LATE, KIND_RESULT, make_join_function
from pipeline.rows import CROSS_ROW, DROP_ROW, SPILL_ROW, WINDOW_ROW, cross_row
from pipeline.spill import SpillChoice, batch_room, choose_spills, old_generation_gone
from tests.unit.test_join import Tuple3, brute_force, late_by_the_rule, with_progress

PID = 7


class StateStore:
    """Spark's per-group state handle, as the operator uses it: one blob per pid."""

    def __init__(self) -> None:
        self.blob: bytes | None = None

    @property
    def exists(self) -> bool:
        return self.blob is not None

    @property
    def get(self) -> tuple[bytes]:
        assert self.blob is not None
        return (self.blob,)

    def update(self, value: tuple[bytes]) -> None:
        self.blob = value[0]

    def remove(self) -> None:
        self.blob = None


def rows(parts: list[list[Tuple3]], code: int = 0, markers: tuple[int, ...] = ()) -> pd.DataFrame:
    """One batch's rows of the pid: stream j's tuples under `code + j`, then marker rows."""
    out: list[tuple[int, int, int, int, int]] = []
    for j, part in enumerate(parts):
        out += [(PID, code + j, i, k, t) for i, k, t in part]
    out += [(PID, m, 0, 0, 0) for m in markers]
    return pd.DataFrame(out, columns=["pid", "stream", "id", "key", "ts"])


class Instance:
    """One instance's run of the pid: each batch through the operator, its output collected."""

    def __init__(self, m: int, window: int, lateness: int) -> None:
        self.join = make_join_function(m, window, lateness)
        self.state = StateStore()
        self.results: list[tuple[int, ...]] = []
        self.late: list[set[int]] = [set() for _ in range(m)]
        self.cleaned = 0

    def batch(self, frame: pd.DataFrame) -> None:
        for out in self.join((PID,), iter([frame]), self.state):
            kinds = out["kind"].to_numpy()
            for payload in out["payload"][kinds == KIND_RESULT]:
                ids = decode_results(payload).ids
                self.results += [tuple(int(x) for x in col) for col in ids.T]
            late = out[kinds == KIND_LATE]
            for j, i in zip(late["aux"], late["id0"], strict=True):
                self.late[int(j)].add(int(i))
            self.cleaned += int((kinds == KIND_CLEANED).sum())


def _slices(streams: list[list[Tuple3]], bounds: list[list[int]], b: int) -> list[list[Tuple3]]:
    return [s[bs[b] : bs[b + 1]] for s, bs in zip(streams, bounds, strict=True)]


def _streams(data: st.DataObject, m: int) -> list[list[Tuple3]]:
    raw = [data.draw(with_progress) for _ in range(m)]
    return [[(PROGRESS_ID if progress else i, k, t) for i, (k, t, progress) in enumerate(s)] for s in raw]


def _expected(streams: list[list[Tuple3]], window: int, lateness: int) -> tuple[list, list[set[int]]]:
    late = [late_by_the_rule(s, lateness) for s in streams]
    on_time = [[x for x in s if x[0] != PROGRESS_ID and x[0] not in late[j]] for j, s in enumerate(streams)]
    return sorted(brute_force(on_time, window)), late


def _points(data: st.DataObject, streams: list[list[Tuple3]], n: int) -> list[list[int]]:
    """Per stream, 0 = p_0 <= p_1 <= ... <= p_n <= len: where each of n + 1 phases begins, and the end."""
    return [
        [0, *sorted(data.draw(st.lists(st.integers(0, len(s)), min_size=n, max_size=n))), len(s)]
        for s in streams
    ]


def _spilled_run(
    one: Instance, streams: list[list[Tuple3]], at: list[list[int]], spills: int
) -> tuple[list[int], ...]:
    """Phases 0 .. 2 * spills: a batch before the first spill, then per spill the batch that spills
    (its input the first of a new generation) and one more batch. The spill points, per stream."""
    one.batch(rows(_slices(streams, at, 0)))
    for i in range(spills):
        one.batch(rows(_slices(streams, at, 2 * i + 1), markers=(SPILL_ROW,)))
        one.batch(rows(_slices(streams, at, 2 * i + 2)))
    return tuple([bounds[2 * i + 1] for bounds in at] for i in range(spills))


def _rebuilt(
    streams: list[list[Tuple3]], points: tuple[list[int], ...], to: list[int], markers: tuple[int, ...]
) -> list[pd.DataFrame]:
    """The rows that rebuild a spilled pid: the window at the first spill point, then each later
    generation, up to `to`, under its own codes."""
    ends = [*points[1:], to]
    out = [rows([s[:c] for s, c in zip(streams, points[0], strict=True)], WINDOW_ROW, markers=markers)]
    for g, (begin, end) in enumerate(zip(points, ends, strict=True)):
        out.append(rows([s[b:e] for s, b, e in zip(streams, begin, end, strict=True)], cross_row(g, 0)))
    return out


def spilled_runs(test: Callable[..., None]) -> Callable[..., None]:
    """300 runs of `test` over 2- and 3-way joins, windows and lateness up to a few time units, and one
    to three spills."""
    runs = given(
        m=st.integers(2, 3),
        data=st.data(),
        window=st.integers(0, 12),
        lateness=st.integers(0, 8),
        spills=st.integers(1, 3),
    )
    return settings(max_examples=300, deadline=None)(runs(test))


@spilled_runs
def test_a_spilled_pid_cleaned_up_later_emits_every_result_once(
    m: int, data: st.DataObject, window: int, lateness: int, spills: int
) -> None:
    """A pid spills `spills` times (each time its newest generation leaves memory), then its clean-up
    batch rebuilds the window at the first spill point, re-reads each later generation up to where the
    batch begins, then reads the batch's own input; then the batches after."""
    streams = _streams(data, m)
    expected, late = _expected(streams, window, lateness)
    at = _points(data, streams, 2 * spills + 2)
    one = Instance(m, window, lateness)
    points = _spilled_run(one, streams, at, spills)
    begin = [bounds[2 * spills + 1] for bounds in at]
    rebuilt = _rebuilt(streams, points, begin, (DROP_ROW,))
    one.batch(pd.concat([*rebuilt, rows(_slices(streams, at, 2 * spills + 1))], ignore_index=True))
    one.batch(rows(_slices(streams, at, 2 * spills + 2)))
    assert sorted(one.results) == expected
    assert one.late == late, "late tuples are reported once, by the new generation"
    assert len(one.results) == len(set(one.results)), "a result was produced twice"


@spilled_runs
def test_a_spilled_pid_whose_owner_dies_is_recovered_whole_from_its_spill_point(
    m: int, data: st.DataObject, window: int, lateness: int, spills: int
) -> None:
    """The owner spills `spills` times, commits batches of the newest generation, and dies; the
    receiver rebuilds the window at the first spill point, re-reads each later generation up to the
    dead owner's last commit joined with the ones before it only (`Handoff.spilled`), and reads on."""
    streams = _streams(data, m)
    expected, late = _expected(streams, window, lateness)
    at = _points(data, streams, 2 * spills + 1)  # the last phase: after the cutoff (the last commit)
    dead = Instance(m, window, lateness)
    points = _spilled_run(dead, streams, at, spills)
    cutoff = [bounds[2 * spills + 1] for bounds in at]
    receiver = Instance(m, window, lateness)
    rebuilt = _rebuilt(streams, points, cutoff, ())
    receiver.batch(pd.concat([*rebuilt, rows(_slices(streams, at, 2 * spills + 1))], ignore_index=True))
    everything = dead.results + receiver.results
    assert sorted(everything) == expected
    assert [a | b for a, b in zip(dead.late, receiver.late, strict=True)] == late


def test_without_its_clean_up_a_spilled_pid_misses_exactly_the_results_spanning_the_generations() -> None:
    """The failure the clean-up mends, pinned: A's tuple before the spill and B's after it join, and
    only the clean-up makes that result."""
    streams = [[(0, 1, 10), (1, 1, 11)], [(0, 1, 12)]]
    one = Instance(2, 5, 0)
    one.batch(rows([streams[0][:1], []]))
    one.batch(rows([streams[0][1:], streams[1]], markers=(SPILL_ROW,)))
    assert one.results == [(1, 0)], "the new generation joins only with itself: A1 x B0, not A0 x B0"
    one.batch(
        pd.concat(
            [
                rows([streams[0][:1], []], WINDOW_ROW, markers=(DROP_ROW,)),
                rows([streams[0][1:], streams[1]], CROSS_ROW),
            ],
            ignore_index=True,
        )
    )
    assert sorted(one.results) == [(0, 0), (1, 0)], "A0 x B0, which spans the generations, once"
    assert one.cleaned == 1


def test_the_least_productive_pids_spill_first_until_about_the_fraction() -> None:
    held = {1: 400, 2: 300, 3: 200, 4: 100}
    results = {1: 4000, 2: 30, 3: 0, 4: 1000}
    args: dict[str, Any] = {"budget": 1000, "threshold": 0.9, "fraction": 0.3}
    assert choose_spills(
        held, results, candidates=[1, 2, 3, 4], choice=SpillChoice.LEAST_PRODUCTIVE, **args
    ) == [
        3,
        2,
    ]
    assert choose_spills(
        held, results, candidates=[1, 2, 3, 4], choice=SpillChoice.MOST_PRODUCTIVE, **args
    ) == [1]
    tied = choose_spills(held, results, candidates=[1, 4], choice=SpillChoice.LEAST_PRODUCTIVE, **args)
    assert tied == [1], "equally productive: by pid, and pid 1 alone frees the fraction"
    under = {**args, "budget": 1200}
    assert (
        choose_spills(held, results, candidates=[1, 2, 3, 4], choice=SpillChoice.LEAST_PRODUCTIVE, **under)
        == []
    )
    off = {**args, "threshold": 0.0}
    assert (
        choose_spills(held, results, candidates=[1, 2, 3, 4], choice=SpillChoice.LEAST_PRODUCTIVE, **off)
        == []
    )


def test_the_next_batch_reads_what_the_budget_leaves_once_the_chosen_pids_have_spilled() -> None:
    held = {1: 400, 2: 300, 3: 200, 4: 100}
    assert batch_room(held, [], budget=1_500, bytes_per_tuple=25) == 20, "500 bytes left: 20 tuples"
    assert batch_room(held, [1, 3], budget=1_000, bytes_per_tuple=24) == 25, "600 bytes spilled"
    assert batch_room(held, [4], budget=800, bytes_per_tuple=24) == 0, "over the budget: nothing"


def test_windows_far_over_the_threshold_spill_down_to_it_at_once() -> None:
    """A budget cut to half of what the windows hold: 30% would leave them over it, so the spill
    frees what takes them under the threshold."""
    held = {1: 400, 2: 300, 3: 200, 4: 100}
    chosen = choose_spills(
        held,
        {},
        budget=500,
        threshold=0.9,
        fraction=0.3,
        choice=SpillChoice.LEAST_PRODUCTIVE,
        candidates=[1, 2, 3, 4],
    )
    assert chosen == [1, 2], "550 bytes freed: 450 left, at the threshold of 500"
    ahead = choose_spills(
        {1: 100, 2: 100, 3: 100},
        {},
        budget=1000,
        threshold=0.5,
        fraction=0.3,
        choice=SpillChoice.LEAST_PRODUCTIVE,
        candidates=[1, 2, 3],
        incoming=350,
    )
    assert ahead == [1, 2], "300 held and 350 to come: 150 must go, and two whole pids free 200"


def test_the_old_generation_is_gone_once_every_stream_has_moved_past_it_by_the_window() -> None:
    # W = 10, lateness 2: a tuple of stream 0 stays while ts >= stream_max[1] - 2 - 10
    assert not old_generation_gone([100, 100], [110, 112], 10, 2)
    assert not old_generation_gone([100, 100], [200, 112], 10, 2), "stream 1 keeps stream 0's old tuples"
    assert old_generation_gone([100, 100], [113, 113], 10, 2)
    no_tuple = int(np.iinfo(np.int64).min)
    assert old_generation_gone([no_tuple, 100], [113, 50], 10, 2), "a stream with no old tuple holds none"
    assert not old_generation_gone([100, 100], [113, 50], 10, 2)
