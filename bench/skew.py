"""`fluxjoin bench skew`: static vs flux under skew that moves, each instance on a fixed CPU budget.

Holds the skew setting (`skew_config`), the calibration of its trigger on this machine
(`measure_idle_batch_s`), the flux preset for it (`flux_skew_params`, `FLUX_SKEW_MODE`), one point
(a rate under a policy) and the report that sets the two policies side by side. The convergence
benchmark runs flux in this same setting and preset.
"""

from __future__ import annotations

import math
import signal
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench.run import bench_run, drain, follow_input, ratio_to, save_report, start_warm
from local.processes import LocalPipeline, MetricsFollower, ProcessFailed, wait_drained, weighted_percentiles
from pipeline.config import Config, HotPidsKeys

FLUX_SKEW_MODE = "replay"
"""Flux's moves run as replays (docs/benchmarks.md, "Method of the skew and convergence benchmarks"). A
transfer pauses the moved pid, a hot one carrying many results, for about three triggers. A parallel track
never pauses it, but its donor goes on joining the pid's new tuples with the old ones for a window, so the
relief comes W after the move. A replay pauses the pid for about two batch intervals (decisions 0035, 0037)
and relieves the donor at once: side by side, flux's p99 was lower with replays than with parallel
tracks."""
FLUX_SKEW_MOVES_PER_PAIR = 8
"""Flux may move up to this many pids per pair and round (docs/load-model.md, "Which pids move"): the hot set
is 13 pids."""
FLUX_SKEW_MIN_MOVE_SHARE = 0.25
"""A pid that processed less than this share of its donor's largest pid's tuples stays put (decision
0021). A hot pid carries 16 times a cold one's tuples here (80% of them on 20% of the pids); at 750
tuples/s rounds moved up to 16 cold pids at a time, each worth 0.001-0.004 of its donor's time, off
instances that read as loaded by the hot pids on their way to them."""


def skew_trigger_ms(idle_batch_s: float) -> int:
    """The skew benchmark's trigger: twice an idle instance's micro-batch, rounded up to whole seconds,
    so that an idle instance idles about half the time and busy fractions tell it from a loaded one.
    With back-to-back batches every instance reads as fully busy and no policy can see the skew
    (docs/benchmarks.md, "Method of the skew and convergence benchmarks")."""
    return 1000 * math.ceil(2 * idle_batch_s - 1e-9)


CALIBRATION_INPUT_S = 40.0
"""Seconds of input in the trigger's calibration; its batches after the first 10 s give the median."""


def measure_idle_batch_s(
    cfg: Config,
    bootstrap: str,
    run_id: str,
    work: Path,
    rate: float,
    instances: int,
    cpu: float,
    key_seconds: float,
    say: Callable[[str], None],
) -> float:
    """The median micro-batch of an idle instance of the skew shape, on this machine: the benchmark's
    instances on the `cpu` budget, each owning its share of the pids, fed what instances away from the
    hot set get at `rate` (the 20% of tuples outside the hot set, spread evenly, over the benchmark's
    keys), with a 1 s trigger so that batches run back to back.

    Measured rather than assumed (docs/benchmarks.md, "Method of the skew and convergence benchmarks"): an
    idle batch's cost assumed from one machine made every instance read as busy on a machine twice as slow,
    and flux saw no skew to act on. Measured on the benchmark's own instances: one instance owning all 64
    pids ran much longer batches than the benchmark's idle instances do, so its trigger was far longer than
    needed, and a pipeline that keeps up shows its results a trigger later."""
    name = f"{run_id}-calibration"
    cold = 0.2  # the share of the input outside the hot set; key_seconds scaled to the benchmark's keys
    c = skew_config(
        cfg, name, cold * rate, 0.0, instances, cpu, key_seconds / cold, 1000, even_s=CALIBRATION_INPUT_S
    )
    pipeline = LocalPipeline(c, bootstrap, work / name)
    follower = MetricsFollower(c, bootstrap)
    records: list[dict[str, Any]] = []
    try:
        start_warm(pipeline, follower, records, "static")
        started_ms = time.time() * 1000
        follow_input(pipeline, follower, records)
    finally:
        follower.close()
        pipeline.stop()
    durations = [
        r["duration_s"] for r in records if r.get("kind") == "batch" and r["time_ms"] >= started_ms + 10_000
    ]
    if not durations:
        raise RuntimeError(
            f"the trigger's calibration saw no micro-batch in {CALIBRATION_INPUT_S:g} s of input"
        )
    idle_s = round(statistics.median(durations), 2)
    say(f"skew: an idle batch takes {idle_s} s on {cpu:g} cores: trigger {skew_trigger_ms(idle_s)} ms")
    return idle_s


