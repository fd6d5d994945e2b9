"""The generator's pure half: which tuples exist, how they are cut into messages, which progress
records and late tuples are written (no Kafka)."""

from __future__ import annotations

import logging
from collections.abc import Iterable

import numpy as np
import pytest

from generator.messages import (
    MAX_MESSAGE_BYTES,
    HeldBack,
    MessagePlanner,
    Record,
    encode_slice,
    max_tuples_per_message,
)
from generator.tuples import LATE_SPAN, StreamSlice, TupleSource, payload_salt, payloads
from pipeline.codec import decode_tuples, progress_of
from pipeline.config import Config, ConfigError, load_config
from pipeline.partitioning import pids_of

START_MS = 1_700_000_000_000


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
    for e in encode_slice(sl, start_ms, partitions=16, tuples_per_message=100):
        batch = decode_tuples(e.value)
        assert 0 < len(batch) <= 100
        assert e.tuples == len(batch)
        assert not e.late
        assert (pids_of(batch.keys, 16) == e.pid).all()
        assert (np.diff(batch.ids) > 0).all()  # arrival order within a pid
        np.testing.assert_array_equal(batch.event_times, sl.offsets_ms[batch.ids] + start_ms)
        np.testing.assert_array_equal(batch.payload, sl.payload[batch.ids])
        assert e.first_ms == batch.event_times.min()  # the message timestamp
        assert e.max_ms == batch.event_times.max()
        seen.append(batch.ids)
    np.testing.assert_array_equal(np.sort(np.concatenate(seen)), sl.ids)


def test_messages_stay_under_the_size_limit() -> None:
    assert max_tuples_per_message(100_000, 16) * 40 < MAX_MESSAGE_BYTES
    assert max_tuples_per_message(256, 16) == 256
    assert max_tuples_per_message(10, 65536) == 10
    assert max_tuples_per_message(100, 65536) == 14
    sl = _one_slice(30_000, payload_bytes=100)
    sizes = [len(e.value) for e in encode_slice(sl, 0, partitions=1, tuples_per_message=100_000)]
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


# --- silences, progress records, late tuples, id bases ---


def _plan(cfg: Config, step_s: float, **source_args: list[int]) -> tuple[list[list[Record]], list[float]]:
    """Drain a source through a planner: the records of each step, and each step's end of event time."""
    source = TupleSource(cfg, **source_args)
    planner = MessagePlanner(cfg, START_MS)
    steps, ends = [], []
    t = 0.0
    while not source.done:
        t += step_s
        steps.append(planner.plan(source.take(t), source.end_s))
        ends.append(source.end_s)
    assert planner.late_written == source.late_injected
    assert planner.progress_records == sum(r.tuples == 0 for rs in steps for r in rs)
    return steps, ends


def _partitions(records: Iterable[Record]) -> dict[tuple[int, int], list[bytes]]:
    """Each input partition's message values in write order, which is its offset order."""
    out: dict[tuple[int, int], list[bytes]] = {}
    for r in records:
        out.setdefault((r.stream, r.pid), []).append(r.value)
    return out


def late_by_the_rule(values: list[bytes], lateness_ms: int) -> list[int]:
    """Decision 0047, brute force: ids of the tuples below the largest event time of the tuples and
    progress records before them in their partition (values in offset order), minus the lateness."""
    late: list[int] = []
    largest: int | None = None
    for value in values:
        progress = progress_of(value)
        if progress is not None:
            largest = progress if largest is None else max(largest, progress)
            continue
        batch = decode_tuples(value)
        for tuple_id, event_time in zip(batch.ids.tolist(), batch.event_times.tolist(), strict=True):
            if largest is not None and event_time < largest - lateness_ms:
                late.append(tuple_id)
            largest = event_time if largest is None else max(largest, event_time)
    return late


SILENCE = (
    "generator.silences=[{stream: B, pids: [3, 11], from_s: 1.0, to_s: 2.6},"
    " {stream: A, pids: [0], from_s: 0, to_s: 0.5}]"
)


def test_silences_drop_exactly_their_tuples_and_keep_the_other_ids() -> None:
    full = _drain(TupleSource(_cfg()), 0.5)
    for step in (0.05, 0.3137):
        quiet = _drain(TupleSource(_cfg(SILENCE)), step)
        for s, name_spans in ((0, [((0,), 0.0, 0.5)]), (1, [((3, 11), 1.0, 2.6)]), (2, [])):
            f = full[s]
            drop = np.zeros(len(f["ids"]), dtype=bool)
            for pids, lo, hi in name_spans:
                span = (f["offsets"] >= lo * 1000) & (f["offsets"] < hi * 1000)
                drop |= span & np.isin(pids_of(f["keys"], 16), pids)
            if s < 2:
                assert drop.sum() > 20
            for col in ("ids", "keys", "offsets", "payload"):
                np.testing.assert_array_equal(quiet[s][col], f[col][~drop])


def test_max_tuples_counts_the_tuples_that_exist() -> None:
    cut = _drain(TupleSource(_cfg(SILENCE, "generator.max_tuples=30000")), 0.2)
    assert sum(len(c["ids"]) for c in cut.values()) == 30_000


