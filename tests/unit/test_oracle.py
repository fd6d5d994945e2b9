"""The oracle's pure core against brute force: the late set by input partition (progress records
included), the counted join, each produced result judged on its own, the dead letters against the rule,
and input it must refuse or report."""

from __future__ import annotations

import itertools
import json
from collections import Counter
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipeline import oracle
from pipeline.codec import encode_progress, encode_results, encode_tuples
from pipeline.config import Config
from pipeline.join import Part
from pipeline.oracle import (
    PartitionLog,
    VerifyReport,
    check_produced,
    count_expected,
    judge,
    late_reports,
    partition_logs,
    result_ids,
    stream_input,
)
from pipeline.partitioning import pid_of
from pipeline.topics import TopicError
from tests.unit.test_join import as_part, brute_force

Tuple3 = tuple[int, int, int]  # (id, key, ts)
Record = int | list[Tuple3]  # a progress record's event time, or a tuple record's tuples in order


def log_of(pid: int, records: list[Record]) -> PartitionLog:
    times, is_tuple, ids, keys = [], [], [], []
    for r in records:
        if isinstance(r, int):
            times.append(r)
            is_tuple.append(False)
            continue
        for i, k, t in r:
            times.append(t)
            is_tuple.append(True)
            ids.append(i)
            keys.append(k)
    return PartitionLog(
        pid,
        np.array(times, dtype=np.int64),
        np.array(is_tuple, dtype=np.bool_),
        np.array(ids, dtype=np.int64),
        np.array(keys, dtype=np.int64),
    )


def late_by_hand(records: list[Record], lateness: int) -> set[int]:
    """The rule, one element at a time."""
    top: int | None = None
    late = set()
    for r in records:
        elements = [(r, None)] if isinstance(r, int) else [(t, i) for i, _, t in r]
        for t, i in elements:
            if i is not None and top is not None and t < top - lateness:
                late.add(i)
            top = t if top is None else max(top, t)
    return late


# Messages of one stream in offset order, partitions interleaved: (pid, progress time or tuples' (key, ts)).
messages = st.lists(
    st.tuples(
        st.integers(0, 3),
        st.one_of(st.integers(0, 60), st.lists(st.tuples(st.integers(0, 3), st.integers(0, 60)), max_size=4)),
    ),
    max_size=20,
)


def by_partition(stream: list[tuple[int, Any]], first_id: int = 0) -> dict[int, list[Record]]:
    """Group a stream's messages by partition (offset order kept), giving tuples ids in order."""
    out: dict[int, list[Record]] = {}
    next_id = first_id
    for pid, body in stream:
        if isinstance(body, int):
            out.setdefault(pid, []).append(body)
        else:
            rec = []
            for k, t in body:
                rec.append((next_id, k, t))
                next_id += 1
            out.setdefault(pid, []).append(rec)
    return out


@settings(max_examples=300, deadline=None)
@given(stream=messages, lateness=st.integers(0, 20))
def test_late_set_is_the_rule_applied_per_partition(stream: list[tuple[int, Any]], lateness: int) -> None:
    parts = by_partition(stream)
    s = stream_input([log_of(p, recs) for p, recs in parts.items()], lateness)
    want = set().union(*(late_by_hand(recs, lateness) for recs in parts.values()))
    every = {i for recs in parts.values() for r in recs if not isinstance(r, int) for i, _, _ in r}
    assert sorted(s.late_ids.tolist()) == sorted(want)
    assert sorted(s.on_time.ids.tolist()) == sorted(every - want)
    assert s.tuples == len(every)
    assert s.progress_records == sum(isinstance(r, int) for recs in parts.values() for r in recs)
    assert s.duplicate_ids == 0
    by_id = {i: (k, t) for recs in parts.values() for r in recs if not isinstance(r, int) for i, k, t in r}
    for i, k, t in zip(s.on_time.ids, s.on_time.keys, s.on_time.ts, strict=True):
        assert by_id[int(i)] == (int(k), int(t))


def test_a_progress_record_makes_later_older_tuples_late_in_its_partition_only() -> None:
    parts = [log_of(0, [[(1, 5, 10)], 30, [(2, 5, 27), (3, 5, 24)]]), log_of(1, [[(4, 6, 0)]])]
    s = stream_input(parts, 4)
    assert s.late_ids.tolist() == [3]  # 24 < 30 - 4; 27 is not; partition 1 has its own history
    assert s.progress_records == 1
    # Within one record, the tuples before count as well.
    assert stream_input([log_of(0, [[(1, 5, 10), (2, 5, 3)]])], 4).late_ids.tolist() == [2]


