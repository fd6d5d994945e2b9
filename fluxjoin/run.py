"""The commands that run a part of the pipeline until it ends or is stopped: the generator, a join
instance, the controller and the Kubernetes operator, and the demo that runs them all on this machine.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from pathlib import Path
from typing import Annotated

import typer

from fluxjoin.options import (
    BootstrapOpt,
    ConfigOpt,
    JsonOpt,
    SetOpt,
    broker_address,
    fail,
    handoff_mode,
    read_config,
    user_errors,
)
from pipeline.health import DEFAULT_METRICS_PORT, STALL_TIMEOUT_S
from pipeline.process_log import LOG_FORMAT, configure_logging


def generate(config: ConfigOpt = None, set_: SetOpt = None, bootstrap: BootstrapOpt = None) -> None:
    """Produce Poisson streams to the input topics (keyed and partitioned by pid).

    SIGINT or SIGTERM ends the run early and cleanly: what was produced is flushed and acknowledged."""
    configure_logging()
    from generator.producer import run_generator

    cfg = read_config(config, set_, bootstrap)
    try:
        stats = run_generator(cfg, broker_address(cfg), progress=True, stop=_stop_on_signals())
    except user_errors() as exc:
        fail(str(exc))
    print(json.dumps(stats))


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
    configure_logging()
    from pipeline.executors import NotInAPod, check_pod
    from pipeline.health import MetricsPortError
    from pipeline.instance import parse_pids, run_instance

    cfg = read_config(config, set_, bootstrap)
    try:
        owned = parse_pids(pids, cfg.partitions) if pids is not None else None
        if cfg.instance.executors is not None:
            check_pod(os.environ)
    except (ValueError, NotInAPod) as exc:
        fail(str(exc))
    errors: tuple[type[Exception], ...] = (*user_errors(), MetricsPortError)
    try:
        run_instance(
            cfg, broker_address(cfg), name, owned, metrics_port=metrics_port, stall_timeout_s=stall_timeout
        )
    except errors as exc:
        fail(str(exc))


def executor() -> None:
    """Run a Spark executor in a pod that an instance's Spark driver created (`instance.executors`).

    Spark's Kubernetes backend starts executor pods from the instance's image with the argument
    `executor` and says in their environment whom to serve; the image's entry point is this command."""
    import pyspark

    from pipeline.executors import executor_command

    try:
        command = executor_command(os.environ, Path(pyspark.__file__).parent / "jars")
    except KeyError as missing:
        fail(f"fluxjoin executor runs only in an executor pod Spark created: {missing} is not set")
    os.execvp(command[0], command)


def demo(
    config: ConfigOpt = None,
    set_: SetOpt = None,
    bootstrap: BootstrapOpt = None,
    json_: JsonOpt = False,
    duration: Annotated[float, typer.Option(help="Seconds of input to generate.")] = 150.0,
    policy: Annotated[
        str | None, typer.Option(help="Controller policy (default: the config's policy.name, flux).")
    ] = None,
) -> None:
    """Embedded Kafka, generator, controller, N instances, live view, verification and a report."""
    from controller.policies import POLICIES
    from local.demo import DEMO_DEFAULTS, run_demo

    cfg = read_config(config, [*DEMO_DEFAULTS, *(set_ or [])], bootstrap)
    if policy is not None:
        cfg = cfg.with_overrides(**{"policy.name": policy})
    if cfg.policy.name not in POLICIES:
        fail(f"unknown policy {cfg.policy.name!r}; choose from {', '.join(POLICIES)}")
    try:
        summary = run_demo(cfg, duration_s=duration, json_output=json_)
    except user_errors() as exc:
        fail(str(exc))
    if json_:
        print(json.dumps(summary))
    raise typer.Exit(0 if summary.get("exact") else 1)


