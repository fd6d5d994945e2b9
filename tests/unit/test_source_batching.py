"""How the instance's source caps a batch: whole pids round robin, a pid over the cap cut, fewer tuples
where a batch could make too many results (pipeline/batch_sizing.py)."""

from __future__ import annotations

from pathlib import Path

from pipeline.batch_sizing import ArrivalMeter, BatchBound, Yield, pids_within, results_of, tuples_within
from pipeline.instance_files import read_recent_yields, write_recent_yields


def offsets(**by_stream: dict[int, int]) -> dict[str, dict[str, int]]:
    return {s: {str(p): o for p, o in v.items()} for s, v in by_stream.items()}


START = offsets(A={0: 0, 1: 0, 2: 0}, B={0: 0, 1: 0, 2: 0})
LATEST = offsets(A={0: 10, 1: 2, 2: 30}, B={0: 1, 1: 20, 2: 30})
SEEN = {p: [(1_000, 0, 0)] for p in range(3)}  # results bound nothing here


def messages(cap: float, yields: dict[int, list[Yield]] | None = None, results: float = 1e9) -> BatchBound:
    return BatchBound(cap, results, 1.0, 2, SEEN if yields is None else yields)


def test_a_pid_is_taken_whole_or_not_at_all() -> None:
    cut, next_pid = pids_within(START, LATEST, messages(35), first_pid=0)
    assert cut == offsets(A={0: 10, 1: 2, 2: 0}, B={0: 1, 1: 20, 2: 0})  # 11 + 22 messages
    assert next_pid == 2


def test_the_next_batch_starts_where_the_last_stopped_and_wraps_round() -> None:
    cut, next_pid = pids_within(START, LATEST, messages(35), first_pid=1)
    assert cut == offsets(A={0: 0, 1: 2, 2: 0}, B={0: 0, 1: 20, 2: 0})  # pid 2 does not fit beside it
    assert next_pid == 2


def test_a_pid_over_the_cap_alone_is_cut_in_the_same_share_of_each_stream_and_the_others_go_next() -> None:
    cut, next_pid = pids_within(START, LATEST, messages(35), first_pid=2)
    assert cut == offsets(A={0: 0, 1: 0, 2: 18}, B={0: 0, 1: 0, 2: 17})  # 35 messages, half each
    assert next_pid == 0
    tiny, _ = pids_within(START, LATEST, messages(1), first_pid=2)
    assert sum(tiny[s]["2"] for s in tiny) == 1, "always some input"
    three, _ = pids_within(START, LATEST, messages(3.9), first_pid=2)
    assert sum(three[s]["2"] for s in three) == 3, "no message lost to rounding each stream down"


def test_every_pid_is_served_within_a_round() -> None:
    served: set[int] = set()
    start, first = START, 0
    for _ in range(30):
        cut, after = pids_within(start, LATEST, messages(5), first_pid=first)
        first = after if after is not None else 0
        served |= {int(p) for p in cut["A"] if cut["A"][p] == LATEST["A"][p]}
        start = cut
    assert served == {0, 1, 2}


def test_nothing_to_cut_without_pids() -> None:
    empty = offsets(A={}, B={})
    assert pids_within(empty, empty, messages(5), first_pid=3) == (empty, None)


def test_arrivals_are_measured_between_two_plans() -> None:
    meter = ArrivalMeter()
    meter.observe(offsets(A={0: 0, 1: 0}, B={0: 0, 1: 0}), now=10.0)
    assert meter.rate is None
    meter.observe(offsets(A={0: 30, 1: 10}, B={0: 20, 1: 20}), now=20.0)
    assert meter.rate == 8.0  # 80 messages in 10 s


def test_a_pid_seen_for_the_first_time_adds_no_arrivals() -> None:
    meter = ArrivalMeter()
    meter.observe(offsets(A={0: 0}, B={0: 0}), now=0.0)
    meter.observe(offsets(A={0: 10, 5: 1000}, B={0: 10, 5: 1000}), now=10.0)  # pid 5 just acquired
    assert meter.rate == 2.0


def test_an_instance_is_behind_when_more_waits_than_arrives_within_the_horizon() -> None:
    meter = ArrivalMeter()
    meter.observe(offsets(A={0: 0}, B={0: 0}), now=0.0)
    meter.observe(offsets(A={0: 50}, B={0: 50}), now=10.0)  # 10 messages a second
    assert not meter.behind(waiting=40, horizon_s=4.0)
    assert meter.behind(waiting=50, horizon_s=4.0)


def test_nobody_is_behind_before_arrivals_are_known() -> None:
    meter = ArrivalMeter()
    assert not meter.behind(waiting=123, horizon_s=1.0)