def test_late_rule_does_not_overflow_at_extreme_event_times() -> None:
    lo, hi = -(2**63), 2**63 - 1
    s = stream_input([log_of(0, [[(1, 0, hi), (2, 0, lo), (3, 0, hi - 5)]])], 10)
    assert s.late_ids.tolist() == [2]


def expected_by_hand(streams: list[list[Tuple3]], window: int, partitions: int) -> Counter[int]:
    by_id = [{i: k for i, k, _ in s} for s in streams]
    return Counter(pid_of(by_id[0][combo[0]], partitions) for combo in brute_force(streams, window))


stream_tuples = st.lists(st.tuples(st.integers(0, 3), st.integers(0, 40)), max_size=25)
extreme_times = st.one_of(
    st.integers(0, 40), st.sampled_from([-(2**63), -(2**62), 2**62, 2**63 - 20, 2**63 - 1])
)


@settings(max_examples=300, deadline=None)
@given(
    raw=st.lists(stream_tuples, min_size=2, max_size=3),
    window=st.integers(0, 15),
    chunk=st.integers(1, 10),
    python_ints=st.booleans(),
)
def test_counted_join_equals_brute_force(
    raw: list[list[tuple[int, int]]], window: int, chunk: int, python_ints: bool
) -> None:
    streams = [[(i, k, t) for i, (k, t) in enumerate(s)] for s in raw]
    got = count_expected(
        [as_part(s) for s in streams], window, 8, chunk=chunk, int64_bound=0.0 if python_ints else 2.0**62
    )
    want = expected_by_hand(streams, window, 8)
    assert got.total == sum(want.values())
    assert got.by_pid == [want.get(p, 0) for p in range(8)]


@settings(max_examples=200, deadline=None)
@given(
    raw=st.lists(st.lists(st.tuples(st.integers(0, 2), extreme_times), max_size=12), min_size=2, max_size=3),
    window=st.sampled_from([0, 5, 2**62]),
)
def test_counted_join_key_by_key_when_event_times_span_int64(
    raw: list[list[tuple[int, int]]], window: int
) -> None:
    streams = [[(i, k, t) for i, (k, t) in enumerate(s)] for s in raw]
    got = count_expected([as_part(s) for s in streams], window, 4)
    want = expected_by_hand(streams, window, 4)
    assert got.total == sum(want.values())
    assert got.by_pid == [want.get(p, 0) for p in range(4)]


def test_ties_at_exactly_the_window_and_equal_times_across_streams_join() -> None:
    w = 10
    a, b, c = [(1, 7, 0)], [(2, 7, w), (3, 7, w + 1)], [(4, 7, w), (5, 7, 0)]
    assert count_expected([as_part(a), as_part(b), as_part(c)], w, 4).total == len(brute_force([a, b, c], w))
    assert len(brute_force([a, b, c], w)) == 2  # (1, 2, 4) and (1, 2, 5)
    same = [[(i, 3, 5) for i in range(n)] for n in (3, 4, 5)]
    assert count_expected([as_part(s) for s in same], 0, 4).total == 3 * 4 * 5


def rows(*results: tuple[int, ...]) -> np.ndarray:
    return np.array(results, dtype=np.int64).reshape(len(results), -1).T


def hand_made() -> tuple[list[list[PartitionLog]], int, int]:
    """Streams A and B, W = 10, L = 5, keys 7 and k (of another pid). Tuple 3 is late (10 < 20 - 5).
    Expected: (1, 11), (2, 12) and (4, 13), the last of key k."""
    k = next(k for k in range(8, 100) if pid_of(k, 4) != pid_of(7, 4))
    p7, pk = pid_of(7, 4), pid_of(k, 4)
    a = [log_of(p7, [[(1, 7, 0), (2, 7, 20)], [(3, 7, 10)]]), log_of(pk, [[(4, k, 8)]])]
    b = [log_of(p7, [[(11, 7, 5)], 15, [(12, 7, 22)]]), log_of(pk, [[(13, k, 3)]])]
    return [a, b], p7, pk


