"""The oracle's chunked join, its multiset comparison and its check bucket by bucket, against brute
force and against comparing everything at once."""

from __future__ import annotations

from collections import Counter

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from pipeline.join import Results
from pipeline.oracle import check, compare, expected_join, missing_by_pid, split_results
from pipeline.partitioning import pids_of
from tests.unit.test_join import as_part, brute_force, result_set


@settings(max_examples=100, deadline=None)
@given(
    raw=st.lists(
        st.lists(st.tuples(st.integers(0, 3), st.integers(0, 60)), max_size=30), min_size=2, max_size=3
    ),
    window=st.integers(0, 15),
    chunk=st.integers(1, 10),
)
def test_chunked_oracle_equals_brute_force(raw: list[list[tuple[int, int]]], window: int, chunk: int) -> None:
    streams = [[(i, k, t) for i, (k, t) in enumerate(s)] for s in raw]
    got = expected_join([as_part(s) for s in streams], window, chunk=chunk)
    assert sorted(result_set(got.ids)) == sorted(brute_force(streams, window))


def test_compare_counts_missing_duplicate_and_spurious() -> None:
    expected = np.array([[1, 2, 3, 4], [10, 20, 30, 40]])
    produced = np.array([[1, 2, 2, 5, 5], [10, 20, 20, 50, 50]])
    assert compare(expected, produced) == (2, 1, 2)
    assert compare(expected, expected) == (0, 0, 0)
    empty = np.empty((2, 0), dtype=np.int64)
    assert compare(expected, empty) == (4, 0, 0)
    assert compare(empty, empty) == (0, 0, 0)


@settings(max_examples=200, deadline=None)
@given(
    m=st.integers(2, 3),
    expected=st.lists(st.tuples(st.integers(0, 19), st.integers(0, 3), st.integers(0, 3)), max_size=25),
    produced=st.lists(st.tuples(st.integers(0, 19), st.integers(0, 3), st.integers(0, 3)), max_size=25),
)
def test_compare_equals_counting_by_hand(
    m: int, expected: list[tuple[int, int, int]], produced: list[tuple[int, int, int]]
) -> None:
    e, p = Counter(r[:m] for r in expected), Counter(r[:m] for r in produced)
    by_hand = (
        sum((e - p).values()),
        sum(n for row, n in (p - e).items() if row in e),
        sum(n for row, n in p.items() if row not in e),
    )

    def columns(rows: list[tuple[int, int, int]]) -> np.ndarray:
        return np.array([r[:m] for r in rows], dtype=np.int64).reshape(-1, m).T

    assert compare(columns(expected), columns(produced)) == by_hand


def test_missing_results_are_counted_by_the_pid_of_their_key() -> None:
    keys = np.array([3, 4, 5, 6], dtype=np.int64)
    pids = pids_of(keys, 8)
    expected = Results(np.array([[1, 2, 3, 4], [10, 20, 30, 40]]), keys, np.zeros(4, np.int64))
    produced = np.array([[1, 3, 9], [10, 30, 90]])
    want: dict[int, int] = {}
    for p in pids[[1, 3]]:
        want[int(p)] = want.get(int(p), 0) + 1
    assert missing_by_pid(expected, produced, 8) == want
    assert missing_by_pid(expected, expected.ids, 8) == {}


@settings(max_examples=100, deadline=None)
@given(
    raw=st.lists(
        st.lists(st.tuples(st.integers(0, 40), st.integers(0, 30)), max_size=25), min_size=2, max_size=3
    ),
    window=st.integers(0, 10),
    picks=st.lists(st.integers(0, 10**6), max_size=40),
    spurious=st.integers(0, 3),
    batch=st.integers(1, 7),
)
def test_checking_bucket_by_bucket_equals_comparing_all_at_once(
    raw: list[list[tuple[int, int]]], window: int, picks: list[int], spurious: int, batch: int
) -> None:
    """Produced rows are drawn from the expected ones (some missed, some repeated) plus rows of ids
    no stream has, and arrive in batches; ids up to 24 fill every bucket."""
    partitions = 64
    parts = [as_part([(i, k, t) for i, (k, t) in enumerate(s)]) for s in raw]
    whole = expected_join(parts, window)
    n = len(whole)
    chosen = [p % n for p in picks] if n else []
    m = len(parts)
    ids = np.hstack([whole.ids[:, chosen], np.tile(np.arange(1000, 1000 + spurious), (m, 1))])
    batches = [ids[:, lo : lo + batch] for lo in range(0, ids.shape[1], batch)]
    got = check(parts, split_results(batches, m), window, partitions, lambda _: None)
    missing, duplicate, extra = compare(whole.ids, ids)
    assert (got.expected, got.missing, got.duplicate, got.spurious) == (n, missing, duplicate, extra)
    assert got.missing_by_pid == missing_by_pid(whole, ids, partitions)
