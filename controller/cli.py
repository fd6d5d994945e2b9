"""The `fluxjoin` command: thin wiring from flags to the modules that do the work.

Every subcommand takes the same `--config FILE`, repeated `--set key.path=value` overrides and
`--bootstrap HOST:PORT`; without `--bootstrap` they use the embedded broker that `fluxjoin kafka start`
(or `fluxjoin demo`) runs. Heavy imports (Spark, matplotlib) happen inside the commands that need them.
"""

from __future__ import annotations

import json
import signal
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, NoReturn, TypeVar

import typer
from confluent_kafka import KafkaException

from controller.assignment import HandoffMode
from pipeline.config import Config, ConfigError, load_config
from pipeline.health import DEFAULT_METRICS_PORT, STALL_TIMEOUT_S

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


EXIT_NOT_EXACT, EXIT_USAGE, EXIT_UNREACHABLE = 1, 2, 3
"""Exit statuses (README): 0 done (`verify`: exact); 1 `verify` found the results not exact, or `move`
did not complete in time; 2 a usage or configuration error; 3 Kafka unreachable or refusing us."""


def fail(message: str, code: int = EXIT_USAGE) -> NoReturn:
    typer.secho(f"error: {message}", fg=typer.colors.RED, err=True)
    raise typer.Exit(code)


@app.callback()
def _kafka_security() -> None:
    """Check the FLUXJOIN_KAFKA_* settings (docs/security.md) before any command makes a Kafka client."""
    from pipeline.kafka_client import KafkaSecurity, KafkaSecurityError

    try:
        KafkaSecurity.from_env()
    except KafkaSecurityError as exc:
        fail(str(exc))


def _user_errors() -> tuple[type[Exception], ...]:
    """Errors that are the user's to fix: printed as one line, no traceback."""
    from controller.cpu_budget import CpuBudgetError
    from pipeline.topics import BrokerUnreachable, TopicError

    return (ConfigError, BrokerUnreachable, TopicError, CpuBudgetError)


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
        fail(
            "no Kafka broker: run `fluxjoin kafka start` first, or pass --bootstrap HOST:PORT",
            EXIT_UNREACHABLE,
        )
    return address


def _reachable(cfg: Config) -> str:
    """`_bootstrap`, checked to answer within 10 s: one line and exit status 3 when it does not."""
    from pipeline.topics import BrokerUnreachable, check_reachable

    address = _bootstrap(cfg)
    try:
        check_reachable(address)
    except BrokerUnreachable as exc:
        fail(str(exc), EXIT_UNREACHABLE)
    return address


def _kafka_reason(exc: Exception) -> str:
    """A Kafka client's failure in a few words (its error's own text, not the exception's repr)."""
    return exc.args[0].str() if isinstance(exc, KafkaException) and exc.args else str(exc)


@kafka_app.command("start")
def kafka_start(
    port: Annotated[int, typer.Option(help="Client port.")] = 9092,
    fresh: Annotated[
        bool, typer.Option(help="Stop a running broker and delete its data (every topic) first.")
    ] = False,
) -> None:
    """Start the embedded broker (fetching Kafka jars into the cache the first time)."""
    from controller import kafka_runtime

    try:
        print(kafka_runtime.start(port=port, fresh=fresh))
    except kafka_runtime.KafkaRuntimeError as exc:
        fail(str(exc))


@kafka_app.command("stop")
def kafka_stop(port: Annotated[int, typer.Option(help="Client port of the broker to stop.")] = 9092) -> None:
    """Stop the embedded broker (its data stays until the next `start --fresh`)."""
    from controller import kafka_runtime

    pid = kafka_runtime.stop(port=port)
    print(f"stopped the broker at localhost:{port} (pid {pid})" if pid else f"no broker runs for port {port}")


@kafka_app.command("status")
def kafka_status() -> None:
    """Say whether the embedded broker runs, and where."""
    from controller import kafka_runtime

    address = kafka_runtime.running_address()
    print(f"running at {address}" if address else "not running")
    raise typer.Exit(0 if address else 1)


@app.command()
def generate(config: ConfigOpt = None, set_: SetOpt = None, bootstrap: BootstrapOpt = None) -> None:
    """Produce Poisson streams to the input topics (keyed and partitioned by pid).

    SIGINT or SIGTERM ends the run early and cleanly: what was produced is flushed and acknowledged."""
    from generator.producer import run_generator

    cfg = _config(config, set_, bootstrap)
    try:
        stats = run_generator(cfg, _bootstrap(cfg), progress=True, stop=_stop_on_signals())
    except _user_errors() as exc:
        fail(str(exc))
    print(json.dumps(stats))


