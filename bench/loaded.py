"""`fluxjoin bench loaded`: Flux's loaded machines (Figs. 7 and 8 of the paper), static against flux.

Every instance runs on a CPU quota (`instance.cpu_limit`, the local twin of a pod's CPU limit). While
input flows at a fixed real-time rate, first one instance and then k instances are slowed by cutting
their quota (`LocalPipeline.set_cpu_limit`): to the instance it is as if another load on its machine
took the rest. Then every quota is restored. The run is measured per `BUCKET_S` bucket: the tuples the
pipeline joined per second, against the input rate. A slowed static instance falls behind for as long
as it is slowed; flux moves its pids to the others. After each slowdown the benchmark reports the
*recovery*: the time until the pipeline again joins at least `KEEPING_UP` of the input rate in every
bucket up to the next change. Each variant's output is judged by the oracle.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.run import DRAIN_TIMEOUT_S, bench_run, drain, follow_input, moved_pids, save_report, start_warm
from bench.skew import FLUX_SKEW_MODE, flux_skew_params
from local.processes import LocalPipeline, MetricsFollower, wait_drained
from pipeline.config import Config

BUCKET_S = 5.0
"""Throughput is counted over buckets this long (by batch end time)."""
KEEPING_UP = 0.9
"""The share of the input rate a pipeline must join per bucket to count as keeping up."""
TRIGGER_MS = 2000
"""Long enough that an instance with spare quota idles between batches, so that busy fractions tell a
slowed instance from the others (docs/benchmarks.md, "Method of the skew and convergence benchmarks")."""


@dataclass(frozen=True, slots=True)
class Phase:
    """From `at_s` seconds after the input starts, these instances run on `slowed_cores` each (all the
    others on their configured quota)."""

    name: str
    at_s: float
    slowed: tuple[str, ...]


def phases_of(instances: Sequence[str], k: int, calm_s: float, slow_s: float) -> list[Phase]:
    """Calm, one instance slowed (Fig. 7), k slowed (Fig. 8), calm again."""
    return [
        Phase("calm", 0.0, ()),
        Phase("one_slowed", calm_s, (instances[0],)),
        Phase(f"{k}_slowed", calm_s + slow_s, tuple(instances[:k])),
        Phase("restored", calm_s + 2 * slow_s, ()),
    ]


def loaded_config(
    base: Config, pipeline: str, rate: float, seconds: float, instances: int, cpu: float
) -> Config:
    """2-way, W = 10 s, P = 32, uniform keys (a tuple has about 2 W partners a second of keys), real time;
    each instance on `cpu` cores."""
    return base.with_overrides(
        pipeline=pipeline,
        streams=["A", "B"],
        partitions=32,
        instances=instances,
        window_ms=10_000,
        allowed_lateness_ms=1000,
        **{
            "generator.mode": "real_time",
            "generator.duration_s": seconds,
            "generator.max_tuples": None,
            "generator.rate": {"kind": "constant", "rate": rate / 2},
            "generator.keys": {"kind": "uniform", "count": max(256, int(rate / 2))},
            "generator.tuples_per_message": 32,
            "instance.trigger_ms": TRIGGER_MS,
            "instance.spark_master": "local[1]",
            "instance.shuffle_partitions": 1,
            "instance.cpu_limit": cpu,
        },
    )


def throughput_series(records: list[dict[str, Any]], start_ms: float) -> list[float]:
    """Tuples joined per second in each `BUCKET_S` bucket since `start_ms`, by the end time of the
    batches that joined them."""
    counts: dict[int, int] = {}
    for r in records:
        if r.get("kind") == "batch" and r["time_ms"] >= start_ms:
            index = int((r["time_ms"] - start_ms) / 1000 / BUCKET_S)
            counts[index] = counts.get(index, 0) + int(r["tuples_in"])
    return [round(counts.get(i, 0) / BUCKET_S, 1) for i in range(max(counts, default=-1) + 1)]


def recovery_s(series: Sequence[float], rate: float, from_s: float, to_s: float) -> float | None:
    """Seconds from `from_s` until the pipeline joins at least KEEPING_UP of `rate` in every whole bucket
    up to `to_s`; 0 when it never fell behind, None when it did not recover before `to_s`."""
    first, last = int(from_s / BUCKET_S), int(to_s / BUCKET_S)  # buckets [first, last)
    window = series[first:last]
    if len(window) < last - first:
        return None
    behind = [i for i, v in enumerate(window) if v < KEEPING_UP * rate]
    if not behind:
        return 0.0
    if behind[-1] == len(window) - 1:
        return None
    return (behind[-1] + 1) * BUCKET_S


def mean_over(series: Sequence[float], from_s: float, to_s: float) -> float | None:
    """Mean tuples joined per second over the whole buckets from `from_s` to `to_s`."""
    window = series[int(from_s / BUCKET_S) : int(to_s / BUCKET_S)]
    return round(sum(window) / len(window), 1) if window else None


def run_variant(
    cfg: Config,
    bootstrap: str,
    work: Path,
    policy: str,
    rate: float,
    phases: list[Phase],
    slowed_cores: float,
    say: Callable[[str], None],
) -> dict[str, Any]:
    """One pipeline under `policy` through the phases; its series, per-phase means, recoveries, moves and
    the oracle's counts."""
    from controller.runner import instance_names
    from pipeline.oracle import verify_pipeline

    pipeline = LocalPipeline(cfg, bootstrap, work)
    follower = MetricsFollower(pipeline.cfg, bootstrap)
    names = instance_names(cfg.instances)
    cpu = cfg.instance.cpu_limit or 1.0
    records: list[dict[str, Any]] = []
    decisions = work / "decisions.jsonl"
    try:
        params = flux_skew_params(TRIGGER_MS) if policy == "flux" else None
        start_warm(pipeline, follower, records, policy, params, FLUX_SKEW_MODE, decisions)
        start = time.time()
        pending = list(phases)

        def enter_phases(since_s: float) -> None:
            if pending and since_s >= pending[0].at_s:
                phase = pending.pop(0)
                for name in names:
                    pipeline.set_cpu_limit(name, slowed_cores if name in phase.slowed else cpu)
                slowed = ", ".join(phase.slowed) or "none"
                say(f"{policy}: {phase.name} at {since_s:.0f} s (slowed: {slowed})")

        follow_input(pipeline, follower, records, enter_phases)
        wait_drained(pipeline, timeout_s=DRAIN_TIMEOUT_S)  # the oracle judges the whole input
        end_s = time.time() - start
        records.extend(drain(follower))
    finally:
        follower.close()
        pipeline.stop()
    report = verify_pipeline(pipeline.cfg, bootstrap)
    series = throughput_series(records, start * 1000)
    ends = [p.at_s for p in phases[1:]] + [end_s]
    point = {
        "throughput": {p.name: mean_over(series, p.at_s, to) for p, to in zip(phases, ends, strict=True)},
        "recovery_s": {
            p.name: recovery_s(series, rate, p.at_s, to) for p, to in zip(phases, ends, strict=True)
        },
        "moves": moved_pids(decisions),
        "exact": report.exact,
        "missing": report.missing,
        "duplicate": report.duplicate,
        "spurious": report.spurious,
        "series": series,
    }
    say(f"{policy}: { ({k: v for k, v in point.items() if k != 'series'}) }")
    return point