def test_a_pid_never_seen_is_bounded_by_all_its_tuples_on_one_key() -> None:
    assert round(tuples_within(4_000_000, [], streams=2)) == 4_000  # (4,000 / 2)^2 = 4 million
    assert round(tuples_within(1_000_000, [], streams=3)) == 300  # (300 / 3)^3 = 1 million
    assert results_of(4_000, [], streams=2) == 4_000_000


def test_a_pid_takes_fewer_tuples_where_each_makes_many_results() -> None:
    assert round(tuples_within(4_000_000, [(400_000, 3_999_999, 0)], streams=2)) == 400_000  # 10 a tuple
    assert round(tuples_within(4_000_000, [(200_000, 7_999_999, 0)], streams=2)) == 100_000  # 40 a tuple
    assert tuples_within(0, [(200_000, 0, 0)], streams=2) == 0


def test_a_pid_grows_from_a_smaller_batch_as_its_results_within_it_grow() -> None:
    """1,000 tuples made 10 results each, all among themselves (a hot key's): twice the tuples make
    four times those, so 4 million allows about 19,000, not the 400,000 the rate alone would."""
    within = [(1_000, 9_999, 9_999)]
    assert 18_000 < tuples_within(4_000_000, within, streams=2) < 20_000
    # every recent batch bounds it: the smallest bound wins
    assert tuples_within(4_000_000, [(20_000, 199_999, 0), *within], streams=2) < 20_000


def test_a_pid_whose_results_come_from_its_window_grows_with_its_tuples() -> None:
    """The same 10 results a tuple, none among the batch's own tuples (uniform keys, a full window):
    the results grow with the tuples, and 4 million allows close to 400,000."""
    assert 380_000 < tuples_within(4_000_000, [(1_000, 9_999, 0)], streams=2) < 400_000


def test_an_instance_behind_its_input_reads_every_pid_in_one_batch() -> None:
    """64 pids each read 70 tuples a batch making one result each from the window; then the instance
    fell behind by 6,000 tuples a pid. Within 1.33 million results the next batch takes every pid
    whole (about 870,000 results planned). Judged as if every result had come from within the batch,
    it took two pids, and the instance fell further behind."""
    pids = range(64)
    yields: dict[int, list[Yield]] = {p: [(70, 70, 0)] for p in pids}
    latest = offsets(A={p: 3_000 for p in pids}, B={p: 3_000 for p in pids})
    start = offsets(A={p: 0 for p in pids}, B={p: 0 for p in pids})
    end, after = pids_within(start, latest, BatchBound(1e9, 4_000_000 / 3, 1.0, 2, yields), first_pid=0)
    assert end == latest
    assert after is None


def test_a_pid_whose_results_come_from_a_full_window_grows_by_what_its_tuples_add_themselves() -> None:
    """64 tuples of a hot key made 800 results each against its full window, and 32 * 32 among
    themselves: 200 tuples make about 800 each with the window (a little more: the last batch's
    tuples are in it now) and (200 / 64)^2 times the 1,024 among themselves."""
    recent = [(64, 51_199, 1_024)]
    assert 170_000 < results_of(200, recent, streams=2) < 175_000
    assert 190 < tuples_within(167_000, recent, streams=2) < 200


def test_a_hot_pid_is_cut_and_batches_stay_within_their_bound_from_the_first() -> None:
    """A stand-in for the kernel: pid 1's tuples all on one key within W (every tuple of A joins every
    tuple of B), pids 0 and 2 none. Planned from nothing known, no batch makes more than the bound, and
    every pid keeps being served."""
    latest = offsets(A={0: 10_000, 1: 10_000, 2: 10_000}, B={0: 10_000, 1: 10_000, 2: 10_000})
    start, first = START, 0
    yields: dict[int, list[Yield]] = {}
    served: list[set[int]] = []
    for _ in range(12):
        bound = BatchBound(1e9, 100_000, 1.0, 2, yields)
        end, after = pids_within(start, latest, bound, first)
        taken = {p: sum(end[s][str(p)] - start[s][str(p)] for s in end) for p in range(3)}
        a, b = (end[s]["1"] - start[s]["1"] for s in ("A", "B"))
        made = {0: 0, 1: a * b, 2: 0}  # all within the batch: a * b combinations share the key
        assert sum(made.values()) <= 100_000, made
        for p, n in taken.items():
            if n:
                yields[p] = [*yields.get(p, []), (n, made[p], made[p])][-8:]
        served.append({p for p, n in taken.items() if n})
        start, first = end, after if after is not None else 0
    assert all(start[s][str(p)] == 10_000 for s in start for p in (0, 2)), "the cold pids were read up"
    assert all(1 in set().union(*served[i : i + 3]) for i in range(len(served) - 2)), "a slice a round"


