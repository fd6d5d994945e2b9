"""Wire formats of the input and results topics: columnar batches of fixed-width little-endian arrays.

Python-side decoding is the data plane's likely bottleneck, so a Kafka message carries many tuples
of one stream and one pid as whole columns that decode with `numpy.frombuffer` (no per-tuple work).

Tuple batch (input topics), version 1::

    u8 version | u8 kind=1 | 2 pad | u32 count n | u32 payload_len L | 4 pad     (16-byte header)
    i64[n] id | i64[n] key | i64[n] event_time_ms | u8[n*L] payload

Progress record (input topics), version 1: a partition's producer had no tuple to write, and says how far
its event time has come (the lateness rule counts it like a tuple's event time, decision 0047)::

    u8 version | u8 kind=3 | 2 pad | u32 0 | u32 0 | 4 pad | i64 event_time_ms

Result batch (results topic), version 1::

    u8 version | u8 kind=2 | 2 pad | u32 count n | u32 parts m | 4 pad
    i64[m*n] ids (part-major: all ids of stream 0, then stream 1, ...) | i64[n] key | i64[n] max_event_time_ms

A result is identified by the ids of its parts, one per stream in the configured stream order.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from enum import IntEnum

import numpy as np
import numpy.typing as npt

VERSION = 1
KIND_TUPLES = 1
KIND_RESULTS = 2
KIND_PROGRESS = 3
_HEADER = struct.Struct("<BBxxII4x")
HEADER_BYTES = _HEADER.size

I64 = npt.NDArray[np.int64]


class Malformation(IntEnum):
    """Why a record was rejected; travels as a small integer through Spark, as text to the dead letters."""

    TRUNCATED = 1
    UNKNOWN_VERSION = 2
    WRONG_KIND = 3
    WRONG_LENGTH = 4
    WRONG_PARTITION = 5
    NEGATIVE_ID = 6  # negative ids mark progress rows inside an instance


class MalformedRecord(ValueError):
    """A record that does not decode; the message says why (it goes to the dead-letter topic)."""

    def __init__(self, reason: Malformation, detail: str) -> None:
        super().__init__(detail)
        self.reason = reason


@dataclass(frozen=True, slots=True)
class TupleBatch:
    """Tuples of one stream: parallel columns."""

    ids: I64
    keys: I64
    event_times: I64
    payload: npt.NDArray[np.uint8]  # shape (n, payload_len)

    def __len__(self) -> int:
        return len(self.ids)


@dataclass(frozen=True, slots=True)
class ResultBatch:
    """Join results: `ids[j]` is the id column of part j (stream j in configured order)."""

    ids: npt.NDArray[np.int64]  # shape (m, n)
    keys: I64
    max_event_times: I64

    def __len__(self) -> int:
        return len(self.keys)


def encode_tuples(ids: I64, keys: I64, event_times: I64, payload: npt.NDArray[np.uint8]) -> bytes:
    n = len(ids)
    payload_len = payload.shape[1] if payload.ndim == 2 else 0
    return b"".join(
        (
            _HEADER.pack(VERSION, KIND_TUPLES, n, payload_len),
            np.ascontiguousarray(ids, dtype="<i8").tobytes(),
            np.ascontiguousarray(keys, dtype="<i8").tobytes(),
            np.ascontiguousarray(event_times, dtype="<i8").tobytes(),
            np.ascontiguousarray(payload, dtype=np.uint8).tobytes(),
        )
    )


def encode_progress(event_time_ms: int) -> bytes:
    return _HEADER.pack(VERSION, KIND_PROGRESS, 0, 0) + np.int64(event_time_ms).astype("<i8").tobytes()


def progress_of(buf: bytes | None) -> int | None:
    """The event time of a progress record; None for any other record (tuples or not decodable)."""
    if buf is None or len(buf) != HEADER_BYTES + 8 or buf[1] != KIND_PROGRESS:
        return None
    _header(buf, KIND_PROGRESS)
    return int(np.frombuffer(buf, dtype="<i8", count=1, offset=HEADER_BYTES)[0])


def _header(buf: bytes | None, kind: int) -> tuple[int, int]:
    if buf is None or len(buf) < HEADER_BYTES:
        raise MalformedRecord(Malformation.TRUNCATED, f"shorter than the {HEADER_BYTES}-byte header")
    version, got_kind, n, extra = _HEADER.unpack_from(buf)
    if version != VERSION:
        raise MalformedRecord(
            Malformation.UNKNOWN_VERSION, f"unknown schema version {version} (this build reads {VERSION})"
        )
    if got_kind != kind:
        raise MalformedRecord(Malformation.WRONG_KIND, f"record kind {got_kind}, expected {kind}")
    return n, extra


def tuple_count(buf: bytes) -> int:
    """How many tuples a tuple batch holds, from its header alone."""
    return _header(buf, KIND_TUPLES)[0]


def decode_tuples(buf: bytes) -> TupleBatch:
    n, payload_len = _header(buf, KIND_TUPLES)
    expected = HEADER_BYTES + n * (24 + payload_len)
    if len(buf) != expected:
        raise MalformedRecord(Malformation.WRONG_LENGTH, f"length {len(buf)} bytes, header says {expected}")
    cols = np.frombuffer(buf, dtype="<i8", count=3 * n, offset=HEADER_BYTES).reshape(3, n)
    payload = np.frombuffer(buf, dtype=np.uint8, offset=HEADER_BYTES + 24 * n).reshape(n, payload_len)
    return TupleBatch(cols[0], cols[1], cols[2], payload)


def decode_tuple_columns(buf: bytes | None) -> tuple[I64, I64, I64]:
    """ids, keys, event times without touching the payload (what the join needs)."""
    if buf is None:
        raise MalformedRecord(Malformation.TRUNCATED, "no value (a tombstone)")
    n, payload_len = _header(buf, KIND_TUPLES)
    expected = HEADER_BYTES + n * (24 + payload_len)
    if len(buf) != expected:
        raise MalformedRecord(Malformation.WRONG_LENGTH, f"length {len(buf)} bytes, header says {expected}")
    cols = np.frombuffer(buf, dtype="<i8", count=3 * n, offset=HEADER_BYTES).reshape(3, n)
    return cols[0], cols[1], cols[2]


def encode_results(ids: npt.NDArray[np.int64], keys: I64, max_event_times: I64) -> bytes:
    m, n = ids.shape
    return b"".join(
        (
            _HEADER.pack(VERSION, KIND_RESULTS, n, m),
            np.ascontiguousarray(ids, dtype="<i8").tobytes(),
            np.ascontiguousarray(keys, dtype="<i8").tobytes(),
            np.ascontiguousarray(max_event_times, dtype="<i8").tobytes(),
        )
    )


def decode_results(buf: bytes) -> ResultBatch:
    n, m = _header(buf, KIND_RESULTS)
    expected = HEADER_BYTES + 8 * n * (m + 2)
    if len(buf) != expected:
        raise MalformedRecord(Malformation.WRONG_LENGTH, f"length {len(buf)} bytes, header says {expected}")
    cols = np.frombuffer(buf, dtype="<i8", count=(m + 2) * n, offset=HEADER_BYTES).reshape(m + 2, n)
    return ResultBatch(cols[:m], cols[m], cols[m + 1])