def flux_skew_params(trigger_ms: int) -> dict[str, float]:
    """Flux collects over two triggers at least (a shorter interval holds no batch of some instances),
    may move several pids per pair but none too small to matter (docs/load-model.md, "Which pids move") and
    charges a moved pid at the donor's cost (docs/load-model.md, "Which pids move"): the instances are alike,
    and a hot pid's tuples join far more partners than the receiver's own. The round after a move phase comes
    delta_min after it (docs/load-model.md, "Arrival rates"): a receiver's catch-up with the moved backlog can
    last longer than what is left of the input after the hot set moves."""
    two_triggers = 2 * trigger_ms / 1000
    return {
        "delta_s": two_triggers,
        "delta_min_s": two_triggers,
        "max_moves_per_pair": FLUX_SKEW_MOVES_PER_PAIR,
        "min_move_share": FLUX_SKEW_MIN_MOVE_SHARE,
        "donor_cost": 1.0,
        "phase_interval": 0.0,
    }


def sustained_drain_s(trigger_ms: int) -> float:
    """A rate is sustained when the backlog left at the end of the input drains within 10 s beyond the
    two triggers a keeping-up pipeline may need to show its last input done."""
    return 10 + 2 * trigger_ms / 1000


def skew_config(
    base: Config,
    pipeline: str,
    rate: float,
    seconds: float,
    instances: int,
    cpu: float,
    key_seconds: float,
    trigger_ms: int,
    hot_set_s: float = 60.0,
    even_s: float = 0.0,
) -> Config:
    """2-way, W = 10 s, P = 64; after `even_s` seconds of input spread evenly over the pids (warming
    the join up, docs/benchmarks.md, "Method of the skew and convergence benchmarks"), `seconds` in which 20%
    of the pids carry 80% of the tuples and the hot pids change every `hot_set_s`; each instance runs on `cpu`
    cores (a cgroup quota), so skew cannot hide in shared cores.
    As many distinct keys as `key_seconds` of one stream's input (at least 8 per pid, so that every
    pid has keys): a tuple has about 2 W / key_seconds partners on average whatever the rate, so a
    smaller value makes a heavier join per tuple, and the work grows with the rate, not its square.

    A loaded instance's micro-batches grow with its backlog. Capping them at one trigger's worth of
    input was tried: every batch pays the fixed cost, and static drained more slowly (docs/benchmarks.md,
    "Measurements behind the code's constants"), so only the default bounds apply, the one on results
    among them (decision 0045).

    Each instance's JVM has a 2 GB heap: a loaded instance's batch collects millions of results at once
    (a 1 GB heap ran out on static's hot instance at 3,000 tuples/s once its batches ran as one task,
    decision 0033).

    The hot pids are contiguous, so under the static layout (contiguous pid ranges) they load one or
    two instances: with scattered hot pids each of 4 instances holds about its share of them, and the
    static layout is balanced by construction."""
    per_stream, partitions = rate / 2, 64
    return base.with_overrides(
        pipeline=pipeline,
        streams=["A", "B"],
        window_ms=10_000,
        partitions=partitions,
        instances=instances,
        **{
            "generator.mode": "real_time",
            "generator.duration_s": even_s + seconds,
            "generator.max_tuples": None,
            "generator.rate": {"kind": "constant", "rate": per_stream},
            "generator.keys": {
                "kind": "hot_pids",
                "count": max(8 * partitions, int(per_stream * key_seconds)),
                "hot_fraction": 0.2,
                "hot_share": 0.8,
                "move_every_s": hot_set_s,
                "layout": "contiguous",
                "even_s": even_s,
            },
            "instance.spark_master": "local[1]",
            "instance.shuffle_partitions": 1,
            "instance.driver_memory": "2g",
            "instance.trigger_ms": trigger_ms,
            "instance.cpu_limit": cpu,
        },
    )