@app.command()
def instance(
    name: Annotated[str, typer.Option(help="Instance id, e.g. instance-0.")],
    pids: Annotated[
        str | None,
        typer.Option(help="Static pids (ranges and lists, e.g. 0-20,40) when no controller assigns them."),
    ] = None,
    config: ConfigOpt = None,
    set_: SetOpt = None,
    bootstrap: BootstrapOpt = None,
    metrics_port: Annotated[
        int,
        typer.Option(
            min=0,
            max=65535,
            help="Port of /metrics, /healthz and /readyz (0: no server; give each instance on one machine "
            "its own port, or 0).",
        ),
    ] = DEFAULT_METRICS_PORT,
    stall_timeout: Annotated[
        float,
        typer.Option(min=1.0, help="Seconds without query progress (or to start it) before /healthz fails."),
    ] = STALL_TIMEOUT_S,
) -> None:
    """Run one join instance (a Spark Structured Streaming query) until interrupted."""
    from pipeline.health import MetricsPortError
    from pipeline.instance import parse_pids, run_instance

    cfg = _config(config, set_, bootstrap)
    try:
        owned = parse_pids(pids, cfg.partitions) if pids is not None else None
    except ValueError as exc:
        fail(str(exc))
    errors: tuple[type[Exception], ...] = (*_user_errors(), MetricsPortError)
    try:
        run_instance(
            cfg, _bootstrap(cfg), name, owned, metrics_port=metrics_port, stall_timeout_s=stall_timeout
        )
    except errors as exc:
        fail(str(exc))


@app.command()
def verify(
    config: ConfigOpt = None, set_: SetOpt = None, bootstrap: BootstrapOpt = None, json_: JsonOpt = False
) -> None:
    """Judge the results topic and the late dead letters against the input topics alone: the expected
    join is counted by the lateness rule of each input partition (exit 0: exact, 1: not exact, 2: could
    not judge, 3: Kafka unreachable)."""
    from pipeline.oracle import verify_pipeline
    from pipeline.topics import BrokerUnreachable

    cfg = _config(config, set_, bootstrap)
    try:
        report = verify_pipeline(cfg, _bootstrap(cfg), progress=_progress(json_))
    except BrokerUnreachable as exc:
        fail(str(exc), EXIT_UNREACHABLE)
    except _user_errors() as exc:
        fail(str(exc))
    except Exception as exc:  # could not judge: never the "not exact" of exit status 1
        fail(f"could not verify: {type(exc).__name__}: {exc}")
    print(json.dumps(report.as_dict()) if json_ else report.describe())
    raise typer.Exit(0 if report.exact else 1)


@app.command()
def demo(
    config: ConfigOpt = None,
    set_: SetOpt = None,
    bootstrap: BootstrapOpt = None,
    json_: JsonOpt = False,
    duration: Annotated[float, typer.Option(help="Seconds of input to generate.")] = 150.0,
    policy: Annotated[str, typer.Option(help="Controller policy: flux, static or memory.")] = "flux",
) -> None:
    """Embedded Kafka, generator, controller, N instances, live view, verification and a report."""
    from controller.demo import DEMO_DEFAULTS, run_demo
    from controller.policies import POLICIES

    if policy not in POLICIES:
        fail(f"unknown policy {policy!r}; choose from {', '.join(POLICIES)}")
    cfg = _config(config, [*DEMO_DEFAULTS, *(set_ or [])], bootstrap)
    try:
        summary = run_demo(cfg, duration_s=duration, json_output=json_, policy=policy)
    except _user_errors() as exc:
        fail(str(exc))
    if json_:
        print(json.dumps(summary))
    raise typer.Exit(0 if summary.get("exact") else 1)


ModeOpt = Annotated[str, typer.Option("--mode", help="Handoff mode: transfer, replay or parallel-track.")]


def _mode(value: str) -> HandoffMode:
    try:
        return HandoffMode(value.replace("-", "_"))
    except ValueError:
        fail(f"unknown handoff mode {value!r}; choose from {', '.join(m.value for m in HandoffMode)}")


