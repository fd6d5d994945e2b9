"""What every benchmark run shares: a run id and work directory, the broker it runs against, the
deletion of its topics at its end, its report; starting a local pipeline warm and following its input;
and the medians and ratios several benchmarks report.

Apart from the benchmarks themselves so that each of them is read as its measurement alone.
"""

from __future__ import annotations

import json
import statistics
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from local.processes import LocalPipeline, MetricsFollower
from pipeline.config import Config

DRAIN_TIMEOUT_S = 600.0
"""How long a benchmark's instances may take to process what is left of its input once it ends, before
the oracle judges the output."""


def new_run(cfg: Config, kind: str) -> tuple[str, Path]:
    """A fresh run id (also the prefix of the run's pipeline names) and its work directory."""
    run_id = f"bench-{kind}-{time.strftime('%Y%m%d-%H%M%S')}-{uuid.uuid4().hex[:4]}"
    return run_id, Path(cfg.instance.work_dir).resolve() / run_id


def drop_run_topics(bootstrap: str, run_id: str, say: Callable[[str], None]) -> None:
    """Delete the topics of a finished run (its pipelines are named after it), so repeated runs do not
    pile up data on the broker: a broker restarted over gigabytes of old runs takes minutes to load."""
    from pipeline.topics import delete_topics, topics_named_after

    names = topics_named_after(bootstrap, f"{run_id}-")
    delete_topics(bootstrap, names)
    say(f"deleted the run's {len(names)} topics")


def save_report(run_id: str, name: str, summary: dict[str, Any], say: Callable[[str], None]) -> None:
    """Write the summary to reports/bench/<run id>/<name>.json and say where."""
    out = Path("reports") / "bench" / run_id
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.json").write_text(json.dumps(summary, indent=2))
    say(f"report: {out / f'{name}.json'}")


@dataclass(slots=True)
class BenchRun:
    """A benchmark run under way: its id (the prefix of its pipelines' names), its work directory and
    the broker it runs against. A body that sets `keep_topics` leaves the run's topics on the broker."""

    run_id: str
    work: Path
    bootstrap: str
    keep_topics: bool = False


@contextmanager
def bench_run(cfg: Config, kind: str, say: Callable[[str], None]) -> Iterator[BenchRun]:
    """The skeleton of a benchmark run: a fresh run id and work directory (`new_run`), the broker
    (`--bootstrap`, else an embedded one for the run's length) and, when the body ends without an error,
    the run's topics deleted (`drop_run_topics`) unless it kept them. The body's report is written
    after it (`save_report`), once the broker is gone."""
    from local.kafka_runtime import broker_unless

    run_id, work = new_run(cfg, kind)
    with broker_unless(cfg.bootstrap) as bootstrap:
        run = BenchRun(run_id, work, bootstrap)
        yield run
        if not run.keep_topics:
            drop_run_topics(bootstrap, run_id, say)


def drain(follower: MetricsFollower) -> Iterator[dict[str, Any]]:
    """Everything the follower has, until a poll returns nothing."""
    while True:
        got = list(follower.poll())
        if not got:
            return
        yield from got


def follow_input(
    pipeline: LocalPipeline,
    follower: MetricsFollower,
    records: list[dict[str, Any]],
    on_tick: Callable[[float], None] | None = None,
) -> None:
    """Keep the metrics records read until the generator exits; raise if a process failed meanwhile.
    `on_tick`, if given, is called between polls with the seconds since this call: what a benchmark
    does to the pipeline while the input flows (a squeeze, a slowdown)."""
    start = time.time()
    while pipeline.procs["generator"].poll() is None:
        if on_tick is not None:
            on_tick(time.time() - start)
        records.extend(follower.poll())
        pipeline.check_alive()


def wait_warm(
    pipeline: LocalPipeline,
    follower: MetricsFollower,
    names: list[str],
    records: list[dict[str, Any]],
    timeout_s: float = 600,
) -> None:
    """Block until every instance has finished a micro-batch, keeping the records read meanwhile.

    The first batch pays for Spark's warm-up (code generation, Python workers, the state store), which
    under a CPU budget of half a core takes half a minute; input sent before that is a backlog that
    says nothing about the policy.
    """
    pending = set(names)
    deadline = time.monotonic() + timeout_s
    while pending:
        for r in follower.poll():
            records.append(r)
            if r.get("kind") == "batch":
                pending.discard(r["instance"])
        pipeline.check_alive()
        if time.monotonic() > deadline:
            raise TimeoutError(f"{', '.join(sorted(pending))} finished no micro-batch in {timeout_s:.0f} s")


def start_warm(
    pipeline: LocalPipeline,
    follower: MetricsFollower,
    records: list[dict[str, Any]],
    policy: str,
    policy_params: dict[str, float] | None = None,
    mode: str = "transfer",
    decisions: Path | None = None,
) -> None:
    """Start the controller (recording its rounds' decisions to `decisions`, if given) and the
    instances, wait until all are warm, then start the input."""
    from controller.runner import instance_names

    pipeline.start_controller(policy=policy, mode=mode, policy_params=policy_params, decisions=decisions)
    names = instance_names(pipeline.cfg.instances)
    for name in names:
        pipeline.start_instance(name)
    pipeline.wait_running(names)
    wait_warm(pipeline, follower, names, records)
    pipeline.start_generator()


def moved_pids(decisions: Path) -> int:
    """The pids a controller's rounds moved, from its decisions file (`fluxjoin controller --decisions`;
    0 when it wrote none)."""
    if not decisions.exists():
        return 0
    return sum(len(json.loads(line)["moves"]) for line in decisions.read_text().splitlines() if line)


def rounded_median(values: Sequence[float]) -> float | None:
    """The median to two decimals, None without values."""
    return round(statistics.median(values), 2) if values else None


def ratio_to(value: float | None, base: float | None) -> float | None:
    """`value` as a multiple of `base` to two decimals, or None when either is unknown (or `base` is 0)."""
    return round(value / base, 2) if value is not None and base else None


def pyplot(say: Callable[[str], None]) -> Any | None:
    """matplotlib's pyplot on the file-only Agg backend, or None (said once) where matplotlib is not
    installed (the `plots` extra): a report's plot is optional, its numbers are not."""
    try:
        import matplotlib
    except ImportError:
        say("no plot: matplotlib is not installed (pip install 'fluxjoin[plots]')")
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_plot(plt: Any, fig: Any, run_id: str, name: str, say: Callable[[str], None]) -> None:
    """Write `fig` as reports/bench/<run id>/<name>.png, beside the run's report, and close it."""
    out = Path("reports") / "bench" / run_id / f"{name}.png"
    fig.savefig(out, dpi=100, bbox_inches="tight")
    plt.close(fig)
    say(f"plot: {out}")
