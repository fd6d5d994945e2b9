"""The oracle at scale: a hot key whose expected join (over 10**10 results) could never be built is
counted exactly, in memory proportional to the input.

Runs in a subprocess so that its peak memory is its own: measured both as numpy's allocations
(tracemalloc sees them) and as the growth of the process's peak resident set."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np

N = 500_000  # hot-key tuples per stream
STEP, OFFSET, WINDOW = 2, 1, 50_000  # A's k-th at k * STEP, B's at k * STEP + OFFSET
COLD = 100_000  # tuples per stream of keys no other stream has
LATE = 1_000  # hot-key tuples of B appended at event time 0: late
PRODUCED = 300_000
LIMIT = 2 * 1024**3

SCRIPT = f"""
import json, resource, sys, time, tracemalloc
import numpy as np
from pipeline.oracle import PartitionLog, judge
from pipeline.partitioning import pids_of

N, STEP, OFFSET, WINDOW, COLD, LATE, PRODUCED = {N}, {STEP}, {OFFSET}, {WINDOW}, {COLD}, {LATE}, {PRODUCED}
P, HOT = 64, 12345
hot_pid = int(pids_of([HOT], P)[0])
k = np.arange(N, dtype=np.int64)


def log(pid, ids, keys, ts, progress_at=None):
    times = ts if progress_at is None else np.append(ts, progress_at)
    is_tuple = np.ones(len(times), bool)
    if progress_at is not None:
        is_tuple[len(ts):] = False
    return PartitionLog(pid, times, is_tuple, ids, keys)


def cold(stream):
    keys = np.arange(COLD, dtype=np.int64) + (stream + 1) * 10**9
    pids = pids_of(keys, P)
    keys = keys[pids != hot_pid]
    pids = pids[pids != hot_pid]
    ts = np.sort(np.random.default_rng(stream).integers(0, N * STEP, len(keys)))
    ids = np.arange(len(keys), dtype=np.int64) + (stream + 5) * 10**8
    end = np.array([N * STEP])
    return [log(p, ids[pids == p], keys[pids == p], ts[pids == p], end) for p in np.unique(pids)]


late_ids = np.arange(LATE, dtype=np.int64) + 2 * 10**7
cold_a, cold_b = cold(0), cold(1)
a = [log(hot_pid, k, np.full(N, HOT), k * STEP), *cold_a]
b_ids = np.concatenate([k + 10**7, late_ids])
b_ts = np.concatenate([k * STEP + OFFSET, np.zeros(LATE, np.int64)])
b = [log(hot_pid, b_ids, np.full(len(b_ids), HOT), b_ts), *cold_b]
cold_tuples = sum(len(x.ids) for x in cold_a + cold_b)
valid = np.vstack([k[:PRODUCED], k[:PRODUCED] + 10**7])
again = valid[:, :LATE]
spurious = np.vstack([np.zeros(LATE, np.int64), late_ids])
produced = [valid[:, lo:lo + 100_000] for lo in range(0, PRODUCED, 100_000)] + [again, spurious]
reported = [np.empty(0, np.int64), late_ids]

before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
tracemalloc.start()
started = time.monotonic()
report = judge([a, b], produced, reported, window_ms=WINDOW, lateness_ms=2000, partitions=P)
seconds = time.monotonic() - started
peak = tracemalloc.get_traced_memory()[1]
tracemalloc.stop()
after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
json.dump({{"report": report.as_dict(), "hot_pid": hot_pid, "seconds": seconds, "traced_peak": peak,
           "rss_before": before, "rss_growth": after - before, "cold_tuples": cold_tuples,
           "cold_partitions": len(cold_a) + len(cold_b)}}, sys.stdout)
"""


def closed_form() -> int:
    """Pairs (i, j) with |(i - j) * STEP - OFFSET| <= WINDOW: n - |d| pairs for each difference d."""
    d = np.arange(-(N - 1), N, dtype=np.int64)
    joins = np.abs(d * STEP - OFFSET) <= WINDOW
    return int((N - np.abs(d[joins])).sum())


def test_a_hot_key_join_over_ten_billion_is_counted_exactly_in_bounded_memory() -> None:
    root = Path(__file__).resolve().parents[2]
    out = subprocess.run(
        [sys.executable, "-c", SCRIPT], cwd=root, capture_output=True, text=True, check=True, timeout=300
    )
    got = json.loads(out.stdout)
    report = got["report"]
    want = closed_form()
    assert want > 10**10
    assert report["expected"] == want
    assert report["produced"] == PRODUCED + 2 * LATE
    assert (report["missing"], report["duplicate"], report["spurious"]) == (want - PRODUCED, LATE, LATE)
    assert report["missing_by_pid"] == {str(got["hot_pid"]): want - PRODUCED}  # JSON: keys are text
    assert (report["late_expected"], report["late_reported"], report["wrongly_late"]) == (LATE, LATE, 0)
    assert report["late_unreported"] == 0
    assert report["input_tuples"] == 2 * N + LATE + got["cold_tuples"]
    assert report["progress_records"] == got["cold_partitions"]
    print(
        f"\nexpected {want:,} counted in {got['seconds']:.1f} s; "
        f"numpy peak {got['traced_peak'] / 2**20:.0f} MiB, "
        f"peak RSS growth {got['rss_growth'] / 2**20:.0f} MiB over {got['rss_before'] / 2**20:.0f} MiB"
    )
    assert got["traced_peak"] < LIMIT
    assert got["rss_growth"] < LIMIT