@app.command()
def controller(
    config: ConfigOpt = None,
    set_: SetOpt = None,
    bootstrap: BootstrapOpt = None,
    policy: Annotated[str, typer.Option(help="static, flux or memory.")] = "flux",
    mode: ModeOpt = "transfer",
    heartbeat_timeout: Annotated[float, typer.Option(help="Seconds without a heartbeat = dead.")] = 10.0,
    dry_run: Annotated[bool, typer.Option(help="Print decisions, move nothing.")] = False,
    policy_param: Annotated[
        list[str] | None,
        typer.Option(help="A policy parameter, e.g. delta_min_s=1.0 or th_imb=1.5 (repeatable)."),
    ] = None,
) -> None:
    """Run the controller: policy rounds, pid moves, recovery of dead instances."""
    from controller.policies import POLICIES
    from controller.rounds import policy_params
    from controller.runner import run_controller

    cfg = _config(config, set_, bootstrap)
    if policy not in POLICIES:
        fail(f"unknown policy {policy!r}; choose from {', '.join(POLICIES)}")
    try:
        settings = {k: float(v) for k, v in (item.split("=", 1) for item in policy_param or [])}
        params = policy_params(policy, _mode(mode), **settings)
    except (ValueError, TypeError) as exc:
        fail(f"--policy-param: {exc}")
    from controller.moves import ControllerFenced
    from pipeline.control import FENCED_EXIT_STATUS

    stopping = _stop_on_signals()
    try:
        run_controller(
            cfg, _bootstrap(cfg), policy, params, heartbeat_timeout, dry_run, stopping.is_set, _say_with_time
        )
    except ControllerFenced as exc:
        fail(str(exc), FENCED_EXIT_STATUS)
    except _user_errors() as exc:
        fail(str(exc))


def _say_with_time(line: str) -> None:
    """A controller line, prefixed with the wall-clock time: a log of moves is read as a timeline."""
    print(f"{time.strftime('%H:%M:%S')} {line}", flush=True)


def _stop_on_signals() -> threading.Event:
    stopping = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stopping.set())
    return stopping


@app.command()
def move(
    pids: Annotated[str, typer.Option(help="Pids to move, e.g. 3,7 or 0-3.")],
    to: Annotated[str, typer.Option("--to", help="Target instance, e.g. instance-2.")],
    config: ConfigOpt = None,
    set_: SetOpt = None,
    bootstrap: BootstrapOpt = None,
    mode: ModeOpt = "transfer",
    wait: Annotated[
        float,
        typer.Option(help="Seconds to wait for completion; the request expires then (0: do not wait)."),
    ] = 120.0,
    json_: JsonOpt = False,
) -> None:
    """Ask the running controller to move pids to an instance, and wait until they are moved (--json: one
    object, {"request", "pids", "to", "mode", "owners"}; owners null when not waited for)."""
    from controller.moves import request_moves, request_outcome
    from pipeline.control import ControlLog
    from pipeline.instance import parse_pids

    cfg = _config(config, set_, bootstrap)
    try:
        wanted = sorted(parse_pids(pids, cfg.partitions))
    except ValueError as exc:
        fail(str(exc))
    address = _reachable(cfg)
    try:
        request = request_moves(cfg, address, wanted, to, _mode(mode), wait_s=wait)
    except (KafkaException, RuntimeError) as exc:
        fail(f"the move request did not reach Kafka at {address}: {_kafka_reason(exc)}", EXIT_UNREACHABLE)
    asked = {"request": request.request_id, "pids": wanted, "to": to, "mode": request.mode.value}
    if not json_:
        print(f"requested {request.request_id}: pids {pids} -> {to} ({request.mode.value})")
    if wait <= 0:
        if json_:
            print(json.dumps(asked | {"owners": None}))
        return
    log = ControlLog(address, cfg.control_topic)
    deadline = time.monotonic() + wait
    while time.monotonic() < deadline:
        owners = request_outcome(log.catch_up(), request)
        if owners is not None:  # the owners of record: the target may have died during a move
            if json_:
                print(json.dumps(asked | {"owners": {str(p): owner for p, owner in owners.items()}}))
                return
            for p, owner in owners.items():
                print(f"done: pid {p} is processed by {owner}" + ("" if owner == to else f", not {to}"))
            return
        time.sleep(0.5)
    fail(f"not done after {wait:g} s (is `fluxjoin controller` running, and {to} alive?)", EXIT_NOT_EXACT)


