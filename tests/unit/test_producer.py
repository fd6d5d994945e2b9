"""The generator's pure half: which tuples exist, and how they are cut into messages (no Kafka)."""

from __future__ import annotations

import numpy as np
import pytest

from generator.producer import (
    MAX_MESSAGE_BYTES,
    StreamSlice,
    TupleSource,
    encode_slice,
    max_tuples_per_message,
    payload_salt,
    payloads,
)
from pipeline.codec import decode_tuples
from pipeline.config import Config, load_config
from pipeline.partitioning import pids_of


def _cfg(*overrides: str) -> Config:
    base = [
        "generator.rate={kind: toggle, low: 2000, high: 6000, period_s: 0.7}",
        "generator.keys={kind: hot_set, count: 5000, hot_fraction: 0.01, hot_share: 0.5, move_every_s: 1.3}",
        "generator.payload_bytes=12",
        "generator.duration_s=4",
        "partitions=16",
        "instances=2",
    ]
    return load_config(None, [*base, *overrides])


def _drain(source: TupleSource, step_s: float) -> dict[int, dict[str, np.ndarray]]:
    parts: dict[int, list[StreamSlice]] = {}
    t = 0.0
    while not source.done:
        t += step_s
        for sl in source.take(t):
            parts.setdefault(sl.stream, []).append(sl)
    return {
        s: {
            "ids": np.concatenate([p.ids for p in ps]),
            "keys": np.concatenate([p.keys for p in ps]),
            "offsets": np.concatenate([p.offsets_ms for p in ps]),
            "payload": np.concatenate([p.payload for p in ps]),
        }
        for s, ps in parts.items()
    }


def test_real_time_ticks_and_max_rate_chunks_give_identical_tuples() -> None:
    cfg = _cfg()
    ticks = _drain(TupleSource(cfg), 0.05)  # real-time-like
    chunks = _drain(TupleSource(cfg), 0.5)  # max-rate-like
    odd = _drain(TupleSource(cfg), 0.3137)
    assert sorted(ticks) == [0, 1, 2]
    for s in ticks:
        for col in ("ids", "keys", "offsets", "payload"):
            np.testing.assert_array_equal(ticks[s][col], chunks[s][col])
            np.testing.assert_array_equal(ticks[s][col], odd[s][col])


def test_stream_columns_are_well_formed() -> None:
    out = _drain(TupleSource(_cfg()), 0.25)
    for s, cols in out.items():
        n = len(cols["ids"])
        # 4 s of a toggle averaging 4000/s.
        assert n == pytest.approx(16_000, rel=0.1)
        np.testing.assert_array_equal(cols["ids"], np.arange(n))
        assert (np.diff(cols["offsets"]) >= 0).all()
        assert cols["offsets"].min() >= 0
        assert cols["offsets"].max() < 4000
        assert cols["payload"].shape == (n, 12)
        assert ((cols["keys"] >= 0) & (cols["keys"] < 5000)).all()
        np.testing.assert_array_equal(cols["payload"], payloads(cols["ids"], payload_salt(42, s), 12))
    # Streams are independent draws, not copies of each other.
    assert not np.array_equal(out[0]["keys"][:100], out[1]["keys"][:100])


def test_seed_changes_the_tuples() -> None:
    a = _drain(TupleSource(_cfg()), 0.5)
    b = _drain(TupleSource(_cfg("generator.seed=43")), 0.5)
    assert not np.array_equal(a[0]["keys"][:1000], b[0]["keys"][:1000])


def test_max_tuples_keeps_the_earliest_tuples_over_all_streams() -> None:
    full = _drain(TupleSource(_cfg()), 0.5)
    limit = 10_001
    for step in (0.05, 0.5, 3.0):
        cut = _drain(TupleSource(_cfg("generator.max_tuples=10001")), step)
        assert sum(len(c["ids"]) for c in cut.values()) == limit
        last = max(int(c["offsets"][-1]) for c in cut.values())
        for s, c in cut.items():
            n = len(c["ids"])
            np.testing.assert_array_equal(c["keys"], full[s]["keys"][:n])  # a prefix of each stream
            # Nothing left out is earlier than what was kept (ms granularity).
            if n < len(full[s]["ids"]):
                assert full[s]["offsets"][n] >= last


def test_duration_bounds_event_time_and_stops() -> None:
    source = TupleSource(_cfg("generator.duration_s=1.5"))
    slices = source.take(100.0)
    assert source.done
    assert max(int(sl.offsets_ms.max()) for sl in slices) < 1500
    assert source.take(200.0) == []


def test_a_schedule_that_runs_dry_stops_the_source() -> None:
    source = TupleSource(
        _cfg("generator.rate={kind: steps, steps: [[0, 1000], [1, 0]]}", "generator.duration_s=null")
    )
    total = 0
    for t in range(1, 50):
        total += sum(len(sl) for sl in source.take(float(t)))
        if source.done:
            break
    assert source.done
    assert total == pytest.approx(3000, rel=0.15)


def _one_slice(n: int, payload_bytes: int = 12) -> StreamSlice:
    rng = np.random.default_rng(0)
    ids = np.arange(n, dtype=np.int64)
    return StreamSlice(
        stream=0,
        ids=ids,
        keys=rng.integers(0, 10_000, n),
        offsets_ms=np.sort(rng.integers(0, 500, n)),
        payload=payloads(ids, 5, payload_bytes),
    )


def test_encode_slice_groups_by_pid_and_keeps_order() -> None:
    sl = _one_slice(5000)
    start_ms = 1_700_000_000_000
    seen = []
    for pid, value, first_ms in encode_slice(sl, start_ms, partitions=16, tuples_per_message=100):
        batch = decode_tuples(value)
        assert 0 < len(batch) <= 100
        assert (pids_of(batch.keys, 16) == pid).all()
        assert (np.diff(batch.ids) > 0).all()  # arrival order within a pid
        np.testing.assert_array_equal(batch.event_times, sl.offsets_ms[batch.ids] + start_ms)
        np.testing.assert_array_equal(batch.payload, sl.payload[batch.ids])
        assert first_ms == batch.event_times.min()  # the message timestamp
        seen.append(batch.ids)
    np.testing.assert_array_equal(np.sort(np.concatenate(seen)), sl.ids)


def test_messages_stay_under_the_size_limit() -> None:
    assert max_tuples_per_message(100_000, 16) * 40 < MAX_MESSAGE_BYTES
    assert max_tuples_per_message(256, 16) == 256
    assert max_tuples_per_message(10, 65536) == 10
    assert max_tuples_per_message(100, 65536) == 14
    sl = _one_slice(30_000, payload_bytes=100)
    sizes = [len(v) for _, v, _ in encode_slice(sl, 0, partitions=1, tuples_per_message=100_000)]
    assert max(sizes) <= MAX_MESSAGE_BYTES
    assert len(sizes) > 1


def test_payloads_are_deterministic_and_vary() -> None:
    ids = np.arange(1000, dtype=np.int64)
    p = payloads(ids, 123, 20)
    assert p.shape == (1000, 20)
    np.testing.assert_array_equal(p, payloads(ids, 123, 20))
    assert len({bytes(row) for row in p}) == 1000
    assert not np.array_equal(p, payloads(ids, 124, 20))
    assert payloads(ids, 1, 0).shape == (1000, 0)