def run_loaded_bench(
    cfg: Config,
    rate: float = 6000,
    instances: int = 4,
    cpu: float = 0.4,
    slowed_cores: float = 0.05,
    k: int = 2,
    calm_s: float = 30.0,
    slow_s: float = 60.0,
    say: Callable[[str], None] = print,
) -> dict[str, Any]:
    """Static, then flux, through the same phases in one run (one at a time on the same cores)."""
    from controller.runner import instance_names

    if not 1 <= k < instances:
        raise ValueError(f"k must be between 1 and the instances less one ({instances - 1}), got {k}")
    seconds = 2 * calm_s + 2 * slow_s
    phases = phases_of(instance_names(instances), k, calm_s, slow_s)
    summary: dict[str, Any] = {
        "setting": {"rate": rate, "instances": instances, "cpu": cpu, "slowed_cores": slowed_cores, "k": k},
        "phases": {p.name: {"at_s": p.at_s, "slowed": list(p.slowed)} for p in phases},
    }
    with bench_run(cfg, "loaded", say) as run:
        for policy in ("static", "flux"):
            name = f"{run.run_id}-{policy}"
            c = loaded_config(cfg, name, rate, seconds, instances, cpu)
            summary[policy] = run_variant(
                c, run.bootstrap, run.work / name, policy, rate, phases, slowed_cores, say
            )
    for phase in phases:
        flux, static = summary["flux"]["throughput"][phase.name], summary["static"]["throughput"][phase.name]
        summary.setdefault("flux_over_static", {})[phase.name] = (
            round(flux / static, 2) if flux is not None and static else None
        )
    save_report(run.run_id, "loaded", summary, say)
    return summary