def hold_assignment(pipeline: LocalPipeline, mode: str) -> None:
    """Restart the controller under the static policy: it completes the moves in flight and starts
    none. Run when the input ends, so that the drain measures the backlog left then. A move started
    after the end reacts to a load that no longer arrives, and a parallel track started then waits
    for event time that no longer advances and holds the drain long after the backlog has cleared
    (docs/benchmarks.md, "Method of the skew and convergence benchmarks")."""
    pipeline.kill("controller", signal.SIGTERM)
    pipeline.start_controller(policy="static", mode=mode)


SKEW_DRAIN_TIMEOUT_S = 900
"""A point whose backlog has not drained this long after the input ended is recorded as unfinished
(not sustained, latency and output unknown) and the run goes on: static at twice its limit need not drain
in any time a run can wait, and such a point once lost a whole run to the timeout (docs/benchmarks.md,
"Measurements behind the code's constants")."""


def measure_skew_point(
    cfg: Config, bootstrap: str, work: Path, policy: str, say: Callable[[str], None]
) -> dict[str, Any]:
    """One rate under one policy: sustainable when the backlog left at the end of the input drains
    within `sustained_drain_s`, the assignment held from then on (`hold_assignment`); latency
    percentiles over results from the skew's start (after the even warm-up, at least 20 s in). The
    output is checked against the oracle: a policy's moves, several at a time, must lose and
    duplicate nothing. A point that does not drain within SKEW_DRAIN_TIMEOUT_S, or in which a process
    fails (an instance out of heap), is unfinished, with the reason: its results are incomplete, so
    neither its latency nor its exactness is known (both None)."""
    from pipeline.oracle import verify_pipeline

    pipeline = LocalPipeline(cfg, bootstrap, work)
    follower = MetricsFollower(pipeline.cfg, bootstrap)
    records: list[dict[str, Any]] = []
    trigger_ms = cfg.instance.trigger_ms
    rate = cfg.generator.rate.rate * 2  # type: ignore[union-attr]
    try:
        flux = policy == "flux"
        params, mode = (flux_skew_params(trigger_ms), FLUX_SKEW_MODE) if flux else (None, "transfer")
        start_warm(pipeline, follower, records, policy, params, mode)
        started_ms = time.time() * 1000
        drain_s: float | None
        failure: str | None = None
        try:
            follow_input(pipeline, follower, records)
            input_end = time.monotonic()
            hold_assignment(pipeline, mode)
            wait_drained(pipeline, timeout_s=SKEW_DRAIN_TIMEOUT_S)
        except (TimeoutError, ProcessFailed) as stopped:
            failure = str(stopped).splitlines()[0]
            say(f"skew: {policy} at {rate:,.0f} tuples/s unfinished, not sustained: {stopped}")
            drain_s = None
        else:
            drain_s = time.monotonic() - input_end
            time.sleep(1.0)
            records.extend(drain(follower))
    finally:
        follower.close()
        pipeline.stop()
    moves = sum(1 for line in (work / "controller.log").read_text().splitlines() if line.endswith("started"))
    if drain_s is None:
        unknown = (
            "latency_p50_s",
            "latency_p99_s",
            "results",
            "missing",
            "duplicate",
            "spurious",
            "late_expected",
            "late_reported",
        )
        unfinished = {
            "drain_s": None,
            "sustained": False,
            "unfinished": failure,
            "moves": moves,
            "exact": None,
        }
        return unfinished | dict.fromkeys(unknown)
    keys = cfg.generator.keys
    skew_ms = started_ms + max(20.0, keys.even_s if isinstance(keys, HotPidsKeys) else 0.0) * 1000
    steady = [r for r in records if r.get("kind") == "batch" and r["time_ms"] >= skew_ms]
    p50, p99 = weighted_percentiles([r for r in steady if r["results"]], (50, 99))
    report = verify_pipeline(pipeline.cfg, bootstrap)
    point = {
        "drain_s": round(drain_s, 1),
        "sustained": drain_s <= sustained_drain_s(trigger_ms),
        "latency_p50_s": p50,
        "latency_p99_s": p99,
        "moves": moves,
        "results": report.produced,
        "missing": report.missing,
        "duplicate": report.duplicate,
        "spurious": report.spurious,
        "late_expected": report.late_expected,
        "late_reported": report.late_reported,
        "exact": report.exact,
    }
    say(f"skew: {policy} at {rate:,.0f} tuples/s: {point}")
    return point


