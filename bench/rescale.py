"""`fluxjoin bench rescale`: from 2 workers to 3 while the input flows, fluxjoin against Apache Flink.

Flink rescales a job the way its users do: stop with a savepoint, then start the same job from it at
the new parallelism (`bench/flink/`, `--rescale-to`); nothing is read or written in between. fluxjoin
starts a third instance and moves it an even share of the pids (`plan_scale_out`, what the operator
does on `kubectl scale`), in one handoff mode per run, while the pids that stay keep running.

Each engine runs on its own topics (the same seeded input, shifted in time) at a fixed real-time rate,
one at a time on the same cores, with a read_committed reader following its results topic. From what
the reader saw, for each engine:

- **pause**: per pid (keys bucketed by fluxjoin's partitioning function, for both engines alike), the
  longest gap between two reads carrying results of the pid, after the scale command; the largest over
  the pids, against the same figure before the command (the steady gap), and how many pids' gap passed
  twice the steady one;
- **latency after**: p50 and p99 of the results read in the minute after the rescale first touched
  running work (Flink: the savepoint asked for; fluxjoin: the moves requested);
- **time to steady state**: from the scale command to the first second, once the rescale is over
  (Flink running again; fluxjoin's moves finished), from which every second's p99 stays within
  `steady_bound` of the p99 before the command for `STEADY_S` seconds; and the same from the moment
  the rescale first touched running work (fluxjoin's includes the new instance's start-up, during
  which nothing pauses);
- the oracle's verdict on the whole output.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from bench.peers import FlinkJob, FlinkProcess, ResultWatch, flink_classpath, loaded, watched_latency
from bench.run import bench_run, follow_input, save_report, start_warm, wait_warm
from bench.throughput import latency_config
from local.processes import LocalPipeline, MetricsFollower
from pipeline.config import Config

STEADY_S = 10
"""Seconds every per-second p99 must stay within bound for the steady state to count as reached."""
AFTER_S = 60.0
"""The span after the rescale first touched running work whose latency is reported."""
HANDOFF_MODES = ("transfer", "parallel_track", "replay")


def rescale_config(base: Config, pipeline: str, rate: float, seconds: float) -> Config:
    """The latency benchmark's input (2-way, W = 10 s, P = 64, one result per tuple) on 2 instances of
    one core each: 3 instances on the machine's 2 cores once the third has started."""
    return latency_config(base, pipeline, rate, seconds).with_overrides(
        instances=2, **{"instance.spark_master": "local[1]", "instance.shuffle_partitions": 1}
    )


@dataclass(frozen=True)
class Timeline:
    """When (unix seconds) the scale was asked for, when it first touched running work and when it was
    over; what the reader read, with its results' pids."""

    command: float
    disruption: float
    rescaled: float
    reads: Sequence[float]
    latencies: Sequence[npt.NDArray[np.float64]]
    pids: Sequence[npt.NDArray[np.int32]]


def timeline(
    watch: ResultWatch, partitions: int, command: float, disruption: float, rescaled: float
) -> Timeline:
    """The closed reader's messages as read times, per-result latencies (seconds) and their pids."""
    from pipeline.partitioning import pids_of

    seen = watch.seen
    return Timeline(
        command,
        disruption,
        rescaled,
        [at for at, _ in seen],
        [at - t / 1000 for at, t in seen],
        [np.unique(pids_of(k, partitions)) for k in watch.keys],
    )


def longest_gaps(t: Timeline, start: float, end: float) -> dict[int, float]:
    """Per pid, the longest gap between consecutive reads carrying its results, over the gaps that end
    in [start, end) (the read before `start` opens the first)."""
    times: dict[int, list[float]] = {}
    for at, pids in zip(t.reads, t.pids, strict=True):
        for pid in pids.tolist():
            times.setdefault(pid, []).append(at)
    gaps: dict[int, float] = {}
    for pid, ats in times.items():
        arr = np.asarray(ats)
        ends = (arr[1:] >= start) & (arr[1:] < end)
        if ends.any():
            gaps[pid] = float(np.diff(arr)[ends].max())
    return gaps


def p99_in(t: Timeline, start: float, end: float) -> tuple[float | None, float | None]:
    """p50 and p99 latency (seconds) of the results read in [start, end)."""
    picked = [lat for at, lat in zip(t.reads, t.latencies, strict=True) if start <= at < end]
    if not picked:
        return None, None
    p50, p99 = np.percentile(np.concatenate(picked), (50, 99))
    return round(float(p50), 3), round(float(p99), 3)


