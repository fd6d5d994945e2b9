"""`fluxjoin bench`: the benchmark commands, thin wiring from flags to the `bench` package.

Apart from the other commands because only these import `bench`. The five that run a pipeline take the
same `--config`, `--set`, `--bootstrap` and `--json`: `_pipeline_bench` gives them those options, ahead of
a command's own, and the one-line errors of the other commands.
"""

from __future__ import annotations

import inspect
import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, TypeVar

import typer

from fluxjoin.options import (
    BootstrapOpt,
    ConfigOpt,
    JsonOpt,
    SetOpt,
    broker_address,
    fail,
    handoff_mode,
    progress,
    read_config,
    user_errors,
)
from pipeline.config import Config

bench_app = typer.Typer(no_args_is_help=True, help="Benchmarks: print numbers, write a report.")


@dataclass(frozen=True)
class SharedOptions:
    """The options every pipeline benchmark takes, read: the configuration (`--config`, `--set`,
    `--bootstrap`), whether to print one JSON object (`--json`), and where progress lines go."""

    cfg: Config
    json: bool
    say: Callable[[str], None]

    def show(self, summary: Any, compact: Any = None) -> None:
        """Print a benchmark's summary: with `--json` on one line, `compact` (its series left out) if
        given; otherwise indented, whole."""
        print(
            json.dumps(summary if compact is None else compact)
            if self.json
            else json.dumps(summary, indent=2)
        )


_SHARED_OPTIONS = [
    inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=default, annotation=annotation)
    for name, annotation, default in (
        ("config", ConfigOpt, None),
        ("set_", SetOpt, None),
        ("bootstrap", BootstrapOpt, None),
        ("json_", JsonOpt, False),
    )
]


def _pipeline_bench(name: str) -> Callable[[Callable[..., None]], Callable[..., None]]:
    """Register `command(shared: SharedOptions, **its own options)` as `fluxjoin bench NAME`, taking the
    shared options first; an error that is the user's to fix ends it with one line (exit status 2)."""

    def register(command: Callable[..., None]) -> Callable[..., None]:
        def with_shared_options(
            *, config: Path | None, set_: list[str] | None, bootstrap: str | None, json_: bool, **options: Any
        ) -> None:
            shared = SharedOptions(read_config(config, set_, bootstrap), json_, progress(json_))
            try:
                command(shared, **options)
            except user_errors() as exc:
                fail(str(exc))

        own_options = list(inspect.signature(command, eval_str=True).parameters.values())[1:]
        typer_command: Any = with_shared_options  # typer reads the options from its signature
        typer_command.__signature__ = inspect.Signature(
            [*_SHARED_OPTIONS, *(p.replace(kind=inspect.Parameter.KEYWORD_ONLY) for p in own_options)]
        )
        typer_command.__doc__ = command.__doc__
        bench_app.command(name)(typer_command)
        return command

    return register


NumberT = TypeVar("NumberT", int, float)


def _numbers(text: str, option: str, kind: Callable[[str], NumberT]) -> list[NumberT]:
    """A comma-separated option value as numbers, or a clear error naming the option."""
    try:
        return [kind(item) for item in text.split(",")]
    except ValueError as exc:
        fail(f"{option}: {exc}")


@_pipeline_bench("throughput")
def bench_throughput(
    shared: SharedOptions,
    tuples: Annotated[
        int, typer.Option(min=0, help="Tuples pre-loaded for the catch-up run; 0: latency only.")
    ] = 2_000_000,
    repeats: Annotated[
        int, typer.Option(min=1, help="Runs of each measurement (catch-up per engine, latency; medians).")
    ] = 1,
    latency_rate: Annotated[float, typer.Option(help="Tuples/s in total for the latency run.")] = 20_000,
    latency_seconds: Annotated[float, typer.Option(help="Seconds of input for the latency run.")] = 60,
) -> None:
    """Catch-up rate of one instance vs Spark's built-in join, and result latency at 20K tuples/s with
    where the slowest batches' time went."""
    from bench.throughput import run_throughput_bench

    summary = run_throughput_bench(shared.cfg, tuples, repeats, latency_rate, latency_seconds, say=shared.say)
    if shared.json:
        print(json.dumps({k: v for k, v in summary.items() if k != "runs"}))
    else:
        for key in (
            "tuples_per_s",
            "builtin_tuples_per_s",
            "ratio",
            "latency_p50_s",
            "latency_p99_s",
            "exact",
        ):
            print(f"{key:>22}: {summary[key]}")