def controller(
    config: ConfigOpt = None,
    set_: SetOpt = None,
    bootstrap: BootstrapOpt = None,
    policy: Annotated[
        str | None,
        typer.Option(help="static, flux, memory, flux-memory or hybrid (default: the config's policy.name)."),
    ] = None,
    mode: Annotated[
        str | None,
        typer.Option(help="Handoff mode: transfer, replay or parallel-track (default: policy.handoff_mode)."),
    ] = None,
    heartbeat_timeout: Annotated[float, typer.Option(help="Seconds without a heartbeat = dead.")] = 10.0,
    dry_run: Annotated[bool, typer.Option(help="Print decisions, move nothing.")] = False,
    policy_param: Annotated[
        list[str] | None,
        typer.Option(help="A policy parameter, e.g. delta_min_s=1.0 or th_imb=1.5 (repeatable)."),
    ] = None,
    decisions: Annotated[
        Path | None,
        typer.Option(help="Append each policy round's decision to this file, one JSON object a line."),
    ] = None,
) -> None:
    """Run the controller: policy rounds, pid moves, recovery of dead instances."""
    configure_logging()
    from controller.policies import POLICIES
    from controller.policies.params import policy_params
    from controller.runner import run_controller

    cfg = read_config(config, set_, bootstrap)
    policy = policy or cfg.policy.name
    if policy not in POLICIES:
        fail(f"unknown policy {policy!r}; choose from {', '.join(POLICIES)}")
    # The config's parameters are the configured policy's: another one chosen here starts from its defaults.
    configured = dict(cfg.policy.params) if policy == cfg.policy.name else {}
    try:
        settings = {k: float(v) for k, v in (item.split("=", 1) for item in policy_param or [])}
        params = policy_params(
            policy, handoff_mode(mode or cfg.policy.handoff_mode), **(configured | settings)
        )
    except (ValueError, TypeError) as exc:
        fail(f"policy parameters: {exc}")
    from controller.moves.kafka_mover import ControllerFenced
    from pipeline.control import FENCED_EXIT_STATUS

    stopping = _stop_on_signals()
    try:
        run_controller(
            cfg,
            broker_address(cfg),
            policy,
            params,
            heartbeat_timeout,
            dry_run,
            stopping.is_set,
            _say_with_time,
            decisions,
        )
    except ControllerFenced as exc:
        fail(str(exc), FENCED_EXIT_STATUS)
    except user_errors() as exc:
        fail(str(exc))


def _say_with_time(line: str) -> None:
    """A controller line, prefixed with the wall-clock time: a log of moves is read as a timeline."""
    print(f"{time.strftime('%H:%M:%S')} {line}", flush=True)


def _stop_on_signals() -> threading.Event:
    stopping = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stopping.set())
    return stopping


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
    instance_service_account: Annotated[
        str | None,
        typer.Option(
            envvar="FLUXJOIN_INSTANCE_SERVICE_ACCOUNT",
            help="ServiceAccount of instance pods that run executor pods (spec.instance.executors).",
        ),
    ] = None,
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

    from controller.k8s.main import (
        OperatorConfigError,
        OperatorOptions,
        default_namespace,
        run_operator,
    )
    from controller.k8s.spec import InstanceSettings
    from pipeline.control_view import CONTROLLER
    from pipeline.signing import ISSUER_ENV, public_pem, signer

    logging.basicConfig(level=log_level.upper(), format=LOG_FORMAT)
    own, issuer = signer(), os.environ.get(ISSUER_ENV) or None
    if (own is not None and own.name == CONTROLLER) != bool(issuer):
        fail(f"signing needs the controller's key (FLUXJOIN_SIGNING_KEY_FILE) and {ISSUER_ENV}, or neither")
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
            signing_issuer=issuer,
            controller_public_key=public_pem(own.key).decode() if own is not None and issuer else None,
            executor_service_account=instance_service_account or None,
        ),
    )
    try:
        run_operator(options)
    except OperatorConfigError as exc:
        fail(str(exc))
