"""`fluxjoin bench memory`: a memory squeeze, and what each policy does about it.

While input flows at a fixed real-time rate into windows large enough that state matters, the budget of
one instance is cut to a share of what its windows hold (`pipeline.control.set_state_budget`, as
`fluxjoin budget` does). The same run is made with no adaptation (`static`) and each policy that reads
memory: Liu and Rundensteiner's distributed adaptation (`memory`), Flux's memory-constrained round
(`flux-memory`) and its hybrid (`hybrid`), with no policy but spilling (`spill`: the least productive
pids first, Liu and Rundensteiner's choice; `spill-most-productive`: the reverse, for their comparison),
and with their whole rule (`memory-spill`: the distributed adaptation, and spilling only when no
instance has room, decision 0068), with active clean-up (a spilled pid cleaned up once its old
generation has left the window, and spilled again if need be) or lazy (once the input has ended, as
theirs is). Per variant: how long the squeezed instance stays over its budget while the input flows, the
peak of state over budget per instance after the squeeze, once the squeezed instance has had a batch to
answer it (to the end of the input), after the input (the clean-ups rebuild spilled windows whole) and
at the end, the pids moved, the results made while the input flowed and in all, the clean-up's work and
time, and the oracle's counts. An instance that exits fails the run.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from bench.run import (
    DRAIN_TIMEOUT_S,
    bench_run,
    drain,
    follow_input,
    moved_pids,
    pyplot,
    ratio_to,
    save_plot,
    save_report,
    start_warm,
)
from local.processes import LocalPipeline, MetricsFollower, wait_drained
from pipeline.config import Config

VARIANTS = ("static", "spill", "spill-most-productive", "memory", "memory-spill", "flux-memory", "hybrid")
"""No adaptation, spilling alone (either order), then each policy that reads memory."""
SQUEEZED = "instance-0"
SPILL_THRESHOLD = 0.9
"""The spill variants spill once the windows hold this share of the budget."""


def variant_settings(variant: str, cleanup: str = "active") -> tuple[str, dict[str, float], dict[str, Any]]:
    """The controller's policy of a variant, its parameters, and its instances' config overrides: a
    spill variant runs the `static` policy with spilling on (clean-up `cleanup`), `memory-spill` the
    `memory` policy coupled with spilling at the same threshold, the others their policy with spilling
    off."""
    if variant not in ("spill", "spill-most-productive", "memory-spill"):
        return variant, {}, {}
    spilling = {
        "instance.spill_threshold": SPILL_THRESHOLD,
        "instance.spill_choice": "most-productive"
        if variant == "spill-most-productive"
        else "least-productive",
        "instance.spill_cleanup": cleanup,
    }
    if variant == "memory-spill":
        return "memory", {"spill_room": SPILL_THRESHOLD}, spilling
    return "static", {}, spilling


def memory_config(
    base: Config,
    pipeline: str,
    rate: float,
    seconds: float,
    instances: int,
    window_s: float,
    hot_pids: bool = False,
) -> Config:
    """2-way, P = 32, real time, W = `window_s` (the state an instance holds grows with it), one core's
    worth of CPU per instance at most. Keys uniform, or (`hot_pids`) 80% of the tuples on a fixed 20% of
    the pids, keys uniform within a pid: a hot pid makes more results per byte of window than a cold one,
    as Liu and Rundensteiner's partition groups differ in productivity."""
    keys: dict[str, Any] = {"kind": "uniform", "count": max(256, int(rate / 2))}
    if hot_pids:
        keys = {"kind": "hot_pids", "count": max(256, int(rate / 2)), "move_every_s": 10 * seconds}
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
            "generator.keys": keys,
            "generator.tuples_per_message": 32,
            "instance.trigger_ms": 1000,
            "instance.spark_master": "local[1]",
            "instance.shuffle_partitions": 1,
        },
    )


def over_budget_s(
    records: Sequence[dict[str, Any]], instance: str, from_ms: float, until_ms: float = float("inf")
) -> float | None:
    """Seconds from `from_ms` until the instance's batches up to `until_ms` hold at most their budget
    for good (its last batch over budget ends the span); 0 when none is over it after `from_ms`, None
    when its last batch still is."""
    mine = [
        r
        for r in records
        if r.get("kind") == "batch" and r["instance"] == instance and from_ms <= r["time_ms"] <= until_ms
    ]
    over = [r for r in mine if r["state_bytes"] > r["state_budget_bytes"]]
    if not over:
        return 0.0
    if over[-1] is mine[-1]:
        return None
    return round((over[-1]["time_ms"] - from_ms) / 1000, 1)