def test_each_produced_result_is_judged_on_its_own() -> None:
    inputs, p7, _ = hand_made()
    produced = [
        rows((1, 11), (1, 11), (4, 13)),
        rows((3, 11), (1, 12)),  # a late tuple; out of the window
        None,  # a results record that did not decode
        rows((99, 11), (1, 13)),  # an unknown id; keys differ
        np.zeros((3, 2), np.int64),  # a record of three parts in a two-way join
    ]
    late = [np.array([3, 2]), np.array([], np.int64)]
    r = judge(inputs, produced, late, window_ms=10, lateness_ms=5, partitions=4)
    assert (r.input_tuples, r.progress_records, r.malformed, r.duplicate_input_ids) == (7, 1, 0, 0)
    assert (r.expected, r.produced, r.missing, r.duplicate, r.spurious) == (3, 10, 1, 1, 7)
    assert r.missing_by_pid == {p7: 1}
    assert (r.late_expected, r.late_reported, r.wrongly_late, r.late_unreported) == (1, 2, 1, 0)
    assert not r.exact
    assert "NOT EXACT" in r.describe()


def test_exact_needs_the_dead_letters_to_match_the_rule() -> None:
    inputs, _, _ = hand_made()
    every = [rows((1, 11), (2, 12), (4, 13))]
    ok = judge(
        inputs, every, [np.array([3]), np.array([], np.int64)], window_ms=10, lateness_ms=5, partitions=4
    )
    assert ok.exact and ok.late_reported == ok.late_expected == 1
    assert (ok.missing, ok.duplicate, ok.spurious, ok.missing_by_pid) == (0, 0, 0, {})
    assert "-> EXACT" in ok.describe()
    silent = judge(inputs, every, [np.array([], np.int64)] * 2, window_ms=10, lateness_ms=5, partitions=4)
    assert (silent.late_unreported, silent.late_reported, silent.exact) == (1, 0, False)
    stray = judge(
        inputs, every, [np.array([3]), np.array([], np.int64)], window_ms=10, lateness_ms=5, partitions=4,
        late_unknown=2,
    )  # fmt: skip
    assert (stray.late_reported, stray.wrongly_late, stray.exact) == (3, 2, False)


def test_a_subset_misses_results_but_holds_nothing_duplicate_spurious_or_wrongly_late() -> None:
    inputs, _, _ = hand_made()
    late = [np.array([3]), np.array([], np.int64)]

    def report(*produced: np.ndarray, late: list[np.ndarray] = late) -> VerifyReport:
        return judge(inputs, list(produced), late, window_ms=10, lateness_ms=5, partitions=4)

    some = report(rows((1, 11), (4, 13)))
    assert (some.missing, some.exact, some.subset) == (1, False, True)
    assert "a subset of the exact result" in some.describe()
    assert report(rows((1, 11), (1, 11))).subset is False, "a duplicate"
    assert report(rows((3, 11))).subset is False, "a late tuple's result is spurious"
    assert report(rows((1, 11)), late=[np.array([1, 3]), np.array([], np.int64)]).subset is False, (
        "an on-time tuple dead-lettered loses its results for good"
    )
    assert report(rows((1, 11), (2, 12), (4, 13))).subset, "the exact result is a subset of itself"


def test_duplicate_input_ids_make_the_report_inexact() -> None:
    a = [log_of(0, [[(1, 7, 0), (1, 7, 1)]])]
    b = [log_of(0, [[(11, 7, 0)]])]
    r = judge(
        [a, b], [rows((1, 11))], [np.array([], np.int64)] * 2, window_ms=10, lateness_ms=5, partitions=4
    )
    assert r.duplicate_input_ids == 1 and r.expected == 2 and r.missing == 1
    assert not r.exact
    assert "repeat an id" in r.describe()