def steady_bound(p99_before: float) -> float:
    """The per-second p99 that counts as back to steady: half again the p99 before the rescale, or
    half a second above it, whichever is more (a small p99 moves by a batch's length)."""
    return max(1.5 * p99_before, p99_before + 0.5)


def steady_at(t: Timeline, bound: float) -> float | None:
    """The first whole second from `t.rescaled` on after which every second (each with results read)
    has its p99 within `bound` for `STEADY_S` seconds; None if that never happens."""
    seconds: dict[int, list[npt.NDArray[np.float64]]] = {}
    for at, lat in zip(t.reads, t.latencies, strict=True):
        seconds.setdefault(int(at), []).append(lat)
    calm = {s for s, lats in seconds.items() if np.percentile(np.concatenate(lats), 99) <= bound}
    last = max(seconds, default=0)
    for s in range(int(t.rescaled), last - STEADY_S + 1):
        if all(s + i in calm for i in range(STEADY_S)):
            return float(s)
    return None


def rescale_figures(t: Timeline, warm_up_end: float) -> dict[str, Any]:
    """The report's figures of one engine's rescale (module docstring)."""
    before = longest_gaps(t, warm_up_end, t.command)
    after = longest_gaps(t, t.command, float("inf"))
    steady_gap = max(before.values(), default=0.0)
    _, p99_before = p99_in(t, warm_up_end, t.command)
    p50_after, p99_after = p99_in(t, t.disruption, t.disruption + AFTER_S)
    steady = steady_at(t, steady_bound(p99_before)) if p99_before is not None else None
    return {
        "longest_pause_s": round(max(after.values(), default=0.0), 2),
        "steady_gap_s": round(steady_gap, 2),
        "pids_paused": sum(1 for g in after.values() if g > 2 * steady_gap),
        "latency_p99_before_s": p99_before,
        "latency_p50_after_s": p50_after,
        "latency_p99_after_s": p99_after,
        "rescale_s": round(t.rescaled - t.command, 2),
        "to_steady_s": round(steady - t.command, 2) if steady is not None else None,
        "disrupted_to_steady_s": round(steady - t.disruption, 2) if steady is not None else None,
    }


def first_read_event_s(watch: ResultWatch) -> float:
    """The earliest max event time the reader has seen (unix seconds): where the input began."""
    return min(float(t.min()) for _, t in watch.seen if len(t)) / 1000


def run_fluxjoin(
    cfg: Config, bootstrap: str, work: Path, mode: str, command_after_s: float, say: Callable[[str], None]
) -> Callable[[ResultWatch], dict[str, Any]]:
    """fluxjoin's side: 2 instances under a static controller, then a third instance and the moves
    that give it its share, `command_after_s` seconds after the input began."""
    from controller.assignment import initial_assignment
    from controller.moves.kafka_mover import await_request, request_moves
    from controller.runner import instance_names
    from controller.scaling import plan_scale_out
    from pipeline.protocol import Mode

    def run(watch: ResultWatch) -> dict[str, Any]:
        pipeline = LocalPipeline(cfg, bootstrap, work)
        follower = MetricsFollower(pipeline.cfg, bootstrap)
        records: list[dict[str, Any]] = []
        try:
            start_warm(pipeline, follower, records, "static", mode=mode)
            began = time.time()
            _sleep_until(began + command_after_s, pipeline.check_alive)
            command = time.time()
            say(f"fluxjoin ({mode}): starting instance-2")
            pipeline.start_instance("instance-2")
            pipeline.wait_running(["instance-2"])
            wait_warm(pipeline, follower, ["instance-2"], records)  # as the operator waits for readiness
            moves = plan_scale_out(initial_assignment(cfg.partitions, instance_names(2)), ["instance-2"])
            disruption = time.time()
            request = request_moves(pipeline.cfg, bootstrap, [m.pid for m in moves], "instance-2", Mode(mode))
            if await_request(pipeline.cfg, bootstrap, request, wait_s=600) is None:
                raise TimeoutError(f"the {len(moves)} moves to instance-2 did not finish within 600 s")
            rescaled = time.time()
            say(f"fluxjoin ({mode}): {len(moves)} pids moved in {rescaled - disruption:.1f} s")
            follow_input(pipeline, follower, records)
            watch.wait_quiet()
        finally:
            follower.close()
            pipeline.stop()
        return {"command": command, "disruption": disruption, "rescaled": rescaled, "moved": len(moves)}

    return run


