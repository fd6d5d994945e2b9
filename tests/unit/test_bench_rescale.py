"""The rescale benchmark's pure parts: per-pid pauses, latency in a span and the steady state."""

from __future__ import annotations

import numpy as np

from bench.rescale import STEADY_S, Timeline, longest_gaps, p99_in, rescale_figures, steady_at, steady_bound


def _timeline(reads: list[tuple[float, list[int], float]], command: float, rescaled: float) -> Timeline:
    """Reads as (time, pids carried, latency of each of its results)."""
    return Timeline(
        command=command,
        disruption=command,
        rescaled=rescaled,
        reads=[at for at, _, _ in reads],
        latencies=[np.full(len(pids), lat) for _, pids, lat in reads],
        pids=[np.array(pids, np.int32) for _, pids, _ in reads],
    )


def _every_second(
    start: int, end: int, pids: list[int], latency: float
) -> list[tuple[float, list[int], float]]:
    return [(float(s), pids, latency) for s in range(start, end)]


def test_a_pid_that_stops_has_the_longest_gap_and_the_others_keep_theirs() -> None:
    # pids 0 and 1 read every second; pid 1 has nothing read from 40 to 47.
    reads = _every_second(0, 100, [0], 1.0) + [(float(s), [1], 1.0) for s in range(0, 100) if not 40 < s < 47]
    t = _timeline(sorted(reads), command=30, rescaled=50)
    after = longest_gaps(t, t.command, float("inf"))
    assert after == {0: 1.0, 1: 7.0}
    assert longest_gaps(t, 0, t.command) == {0: 1.0, 1: 1.0}
    figures = rescale_figures(t, warm_up_end=0)
    assert figures["longest_pause_s"] == 7.0 and figures["steady_gap_s"] == 1.0
    assert figures["pids_paused"] == 1, "only the pid that stopped is counted as paused"


def test_the_gap_across_the_command_belongs_to_after() -> None:
    t = _timeline([(10.0, [0], 1.0), (20.0, [0], 1.0), (30.0, [0], 1.0)], command=15, rescaled=15)
    assert longest_gaps(t, 15, float("inf")) == {0: 10.0}, "the read before the command opens the gap"
    assert longest_gaps(t, 0, 15) == {}, "no gap ends before the command but the first read's"


def test_latency_in_a_span_is_over_the_results_read_in_it() -> None:
    t = _timeline([(1.0, [0, 1], 1.0), (2.0, [0], 5.0), (3.0, [0], 2.0)], command=0, rescaled=0)
    assert p99_in(t, 1.5, 3.5) == (3.5, 4.97)
    assert p99_in(t, 10, 20) == (None, None)


def test_steady_state_needs_every_second_within_bound_after_the_rescale() -> None:
    bound = steady_bound(1.0)
    assert bound == 1.5, "a small p99 is allowed half a second"
    assert steady_bound(4.0) == 6.0, "a large one half again"
    calm_before = _every_second(0, 40, [0], 1.0)
    spike = _every_second(40, 45, [0], 9.0)
    calm_after = _every_second(45, 45 + STEADY_S + 5, [0], 1.0)
    t = _timeline(calm_before + spike + calm_after, command=30, rescaled=42)
    assert steady_at(t, bound) == 45.0, "not before the rescale, not during the spike"
    silent = calm_before + _every_second(50, 50 + STEADY_S + 5, [0], 1.0)
    assert steady_at(_timeline(silent, command=30, rescaled=42), bound) == 50.0, (
        "a second with no read is no calm"
    )
    assert steady_at(_timeline(calm_before + spike, command=30, rescaled=42), bound) is None