@_pipeline_bench("peers")
def bench_peers(
    shared: SharedOptions,
    tuples: Annotated[int, typer.Option(help="Tuples pre-loaded for the catch-up runs.")] = 2_000_000,
    repeats: Annotated[int, typer.Option(help="Catch-up runs of each engine (medians reported).")] = 1,
    latency_rate: Annotated[float, typer.Option(help="Tuples/s in total for the latency runs.")] = 20_000,
    latency_seconds: Annotated[float, typer.Option(help="Seconds of input per latency run.")] = 60,
) -> None:
    """One instance against Apache Flink's interval join (a Java job on a local MiniCluster, built with
    Maven on first use): catch-up rate and result latency at 20K tuples/s, both engines on the same
    input and cores one at a time, both outputs checked against the oracle (exit 1 if one is not exact)."""
    from bench.peers import run_peers_bench

    summary = run_peers_bench(shared.cfg, tuples, repeats, latency_rate, latency_seconds, say=shared.say)
    compact = {k: v for k, v in summary.items() if k != "runs"}
    shared.show(compact)
    raise typer.Exit(0 if summary["exact"] and summary["flink_exact"] else 1)


@_pipeline_bench("rescale")
def bench_rescale(
    shared: SharedOptions,
    rate: Annotated[float, typer.Option(help="Tuples/s in total, in real time.")] = 10_000,
    seconds: Annotated[float, typer.Option(help="Seconds of input per run.")] = 150,
    command_after: Annotated[float, typer.Option(help="Seconds into the input when the scale begins.")] = 40,
    mode: Annotated[
        list[str] | None, typer.Option(help="fluxjoin's handoff modes, one run each (default: all three).")
    ] = None,
) -> None:
    """From 2 workers to 3 while input flows: Apache Flink by stop-with-savepoint and restart at
    parallelism 3, against fluxjoin starting a third instance and moving it its share of the pids live;
    per engine the longest pause of any pid's results, p99 latency in the minute after, the time to the
    new steady state, and the oracle's verdict (exit 1 if an output is not exact)."""
    from bench.rescale import HANDOFF_MODES, run_rescale_bench

    modes = [handoff_mode(m).value for m in mode] if mode else list(HANDOFF_MODES)
    summary = run_rescale_bench(shared.cfg, rate, seconds, command_after, modes, say=shared.say)
    shared.show(summary)
    raise typer.Exit(0 if summary["exact"] else 1)


@_pipeline_bench("growth")
def bench_growth(
    shared: SharedOptions,
    quick: Annotated[bool, typer.Option(help="Only the two ends of each curve.")] = False,
    curve: Annotated[
        list[str] | None,
        typer.Option(help="Run only this curve (window_s, keys, partitions, instances); repeatable."),
    ] = None,
) -> None:
    """How a catch-up's cost grows with the window (1 s to 300 s), the keys (1K to 10M), the pids (16 to
    1024) and the instances (1 to 4 at half a core each): tuples/s, work (tuples and results) per second,
    microseconds per unit of work and peak window state per point, each output checked against the
    oracle (exit 1 if one is not exact); the report's plot shows the curves."""
    from bench.growth import CURVES, run_growth_bench

    unknown = sorted(set(curve or ()) - set(CURVES))
    if unknown:
        fail(f"unknown curve {', '.join(unknown)}; choose from {', '.join(CURVES)}")
    summary = run_growth_bench(shared.cfg, quick, curve or (), say=shared.say)
    shared.show(summary)
    raise typer.Exit(0 if summary["exact"] else 1)


KeySecondsOpt = Annotated[
    float,
    typer.Option(
        help="Distinct keys: this many seconds of one stream's input. Smaller makes more results per "
        "tuple (about 2 W / key-seconds), a heavier join."
    ),
]


@_pipeline_bench("skew")
def bench_skew(
    shared: SharedOptions,
    rates: Annotated[str, typer.Option(help="Input rates, tuples/s in total.")] = "7000,10000,14000,20000",
    seconds: Annotated[float, typer.Option(help="Seconds of skewed input per point, after --even-s.")] = 240,
    instances: Annotated[int, typer.Option(help="Join instances.")] = 4,
    cpu: Annotated[float, typer.Option(help="CPU cores per instance (cgroup quota).")] = 0.25,
    key_seconds: KeySecondsOpt = 1.0,
    hot_set_s: Annotated[float, typer.Option(help="Seconds between moves of the hot pids.")] = 120,
    even_s: Annotated[
        float, typer.Option(help="Seconds of even input before the skew, warming the join up.")
    ] = 60,
) -> None:
    """Sustainable input rate and latency of the static and flux policies under moving skew; every
    point's output is checked against the oracle (exit 1 if one is not exact). The trigger is twice an
    idle batch, measured first on this machine (about two minutes)."""
    from bench.skew import run_skew_bench

    wanted = _numbers(rates, "--rates", float)
    summary = run_skew_bench(
        shared.cfg, wanted, seconds, instances, cpu, key_seconds, hot_set_s, even_s, shared.say
    )
    compact = {p: {k: v for k, v in s.items() if k != "points"} for p, s in summary.items()}
    shared.show(summary, compact)
    raise typer.Exit(0 if all(s["exact"] for s in summary.values()) else 1)