def peak_fill(
    records: Sequence[dict[str, Any]], from_ms: float, until_ms: float = float("inf")
) -> dict[str, float]:
    """Per instance, the largest state over budget of its batches from `from_ms` to `until_ms`."""
    peaks: dict[str, float] = {}
    for r in records:
        if r.get("kind") != "batch" or not from_ms <= r["time_ms"] <= until_ms:
            continue
        if r["state_budget_bytes"] > 0:
            fill = r["state_bytes"] / r["state_budget_bytes"]
            peaks[r["instance"]] = round(max(peaks.get(r["instance"], 0.0), fill), 3)
    return dict(sorted(peaks.items()))


def fill_at_the_end(records: Sequence[dict[str, Any]]) -> dict[str, float]:
    """Per instance, its newest batch's state over budget: after the clean-ups, which bring spilled
    windows back into memory (docs/memory.md)."""
    newest = {r["instance"]: r for r in records if r.get("kind") == "batch" and r["state_budget_bytes"] > 0}
    return {i: round(r["state_bytes"] / r["state_budget_bytes"], 3) for i, r in sorted(newest.items())}


def answered_at(records: Sequence[dict[str, Any]], instance: str, from_ms: float) -> float:
    """When the instance's first batch after `from_ms` committed: the batch that learned of the new
    budget, and whose state an instance can only answer in the batches after it (a spill is planned by
    the next batch; a move takes longer)."""
    mine = [
        r["time_ms"]
        for r in records
        if r.get("kind") == "batch" and r["instance"] == instance and r["time_ms"] >= from_ms
    ]
    return min(mine, default=float("inf"))


def results_until(records: Sequence[dict[str, Any]], until_ms: float) -> int:
    """The results of the batches committed by `until_ms` (while the input flowed)."""
    return sum(int(r["results"]) for r in records if r.get("kind") == "batch" and r["time_ms"] <= until_ms)


def cleanup_figures(records: Sequence[dict[str, Any]], input_end_ms: float) -> dict[str, Any]:
    """What the clean-ups did: pids cleaned, tuples re-read and results made, and the seconds from the
    end of the input to the last clean-up's batch (None without one after it)."""
    cleaned = [
        (r["time_ms"], entry)
        for r in records
        if r.get("kind") == "batch"
        for entry in r.get("cleaned", {}).values()
    ]
    late = [t for t, _ in cleaned if t >= input_end_ms]
    return {
        "cleanups": len(cleaned),
        "cleanup_tuples": sum(int(tuples) for _, (tuples, _) in cleaned),
        "cleanup_results": sum(int(results) for _, (_, results) in cleaned),
        "cleanup_s": round((max(late) - input_end_ms) / 1000, 1) if late else None,
    }


