"""The oracle's chunked join and multiset comparison, against brute force."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from pipeline.oracle import compare, expected_join
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