@app.command()
def topics(config: ConfigOpt = None, set_: SetOpt = None, bootstrap: BootstrapOpt = None) -> None:
    """The pipeline's topics as fluxjoin creates them (or, with topics.create=false, expects to find)."""
    from pipeline.topics import topic_specs

    cfg = _config(config, set_, bootstrap)
    for spec in topic_specs(cfg):
        settings = " ".join(f"{k}={v}" for k, v in sorted(spec.config.items()))
        print(
            f"{spec.name} partitions={spec.partitions} replication={cfg.topics.replication_factor} {settings}"
        )


@app.command()
def acls(
    principal: Annotated[str, typer.Option(help="The pipeline's Kafka principal, e.g. User:fluxjoin.")],
    config: ConfigOpt = None,
    set_: SetOpt = None,
    bootstrap: BootstrapOpt = None,
    apply: Annotated[
        bool, typer.Option("--apply", help="Create them on the cluster (as an administrator).")
    ] = False,
) -> None:
    """The Kafka ACLs a pipeline's principal needs on a cluster with an authorizer; --apply creates them."""
    from pipeline.acls import create_acls, describe_acl, pipeline_acls

    cfg = _config(config, set_, bootstrap)
    bindings = pipeline_acls(cfg, principal)
    for binding in bindings:
        print(describe_acl(binding))
    if apply:
        address = _reachable(cfg)
        try:
            create_acls(address, bindings)
        except KafkaException as exc:
            fail(f"Kafka at {address}: {_kafka_reason(exc)}", EXIT_UNREACHABLE)
        print(f"created {len(bindings)} ACLs at {address}")


@app.command()
def status(
    config: ConfigOpt = None, set_: SetOpt = None, bootstrap: BootstrapOpt = None, json_: JsonOpt = False
) -> None:
    """The assignment of record, moves in flight and per-instance load and lag (0 once drained)."""
    from controller.status import describe_status, pipeline_status

    cfg = _config(config, set_, bootstrap)
    address = _reachable(cfg)
    try:
        found = pipeline_status(cfg, address)
        print(json.dumps(found) if json_ else describe_status(found))
    except _user_errors() as exc:
        fail(str(exc))
    except KafkaException as exc:
        fail(f"Kafka at {address}: {_kafka_reason(exc)}", EXIT_UNREACHABLE)


@app.command("operator")
def operator_command(
    namespace: Annotated[
        str | None,
        typer.Option(envvar="FLUXJOIN_NAMESPACE", help="Namespace to reconcile (default: the pod's own)."),
    ] = None,
    lease_name: Annotated[
        str, typer.Option(envvar="FLUXJOIN_LEASE_NAME", help="Lease for leader election.")
    ] = "fluxjoin-operator",
    leader_election: Annotated[
        bool, typer.Option(envvar="FLUXJOIN_LEADER_ELECTION", help="Reconcile only while holding the Lease.")
    ] = True,
    identity: Annotated[
        str | None,
        typer.Option(envvar="FLUXJOIN_POD_NAME", help="Holder name in the Lease (default: the host name)."),
    ] = None,
    kubeconfig: Annotated[
        Path | None, typer.Option(help="Kubeconfig file (default: the in-cluster service account).")
    ] = None,
    instance_image: Annotated[
        str | None,
        typer.Option(envvar="FLUXJOIN_INSTANCE_IMAGE", help="Image of instances whose spec names none."),
    ] = None,
    image_pull_policy: Annotated[
        str, typer.Option(envvar="FLUXJOIN_IMAGE_PULL_POLICY", help="Pull policy of instance pods.")
    ] = "IfNotPresent",
    image_pull_secrets: Annotated[
        str, typer.Option(envvar="FLUXJOIN_IMAGE_PULL_SECRETS", help="Pull secrets of instance pods, a,b.")
    ] = "",
    metrics_port: Annotated[
        int, typer.Option(envvar="FLUXJOIN_METRICS_PORT", help="Port of /metrics and /healthz.")
    ] = 9108,
    scrape_annotations: Annotated[
        bool, typer.Option(envvar="FLUXJOIN_SCRAPE_ANNOTATIONS", help="prometheus.io/* on instance pods.")
    ] = True,
    log_level: Annotated[
        str, typer.Option(envvar="FLUXJOIN_LOG_LEVEL", help="debug, info, warning or error.")
    ] = "info",
) -> None:
    """Reconcile JoinPipelines in one namespace: the Kubernetes operator the Helm chart runs."""
    import logging
    import socket

    from controller.operator import (
        OperatorConfigError,
        OperatorOptions,
        default_namespace,
        run_operator,
    )
    from controller.workload import InstanceSettings

    logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    options = OperatorOptions(
        namespace=namespace or default_namespace(),
        identity=identity or socket.gethostname(),
        leader_election=leader_election,
        lease_name=lease_name,
        kubeconfig=kubeconfig,
        metrics_port=metrics_port,
        instance=InstanceSettings(
            image=instance_image,
            pull_policy=image_pull_policy,
            pull_secrets=tuple(s for s in image_pull_secrets.split(",") if s),
            metrics_port=metrics_port,
            scrape_annotations=scrape_annotations,
        ),
    )
    try:
        run_operator(options)
    except OperatorConfigError as exc:
        fail(str(exc))