def run_flink(
    cfg: Config, bootstrap: str, work: Path, classpath: Sequence[Path], command_after_s: float
) -> Callable[[ResultWatch], dict[str, Any]]:
    """Flink's side: the job at parallelism 2, stopped with a savepoint `command_after_s` seconds after
    the input began and started again from it at 3."""

    def run(watch: ResultWatch) -> dict[str, Any]:
        signal = work / "rescale"
        job = FlinkJob.of(cfg, bootstrap, cfg.results_topic, work, bounded=False).rescaled(3, signal, work)
        generator = LocalPipeline(cfg, bootstrap, work / "generator")
        with FlinkProcess(job, classpath, work / "flink") as flink:
            flink.wait_for("running", timeout_s=120)
            generator.start_generator()
            try:
                began = time.time()
                _sleep_until(began + command_after_s, generator.check_alive)
                command = time.time()
                signal.touch()
                flink.wait_for("restarted", timeout_s=600)
                while generator.procs["generator"].poll() is None:
                    generator.check_alive()
                    time.sleep(0.5)
                watch.wait_quiet()
            finally:
                generator.stop()
            if flink.proc.poll() is not None:
                raise RuntimeError(f"the Flink job exited early; see {flink.err}")
            found = flink.markers()
        return {"command": command, "disruption": found["stop"] / 1000, "rescaled": found["restarted"] / 1000}

    return run


def _sleep_until(moment: float, check: Callable[[], None]) -> None:
    while time.time() < moment:
        check()
        time.sleep(0.5)


def measure(
    cfg: Config,
    bootstrap: str,
    name: str,
    run: Callable[[ResultWatch], dict[str, Any]],
    say: Callable[[str], None],
    warm_up_s: float,
) -> dict[str, Any]:
    """One engine's rescale run, its figures and the oracle's verdict."""
    marks: dict[str, Any] = {}
    watches: list[ResultWatch] = []

    def watched(watch: ResultWatch) -> None:
        watches.append(watch)
        marks.update(run(watch))

    verdict = watched_latency(cfg, bootstrap, watched, say, name)  # the reader is closed on return
    watch = watches[0]
    t = timeline(watch, cfg.partitions, marks["command"], marks["disruption"], marks["rescaled"])
    figures = rescale_figures(t, first_read_event_s(watch) + warm_up_s)
    figures |= {"exact": verdict["exact"], "latency_p50_s": verdict["latency_p50_s"]}
    figures |= {k: v for k, v in marks.items() if k == "moved"}
    say(
        f"{name}: longest pause {figures['longest_pause_s']} s (steady gap {figures['steady_gap_s']} s, "
        f"{figures['pids_paused']} pids paused), p99 after {figures['latency_p99_after_s']} s, "
        f"steady after {figures['to_steady_s']} s; exact: {figures['exact']}"
    )
    return loaded(figures)


def run_rescale_bench(
    cfg: Config,
    rate: float = 10_000,
    seconds: float = 150,
    command_after_s: float = 40,
    modes: Sequence[str] = HANDOFF_MODES,
    say: Callable[[str], None] = print,
) -> dict[str, Any]:
    """Flink's stop-with-savepoint rescale, then fluxjoin's live scale-out in each handoff mode; the
    summary (also under reports/bench/) has each engine's figures side by side."""
    from bench.peers import WARM_UP_S

    classpath = flink_classpath(say)
    engines: dict[str, dict[str, Any]] = {}
    with bench_run(cfg, "rescale", say) as run:
        c = rescale_config(cfg, f"{run.run_id}-flink", rate, seconds)
        flink = run_flink(c, run.bootstrap, run.work / "flink", classpath, command_after_s)
        engines["flink"] = measure(c, run.bootstrap, "flink", flink, say, WARM_UP_S)
        for mode in modes:
            c = rescale_config(cfg, f"{run.run_id}-{mode.replace('_', '-')}", rate, seconds)
            ours = run_fluxjoin(c, run.bootstrap, run.work / mode, mode, command_after_s, say)
            engines[f"fluxjoin {mode}"] = measure(c, run.bootstrap, f"fluxjoin {mode}", ours, say, WARM_UP_S)
    summary = {
        "rate": rate,
        "seconds": seconds,
        "command_after_s": command_after_s,
        "exact": all(e["exact"] for e in engines.values()),
        "engines": engines,
    }
    save_report(run.run_id, "rescale", summary, say)
    return summary