def results_over_time(records: Sequence[dict[str, Any]], start_ms: float, bucket_s: float = 5.0) -> list[int]:
    """Results per `bucket_s` seconds from `start_ms`, all instances together: the report's plot."""
    buckets: list[int] = []
    for r in records:
        if r.get("kind") != "batch" or r["time_ms"] < start_ms:
            continue
        i = int((r["time_ms"] - start_ms) / 1000 / bucket_s)
        buckets.extend([0] * (i + 1 - len(buckets)))
        buckets[i] += int(r["results"])
    return buckets


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
    policy_params: dict[str, float] | None = None,
) -> dict[str, Any]:
    """One pipeline under `policy` (with `policy_params`): `squeeze_at_s` seconds into the input, the
    squeezed instance's budget becomes `squeeze_to` of what its windows hold then."""
    from pipeline.control import set_state_budget
    from pipeline.oracle import verify_pipeline

    pipeline = LocalPipeline(cfg, bootstrap, work)
    follower = MetricsFollower(pipeline.cfg, bootstrap)
    records: list[dict[str, Any]] = []
    decisions = work / "decisions.jsonl"
    squeezed_ms: float | None = None
    budget = 0
    try:
        start_warm(pipeline, follower, records, policy, policy_params, decisions=decisions)
        started_ms = time.time() * 1000

        def squeeze(since_s: float) -> None:
            nonlocal squeezed_ms, budget
            if squeezed_ms is None and since_s >= squeeze_at_s:
                budget = max(1, int(held_by(records, SQUEEZED) * squeeze_to))
                set_state_budget(pipeline.cfg, bootstrap, SQUEEZED, budget)
                squeezed_ms = time.time() * 1000
                say(f"{policy}: {SQUEEZED}'s budget cut to {budget:,} bytes")

        follow_input(pipeline, follower, records, squeeze)
        input_end_ms = time.time() * 1000
        wait_drained(pipeline, timeout_s=DRAIN_TIMEOUT_S)  # the oracle judges the whole input
        wait_cleaned(pipeline, follower, records)
        records.extend(drain(follower))
    finally:
        follower.close()
        pipeline.stop()
    report = verify_pipeline(pipeline.cfg, bootstrap)
    after = squeezed_ms if squeezed_ms is not None else float("inf")
    point = {
        "squeezed_budget_bytes": budget,
        "over_budget_s": over_budget_s(records, SQUEEZED, after, input_end_ms),
        "peak_fill_after_squeeze": peak_fill(records, after),
        "peak_fill_once_answered": peak_fill(
            records, answered_at(records, SQUEEZED, after) + 1, input_end_ms
        ),
        "peak_fill_after_the_input": peak_fill(records, input_end_ms),  # the clean-ups' batches
        "fill_at_the_end": fill_at_the_end(records),
        "moves": moved_pids(decisions),
        "results_during_input": results_until(records, input_end_ms),
        "results": sum(int(r["results"]) for r in records if r.get("kind") == "batch"),
        **cleanup_figures(records, input_end_ms),
        "restarts": 0,  # an instance that exits fails the run
        "exact": report.exact,
        "missing": report.missing,
        "duplicate": report.duplicate,
        "spurious": report.spurious,
    }
    say(f"{policy}: { {k: v for k, v in point.items() if k != 'results_per_5s'} }")
    return point | {"results_per_5s": results_over_time(records, started_ms)}


def wait_cleaned(
    pipeline: LocalPipeline, follower: MetricsFollower, records: list[dict[str, Any]], timeout_s: float = 300
) -> None:
    """Block until no instance's newest batch holds a spilled pid with results left for its clean-up
    (`deferred`; a parked one has none): lazy clean-up runs once the input has paused, after the
    instances have read it all."""
    from pipeline.control import wait_for

    def none_spilled() -> bool:
        records.extend(follower.poll())
        newest: dict[str, dict[str, Any]] = {}
        for r in records:
            if r.get("kind") == "batch":
                newest[r["instance"]] = r
        pipeline.check_alive()
        return not any(r.get("deferred") for r in newest.values())

    wait_for(none_spilled, timeout_s, "every spilled pid cleaned up", 1.0)


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
    spill_cleanup: str = "active",
    hot_pids: bool = False,
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
            "spill_cleanup": spill_cleanup,
            "hot_pids": hot_pids,
        }
    }
    with bench_run(cfg, "memory", say) as run:
        for variant in variants:
            name = f"{run.run_id}-{variant}"
            policy, params, overrides = variant_settings(variant, spill_cleanup)
            c = memory_config(cfg, name, rate, seconds, instances, window_s, hot_pids)
            c = c.with_overrides(**overrides)
            summary[variant] = run_variant(
                c, run.bootstrap, run.work / name, policy, squeeze_at_s, squeeze_to, say, params
            )
    least, most = summary.get("spill"), summary.get("spill-most-productive")
    if least and most:  # Liu and Rundensteiner: spilling the least productive leaves less to clean up
        summary["cleanup_tuples_most_over_least"] = ratio_to(most["cleanup_tuples"], least["cleanup_tuples"])
        summary["cleanup_s_most_over_least"] = ratio_to(most["cleanup_s"], least["cleanup_s"])
        summary["cleanup_results_most_over_least"] = ratio_to(
            most["cleanup_results"], least["cleanup_results"]
        )
    save_report(run.run_id, "memory", summary, say)
    plot_results(run.run_id, summary, say)
    return summary


def plot_results(run_id: str, summary: dict[str, Any], say: Callable[[str], None]) -> None:
    """Results per 5 s per variant, as reports/bench/<run id>/memory.png (`bench.run.pyplot`)."""
    plt = pyplot(say)
    if plt is None:
        return
    fig, ax = plt.subplots(figsize=(8, 4))
    for variant, point in summary.items():
        if isinstance(point, dict) and "results_per_5s" in point:
            series = point["results_per_5s"]
            ax.plot([5 * i for i in range(len(series))], series, label=variant)
    ax.set_xlabel("seconds since the input started")
    ax.set_ylabel("results per 5 s")
    ax.legend()
    save_plot(plt, fig, run_id, "memory", say)
