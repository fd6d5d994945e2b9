"""The commands that look after a pipeline and its Kafka cluster: the embedded broker (`fluxjoin kafka`),
a pipeline's verification, moves and state budgets by hand, its topics, ACLs and status.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer
from confluent_kafka import KafkaException

from fluxjoin.options import (
    EXIT_NOT_EXACT,
    EXIT_UNREACHABLE,
    BootstrapOpt,
    ConfigOpt,
    JsonOpt,
    ModeOpt,
    SetOpt,
    broker_address,
    fail,
    handoff_mode,
    progress,
    read_config,
    user_errors,
)
from pipeline.config import Config

kafka_app = typer.Typer(no_args_is_help=True, help="Run a local single-node KRaft Apache Kafka broker.")


@kafka_app.command("start")
def kafka_start(
    port: Annotated[int, typer.Option(help="Client port.")] = 9092,
    fresh: Annotated[
        bool, typer.Option(help="Stop a running broker and delete its data (every topic) first.")
    ] = False,
) -> None:
    """Start the embedded broker (fetching Kafka jars into the cache the first time)."""
    from local import kafka_runtime
    from local.kafka_dist import KafkaRuntimeError

    try:
        print(kafka_runtime.start(port=port, fresh=fresh))
    except KafkaRuntimeError as exc:
        fail(str(exc))


@kafka_app.command("stop")
def kafka_stop(port: Annotated[int, typer.Option(help="Client port of the broker to stop.")] = 9092) -> None:
    """Stop the embedded broker (its data stays until the next `start --fresh`)."""
    from local import kafka_runtime

    pid = kafka_runtime.stop(port=port)
    print(f"stopped the broker at localhost:{port} (pid {pid})" if pid else f"no broker runs for port {port}")


@kafka_app.command("status")
def kafka_status() -> None:
    """Say whether the embedded broker runs, and where."""
    from local import kafka_runtime

    address = kafka_runtime.running_address()
    print(f"running at {address}" if address else "not running")
    raise typer.Exit(0 if address else 1)


def verify(
    config: ConfigOpt = None,
    set_: SetOpt = None,
    bootstrap: BootstrapOpt = None,
    json_: JsonOpt = False,
    subset: Annotated[
        bool,
        typer.Option(
            "--subset",
            help="Pass output that is a subset of the exact result (results still due: spilled pids "
            "before their clean-up, input not processed yet), with nothing duplicate or spurious.",
        ),
    ] = False,
) -> None:
    """Judge the results topic and the late dead letters against the input topics alone: the expected
    join is counted by the lateness rule of each input partition (exit 0: exact, or with --subset a
    subset of it, 1: not, 2: could not judge, 3: Kafka unreachable)."""
    from pipeline.oracle import verify_pipeline
    from pipeline.topics import BrokerUnreachable

    cfg = read_config(config, set_, bootstrap)
    try:
        report = verify_pipeline(cfg, broker_address(cfg), progress=progress(json_))
    except BrokerUnreachable as exc:
        fail(str(exc), EXIT_UNREACHABLE)
    except user_errors() as exc:
        fail(str(exc))
    except Exception as exc:  # could not judge: never the "not exact" of exit status 1
        fail(f"could not verify: {type(exc).__name__}: {exc}")
    print(json.dumps(report.as_dict()) if json_ else report.describe())
    raise typer.Exit(0 if (report.subset if subset else report.exact) else 1)


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
    from controller.moves.kafka_mover import await_request, request_moves
    from pipeline.instance import parse_pids

    cfg = read_config(config, set_, bootstrap)
    try:
        wanted = sorted(parse_pids(pids, cfg.partitions))
    except ValueError as exc:
        fail(str(exc))
    address = _reachable(cfg)
    try:
        request = request_moves(cfg, address, wanted, to, handoff_mode(mode), wait_s=wait)
    except (KafkaException, RuntimeError) as exc:
        fail(f"the move request did not reach Kafka at {address}: {_kafka_reason(exc)}", EXIT_UNREACHABLE)
    asked = {"request": request.request_id, "pids": wanted, "to": to, "mode": request.mode.value}
    if not json_:
        print(f"requested {request.request_id}: pids {pids} -> {to} ({request.mode.value})")
    if wait <= 0:
        if json_:
            print(json.dumps(asked | {"owners": None}))
        return
    owners = await_request(cfg, address, request, wait)
    if owners is None:
        fail(f"not done after {wait:g} s (is `fluxjoin controller` running, and {to} alive?)", EXIT_NOT_EXACT)
    if json_:
        print(json.dumps(asked | {"owners": {str(p): owner for p, owner in owners.items()}}))
        return
    for p, owner in owners.items():  # the owners of record: the target may have died during a move
        print(f"done: pid {p} is processed by {owner}" + ("" if owner == to else f", not {to}"))


def budget(
    instance: Annotated[str, typer.Argument(help="The instance, e.g. instance-0.")],
    size: Annotated[
        str, typer.Argument(help="Bytes its windows may hold: 256m, 1g, 500000; 0 returns to the configured.")
    ],
    config: ConfigOpt = None,
    set_: SetOpt = None,
    bootstrap: BootstrapOpt = None,
) -> None:
    """Set how much window state an instance may hold, while it runs (from its next batch on; it outlives
    the instance's restarts). The controller's memory policies move state away from an instance over its
    budget."""
    from pipeline.config import spark_bytes
    from pipeline.control import set_state_budget

    cfg = read_config(config, set_, bootstrap)
    try:
        wanted = spark_bytes(size)
    except ValueError:
        fail(f"{size!r} is not a size (256m, 1g, or bytes)")
    if wanted < 0:
        fail(f"a budget is at least 0 bytes, got {size!r}")
    address = _reachable(cfg)
    try:
        set_state_budget(cfg, address, instance, wanted)
    except (KafkaException, RuntimeError) as exc:
        fail(f"the budget did not reach Kafka at {address}: {_kafka_reason(exc)}", EXIT_UNREACHABLE)
    configured = cfg.instance.state_budget()
    said = f"{wanted:,} bytes" if wanted else f"the configured {configured:,} bytes"
    print(f"{instance}: state budget {said}")


def topics(config: ConfigOpt = None, set_: SetOpt = None, bootstrap: BootstrapOpt = None) -> None:
    """The pipeline's topics as fluxjoin creates them (or, with topics.create=false, expects to find)."""
    from pipeline.topics import topic_specs

    cfg = read_config(config, set_, bootstrap)
    for spec in topic_specs(cfg):
        settings = " ".join(f"{k}={v}" for k, v in sorted(spec.config.items()))
        print(
            f"{spec.name} partitions={spec.partitions} replication={cfg.topics.replication_factor} {settings}"
        )


def acls(
    principal: Annotated[str, typer.Option(help="The pipeline's Kafka principal, e.g. User:fluxjoin.")],
    role: Annotated[
        str,
        typer.Option(
            help="What the principal does: pipeline (every process), controller, instance or generator."
        ),
    ] = "pipeline",
    config: ConfigOpt = None,
    set_: SetOpt = None,
    bootstrap: BootstrapOpt = None,
    apply: Annotated[
        bool, typer.Option("--apply", help="Create them on the cluster (as an administrator).")
    ] = False,
) -> None:
    """The Kafka ACLs a pipeline's principal needs on a cluster with an authorizer; --apply creates them."""
    from pipeline.acls import ROLES, create_acls, describe_acl, pipeline_acls

    cfg = read_config(config, set_, bootstrap)
    if role not in ROLES:
        fail(f"--role {role}: use one of {', '.join(ROLES)}")
    bindings = pipeline_acls(cfg, principal, role)
    for binding in bindings:
        print(describe_acl(binding))
    if apply:
        address = _reachable(cfg)
        try:
            create_acls(address, bindings)
        except KafkaException as exc:
            fail(f"Kafka at {address}: {_kafka_reason(exc)}", EXIT_UNREACHABLE)
        print(f"created {len(bindings)} ACLs at {address}")


def keys(
    directory: Annotated[Path, typer.Argument(help="Where the keys go (and where controller.key is kept).")],
    names: Annotated[
        list[str] | None,
        typer.Argument(help="The writers to issue keys to (default: the instances instance-0..N-1)."),
    ] = None,
    config: ConfigOpt = None,
    set_: SetOpt = None,
) -> None:
    """Make signing keys: the controller's (`controller.key`; `controller.pub` is what every process
    trusts) and a key with a certificate for the pipeline per writer (`<name>.key`, `<name>.cert`).
    Existing keys are kept; run it again to add an instance."""
    from pipeline.signing import KEY_ENV, TRUST_ENV, create_keys

    cfg = read_config(config, set_, None)
    wanted = names or [f"instance-{i}" for i in range(cfg.instances)]
    for path in create_keys(directory, cfg.pipeline, wanted):
        print(f"{KEY_ENV}={path}")
    print(f"{TRUST_ENV}={directory / 'controller.pub'}")


def status(
    config: ConfigOpt = None, set_: SetOpt = None, bootstrap: BootstrapOpt = None, json_: JsonOpt = False
) -> None:
    """The assignment of record, moves in flight and per-instance load and lag (0 once drained)."""
    from controller.status import describe_status, pipeline_status

    cfg = read_config(config, set_, bootstrap)
    address = _reachable(cfg)
    try:
        found = pipeline_status(cfg, address)
        print(json.dumps(found) if json_ else describe_status(found))
    except user_errors() as exc:
        fail(str(exc))
    except KafkaException as exc:
        fail(f"Kafka at {address}: {_kafka_reason(exc)}", EXIT_UNREACHABLE)


def _reachable(cfg: Config) -> str:
    """`broker_address`, checked to answer within 10 s: one line and exit status 3 when it does not."""
    from pipeline.topics import BrokerUnreachable, check_reachable

    address = broker_address(cfg)
    try:
        check_reachable(address)
    except BrokerUnreachable as exc:
        fail(str(exc), EXIT_UNREACHABLE)
    return address


def _kafka_reason(exc: Exception) -> str:
    """A Kafka client's failure in a few words (its error's own text, not the exception's repr)."""
    return exc.args[0].str() if isinstance(exc, KafkaException) and exc.args else str(exc)
