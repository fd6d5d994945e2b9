"""The `fluxjoin` command: thin wiring from flags to the modules that do the work.

Every subcommand takes the same `--config FILE`, repeated `--set key.path=value` overrides and
`--bootstrap HOST:PORT`; without `--bootstrap` they use the embedded broker that `fluxjoin kafka start`
(or `fluxjoin demo`) runs. Heavy imports (Spark, matplotlib) happen inside the commands that need them.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Annotated, NoReturn

import typer

from pipeline.config import Config, ConfigError, load_config

app = typer.Typer(no_args_is_help=True, add_completion=False, help=__doc__.split("\n")[0])
kafka_app = typer.Typer(no_args_is_help=True, help="Run a local single-node KRaft Apache Kafka broker.")
bench_app = typer.Typer(no_args_is_help=True, help="Benchmarks: print numbers, write a report.")
app.add_typer(kafka_app, name="kafka")
app.add_typer(bench_app, name="bench")

ConfigOpt = Annotated[Path | None, typer.Option("--config", "-c", help="YAML configuration file.")]
SetOpt = Annotated[
    list[str] | None, typer.Option("--set", help="Override a config field: key.path=value (repeatable).")
]
BootstrapOpt = Annotated[
    str | None, typer.Option("--bootstrap", help="Use this Kafka cluster instead of the embedded broker.")
]
JsonOpt = Annotated[bool, typer.Option("--json", help="Print one JSON object instead of text.")]


def fail(message: str, code: int = 2) -> NoReturn:
    typer.secho(f"error: {message}", fg=typer.colors.RED, err=True)
    raise typer.Exit(code)


def _user_errors() -> tuple[type[Exception], ...]:
    """Errors that are the user's to fix: printed as one line, no traceback."""
    from pipeline.topics import BrokerUnreachable, TopicError

    return (ConfigError, BrokerUnreachable, TopicError)


def _config(config: Path | None, sets: list[str] | None, bootstrap: str | None) -> Config:
    try:
        cfg = load_config(config, sets or [])
        if bootstrap:
            cfg = cfg.with_overrides(bootstrap=bootstrap)
        return cfg
    except ConfigError as exc:
        fail(str(exc))


def _bootstrap(cfg: Config) -> str:
    """The cluster to talk to: `--bootstrap`, else the running embedded broker."""
    if cfg.bootstrap:
        return cfg.bootstrap
    from controller import kafka_runtime

    address = kafka_runtime.running_address()
    if address is None:
        fail("no Kafka broker: run `fluxjoin kafka start` first, or pass --bootstrap HOST:PORT")
    return address


@kafka_app.command("start")
def kafka_start(port: Annotated[int, typer.Option(help="Client port.")] = 9092) -> None:
    """Start the embedded broker (fetching Kafka jars into the cache the first time)."""
    from controller import kafka_runtime

    try:
        print(kafka_runtime.start(port=port))
    except kafka_runtime.KafkaRuntimeError as exc:
        fail(str(exc))


@kafka_app.command("stop")
def kafka_stop() -> None:
    """Stop the embedded broker (its data stays until the next `start --fresh`)."""
    from controller import kafka_runtime

    kafka_runtime.stop()


@kafka_app.command("status")
def kafka_status() -> None:
    """Say whether the embedded broker runs, and where."""
    from controller import kafka_runtime

    address = kafka_runtime.running_address()
    print(f"running at {address}" if address else "not running")
    raise typer.Exit(0 if address else 1)


@app.command()
def generate(config: ConfigOpt = None, set_: SetOpt = None, bootstrap: BootstrapOpt = None) -> None:
    """Produce Poisson streams to the input topics (keyed and partitioned by pid)."""
    from generator.producer import run_generator

    cfg = _config(config, set_, bootstrap)
    try:
        stats = run_generator(cfg, _bootstrap(cfg), progress=True)
    except _user_errors() as exc:
        fail(str(exc))
    print(json.dumps(stats))


@app.command()
def instance(
    name: Annotated[str, typer.Option(help="Instance id, e.g. instance-0.")],
    pids: Annotated[str, typer.Option(help="Owned pids: ranges and lists, e.g. 0-20,40.")],
    config: ConfigOpt = None,
    set_: SetOpt = None,
    bootstrap: BootstrapOpt = None,
) -> None:
    """Run one join instance (a Spark Structured Streaming query) until interrupted."""
    from pipeline.instance import parse_pids, run_instance

    cfg = _config(config, set_, bootstrap)
    try:
        owned = parse_pids(pids, cfg.partitions)
    except ValueError as exc:
        fail(str(exc))
    try:
        run_instance(cfg, _bootstrap(cfg), name, owned)
    except _user_errors() as exc:
        fail(str(exc))


@app.command()
def verify(
    config: ConfigOpt = None, set_: SetOpt = None, bootstrap: BootstrapOpt = None, json_: JsonOpt = False
) -> None:
    """Compare the results topic with the exact join computed offline from the input topics."""
    from pipeline.oracle import verify_pipeline

    cfg = _config(config, set_, bootstrap)
    try:
        report = verify_pipeline(cfg, _bootstrap(cfg))
    except _user_errors() as exc:
        fail(str(exc))
    print(json.dumps(report.as_dict()) if json_ else report.describe())
    raise typer.Exit(0 if report.exact else 1)


@app.command()
def demo(
    config: ConfigOpt = None,
    set_: SetOpt = None,
    bootstrap: BootstrapOpt = None,
    json_: JsonOpt = False,
    duration: Annotated[float, typer.Option(help="Seconds of input to generate.")] = 150.0,
) -> None:
    """Embedded Kafka, generator, N instances, live view, verification and a report."""
    from controller.demo import DEMO_DEFAULTS, run_demo

    cfg = _config(config, [*DEMO_DEFAULTS, *(set_ or [])], bootstrap)
    try:
        summary = run_demo(cfg, duration_s=duration, json_output=json_)
    except _user_errors() as exc:
        fail(str(exc))
    if json_:
        print(json.dumps(summary))
    raise typer.Exit(0 if summary.get("exact") else 1)


@bench_app.command("throughput")
def bench_throughput(
    config: ConfigOpt = None, set_: SetOpt = None, bootstrap: BootstrapOpt = None, json_: JsonOpt = False
) -> None:
    """Catch-up rate of one instance vs Spark's built-in join, and result latency at 20K tuples/s."""
    from controller.bench import run_throughput_bench

    cfg = _config(config, set_, bootstrap)
    summary = run_throughput_bench(cfg, json_output=json_)
    if json_:
        print(json.dumps(summary))


def main() -> None:
    try:
        app()
    except KeyboardInterrupt:
        sys.exit(130)