@settings(max_examples=200, deadline=None)
@given(
    raw=st.lists(stream_tuples, min_size=2, max_size=3),
    window=st.integers(0, 10),
    picks=st.lists(st.integers(0, 10**6), max_size=40),
    strays=st.lists(st.tuples(st.integers(0, 30), st.integers(0, 30), st.integers(0, 30)), max_size=10),
    batch=st.integers(1, 7),
)
def test_produced_results_counted_like_by_hand(
    raw: list[list[tuple[int, int]]],
    window: int,
    picks: list[int],
    strays: list[tuple[int, int, int]],
    batch: int,
) -> None:
    """Produced rows: expected ones (some missed, some repeated) and arbitrary id rows (valid or not)."""
    m = len(raw)
    streams = [[(i, k, t) for i, (k, t) in enumerate(s)] for s in raw]
    expected = sorted(brute_force(streams, window))
    chosen = [expected[p % len(expected)] for p in picks] if expected else []
    got_rows = chosen + [s[:m] for s in strays]
    ids = np.array(got_rows, dtype=np.int64).reshape(-1, m).T
    batches = [ids[:, lo : lo + batch] for lo in range(0, ids.shape[1], batch)]
    got = check_produced([as_part(s) for s in streams], batches, window, 4)
    valid = [r for r in got_rows if r in set(expected)]
    assert (got.produced, got.spurious) == (len(got_rows), len(got_rows) - len(valid))
    assert got.duplicate == len(valid) - len(set(valid))
    keys = [{i: k for i, k, _ in s} for s in streams]
    by_pid = Counter(pid_of(keys[0][r[0]], 4) for r in set(valid))
    assert got.distinct_by_pid == [by_pid.get(p, 0) for p in range(4)]


def tuples_record(rows_: list[Tuple3]) -> bytes:
    a = np.array(rows_, dtype=np.int64).reshape(-1, 3)
    return encode_tuples(a[:, 0], a[:, 1], a[:, 2], np.zeros((len(a), 0), np.uint8))


def test_records_become_logs_per_partition_in_offset_order_and_bad_ones_are_counted() -> None:
    partitions = 4
    k0 = next(k for k in range(100) if pid_of(k, partitions) == 0)
    k1 = next(k for k in range(100) if pid_of(k, partitions) == 1)
    msgs = [
        (1, 0, tuples_record([(10, k1, 5)])),
        (0, 1, encode_progress(40)),
        (0, 0, tuples_record([(1, k0, 7), (2, k0, 9)])),  # delivered after offset 1: sorted back
        (0, 2, None),  # tombstone
        (0, 3, b"\x01garbage"),
        (0, 4, tuples_record([(3, k1, 50)])),  # a key of pid 1 in partition 0
        (0, 6, tuples_record([(5, k0, 60), (-6, k0, 61)])),  # a negative id
        (1, 1, encode_results(np.zeros((2, 1), np.int64), np.zeros(1, np.int64), np.zeros(1, np.int64))),
        (0, 5, tuples_record([(4, k0, 30)])),
        (1, 2, tuples_record([])),
    ]
    logs, malformed = partition_logs(msgs, partitions)
    assert malformed == 5
    assert [log.pid for log in logs] == [0, 1]
    first = logs[0]
    assert first.times.tolist() == [7, 9, 40, 30]
    assert first.is_tuple.tolist() == [True, True, False, True]
    assert (first.ids.tolist(), first.keys.tolist()) == ([1, 2, 4], [k0, k0, k0])
    assert (logs[1].ids.tolist(), logs[1].times.tolist()) == ([10], [5])
    s = stream_input(logs, 5)
    assert s.late_ids.tolist() == [4] and s.progress_records == 1


def test_late_dead_letters_are_read_per_stream() -> None:
    def dl(**fields: Any) -> bytes:
        return json.dumps(fields).encode()

    values = [
        dl(reason="late: event time older than the pid's watermark", stream="B", id=7),
        dl(reason="late: ...", stream="A", id=1),
        dl(reason="late: ...", stream="A", id=1),
        dl(reason="malformed: truncated", stream="A", id=2),
        dl(reason="late: ...", stream="Z", id=3),
        dl(reason="late: ...", stream="A"),
        dl(reason="late: ...", stream="A", id=2**70),
        b"not json",
        b"[1, 2]",
        None,
    ]
    ids, unknown = late_reports(values, ["A", "B"])
    assert [x.tolist() for x in ids] == [[1, 1], [7]]
    assert unknown == 3


def test_results_records_that_do_not_decode_are_none() -> None:
    good = encode_results(rows((1, 2), (3, 4)), np.zeros(2, np.int64), np.zeros(2, np.int64))
    got = list(result_ids([good, None, b"\x01\x02", encode_progress(3)]))
    assert got[0] is not None and got[0].tolist() == [[1, 3], [2, 4]]
    assert got[1:] == [None, None, None]