def test_pids_never_seen_share_one_batch_within_the_bound_of_their_worst_case() -> None:
    """Eight new pids of 10,000 tuples each: one pid alone may take 2 * sqrt(R) tuples (all on one key,
    (n/2)^2 results); eight together take 2 * sqrt(R / 8) each, sqrt(8) times as much in all, and the
    sum of their worst cases stays within the bound."""
    pids = range(8)
    latest = offsets(A={p: 5_000 for p in pids}, B={p: 5_000 for p in pids})
    start = offsets(A={p: 0 for p in pids}, B={p: 0 for p in pids})
    end, after = pids_within(start, latest, BatchBound(1e9, 80_000, 1.0, 2, {}), first_pid=3)
    taken = [sum(end[s][str(p)] for s in end) for p in pids]
    assert taken == [200] * 8  # (200 / 2)^2 = 10,000 = 80,000 / 8
    assert sum((n / 2) ** 2 for n in taken) <= 80_000
    assert after == 3, "the round is over"


def test_a_new_pids_slice_holds_a_message_of_every_stream_so_its_next_batch_is_judged_by_results() -> None:
    """100 tuples a message: a slice of two messages (one a stream) makes at most 100 * 100 results, so
    a bound of 30,000 lets three new pids in, each with a message of A and one of B; the fourth new pid
    begins the next batch."""
    pids = range(6)
    latest = offsets(A={p: 50 for p in pids}, B={p: 50 for p in pids})
    start = offsets(A={p: 0 for p in pids}, B={p: 0 for p in pids})
    end, after = pids_within(start, latest, BatchBound(1e9, 30_000, 100.0, 2, {}), first_pid=0)
    assert [(end["A"][str(p)], end["B"][str(p)]) for p in pids] == [(1, 1)] * 3 + [(0, 0)] * 3
    assert after == 3


def test_many_small_new_pids_share_a_batch_in_slices_though_each_would_fit_whole() -> None:
    """256 new pids of 16 messages each (100 tuples a message: a pid's worst case whole is (800)^2 =
    640,000 results). Taken whole, two fit a bound of 1.5 million; in slices of one message a stream
    (10,000 results at worst), as many as the bound holds each take a slice."""
    pids = range(256)
    latest = offsets(A={p: 8 for p in pids}, B={p: 8 for p in pids})
    start = offsets(A={p: 0 for p in pids}, B={p: 0 for p in pids})
    end, after = pids_within(start, latest, BatchBound(1e9, 1_500_000, 100.0, 2, {}), first_pid=0)
    taken = [end["A"][str(p)] + end["B"][str(p)] for p in pids]
    served = sum(1 for n in taken if n)
    assert served == 150, f"{served} pids in the batch"
    assert sum((100 * n / 2) ** 2 for n in taken) <= 1_500_000
    assert after == 150


def test_one_new_pid_that_fits_is_taken_whole_beside_the_others() -> None:
    """A lone new pid (a move's) is read whole with the known pids around it: slices would hold the
    known pids back a batch for nothing."""
    yields: dict[int, list[Yield]] = {0: [(1_000, 0, 0)], 2: [(1_000, 0, 0)]}
    latest = offsets(A={0: 10, 1: 10, 2: 10}, B={0: 10, 1: 10, 2: 10})
    start = offsets(A={0: 0, 1: 0, 2: 0}, B={0: 0, 1: 0, 2: 0})
    end, after = pids_within(start, latest, BatchBound(1e9, 1e6, 1.0, 2, yields), first_pid=1)
    assert end == latest and after is None


def test_new_pids_wait_behind_a_batch_of_whole_pids() -> None:
    yields: dict[int, list[Yield]] = {0: [(1_000, 0, 0)]}
    latest = offsets(A={0: 10, 1: 500, 2: 500}, B={0: 10, 1: 500, 2: 500})
    start = offsets(A={0: 0, 1: 0, 2: 0}, B={0: 0, 1: 0, 2: 0})
    end, after = pids_within(start, latest, BatchBound(1e9, 10_000, 1.0, 2, yields), first_pid=0)
    assert end == offsets(A={0: 10, 1: 0, 2: 0}, B={0: 10, 1: 0, 2: 0})
    assert after == 1


def test_the_recent_yields_file_reads_back_what_the_sink_wrote(tmp_path: Path) -> None:
    path = tmp_path / "recent_yields.json"
    assert read_recent_yields(path) == {}
    write_recent_yields(path, {3: [(10, 20, 5)]})
    write_recent_yields(path, {3: [(10, 20, 5), (30, 40, 0)], 5: [(1, 0, 0)]})
    assert read_recent_yields(path) == {3: [(10, 20, 5), (30, 40, 0)], 5: [(1, 0, 0)]}
    path.write_text('{"3": [[10, 20]]}')  # an earlier version's file: every result counts as made within
    assert read_recent_yields(path) == {3: [(10, 20, 20)]}
    assert [f.name for f in tmp_path.iterdir()] == [path.name]