def test_id_base_offsets_every_id() -> None:
    base = [1000, 0, 77]
    full = _drain(TupleSource(_cfg(SILENCE)), 0.5)
    based = _drain(TupleSource(_cfg(SILENCE), id_base=base), 0.5)
    for s in full:
        np.testing.assert_array_equal(based[s]["ids"], full[s]["ids"] + base[s])
        np.testing.assert_array_equal(based[s]["keys"], full[s]["keys"])
        np.testing.assert_array_equal(based[s]["payload"], payloads(based[s]["ids"], payload_salt(42, s), 12))
    with pytest.raises(ValueError, match="id_base"):
        TupleSource(_cfg(), id_base=[0, 0])


@pytest.mark.parametrize("step_s", [0.05, 0.5, 0.3137])
def test_progress_records_cover_idle_partitions_and_never_exceed_later_tuples(step_s: float) -> None:
    interval = 200
    cfg = _cfg(SILENCE, f"generator.progress_interval_ms={interval}")
    steps, ends = _plan(cfg, step_s)
    largest: dict[tuple[int, int], int] = {}
    written: dict[tuple[int, int], list[tuple[str, int]]] = {}  # partition -> (kind, event time)
    for records, end_s in zip(steps, ends, strict=True):
        for r in records:
            progress = progress_of(r.value)
            part = (r.stream, r.pid)
            if progress is None:
                times = decode_tuples(r.value).event_times
                assert r.timestamp_ms == int(times.min())
                written.setdefault(part, []).extend(("tuple", int(t)) for t in times)
                largest[part] = max(largest.get(part, START_MS), int(times.max()))
            else:
                assert r.timestamp_ms == progress and r.tuples == 0
                assert r.pid < 16 and r.stream < 3
                # Written only to a partition idle for an interval, at the step's end.
                assert progress == START_MS + int(np.floor(end_s * 1000))
                assert largest.get(part, START_MS) <= progress - interval
                written.setdefault(part, []).append(("progress", progress))
                largest[part] = progress
        now_ms = START_MS + int(np.floor(end_s * 1000))
        # After each step, no partition is an interval or more behind.
        for stream in range(3):
            for pid in range(16):
                assert largest.get((stream, pid), START_MS) > now_ms - interval
    for part, events in written.items():
        times = np.array([t for _, t in events])
        # Nothing written later to a partition is below a progress record before it (nor below a tuple).
        assert (np.diff(times) >= 0).all(), part
    progress_parts = {part for part, ev in written.items() if any(k == "progress" for k, _ in ev)}
    # Busy partitions (hundreds of tuples/s each) need none; silenced ones get one per interval.
    assert progress_parts <= {(1, 3), (1, 11), (0, 0)}
    for part in [(1, 3), (1, 11)]:
        in_span = [t for k, t in written[part] if k == "progress" and START_MS + 1000 < t <= START_MS + 2600]
        # One per step at most: every max(interval, step) to max(interval, step) + step.
        every_ms = max(interval, step_s * 1000)
        assert 1600 / (every_ms + step_s * 1000) - 1 <= len(in_span) <= 1600 / every_ms + 1
        assert not [t for k, t in written[part] if k == "tuple" and START_MS + 1000 <= t < START_MS + 2600]
    assert all(late_by_the_rule(v, 0) == [] for v in _partitions(r for rs in steps for r in rs).values())


def _late_tuples(steps: list[list[Record]]) -> set[tuple[int, int, int]]:
    out = set()
    for r in (r for rs in steps for r in rs):
        if r.late:
            assert r.tuples == 1
            b = decode_tuples(r.value)
            out.add((r.stream, int(b.ids[0]), int(b.event_times[0])))
    return out


@pytest.mark.parametrize("lateness", [0, 300])
def test_injected_late_tuples_are_late_by_the_rule_and_nothing_else_is(lateness: int) -> None:
    n = 25
    cfg = _cfg(SILENCE, f"allowed_lateness_ms={lateness}", f"generator.late_tuples={n}")
    results = []
    for step in (0.05, 0.5, 0.3137):
        steps, _ = _plan(cfg, step, id_base=[5, 0, 1_000_000])
        records = [r for rs in steps for r in rs]
        late: set[tuple[int, int]] = set()
        for (stream, _pid), values in _partitions(records).items():
            late |= {(stream, i) for i in late_by_the_rule(values, lateness)}
        assert len(late) == n
        # Each alone in its message, spread round the streams.
        singles = {(s, i) for s, i, _ in _late_tuples(steps)}
        assert late <= singles
        assert [sum(s == k for s, _ in late) for k in range(3)] == [9, 8, 8]
        # Ids stay unique per stream, from its base, and increase in each partition's offset order
        # (the late ones take their place in the sequence), which `largest_ids` relies on.
        for (stream, _pid), values in _partitions(records).items():
            ids = np.concatenate([decode_tuples(v).ids for v in values if progress_of(v) is None])
            assert (np.diff(ids) > 0).all()
            assert ids[0] >= [5, 0, 1_000_000][stream]
        for stream in range(3):
            ids = np.concatenate(
                [decode_tuples(r.value).ids for r in records if r.stream == stream and r.tuples]
            )
            assert len(np.unique(ids)) == len(ids)
        results.append({t for t in _late_tuples(steps) if (t[0], t[1]) in late})
    # The same late tuples whatever the slicing; spread over the first LATE_SPAN of the 4 s run.
    assert results[0] == results[1] == results[2]
    offsets = sorted(et - START_MS + lateness for _, _, et in results[0])
    assert offsets[0] < 4000 * LATE_SPAN / n + 50 and offsets[-1] < 4000 * LATE_SPAN
    assert offsets[-1] > 4000 * LATE_SPAN * (1 - 1.5 / n)