def run_skew_bench(
    cfg: Config,
    rates: list[float],
    seconds: float = 240,
    instances: int = 4,
    cpu: float = 0.25,
    key_seconds: float = 1.0,
    hot_set_s: float = 120.0,
    even_s: float = 60.0,
    say: Callable[[str], None] = print,
) -> dict[str, Any]:
    """Both policies at each rate (ascending), side by side; stops a policy at its first failed rate.
    The defaults are the setting in which static saturates before the machine does: a quarter core per
    instance, a heavy join per tuple (1 s of keys), and two hot sets of 120 s each."""
    points: dict[str, dict[float, dict[str, Any]]] = {"static": {}, "flux": {}}
    with bench_run(cfg, "skew", say) as run:
        idle_s = measure_idle_batch_s(
            cfg, run.bootstrap, run.run_id, run.work, min(rates), instances, cpu, key_seconds, say
        )
        trigger_ms = skew_trigger_ms(idle_s)
        inexact: list[str] = []  # the config files of the points whose output was not exact
        for rate in sorted(rates):
            for policy in ("static", "flux"):
                earlier = points[policy]
                if earlier and not earlier[max(earlier)]["sustained"]:
                    continue
                name = f"{run.run_id}-{policy}-{int(rate)}"
                c = skew_config(
                    cfg, name, rate, seconds, instances, cpu, key_seconds, trigger_ms, hot_set_s, even_s
                )
                earlier[rate] = measure_skew_point(c, run.bootstrap, run.work / name, policy, say)
                if earlier[rate]["exact"] is False:
                    inexact.append(str(run.work / name / "config.yaml"))
        if inexact:  # the evidence of a wrong result outweighs the broker's disk
            configs = " ".join(inexact)
            say(f"kept the run's topics, a point was not exact: fluxjoin verify -c CONFIG for {configs}")
            run.keep_topics = True
    setting = {"hot_set_s": hot_set_s, "even_s": even_s, "idle_batch_s": idle_s, "trigger_ms": trigger_ms}
    summary = {policy: skew_summary(by_rate, setting) for policy, by_rate in points.items()}
    summary["flux"]["against_static"] = against_static(summary["static"], summary["flux"])
    say(f"skew: flux against static: {summary['flux']['against_static']}")
    save_report(run.run_id, "skew", summary, say)
    return summary


def against_static(static: dict[str, Any], flux: dict[str, Any]) -> dict[str, Any]:
    """The issue's two ratios, from the two policies' lines of one run (`skew_summary`).

    Static's saturation rate is the lowest rate it did not sustain. `rate_ratio` is flux's sustainable
    rate over static's (None when static sustained no rate tried); `rate_ratio_at_least` divides by
    the saturation rate instead, a lower bound of the true ratio whatever static's limit below it is.
    The latency ratios are static's over flux's at the saturation rate (None where a point is
    missing or unfinished)."""
    failed = [rate for rate, p in static["points"].items() if not p["sustained"]]
    saturation = min(failed, key=int) if failed else None
    saturation_rate = float(saturation) if saturation else None
    at_static, at_flux = static["points"].get(saturation, {}), flux["points"].get(saturation, {})
    return {
        "rate_ratio": ratio_to(flux["sustainable_rate"], static["sustainable_rate"]),
        "rate_ratio_at_least": ratio_to(flux["sustainable_rate"], saturation_rate),
        "static_saturation_rate": saturation_rate,
        "latency_p50_ratio": ratio_to(at_static.get("latency_p50_s"), at_flux.get("latency_p50_s")),
        "latency_p99_ratio": ratio_to(at_static.get("latency_p99_s"), at_flux.get("latency_p99_s")),
    }


def skew_summary(by_rate: dict[float, dict[str, Any]], setting: dict[str, Any]) -> dict[str, Any]:
    """One policy's line of the skew report: its largest sustained rate with the latency there, and
    whether every point it verified was exact (an unfinished point, exact None, was not verified)."""
    ok = [r for r, p in by_rate.items() if p["sustained"]]
    best = max(ok) if ok else 0.0
    at = by_rate.get(best, {})
    return {
        "sustainable_rate": best,
        **setting,
        "latency_p50_s": at.get("latency_p50_s"),
        "latency_p99_s": at.get("latency_p99_s"),
        "exact": all(p["exact"] for p in by_rate.values() if p["exact"] is not None),
        "points": {str(int(r)): p for r, p in sorted(by_rate.items())},
    }
