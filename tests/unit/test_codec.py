"""Wire formats: everything encoded decodes to the same columns; anything else is MalformedRecord."""

from __future__ import annotations

import struct

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from pipeline.codec import (
    HEADER_BYTES,
    KIND_RESULTS,
    KIND_TUPLES,
    VERSION,
    MalformedRecord,
    decode_results,
    decode_tuple_columns,
    decode_tuples,
    encode_results,
    encode_tuples,
)

i64 = st.integers(min_value=-(2**63), max_value=2**63 - 1)


@st.composite
def tuple_batches(draw: st.DrawFn) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    n = draw(st.integers(min_value=0, max_value=40))
    payload_len = draw(st.integers(min_value=0, max_value=24))
    cols = [np.array(draw(st.lists(i64, min_size=n, max_size=n)), dtype=np.int64) for _ in range(3)]
    raw = draw(st.binary(min_size=n * payload_len, max_size=n * payload_len))
    payload = np.frombuffer(raw, dtype=np.uint8).reshape(n, payload_len)
    return cols[0], cols[1], cols[2], payload


@given(tuple_batches())
def test_tuple_round_trip(batch: tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]) -> None:
    ids, keys, times, payload = batch
    buf = encode_tuples(ids, keys, times, payload)
    assert len(buf) == HEADER_BYTES + len(ids) * (24 + payload.shape[1])
    out = decode_tuples(buf)
    assert len(out) == len(ids)
    np.testing.assert_array_equal(out.ids, ids)
    np.testing.assert_array_equal(out.keys, keys)
    np.testing.assert_array_equal(out.event_times, times)
    np.testing.assert_array_equal(out.payload, payload)
    assert out.payload.shape == payload.shape
    c_ids, c_keys, c_times = decode_tuple_columns(buf)
    np.testing.assert_array_equal(c_ids, ids)
    np.testing.assert_array_equal(c_keys, keys)
    np.testing.assert_array_equal(c_times, times)


@given(
    m=st.integers(min_value=1, max_value=8),
    rows=st.lists(st.lists(i64, min_size=10, max_size=10), min_size=0, max_size=20),
)
def test_result_round_trip(m: int, rows: list[list[int]]) -> None:
    n = len(rows)
    table = np.array(rows, dtype=np.int64).reshape(n, 10)
    ids = np.ascontiguousarray(table[:, :m].T)
    keys, max_times = table[:, 8].copy(), table[:, 9].copy()
    out = decode_results(encode_results(ids, keys, max_times))
    assert len(out) == n
    assert out.ids.shape == (m, n)
    np.testing.assert_array_equal(out.ids, ids)
    np.testing.assert_array_equal(out.keys, keys)
    np.testing.assert_array_equal(out.max_event_times, max_times)


def _valid_tuples(n: int = 3, payload_len: int = 4) -> bytes:
    ids = np.arange(n, dtype=np.int64)
    return encode_tuples(ids, ids * 7, ids + 1000, np.full((n, payload_len), 9, dtype=np.uint8))


@given(tuple_batches(), st.data())
def test_every_truncation_is_malformed(
    batch: tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray], data: st.DataObject
) -> None:
    buf = encode_tuples(*batch)
    cut = data.draw(st.integers(min_value=0, max_value=len(buf) - 1))
    with pytest.raises(MalformedRecord):
        decode_tuples(buf[:cut])
    with pytest.raises(MalformedRecord):
        decode_tuple_columns(buf[:cut])


@pytest.mark.parametrize(
    ("buf", "reason"),
    [
        pytest.param(b"", "header", id="empty"),
        pytest.param(_valid_tuples()[: HEADER_BYTES - 1], "header", id="truncated-header"),
        pytest.param(_valid_tuples()[:-1], "length", id="truncated-body"),
        pytest.param(_valid_tuples() + b"\x00", "length", id="trailing-byte"),
        pytest.param(bytes([VERSION + 1]) + _valid_tuples()[1:], "version", id="bad-version"),
        pytest.param(struct.pack("<BBxxII4x", VERSION, 7, 0, 0), "kind", id="unknown-kind"),
        pytest.param(
            encode_results(np.zeros((2, 1), np.int64), np.zeros(1, np.int64), np.zeros(1, np.int64)),
            "kind",
            id="results-as-tuples",
        ),
        pytest.param(struct.pack("<BBxxII4x", VERSION, KIND_TUPLES, 2**31, 0), "length", id="huge-count"),
    ],
)
def test_malformed_tuples_say_why(buf: bytes, reason: str) -> None:
    with pytest.raises(MalformedRecord, match=reason):
        decode_tuples(buf)
    with pytest.raises(MalformedRecord, match=reason):
        decode_tuple_columns(buf)


@pytest.mark.parametrize(
    ("buf", "reason"),
    [
        pytest.param(b"\x01", "header", id="truncated-header"),
        pytest.param(_valid_tuples(), "kind", id="tuples-as-results"),
        pytest.param(struct.pack("<BBxxII4x", 9, KIND_RESULTS, 0, 2), "version", id="bad-version"),
        pytest.param(
            struct.pack("<BBxxII4x", VERSION, KIND_RESULTS, 1, 2) + b"\x00" * 8, "length", id="short"
        ),
    ],
)
def test_malformed_results_say_why(buf: bytes, reason: str) -> None:
    with pytest.raises(MalformedRecord, match=reason):
        decode_results(buf)


def test_malformed_record_is_a_value_error() -> None:
    # Consumers route ValueErrors from decoding to the dead-letter topic.
    assert issubclass(MalformedRecord, ValueError)


def test_tuple_count_reads_the_header_only() -> None:
    from pipeline.codec import tuple_count

    ids = np.arange(7, dtype=np.int64)
    buf = encode_tuples(ids, ids, ids, np.zeros((7, 3), dtype=np.uint8))
    assert tuple_count(buf) == 7
    with pytest.raises(MalformedRecord):
        tuple_count(buf[:5])
