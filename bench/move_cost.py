"""`fluxjoin bench move-cost`: what one move costs, by handoff mode and window size, against a restart.

Holds the setting (two instances, P = 16), the figures read from the instances' batch records (a moved
pid's pause, the time until its target reads it, the other pids' p99, the CPU per second) and the run
that compares each move with the quiet spell just before it.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from functools import partial
from itertools import pairwise
from pathlib import Path
from typing import Any

from bench.run import bench_run, ratio_to, rounded_median, save_report, start_warm
from local.processes import LocalPipeline, MetricsFollower, weighted_percentiles
from pipeline.config import Config


def move_cost_config(base: Config, pipeline: str, window_ms: int, rate: float, seconds: float) -> Config:
    """2-way, P = 16, 2 instances; keys sized for about one result per input tuple at this window.
    Polled every 0.1 s: a move's step starts at the next poll, not at the next trigger (decision 0027)."""
    per_stream = rate / 2
    return base.with_overrides(
        pipeline=pipeline,
        streams=["A", "B"],
        window_ms=window_ms,
        partitions=16,
        instances=2,
        **{
            "generator.mode": "real_time",
            "generator.duration_s": seconds,
            "generator.max_tuples": None,
            "generator.rate": {"kind": "constant", "rate": per_stream},
            "generator.keys": {"kind": "uniform", "count": max(256, int(per_stream * window_ms / 1000))},
            "instance.spark_master": "local[1]",
            "instance.shuffle_partitions": 1,
            "instance.trigger_ms": 500,
            "instance.poll_ms": 100,
        },
    )


def _pid_batches(records: list[dict[str, Any]], pid: int) -> list[tuple[float, str]]:
    """(batch end ms, instance) of every batch that read input of `pid`, in time order."""
    return sorted(
        (r["time_ms"], r["instance"]) for r in records if r["pids"].get(str(pid), {}).get("in", 0) > 0
    )


def pause_of(records: list[dict[str, Any]], pid: int, after_ms: float) -> float:
    """The longest gap between consecutive batches reading `pid` from `after_ms` on (seconds): the pid's
    pause across a move or a restart."""
    times = [t for t, _ in _pid_batches(records, pid) if t >= after_ms - 5000]
    gaps = [b - a for a, b in pairwise(times)]
    return round(max(gaps, default=0.0) / 1000, 2)


def batch_interval_s(records: list[dict[str, Any]], start_ms: float, end_ms: float) -> float:
    """The median gap between consecutive batches reading a pid, over all pids, in [start_ms, end_ms):
    how often a pid's input is processed in steady state (the yardstick of a move's pause)."""
    gaps = []
    for pid in {int(p) for r in records for p in r["pids"]}:
        times = [t for t, _ in _pid_batches(records, pid) if start_ms <= t < end_ms]
        gaps += [b - a for a, b in pairwise(times)]
    return round(statistics.median(gaps) / 1000, 2) if gaps else 0.0


def to_target_s(records: list[dict[str, Any]], pid: int, target: str, after_ms: float) -> float | None:
    """Seconds from `after_ms` (the move's request) to the target's first batch reading `pid`."""
    first = [t for t, i in _pid_batches(records, pid) if i == target and t >= after_ms]
    return round((first[0] - after_ms) / 1000, 2) if first else None


def busy_per_s(records: list[dict[str, Any]], start_ms: float, end_ms: float) -> float:
    """Seconds of micro-batch work per second of wall time, summed over the instances, in
    [start_ms, end_ms): the CPU a step costs, compared with the same figure in steady state."""
    work = sum(r["duration_s"] for r in records if start_ms <= r["time_ms"] < end_ms)
    return round(work / max((end_ms - start_ms) / 1000, 1e-3), 3)


def _acquired(log: Any, move_id: str) -> bool:
    return move_id in log.catch_up().acquired


def _settled(log: Any) -> bool:
    """No move in flight and no parallel track open: the assignment of record is at rest."""
    a = log.catch_up().assignment
    return a is not None and not (a.moving or a.handoffs or a.tracks or a.track_handoffs)


def p99_of_pids(
    records: list[dict[str, Any]], start_ms: float, end_ms: float, moved: int | None = None
) -> float | None:
    """The result-latency p99 of the batches in [start_ms, end_ms), from each pid's latency sample,
    leaving out the `moved` pid: how a move treats the pids it does not move."""
    samples = [
        p
        for r in records
        if start_ms <= r["time_ms"] < end_ms
        for pid, p in r["pids"].items()
        if int(pid) != moved and p.get("results")
    ]
    return weighted_percentiles(samples, (99,))[0]


MOVES_PER_MODE = 3
"""Moves of each mode per window size, there and back. One move's pause is one sample of a noisy machine
(the pauses of one mode in one setting spread widely, decision 0038): the report gives each figure's
median over the moves, the longest pause and every move's figures."""


def medians_of(samples: list[dict[str, Any]]) -> dict[str, float | None]:
    """Each key's median over the samples that have a value for it."""
    out: dict[str, float | None] = {}
    for key in samples[0]:
        values = [s[key] for s in samples if s[key] is not None]
        out[key] = rounded_median(values)
    return out


def spell_figures(records: list[dict[str, Any]], start_ms: float, end_ms: float) -> dict[str, Any]:
    """A quiet spell's yardsticks: the p99 of every pid, the batch interval and the work per second."""
    return {
        "p99_s": p99_of_pids(records, start_ms, end_ms),
        "batch_interval_s": batch_interval_s(records, start_ms, end_ms),
        "busy_per_s": busy_per_s(records, start_ms, end_ms),
    }


