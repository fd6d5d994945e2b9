"""`fluxjoin demo`: the whole pipeline on this machine, watched live, verified at the end.

Embedded Kafka (or `--bootstrap`), a generator with a skewed key distribution whose hot set moves,
the controller (policy `flux` unless `--policy static`), N instance processes starting on contiguous pid
ranges, a live terminal view fed by the metrics topic with the moves listed as they happen, then a
drain, the oracle's verdict and a report (markdown + plot) under `reports/`.
Every run gets its own pipeline name, so runs never share topics or checkpoints.
"""

from __future__ import annotations

import time
from collections import defaultdict, deque
from pathlib import Path
from typing import Any

import numpy as np
from rich.console import Console, Group
from rich.live import Live
from rich.panel import Panel
from rich.table import Table

from local.processes import LocalPipeline, MetricsFollower, backlog, wait_drained, weighted_percentiles
from pipeline.config import Config

# A 3-way join in which 20% of the pids carry 80% of the tuples, and the hot pids change every 40 s (the
# Flux paper's skew over partitions), so the controller has load to move; about 0.9 results per input
# tuple. Applied before the user's `--set` overrides, so each can still be changed.
DEMO_DEFAULTS = [
    "generator.rate={kind: constant, rate: 1200}",
    "generator.keys={kind: hot_pids, count: 40000, hot_fraction: 0.2, hot_share: 0.8, move_every_s: 40}",
    "generator.mode=real_time",
    "instance.trigger_ms=2000",
    "instance.spark_master=local[1]",
    "instance.shuffle_partitions=1",
]


def demo_config(cfg: Config, duration_s: float) -> Config:
    """The run's own pipeline name (runs never share topics or checkpoints) and input duration."""
    stamp = time.strftime("%Y%m%d-%H%M%S")
    return cfg.with_overrides(
        **{"generator.duration_s": duration_s, "pipeline": f"{cfg.pipeline}-demo-{stamp}"}
    )


class LiveStats:
    """Per-instance rolling numbers from metrics records (last 5 s) and the run's time series."""

    def __init__(self) -> None:
        self.recent: dict[str, deque[dict[str, Any]]] = defaultdict(lambda: deque(maxlen=200))
        self.series: list[dict[str, Any]] = []
        self.tuples = 0

    def add(self, record: dict[str, Any]) -> None:
        if record.get("kind") != "batch":
            return
        self.tuples += record["tuples_in"]
        self.recent[record["instance"]].append(record)
        self.series.append(record)

    def table(self, elapsed: float, left: int) -> Table:
        title = f"fluxjoin demo  t={elapsed:5.0f}s  joined {self.tuples:,} tuples  backlog {left:,} msgs"
        t = Table(title=title)
        for col in ("instance", "pids", "tuples/s", "lag (msgs)", "state", "results/s", "latency p50", "p99"):
            t.add_column(col, justify="right")
        now_ms = time.time() * 1000
        for name in sorted(self.recent):
            window = [r for r in self.recent[name] if now_ms - r["time_ms"] <= 5000]
            last = self.recent[name][-1]
            tuples = sum(r["tuples_in"] for r in window) / 5
            results = sum(r["results"] for r in window) / 5
            state = last.get("state_bytes", 0)
            p50, p99 = last.get("latency_p50_s"), last.get("latency_p99_s")
            t.add_row(
                name,
                str(len(last["lag"])),
                f"{tuples:,.0f}",
                f"{sum(last['lag'].values()):,}",
                f"{state / 1e6:,.1f} MB",
                f"{results:,.0f}",
                f"{p50:.2f}s" if p50 is not None else "-",
                f"{p99:.2f}s" if p99 is not None else "-",
            )
        return t


def controller_events(pipeline: LocalPipeline) -> list[str]:
    """The controller's lines about moves, deaths and rejoins, oldest first."""
    path = pipeline.work / "controller.log"
    if not path.exists():
        return []
    words = ("->", "dead", "rejoined", "handed", "now processed")
    return [line for line in path.read_text(errors="replace").splitlines() if any(w in line for w in words)]


def live_view(stats: LiveStats, elapsed: float, left: int, events: list[str]) -> Group:
    moves = sum(1 for e in events if e.endswith("started"))
    recent = "\n".join(events[-6:]) or "(no moves yet)"
    return Group(stats.table(elapsed, left), Panel(recent, title=f"controller: {moves} moves started"))


def write_report(out: Path, cfg: Config, stats: LiveStats, summary: dict[str, Any]) -> Path:
    """report.md and, where matplotlib is installed (the `plots` extra; not in the image),
    throughput_latency.png; returns the report path."""
    out.mkdir(parents=True, exist_ok=True)
    plotted = _plot(out / "throughput_latency.png", stats)
    lines = [
        f"# fluxjoin demo: {cfg.pipeline}",
        "",
        f"{len(cfg.streams)}-way join of {', '.join(cfg.streams)}, W = {cfg.window_ms} ms, "
        f"P = {cfg.partitions}, {cfg.instances} instances.",
        "",
        "| measure | value |",
        "|---|---|",
        *[f"| {k} | {v} |" for k, v in summary.items()],
        "",
        "![throughput and latency](throughput_latency.png)"
        if plotted
        else "(no plot: matplotlib is not installed; `pip install 'fluxjoin[plots]'`)",
        "",
    ]
    path = out / "report.md"
    path.write_text("\n".join(lines))
    return path