def _progress(json_: bool) -> Callable[[str], None]:
    """Where a command's progress lines go: stderr when stdout carries the JSON summary."""
    return (lambda m: print(m, file=sys.stderr, flush=True)) if json_ else print


NumberT = TypeVar("NumberT", int, float)


def _numbers(text: str, option: str, kind: Callable[[str], NumberT]) -> list[NumberT]:
    """A comma-separated option value as numbers, or a clear error naming the option."""
    try:
        return [kind(item) for item in text.split(",")]
    except ValueError as exc:
        fail(f"{option}: {exc}")


@bench_app.command("throughput")
def bench_throughput(
    config: ConfigOpt = None,
    set_: SetOpt = None,
    bootstrap: BootstrapOpt = None,
    json_: JsonOpt = False,
    tuples: Annotated[int, typer.Option(help="Tuples pre-loaded for the catch-up run.")] = 2_000_000,
    repeats: Annotated[int, typer.Option(help="Catch-up runs of each engine (medians reported).")] = 1,
    latency_rate: Annotated[float, typer.Option(help="Tuples/s in total for the latency run.")] = 20_000,
    latency_seconds: Annotated[float, typer.Option(help="Seconds of input for the latency run.")] = 60,
) -> None:
    """Catch-up rate of one instance vs Spark's built-in join, and result latency at 20K tuples/s."""
    from controller.bench import run_throughput_bench

    cfg = _config(config, set_, bootstrap)
    say = _progress(json_)
    try:
        summary = run_throughput_bench(cfg, tuples, repeats, latency_rate, latency_seconds, say=say)
    except _user_errors() as exc:
        fail(str(exc))
    if json_:
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


KeySecondsOpt = Annotated[
    float,
    typer.Option(
        help="Distinct keys: this many seconds of one stream's input. Smaller makes more results per "
        "tuple (about 2 W / key-seconds), a heavier join."
    ),
]


