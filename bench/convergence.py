"""`fluxjoin bench convergence`: how fast flux rebalances after a load shift, and whether it thrashes.

Flux runs in the skew benchmark's setting and preset (`bench.skew`), once per delta_min; its controller
records every round's decision as a JSON line (`fluxjoin controller --decisions`), and the instances'
batch records give the imbalance over time.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.run import bench_run, drain, follow_input, rounded_median, save_report, start_warm
from bench.skew import FLUX_SKEW_MODE, flux_skew_params, measure_idle_batch_s, skew_config, skew_trigger_ms
from local.processes import LocalPipeline, MetricsFollower
from pipeline.config import Config

BUCKET_S = 5.0
"""Busy fractions are compared over buckets this long (by batch end time)."""


def imbalance_series(records: list[dict[str, Any]], instances: list[str], start_ms: float) -> list[float]:
    """Per `BUCKET_S` bucket since `start_ms`: busiest over idlest instance's busy fraction, the policy's
    own measure (`controller.observation.estimates.busy_fraction`) over the batches ending in the
    bucket. An instance with none keeps its last figure (it is inside a longer batch); before its first
    batch it reads 0. The idlest is floored at 0.01, so an idle instance reads as a large, finite
    imbalance."""
    from controller.observation.estimates import busy_fraction

    buckets: dict[int, dict[str, list[dict[str, Any]]]] = {}
    for r in records:
        if r.get("kind") == "batch" and r["time_ms"] >= start_ms and r["instance"] in instances:
            index = int((r["time_ms"] - start_ms) / 1000 / BUCKET_S)
            buckets.setdefault(index, {}).setdefault(r["instance"], []).append(r)
    busy = dict.fromkeys(instances, 0.0)
    series = []
    for index in range(max(buckets, default=-1) + 1):
        for name, batches in buckets.get(index, {}).items():
            busy[name] = busy_fraction(batches)
        high, low = max(busy.values()), min(busy.values())
        series.append(round(high / max(0.01, low), 2) if high > 0 else 1.0)
    return series


@dataclass(frozen=True, slots=True)
class Round:
    """A policy round as the controller recorded it: when (seconds since the input started), how many
    pids it moved, and whether the policy found the instances balanced by its own test (flux: the most
    and the least utilized instance within th_imb of each other, `Decision.balanced`)."""

    at_s: float
    moves: int
    balanced: bool


def rounds_of(decisions: Path, start: float) -> list[Round]:
    """The rounds in a controller's decisions file (`fluxjoin controller --decisions`: one JSON object a
    round, its unix `time`, `moves` and `balanced`), timed from `start` (epoch seconds)."""
    records = [json.loads(line) for line in decisions.read_text().splitlines() if line]
    return [Round(r["time"] - start, len(r["moves"]), r["balanced"]) for r in records]


def convergence_of(
    rounds: list[Round], shift_s: float, end_s: float, quiet_s: float = 20.0
) -> dict[str, Any]:
    """Moves per minute over the run; after the shift, the rounds that moved pids, and the rounds and
    seconds until balanced: until the first round after the shift's last moves that found the
    instances balanced by the policy's own test, at least `quiet_s` before the end, so that they
    stayed balanced that long (0 if the shift needed no move; None if no round did so: still moving,
    or left unbalanced). A round found balanced between moves does not count: the load it saw may not
    yet have been the shift's.
    `settle_s` is the time from the shift to the last move, if the moves stopped at least `quiet_s`
    before the end (else None: still moving)."""
    moves = sum(r.moves for r in rounds)
    after = [r for r in rounds if r.at_s >= shift_s]
    moved = [i for i, r in enumerate(after) if r.moves]
    point: dict[str, Any] = {
        "moves": moves,
        "moves_per_min": round(moves / (end_s / 60), 2),
        "rounds_after_shift": len(moved),
        "rounds_to_balance": 0,
        "balanced_s": 0.0,
        "settle_s": None if moved and after[moved[-1]].at_s > end_s - quiet_s else 0.0,
    }
    if not moved:
        return point
    if point["settle_s"] is not None:
        point["settle_s"] = round(after[moved[-1]].at_s - shift_s, 1)
    balanced = next((r for r in after[moved[-1] :] if r.balanced), None)
    if balanced is None or balanced.at_s > end_s - quiet_s:
        return point | {"rounds_to_balance": None, "balanced_s": None}
    return point | {"rounds_to_balance": len(moved), "balanced_s": round(balanced.at_s - shift_s, 1)}


CONVERGENCE_SERIES = ("imbalance_series", "rounds")
"""A convergence point's per-bucket and per-round listings, left out where a summary is printed."""