def test_a_topic_with_another_partition_count_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    from fluxjoin.options import user_errors

    cfg = Config(pipeline="p", streams=["A", "B"], partitions=8)
    counts = {
        cfg.input_topic("A"): 8,
        cfg.input_topic("B"): 4,
        cfg.results_topic: 8,
        cfg.dead_letter_topic: 1,
    }

    def meta(n: int) -> SimpleNamespace:
        return SimpleNamespace(error=None, partitions=dict.fromkeys(range(n)))

    admin = SimpleNamespace(
        list_topics=lambda timeout: SimpleNamespace(topics={t: meta(n) for t, n in counts.items()})
    )
    monkeypatch.setattr(oracle, "check_reachable", lambda bootstrap: None)
    monkeypatch.setattr(oracle, "admin_client", lambda bootstrap: admin)
    with pytest.raises(TopicError, match=r"topic p\.in\.B has 4 partitions but the configuration says 8"):
        oracle.check_topics(cfg, "broker:9092")
    assert issubclass(TopicError, user_errors())
    del counts[cfg.input_topic("B")]
    with pytest.raises(TopicError, match=r"topic p\.in\.B does not exist"):
        oracle.check_topics(cfg, "broker:9092")
    counts[cfg.input_topic("B")] = 8
    oracle.check_topics(cfg, "broker:9092")


def test_counting_agrees_with_itself_on_a_random_workload() -> None:
    """Both counting paths and a per-key pairwise count on a few thousand random tuples."""
    rng = np.random.default_rng(7)
    parts = [
        Part(np.arange(n, dtype=np.int64), rng.integers(0, 30, n), rng.integers(0, 5_000, n))
        for n in (3000, 2500, 2000)
    ]
    fast = count_expected(parts, 40, 16, chunk=777)
    forced = count_expected(parts, 40, 16, int64_bound=0.0)
    assert fast == forced
    total = 0
    for key in range(30):
        a, b, c = (np.sort(p.ts[p.keys == key]) for p in parts)
        for x, y in itertools.product(a.tolist(), b.tolist()):
            lo, hi = max(x, y) - 40, min(x, y) + 40
            if abs(x - y) <= 40:
                total += int(np.searchsorted(c, hi, "right") - np.searchsorted(c, lo, "left"))
    assert fast.total == total
    assert sum(fast.by_pid) == total
    assert np.all(np.array(fast.by_pid) >= 0)


def test_verify_pipeline_reads_each_topic_and_judges(monkeypatch: pytest.MonkeyPatch) -> None:
    """The wiring without a broker: messages per topic in, one report out, progress said."""
    cfg = Config(pipeline="p", streams=["A", "B"], partitions=4, window_ms=10, allowed_lateness_ms=5)
    k = 7
    p = pid_of(k, 4)
    late_dl = json.dumps({"reason": "late: ...", "stream": "A", "id": 3}).encode()
    topics: dict[str, list[tuple[int, int, bytes | None]]] = {
        cfg.input_topic("A"): [
            (p, 0, tuples_record([(1, k, 0), (2, k, 20)])),
            (p, 1, tuples_record([(3, k, 10)])),
            (p, 2, None),
        ],
        cfg.input_topic("B"): [(p, 0, tuples_record([(11, k, 5)])), (p, 1, encode_progress(15))],
        cfg.dead_letter_topic: [(0, 0, late_dl)],
        cfg.results_topic: [
            (p, 0, encode_results(rows((1, 11)), np.array([k]), np.array([5]))),
            (p, 1, b"junk"),
        ],
    }
    monkeypatch.setattr(oracle, "check_topics", lambda cfg, bootstrap: None)
    monkeypatch.setattr(oracle, "read_records", lambda bootstrap, topic: iter(topics[topic]))
    said: list[str] = []
    r = oracle.verify_pipeline(cfg, "broker:9092", progress=said.append)
    assert (r.input_tuples, r.progress_records, r.malformed) == (4, 1, 1)
    assert (r.late_expected, r.late_reported, r.wrongly_late, r.late_unreported) == (1, 1, 0, 0)
    assert (r.expected, r.produced, r.missing, r.duplicate, r.spurious) == (1, 2, 0, 0, 1)
    assert not r.exact
    assert said[0] == "reading p.in.A" and any("counting" in m for m in said)