@_pipeline_bench("move-cost")
def bench_move_cost(
    shared: SharedOptions,
    windows: Annotated[str, typer.Option(help="Window sizes W in ms (state sizes).")] = "2000,10000,30000",
    rate: Annotated[float, typer.Option(help="Input tuples/s in total.")] = 4000,
) -> None:
    """Pause of a moved pid and latency of the others, per handoff mode and window, vs a query restart."""
    from bench.move_cost import run_move_cost_bench

    wanted = _numbers(windows, "--windows", int)
    summary = run_move_cost_bench(shared.cfg, wanted, rate, say=shared.say)
    shared.show(summary)


@_pipeline_bench("convergence")
def bench_convergence(
    shared: SharedOptions,
    delta_min: Annotated[str, typer.Option(help="Flux delta_min values to sweep, seconds.")] = "1,4,16",
    rate: Annotated[float, typer.Option(help="Input tuples/s in total.")] = 2000,
    shift: Annotated[float, typer.Option(help="Seconds until the hot pids change (run = twice this).")] = 90,
    instances: Annotated[int, typer.Option(help="Join instances.")] = 4,
    cpu: Annotated[float, typer.Option(help="CPU cores per instance (cgroup quota).")] = 0.25,
    key_seconds: KeySecondsOpt = 1.0,
) -> None:
    """Flux after a load shift: rounds and seconds until balanced, moves per minute, imbalance."""
    from bench.convergence import CONVERGENCE_SERIES, run_convergence_bench

    wanted = _numbers(delta_min, "--delta-min", float)
    summary = run_convergence_bench(shared.cfg, wanted, rate, shift, instances, cpu, key_seconds, shared.say)
    compact = {d: {k: v for k, v in p.items() if k not in CONVERGENCE_SERIES} for d, p in summary.items()}
    shared.show(summary, compact)


@_pipeline_bench("loaded")
def bench_loaded(
    shared: SharedOptions,
    rate: Annotated[float, typer.Option(help="Input tuples/s in total.")] = 6000,
    instances: Annotated[int, typer.Option(help="Join instances.")] = 4,
    cpu: Annotated[float, typer.Option(help="CPU cores per instance (cgroup quota).")] = 0.4,
    slowed_cores: Annotated[float, typer.Option(help="CPU cores a slowed instance keeps.")] = 0.05,
    k: Annotated[int, typer.Option(help="Instances slowed in the second phase.")] = 2,
    calm_s: Annotated[float, typer.Option(help="Seconds before the first slowdown and after the last.")] = 30,
    slow_s: Annotated[float, typer.Option(help="Seconds of each slowed phase.")] = 60,
) -> None:
    """Flux's loaded machines (Figs. 7 and 8): tuples joined per second while one, then k instances run
    on a cut CPU quota, static against flux, with the recovery time after each slowdown; both outputs
    checked against the oracle (exit 1 if one is not exact)."""
    from bench.loaded import run_loaded_bench

    summary = run_loaded_bench(shared.cfg, rate, instances, cpu, slowed_cores, k, calm_s, slow_s, shared.say)
    compact = {
        key: {k2: v for k2, v in value.items() if k2 != "series"} if isinstance(value, dict) else value
        for key, value in summary.items()
    }
    shared.show(summary, compact)
    raise typer.Exit(0 if summary["static"]["exact"] and summary["flux"]["exact"] else 1)


