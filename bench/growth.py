"""`fluxjoin bench growth`: how the cost of a catch-up grows with the window, the keys, the pids and
the instances, each point judged by the oracle.

Every point pre-loads a 2-way input on fresh topics and times its catch-up, as `bench throughput` does:
from the start of the first micro-batch to the end of the last (Spark's start-up excluded), reporting
tuples/s, the work done per second (input tuples plus results: what the join must touch), and the peak
of the window state the instances held. Four curves, each changing one setting from the base (W = 10 s,
P = 64, one instance `local[2]`, event time at `RATE` tuples/s per stream):

- **window** W in 1, 10, 60, 300 s, with keys = RATE x W so that each tuple has about one result: the
  work per tuple stays the same and the state grows with W. The input spans at least three windows.
- **keys** from 1K to 10M at W = 10 s: results per tuple fall from about 20 to about 0.002.
- **pids** P in 16, 64, 256, 1024.
- **instances** 1 to 4, each on a contiguous range of the pids, `local[1]` under a CPU quota of half a
  core (`instance.cpu_limit`), so that four share the 2 cores as one would have them alone; 2,000,000
  tuples a point.

The figure to read is the cost per unit of work (microseconds per tuple or result, `us_per_work`): flat
along a curve means the cost grows as the work does.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, replace
from typing import Any

from bench.run import bench_run, pyplot, save_plot, save_report
from bench.throughput import catchup_config, measure_fluxjoin
from pipeline.config import Config

RATE = 2_000
"""Event-time tuples/s per stream: a modest real-time stream, so that a 300 s window is 1.2M tuples."""
MIN_TUPLES = 400_000
"""Tuples pre-loaded per point at least (more where the input must span three large windows)."""
SCALE_TUPLES = 2_000_000
"""Tuples per point of the instances curve: under half a core, an instance's first batch (code
generation, Python workers) takes seconds, which a short catch-up would mostly measure."""
WINDOWS_S = (1, 10, 60, 300)
KEYS = (1_000, 10_000, 100_000, 1_000_000, 10_000_000)
PARTITIONS = (16, 64, 256, 1024)
INSTANCES = (1, 2, 3, 4)
QUOTA_CORES = 0.5
"""Each instance's CPU quota on the instances curve: four of them fill the machine's 2 cores."""


@dataclass(frozen=True)
class Point:
    """One catch-up's settings."""

    window_s: int = 10
    keys: int = RATE * 10
    partitions: int = 64
    instances: int = 1
    quota: bool = False
    min_tuples: int = MIN_TUPLES

    @property
    def tuples(self) -> int:
        """Enough for the input to span three windows, and at least `min_tuples`."""
        return max(self.min_tuples, 2 * RATE * 3 * self.window_s)

    def config(self, base: Config, pipeline: str) -> Config:
        cfg = catchup_config(base, pipeline, self.tuples).with_overrides(
            window_ms=self.window_s * 1000,
            partitions=self.partitions,
            instances=self.instances,
            **{
                "generator.rate": {"kind": "constant", "rate": RATE},
                "generator.keys": {"kind": "uniform", "count": self.keys},
            },
        )
        if not self.quota:
            return cfg
        quota = {"instance.cpu_limit": QUOTA_CORES, "instance.spark_master": "local[1]"}
        return cfg.with_overrides(**quota, **{"instance.shuffle_partitions": 1})


CURVES = ("window_s", "keys", "partitions", "instances")


def curves(quick: bool = False, only: Sequence[str] = ()) -> dict[str, list[tuple[int, Point]]]:
    """Each curve's (value, point) pairs, of the curves in `only` (all without it); `quick` keeps the
    two ends of each (for a first look)."""
    unknown = set(only) - set(CURVES)
    if unknown:
        raise ValueError(f"unknown curves {sorted(unknown)}; choose from {', '.join(CURVES)}")
    base = Point()
    full = {
        "window_s": [(w, replace(base, window_s=w, keys=RATE * w)) for w in WINDOWS_S],
        "keys": [(k, replace(base, keys=k)) for k in KEYS],
        "partitions": [(p, replace(base, partitions=p)) for p in PARTITIONS],
        "instances": [
            (n, replace(base, instances=n, quota=True, min_tuples=SCALE_TUPLES)) for n in INSTANCES
        ],
    }
    chosen = {name: pairs for name, pairs in full.items() if not only or name in only}
    return {name: [pairs[0], pairs[-1]] if quick else pairs for name, pairs in chosen.items()}


def work_figures(measured: dict[str, Any]) -> dict[str, Any]:
    """Work done per second (tuples in plus results out) and its cost in microseconds per unit."""
    work = measured["tuples"] + measured["results"]
    seconds = measured["seconds"]
    return measured | {
        "work_per_s": round(work / seconds, 1),
        "us_per_work": round(1e6 * seconds / work, 3),
    }


def _points(c: dict[str, list[tuple[int, Point]]]) -> Iterator[Point]:
    """Every distinct point, in curve order (the base lies on two curves and runs once)."""
    seen: set[Point] = set()
    for pairs in c.values():
        for _, point in pairs:
            if point not in seen:
                seen.add(point)
                yield point


def run_growth_bench(
    cfg: Config, quick: bool = False, only: Sequence[str] = (), say: Callable[[str], None] = print
) -> dict[str, Any]:
    """Every point of `curves` once; the summary (also under reports/bench/, with a plot) holds each
    curve's points in order."""
    from generator.producer import run_generator

    c = curves(quick, only)
    measured: dict[Point, dict[str, Any]] = {}
    with bench_run(cfg, "growth", say) as run:
        todo = list(_points(c))
        for i, point in enumerate(todo):
            name = f"{run.run_id}-{i}"
            pc = point.config(cfg, name)
            say(f"[{i + 1}/{len(todo)}] {point}: pre-loading {point.tuples:,} tuples")
            run_generator(pc, run.bootstrap)
            measured[point] = work_figures(measure_fluxjoin(pc, run.bootstrap, run.work / name, say))
    summary = {
        "rate_per_stream": RATE,
        "exact": all(m["exact"] for m in measured.values()),
        "curves": {name: [{"value": v, **measured[p]} for v, p in pairs] for name, pairs in c.items()},
    }
    save_report(run.run_id, "growth", summary, say)
    plot_curves(run.run_id, summary, say)
    return summary


def plot_curves(run_id: str, summary: dict[str, Any], say: Callable[[str], None]) -> None:
    """Tuples/s and microseconds per unit of work along each curve, as reports/bench/<run id>/growth.png
    (`bench.run.pyplot`)."""
    plt = pyplot(say)
    if plt is None:
        return
    curves_ = summary["curves"]
    fig, axes = plt.subplots(1, len(curves_), figsize=(4 * len(curves_), 3.5), squeeze=False)
    for ax, (name, points) in zip(axes[0], curves_.items(), strict=True):
        values = [p["value"] for p in points]
        ax.plot(values, [p["tuples_per_s"] for p in points], "o-", label="tuples/s")
        ax.set_xscale("log" if name != "instances" else "linear")
        ax.set_xlabel(name)
        ax.set_ylabel("tuples/s")
        cost = ax.twinx()
        cost.plot(values, [p["us_per_work"] for p in points], "s--", color="tab:red", label="µs per unit")
        cost.set_ylabel("µs per tuple or result")
    fig.tight_layout()
    save_plot(plt, fig, run_id, "growth", say)