def measure_move_cost(
    cfg: Config, bootstrap: str, work: Path, steady_s: float, say: Callable[[str], None]
) -> dict[str, Any]:
    """After the window has filled: `MOVES_PER_MODE` moves by transfer, by replay and by parallel track,
    then a restart of instance-0's query (the stop-the-world alternative).

    Each step is compared with the quiet spell just before it (docs/benchmarks.md, "Method of the move-cost
    benchmark"): a spell's p99 is about its slowest batch, and one steady spell measured minutes earlier
    drifted from the moves' spells by as much as the 1.2x the issue allows. A quiet spell begins once the
    previous move has settled (a parallel track stays open until the sender's old tuples have left the
    window)."""
    import signal

    from controller.moves.kafka_mover import request_moves
    from controller.runner import instance_names
    from pipeline.control import ControlLog, wait_for
    from pipeline.protocol import Mode

    pipeline = LocalPipeline(cfg, bootstrap, work)
    follower = MetricsFollower(pipeline.cfg, bootstrap)
    log = ControlLog(bootstrap, cfg.control_topic)
    records: list[dict[str, Any]] = []
    spells: list[dict[str, Any]] = []

    def collect_for(seconds: float) -> None:
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            records.extend(r for r in follower.poll() if r.get("kind") == "batch")
            pipeline.check_alive()

    def quiet_spell() -> dict[str, Any]:
        wait_for(partial(_settled, log), 120, "the previous move to settle")
        start = time.time() * 1000
        collect_for(steady_s)
        spells.append(spell_figures(records, start, time.time() * 1000))
        return spells[-1]

    out: dict[str, Any] = {}
    names = instance_names(2)
    try:
        warm_up: list[dict[str, Any]] = []
        start_warm(pipeline, follower, warm_up, "static")
        records.extend(r for r in warm_up if r.get("kind") == "batch")
        collect_for(cfg.window_ms / 1000 + 15)  # fill the window
        for pid, mode in ((0, Mode.TRANSFER), (1, Mode.REPLAY), (3, Mode.PARALLEL_TRACK)):
            moves: list[dict[str, Any]] = []
            for n in range(MOVES_PER_MODE):  # instance-0 to instance-1, back, and so on
                steady = quiet_spell()
                target = names[(n + 1) % 2]
                started = time.time() * 1000
                move_id = request_moves(cfg, bootstrap, [pid], target, mode).move_id(pid)
                wait_for(partial(_acquired, log, move_id), 120, f"the {mode.value} move")
                collect_for(steady_s)
                ended = time.time() * 1000
                others_p99 = p99_of_pids(records, started, ended, moved=pid)
                busy = busy_per_s(records, started, ended)
                moves.append(
                    {
                        "pause_s": pause_of(records, pid, started),
                        "to_target_s": to_target_s(records, pid, target, started),
                        "others_p99_s": others_p99,
                        "others_p99_x": ratio_to(others_p99, steady["p99_s"]),
                        "busy_per_s": busy,
                        "busy_x": ratio_to(busy, steady["busy_per_s"]),
                        "steady_p99_s": steady["p99_s"],
                    }
                )
                say(f"move-cost W={cfg.window_ms} ms {mode.value} move {n + 1}: {moves[-1]}")
            out[mode.value] = medians_of(moves) | {
                "pause_max_s": max(m["pause_s"] for m in moves),
                "others_p99_x_max": max((m["others_p99_x"] or 0.0) for m in moves),
                "moves": moves,
            }
        steady = quiet_spell()
        started = time.time() * 1000
        pipeline.kill(names[0], signal.SIGTERM)  # the global alternative: stop the query, start it again
        stopped = time.time() * 1000  # the old process has exited: a batch after this is the new one's
        pipeline.start_instance(names[0])
        deadline = time.monotonic() + 300
        while not any(t > stopped for t, _ in _pid_batches(records, 2)) and time.monotonic() < deadline:
            collect_for(1.0)  # until the restarted query reads pid 2 again
        collect_for(steady_s)
        others_p99 = p99_of_pids(records, started, time.time() * 1000)
        out["restart"] = {
            "pause_s": pause_of(records, 2, started),
            "others_p99_s": others_p99,
            "others_p99_x": ratio_to(others_p99, steady["p99_s"]),
        }
        say(f"move-cost W={cfg.window_ms} ms restart: {out['restart']}")
    finally:
        log.close()
        follower.close()
        pipeline.stop()
    out |= {f"steady_{k}": v for k, v in medians_of(spells).items()}  # the yardsticks of the quiet spells
    state = [int(r.get("state_bytes", 0)) for r in records if r["instance"] == "instance-0"]
    out["state_bytes_instance0"] = max(state, default=0)
    return out


def run_move_cost_bench(
    cfg: Config,
    windows_ms: list[int],
    rate: float = 4000,
    steady_s: float = 15,
    say: Callable[[str], None] = print,
) -> dict[str, Any]:
    summary: dict[str, Any] = {}
    with bench_run(cfg, "move-cost", say) as run:
        for w in windows_ms:
            # Fill, a quiet spell and a spell after each move, the restart's; parallel tracks settle.
            spells = 6 * MOVES_PER_MODE + 3
            seconds = w / 1000 + 15 + spells * steady_s + MOVES_PER_MODE * w / 1000 + 90
            c = move_cost_config(cfg, f"{run.run_id}-w{w}", w, rate, seconds)
            summary[str(w)] = measure_move_cost(c, run.bootstrap, run.work / f"w{w}", steady_s, say)
    save_report(run.run_id, "move_cost", summary, say)
    return summary
