"""`fluxjoin bench memory`: a memory squeeze, and what each policy does about it.

While input flows at a fixed real-time rate into windows large enough that state matters, the budget of
one instance is cut to a share of what its windows hold (`pipeline.control.set_state_budget`, as
`fluxjoin budget` does). The same run is made with no adaptation (`static`) and each policy that reads
memory: Liu and Rundensteiner's distributed adaptation (`memory`), Flux's memory-constrained round
(`flux-memory`) and its hybrid (`hybrid`). Per variant: how long the squeezed instance stays over its
budget, the peak of state over budget per instance after the squeeze, the pids moved, the results and
the oracle's counts. An instance that exits fails the run.

Nothing spills yet (docs/memory.md): an instance over its budget keeps its windows, so the variants
differ only in what the controller moves.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from bench.run import DRAIN_TIMEOUT_S, bench_run, drain, follow_input, moved_pids, save_report, start_warm
from local.processes import LocalPipeline, MetricsFollower, wait_drained
from pipeline.config import Config

VARIANTS = ("static", "memory", "flux-memory", "hybrid")
"""No adaptation, then each policy that reads memory."""
SQUEEZED = "instance-0"


def memory_config(
    base: Config, pipeline: str, rate: float, seconds: float, instances: int, window_s: float
) -> Config:
    """2-way, P = 32, uniform keys, real time, W = `window_s` (the state an instance holds grows with it),
    one core's worth of CPU per instance at most."""
    return base.with_overrides(
        pipeline=pipeline,
        streams=["A", "B"],
        partitions=32,
        instances=instances,
        window_ms=int(window_s * 1000),
        allowed_lateness_ms=1000,
        **{
            "generator.mode": "real_time",
            "generator.duration_s": seconds,
            "generator.max_tuples": None,
            "generator.rate": {"kind": "constant", "rate": rate / 2},
            "generator.keys": {"kind": "uniform", "count": max(256, int(rate / 2))},
            "generator.tuples_per_message": 32,
            "instance.trigger_ms": 1000,
            "instance.spark_master": "local[1]",
            "instance.shuffle_partitions": 1,
        },
    )


def over_budget_s(records: Sequence[dict[str, Any]], instance: str, from_ms: float) -> float | None:
    """Seconds from `from_ms` until the instance's batches hold at most their budget for good (its last
    batch over budget ends the span); 0 when none is over it after `from_ms`, None when its last batch
    still is."""
    mine = [
        r
        for r in records
        if r.get("kind") == "batch" and r["instance"] == instance and r["time_ms"] >= from_ms
    ]
    over = [r for r in mine if r["state_bytes"] > r["state_budget_bytes"]]
    if not over:
        return 0.0
    if over[-1] is mine[-1]:
        return None
    return round((over[-1]["time_ms"] - from_ms) / 1000, 1)


def peak_fill(records: Sequence[dict[str, Any]], from_ms: float) -> dict[str, float]:
    """Per instance, the largest state over budget of its batches from `from_ms`."""
    peaks: dict[str, float] = {}
    for r in records:
        if r.get("kind") == "batch" and r["time_ms"] >= from_ms and r["state_budget_bytes"] > 0:
            fill = r["state_bytes"] / r["state_budget_bytes"]
            peaks[r["instance"]] = round(max(peaks.get(r["instance"], 0.0), fill), 3)
    return dict(sorted(peaks.items()))


def held_by(records: Sequence[dict[str, Any]], instance: str) -> int:
    """The state the instance's newest batch record reports."""
    mine = [r for r in records if r.get("kind") == "batch" and r["instance"] == instance]
    return int(mine[-1]["state_bytes"]) if mine else 0


def run_variant(
    cfg: Config,
    bootstrap: str,
    work: Path,
    policy: str,
    squeeze_at_s: float,
    squeeze_to: float,
    say: Callable[[str], None],
) -> dict[str, Any]:
    """One pipeline under `policy`: `squeeze_at_s` seconds into the input, the squeezed instance's budget
    becomes `squeeze_to` of what its windows hold then."""
    from pipeline.control import set_state_budget
    from pipeline.oracle import verify_pipeline

    pipeline = LocalPipeline(cfg, bootstrap, work)
    follower = MetricsFollower(pipeline.cfg, bootstrap)
    records: list[dict[str, Any]] = []
    decisions = work / "decisions.jsonl"
    squeezed_ms: float | None = None
    budget = 0
    try:
        start_warm(pipeline, follower, records, policy, decisions=decisions)

        def squeeze(since_s: float) -> None:
            nonlocal squeezed_ms, budget
            if squeezed_ms is None and since_s >= squeeze_at_s:
                budget = max(1, int(held_by(records, SQUEEZED) * squeeze_to))
                set_state_budget(pipeline.cfg, bootstrap, SQUEEZED, budget)
                squeezed_ms = time.time() * 1000
                say(f"{policy}: {SQUEEZED}'s budget cut to {budget:,} bytes")

        follow_input(pipeline, follower, records, squeeze)
        wait_drained(pipeline, timeout_s=DRAIN_TIMEOUT_S)  # the oracle judges the whole input
        records.extend(drain(follower))
    finally:
        follower.close()
        pipeline.stop()
    report = verify_pipeline(pipeline.cfg, bootstrap)
    after = squeezed_ms if squeezed_ms is not None else float("inf")
    point = {
        "squeezed_budget_bytes": budget,
        "over_budget_s": over_budget_s(records, SQUEEZED, after),
        "peak_fill_after_squeeze": peak_fill(records, after),
        "moves": moved_pids(decisions),
        "results": sum(int(r["results"]) for r in records if r.get("kind") == "batch"),
        "exact": report.exact,
        "missing": report.missing,
        "duplicate": report.duplicate,
        "spurious": report.spurious,
    }
    say(f"{policy}: {point}")
    return point


def run_memory_bench(
    cfg: Config,
    rate: float = 2000,
    instances: int = 3,
    window_s: float = 20.0,
    squeeze_at_s: float = 40.0,
    squeeze_to: float = 0.5,
    seconds: float = 120.0,
    variants: Sequence[str] = VARIANTS,
    say: Callable[[str], None] = print,
) -> dict[str, Any]:
    """Each variant in turn on the same cores, in one run."""
    if not 0 < squeeze_to < 1:
        raise ValueError(f"squeeze_to must be between 0 and 1, got {squeeze_to}")
    summary: dict[str, Any] = {
        "setting": {
            "rate": rate,
            "instances": instances,
            "window_s": window_s,
            "squeeze_at_s": squeeze_at_s,
            "squeeze_to": squeeze_to,
            "seconds": seconds,
        }
    }
    with bench_run(cfg, "memory", say) as run:
        for policy in variants:
            name = f"{run.run_id}-{policy}"
            c = memory_config(cfg, name, rate, seconds, instances, window_s)
            summary[policy] = run_variant(
                c, run.bootstrap, run.work / name, policy, squeeze_at_s, squeeze_to, say
            )
    save_report(run.run_id, "memory", summary, say)
    return summary