def test_late_tuples_spread_over_a_run_bounded_by_a_count() -> None:
    cfg = _cfg("generator.duration_s=null", "generator.max_tuples=24000", "generator.late_tuples=4")
    steps, _ = _plan(cfg, 0.25)
    late = sorted(et - START_MS for _, _, et in _late_tuples(steps))
    assert len(late) == 4
    # Without silences, ids are contiguous per stream: the late ones take their place in the sequence.
    for stream in range(3):
        ids = np.concatenate(
            [decode_tuples(r.value).ids for rs in steps for r in rs if r.stream == stream and r.tuples]
        )
        np.testing.assert_array_equal(np.sort(ids), np.arange(len(ids)))
    # 24000 tuples of 3 toggling streams: expected by 2.267 s (1.4 s cycles of 5600 per stream, then
    # 1400 more at 2000/s and 1000 at 6000/s); the tuples end about there.
    expected_s = 1.4 + 0.7 + 1000 / 6000
    last = max(int(decode_tuples(r.value).event_times.max()) for rs in steps for r in rs if r.tuples)
    assert last - START_MS == pytest.approx(expected_s * 1000, abs=100)
    # Due at 0.8 x expected x (j + 1/2) / 4; each follows a tuple less than 5 ms after that (streams
    # of 2000/s or more), with an event time 2000 + 1 + j ms below it.
    for j, et in enumerate(late):
        due_ms = LATE_SPAN * expected_s * 1000 * (j + 0.5) / 4
        assert -1 < et + 2000 + 1 + j - due_ms < 5  # event times are whole ms (floor)


def test_held_back_streams_keep_their_order_and_wait_their_lag() -> None:
    held = HeldBack({1: 2.0, 0: 0.0})
    rec = [Record(s, p, b"", 0, 1) for s, p in [(0, 1), (1, 1), (1, 2), (2, 3)]]
    assert held.hold(rec, 0.5) == [rec[0], rec[3]]
    later = [Record(1, 9, b"", 0, 1)]
    assert held.hold(later, 0.7) == []
    assert len(held) == 3
    assert held.release(2.49) == []
    assert held.release(2.5) == [rec[1], rec[2]]
    assert held.release(100) == later
    assert len(held) == 0 and held.release(float("inf")) == []


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("generator.silences=[{stream: Z, pids: [1], from_s: 0, to_s: 1}]", "is not one of"),
        ("generator.silences=[{stream: A, pids: [16], from_s: 0, to_s: 1}]", "pids must be < partitions"),
        ("generator.silences=[{stream: A, pids: [1], from_s: 2, to_s: 1}]", "must be > from_s"),
        ("generator.silences=[{stream: A, pids: [], from_s: 0, to_s: 1}]", "silences.0.pids"),
        ("generator.stream_lag_ms={Z: 100}", "unknown streams"),
        ("generator.stream_lag_ms={A: -1}", "stream_lag_ms.A"),
        ("generator.progress_interval_ms=0", "progress_interval_ms"),
    ],
)
def test_generator_settings_are_checked(override: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        _cfg(override)


def test_stream_lag_is_refused_in_max_rate_mode_and_late_tuples_need_an_end() -> None:
    assert _cfg("generator.stream_lag_ms={B: 3000}").generator.stream_lag_ms == {"B": 3000}
    with pytest.raises(ConfigError, match="stream_lag_ms needs mode real_time"):
        _cfg("generator.stream_lag_ms={B: 3000}", "generator.mode=max_rate")
    with pytest.raises(ConfigError, match="late_tuples needs"):
        _cfg("generator.late_tuples=3", "generator.duration_s=null")


def test_a_generator_whose_stderr_is_no_terminal_says_how_far_it_got_every_30_s(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A pod's log gets a plain line every 30 s instead of a progress bar drawn only at the end."""
    from generator.producer import _Progress

    caplog.set_level(logging.INFO, logger="generator.producer")
    display = _Progress(enabled=True, total=None)
    for tuples, seconds in ((1_000, 10.0), (3_000, 30.5), (4_000, 45.0), (6_000, 60.0)):
        display.update(tuples, seconds)
    display.close()
    assert caplog.messages == [
        "generator: 3,000 tuples in 30 s (98 tuples/s)",
        "generator: 6,000 tuples in 60 s (100 tuples/s)",
    ]