def _plot(path: Path, stats: LiveStats) -> bool:
    """Input tuples/s and result latency per instance over the run, as a PNG; False without matplotlib."""
    try:
        import matplotlib
    except ImportError:
        return False
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    start = min((r["time_ms"] for r in stats.series), default=0)
    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(9, 6), sharex=True)
    for name in sorted(stats.recent):
        rows = [r for r in stats.series if r["instance"] == name]
        t = np.array([(r["time_ms"] - start) / 1000 for r in rows])
        if not len(t):
            continue
        # tuples/s per instance, in 5 s bins
        bins = np.arange(0, t.max() + 5, 5)
        counts, _ = np.histogram(t, bins=bins, weights=[r["tuples_in"] for r in rows])
        ax1.plot(bins[:-1], counts / 5, label=name)
        lat = [
            (x, r["latency_p50_s"]) for x, r in zip(t, rows, strict=True) if r["latency_p50_s"] is not None
        ]
        if lat:
            ax2.plot([a for a, _ in lat], [b for _, b in lat], ".", markersize=3, label=f"{name} p50")
    ax1.set_ylabel("input tuples/s")
    ax1.legend(loc="upper right", fontsize=8)
    ax2.set_ylabel("result latency p50 (s)")
    ax2.set_xlabel("seconds since the first batch")
    ax2.legend(loc="upper right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def run_demo(cfg: Config, duration_s: float, json_output: bool) -> dict[str, Any]:
    from local import kafka_runtime

    console = Console(stderr=True)
    cfg = demo_config(cfg, duration_s)
    if not cfg.bootstrap:
        console.print("starting the embedded Kafka broker ...")
    with kafka_runtime.broker_unless(cfg.bootstrap) as bootstrap:
        return _run_and_verify(cfg, bootstrap, console, json_output)


def _run_and_verify(cfg: Config, bootstrap: str, console: Console, json_output: bool) -> dict[str, Any]:
    from pipeline.oracle import verify_pipeline
    from pipeline.topics import check_reachable, ensure_topics

    summary: dict[str, Any] = {"pipeline": cfg.pipeline, "exact": False}
    pipeline: LocalPipeline | None = None
    try:
        check_reachable(bootstrap)
        ensure_topics(cfg, bootstrap)
        pipeline = LocalPipeline(cfg, bootstrap, Path(cfg.instance.work_dir).resolve() / cfg.pipeline)
        stats, run_s = _run_live(pipeline, cfg, console, json_output)
        pipeline.stop()
        console.print("verifying against the oracle ...")
        report = verify_pipeline(pipeline.cfg, bootstrap, progress=lambda m: console.print(f"  {m}"))
        console.print(report.describe())
        p50, p99 = weighted_percentiles(stats.series, (50, 99))
        summary |= {
            "input_tuples": report.input_tuples,
            "results": report.produced,
            "expected": report.expected,
            "missing": report.missing,
            "duplicate": report.duplicate,
            "spurious": report.spurious,
            "late": report.late_reported,
            "late_expected": report.late_expected,
            "late_injected": cfg.generator.late_tuples,
            "wrongly_late": report.wrongly_late,
            "tuples_per_s": round(report.input_tuples / run_s, 1),
            "latency_p50_s": p50,
            "latency_p99_s": p99,
            "exact": report.exact,
            "policy": cfg.policy.name,
            "moves": sum(1 for e in controller_events(pipeline) if e.endswith("started")),
        }
        path = write_report(Path("reports") / cfg.pipeline, cfg, stats, summary)
        summary["report"] = str(path)
        console.print(f"report: {path}")
    except KeyboardInterrupt:
        console.print("interrupted: stopping the pipeline")
    finally:
        if pipeline is not None:
            pipeline.stop()
    return summary


def _run_live(
    pipeline: LocalPipeline, cfg: Config, console: Console, json_output: bool
) -> tuple[LiveStats, float]:
    """Start the controller, instances and generator, show the live view until all input is processed."""
    from controller.runner import instance_names
    from pipeline.control import ControlLog

    stats = LiveStats()
    t0 = time.monotonic()
    pipeline.start_controller()  # the policy of the config
    names = instance_names(cfg.instances)
    for name in names:
        pipeline.start_instance(name)
    console.print(f"starting {len(names)} Spark instances (logs in {pipeline.work}) ...")
    pipeline.wait_running(names)
    pipeline.start_generator()
    follower = MetricsFollower(pipeline.cfg, pipeline.bootstrap)
    control = ControlLog(pipeline.bootstrap, pipeline.cfg.control_topic)
    console.print(
        f"pipeline {cfg.pipeline}: {cfg.instances} instances, policy {cfg.policy.name}, generating for "
        f"{cfg.generator.duration_s:.0f} s; logs in {pipeline.work}"
    )
    try:
        with Live(console=console, refresh_per_second=2, transient=json_output) as live:
            last_check, left = 0.0, 0
            while True:
                for record in follower.poll():
                    stats.add(record)
                now = time.monotonic()
                if now - last_check > 2:
                    last_check = now
                    left = backlog(pipeline.cfg, pipeline.bootstrap, control)
                    pipeline.check_alive()
                    if pipeline.procs["generator"].poll() == 0 and left == 0:
                        break
                live.update(live_view(stats, now - t0, left, controller_events(pipeline)))
        wait_drained(pipeline, timeout_s=120)
        run_s = time.monotonic() - t0
        time.sleep(1.0)
        for record in follower.poll():
            stats.add(record)
    finally:
        follower.close()
        control.close()
    return stats, run_s