@bench_app.command("skew")
def bench_skew(
    config: ConfigOpt = None,
    set_: SetOpt = None,
    bootstrap: BootstrapOpt = None,
    json_: JsonOpt = False,
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
    from controller.bench import run_skew_bench

    cfg = _config(config, set_, bootstrap)
    say = _progress(json_)
    wanted = _numbers(rates, "--rates", float)
    try:
        summary = run_skew_bench(cfg, wanted, seconds, instances, cpu, key_seconds, hot_set_s, even_s, say)
    except _user_errors() as exc:
        fail(str(exc))
    compact = {p: {k: v for k, v in s.items() if k != "points"} for p, s in summary.items()}
    print(json.dumps(compact) if json_ else json.dumps(summary, indent=2))
    raise typer.Exit(0 if all(s["exact"] for s in summary.values()) else 1)


@bench_app.command("move-cost")
def bench_move_cost(
    config: ConfigOpt = None,
    set_: SetOpt = None,
    bootstrap: BootstrapOpt = None,
    json_: JsonOpt = False,
    windows: Annotated[str, typer.Option(help="Window sizes W in ms (state sizes).")] = "2000,10000,30000",
    rate: Annotated[float, typer.Option(help="Input tuples/s in total.")] = 4000,
) -> None:
    """Pause of a moved pid and latency of the others, per handoff mode and window, vs a query restart."""
    from controller.bench import run_move_cost_bench

    cfg = _config(config, set_, bootstrap)
    say = _progress(json_)
    wanted = _numbers(windows, "--windows", int)
    try:
        summary = run_move_cost_bench(cfg, wanted, rate, say=say)
    except _user_errors() as exc:
        fail(str(exc))
    print(json.dumps(summary) if json_ else json.dumps(summary, indent=2))


@bench_app.command("convergence")
def bench_convergence(
    config: ConfigOpt = None,
    set_: SetOpt = None,
    bootstrap: BootstrapOpt = None,
    json_: JsonOpt = False,
    delta_min: Annotated[str, typer.Option(help="Flux delta_min values to sweep, seconds.")] = "1,4,16",
    rate: Annotated[float, typer.Option(help="Input tuples/s in total.")] = 2000,
    shift: Annotated[float, typer.Option(help="Seconds until the hot pids change (run = twice this).")] = 90,
    instances: Annotated[int, typer.Option(help="Join instances.")] = 4,
    cpu: Annotated[float, typer.Option(help="CPU cores per instance (cgroup quota).")] = 0.25,
    key_seconds: KeySecondsOpt = 1.0,
) -> None:
    """Flux after a load shift: rounds and seconds until balanced, moves per minute, imbalance."""
    from controller.bench import CONVERGENCE_SERIES, run_convergence_bench

    cfg = _config(config, set_, bootstrap)
    say = _progress(json_)
    wanted = _numbers(delta_min, "--delta-min", float)
    try:
        summary = run_convergence_bench(cfg, wanted, rate, shift, instances, cpu, key_seconds, say)
    except _user_errors() as exc:
        fail(str(exc))
    compact = {d: {k: v for k, v in p.items() if k not in CONVERGENCE_SERIES} for d, p in summary.items()}
    print(json.dumps(compact) if json_ else json.dumps(summary, indent=2))


@bench_app.command("soak")
def bench_soak(
    config: ConfigOpt = None,
    set_: SetOpt = None,
    bootstrap: BootstrapOpt = None,
    json_: JsonOpt = False,
    moves: Annotated[int, typer.Option(help="Random moves to make.")] = 100,
    seed: Annotated[int, typer.Option(help="Seed of the random choices.")] = 7,
) -> None:
    """Random moves (all three modes) under faults, then the oracle: kill -9s of the controller and of
    instances, instances frozen past the heartbeat timeout and let go, a second controller, the control
    topic truncated below its newest snapshot. The JSON counts each kind of fault injected."""
    from controller import kafka_runtime
    from controller.bench import new_run
    from controller.soak import SoakPlan, run_soak, soak_config

    cfg = _config(config, set_, bootstrap)
    say = _progress(json_)
    name, work = new_run(cfg, "soak")
    soak_cfg = soak_config(cfg, name, seconds=max(600.0, 30.0 * moves))
    plan = SoakPlan(
        moves=moves,
        seed=seed,
        kill_controller_every=5,
        kill_instance_every=8,
        freeze_instance_every=7,
        second_controller_every=6,
        truncate_control_every=4,
    )
    try:
        with kafka_runtime.broker_unless(cfg.bootstrap) as address:
            report, done = run_soak(soak_cfg, address, work, plan, say)
    except _user_errors() as exc:
        fail(str(exc))
    summary = {**done, **report.as_dict(), "seed": seed, "pipeline": name}
    print(json.dumps(summary) if json_ else report.describe())
    raise typer.Exit(0 if report.exact else 1)


@bench_app.command("fold")
def bench_fold(
    bootstrap: BootstrapOpt = None,
    moves: Annotated[int, typer.Option(help="Moves in the synthetic control log.")] = 15_000,
    broker: Annotated[bool, typer.Option(help="Also catch up with the log from a real topic.")] = True,
) -> None:
    """What a restart costs on a long control log: fold and decode times of `--moves` moves (about 6.7
    messages each), and with a broker a reader's catch-up of them from a control topic."""
    from controller import kafka_runtime
    from controller.fold_bench import run

    cfg = _config(None, None, bootstrap)
    try:
        if not broker:
            print(json.dumps(run(moves), indent=2))
            return
        with kafka_runtime.broker_unless(cfg.bootstrap) as address:
            print(json.dumps(run(moves, address), indent=2))
    except _user_errors() as exc:
        fail(str(exc))


@bench_app.command("generator")
def bench_generator(
    bootstrap: BootstrapOpt = None,
    tuples: Annotated[int, typer.Option(help="Tuples per run.")] = 2_000_000,
    runs: Annotated[int, typer.Option(help="Runs per message size (median reported).")] = 3,
) -> None:
    """The generator's max-rate throughput on one core, for several tuples-per-message sizes."""
    from generator.bench import run_generator_bench

    cfg = _config(None, None, bootstrap)
    print(json.dumps(run_generator_bench(_bootstrap(cfg), tuples=tuples, runs=runs), indent=2))


def main() -> None:
    try:
        app()
    except KeyboardInterrupt:
        sys.exit(130)