def measure_convergence(
    cfg: Config, bootstrap: str, work: Path, delta_min_s: float, shift_s: float, say: Callable[[str], None]
) -> dict[str, Any]:
    """One flux run with `delta_min_s`, otherwise as the skew benchmark runs flux (several moves per
    pair, in FLUX_SKEW_MODE): the input's hot pids change at `shift_s` (and at its multiples)."""
    from controller.runner import instance_names

    pipeline = LocalPipeline(cfg, bootstrap, work)
    follower = MetricsFollower(pipeline.cfg, bootstrap)
    names = instance_names(cfg.instances)
    records: list[dict[str, Any]] = []
    try:
        params = flux_skew_params(cfg.instance.trigger_ms) | {
            "delta_min_s": delta_min_s,
            "delta_s": max(1.0, delta_min_s),
        }
        start_warm(pipeline, follower, records, "flux", params, FLUX_SKEW_MODE, work / "decisions.jsonl")
        start = time.time()
        follow_input(pipeline, follower, records)
        end_s = time.time() - start
        records.extend(drain(follower))
    finally:
        follower.close()
        pipeline.stop()
    rounds = rounds_of(work / "decisions.jsonl", start)
    series = imbalance_series(records, names, start * 1000)
    before = series[max(0, int((shift_s - 20) / BUCKET_S)) : int(shift_s / BUCKET_S)]
    last = series[-int(20 / BUCKET_S) - 1 : -1]  # the final bucket is partial
    point = {
        **convergence_of(rounds, shift_s, end_s),
        "imbalance_before_shift": rounded_median(before),
        "imbalance_at_end": rounded_median(last),
        "imbalance_series": series,
        "rounds": [[round(r.at_s, 1), r.moves, r.balanced] for r in rounds],
    }
    shown = {k: v for k, v in point.items() if k not in CONVERGENCE_SERIES}
    say(f"convergence: delta_min {delta_min_s:g} s: {shown}")
    return point


def run_convergence_bench(
    cfg: Config,
    delta_mins: list[float],
    rate: float = 2000,
    shift_s: float = 90,
    instances: int = 4,
    cpu: float = 0.25,
    key_seconds: float = 1.0,
    say: Callable[[str], None] = print,
) -> dict[str, Any]:
    """Flux after a load shift, once per delta_min (the Flux paper's Fig. 9 sweep), in one run; the
    defaults are the skew benchmark's setting at a rate both policies sustain there."""
    summary: dict[str, Any] = {}
    with bench_run(cfg, "convergence", say) as run:
        idle_s = measure_idle_batch_s(
            cfg, run.bootstrap, run.run_id, run.work, rate, instances, cpu, key_seconds, say
        )
        trigger_ms = skew_trigger_ms(idle_s)
        for delta_min in delta_mins:
            name = f"{run.run_id}-d{delta_min:g}".replace(".", "p")
            c = skew_config(cfg, name, rate, 2 * shift_s, instances, cpu, key_seconds, trigger_ms, shift_s)
            summary[f"{delta_min:g}"] = measure_convergence(
                c, run.bootstrap, run.work / name, delta_min, shift_s, say
            )
    save_report(run.run_id, "convergence", summary, say)
    return summary