@_pipeline_bench("memory")
def bench_memory(
    shared: SharedOptions,
    rate: Annotated[float, typer.Option(help="Input tuples/s in total.")] = 2000,
    instances: Annotated[int, typer.Option(help="Join instances.")] = 3,
    window_s: Annotated[float, typer.Option(help="Window W in seconds: the state grows with it.")] = 20,
    squeeze_at_s: Annotated[float, typer.Option(help="Seconds into the input when the budget is cut.")] = 40,
    squeeze_to: Annotated[
        float, typer.Option(help="The squeezed budget, as a share of what the windows hold then.")
    ] = 0.5,
    seconds: Annotated[float, typer.Option(help="Seconds of input per variant.")] = 120,
    variants: Annotated[
        str,
        typer.Option(
            help="Variants to run: static, spill, spill-most-productive, memory, memory-spill, "
            "flux-memory, hybrid."
        ),
    ] = "static,spill,spill-most-productive,memory,memory-spill,flux-memory,hybrid",
    spill_cleanup: Annotated[
        str, typer.Option(help="The spill variants' clean-up: active or lazy (docs/memory.md).")
    ] = "active",
    hot_pids: Annotated[
        bool,
        typer.Option(help="80% of the tuples on 20% of the pids: pids that differ in productivity."),
    ] = False,
) -> None:
    """A memory squeeze: one instance's state budget cut below what its windows hold, with no adaptation,
    spilling alone, each memory policy, and the memory policy coupled with spilling; per variant the
    time over budget, the peak fill, moves, results while the input flowed, the clean-up's work and
    time, each output checked against the oracle (exit 1 if one is not exact); the report's plot shows
    results over time per variant."""
    from bench.memory import run_memory_bench

    chosen = [v for v in variants.split(",") if v]
    summary = run_memory_bench(
        shared.cfg,
        rate,
        instances,
        window_s,
        squeeze_at_s,
        squeeze_to,
        seconds,
        chosen,
        shared.say,
        spill_cleanup,
        hot_pids,
    )
    compact = {
        k: {k2: v2 for k2, v2 in v.items() if k2 != "results_per_5s"} if isinstance(v, dict) else v
        for k, v in summary.items()
    }
    shared.show(summary, compact)
    raise typer.Exit(0 if all(summary[v]["exact"] for v in chosen) else 1)


@_pipeline_bench("soak")
def bench_soak(
    shared: SharedOptions,
    moves: Annotated[int, typer.Option(help="Random moves to make.")] = 100,
    seed: Annotated[int, typer.Option(help="Seed of the random choices.")] = 7,
) -> None:
    """Random moves (all three modes) under faults, then the oracle: kill -9s of the controller and of
    instances, instances frozen past the heartbeat timeout and let go, a second controller, the control
    topic truncated below its newest snapshot. The JSON counts each kind of fault injected."""
    from bench.run import new_run
    from bench.soak import SoakPlan, run_soak, soak_config
    from local import kafka_runtime

    name, work = new_run(shared.cfg, "soak")
    soak_cfg = soak_config(shared.cfg, name, seconds=max(600.0, 30.0 * moves))
    plan = SoakPlan(
        moves=moves,
        seed=seed,
        kill_controller_every=5,
        kill_instance_every=8,
        freeze_instance_every=7,
        second_controller_every=6,
        truncate_control_every=4,
    )
    with kafka_runtime.broker_unless(shared.cfg.bootstrap) as address:
        report, done = run_soak(soak_cfg, address, work, plan, shared.say)
    summary = {**done, **report.as_dict(), "seed": seed, "pipeline": name}
    print(json.dumps(summary) if shared.json else report.describe())
    raise typer.Exit(0 if report.exact else 1)


@bench_app.command("fold")
def bench_fold(
    bootstrap: BootstrapOpt = None,
    moves: Annotated[int, typer.Option(help="Moves in the synthetic control log.")] = 15_000,
    broker: Annotated[bool, typer.Option(help="Also catch up with the log from a real topic.")] = True,
) -> None:
    """What a restart costs on a long control log: fold and decode times of `--moves` moves (about 6.7
    messages each), and with a broker a reader's catch-up of them from a control topic."""
    from bench.fold import run
    from local import kafka_runtime

    cfg = read_config(None, None, bootstrap)
    try:
        if not broker:
            print(json.dumps(run(moves), indent=2))
            return
        with kafka_runtime.broker_unless(cfg.bootstrap) as address:
            print(json.dumps(run(moves, address), indent=2))
    except user_errors() as exc:
        fail(str(exc))


@bench_app.command("generator")
def bench_generator(
    bootstrap: BootstrapOpt = None,
    tuples: Annotated[int, typer.Option(help="Tuples per run.")] = 2_000_000,
    runs: Annotated[int, typer.Option(help="Runs per message size (median reported).")] = 3,
) -> None:
    """The generator's max-rate throughput on one core, for several tuples-per-message sizes."""
    from bench.generator import run_generator_bench

    cfg = read_config(None, None, bootstrap)
    print(json.dumps(run_generator_bench(broker_address(cfg), tuples=tuples, runs=runs), indent=2))
