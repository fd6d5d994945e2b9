"""`fluxjoin operator`: its options, the Kubernetes client it builds from them, and `run_operator`, which
wires the Lease elector, the production movers, the reconcile loop and the health server together.

Apart from the loop so that the loop is built from parts the tests give it, and this module alone reads
the process's environment (kubeconfig, service account, signals).
"""

from __future__ import annotations

import logging
import signal
import socket
from dataclasses import dataclass, field
from pathlib import Path

import kubernetes

from controller.k8s.certificates import Issuer
from controller.k8s.health import serve_health
from controller.k8s.lease import LeaseElector
from controller.k8s.ports import make_mover
from controller.k8s.reconciler import Operator
from controller.k8s.spec import InstanceSettings
from pipeline import signing

log = logging.getLogger(__name__)

SERVICE_ACCOUNT_NAMESPACE = Path("/var/run/secrets/kubernetes.io/serviceaccount/namespace")


def default_namespace() -> str:
    """The namespace of the pod's service account, or "default" outside a cluster."""
    try:
        return SERVICE_ACCOUNT_NAMESPACE.read_text().strip() or "default"
    except OSError:
        return "default"


@dataclass(frozen=True, slots=True, kw_only=True)
class OperatorOptions:
    """Everything `fluxjoin operator` is started with (flags or the chart's FLUXJOIN_* variables)."""

    namespace: str
    identity: str = field(default_factory=socket.gethostname)
    leader_election: bool = True
    lease_name: str = "fluxjoin-operator"
    kubeconfig: Path | None = None
    metrics_port: int = 9108
    instance: InstanceSettings = field(default_factory=InstanceSettings)


class OperatorConfigError(RuntimeError):
    """The operator cannot reach the API server with the configuration it was given."""


def _api_client(kubeconfig: Path | None) -> kubernetes.client.ApiClient:
    try:
        if kubeconfig is not None:
            return kubernetes.config.new_client_from_config(config_file=str(kubeconfig))
        kubernetes.config.load_incluster_config()
    except kubernetes.config.ConfigException as exc:
        where = f"kubeconfig {kubeconfig}" if kubeconfig else "the in-cluster service account"
        raise OperatorConfigError(f"cannot configure the Kubernetes client from {where}: {exc}") from exc
    return kubernetes.client.ApiClient()


def run_operator(options: OperatorOptions) -> None:
    """Run the operator until SIGTERM or SIGINT, with `make_mover` for every pipeline.

    Raises OperatorConfigError when the API server cannot be configured.
    """
    api_client = _api_client(options.kubeconfig)
    elector = (
        LeaseElector(
            kubernetes.client.CoordinationV1Api(api_client),
            options.namespace,
            options.lease_name,
            options.identity,
        )
        if options.leader_election
        else None
    )
    operator = Operator(
        api_client,
        options.namespace,
        make_mover,
        options.instance,
        elector=elector,
        identity=options.identity,
    )
    signer = signing.signer()
    issuer = (
        Issuer(api_client, options.namespace, signer)
        if signer is not None and options.instance.signing_issuer
        else None
    )
    server = serve_health(operator.healthy, operator.metrics, options.metrics_port, issuer=issuer)
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: operator.request_stop())
    log.info("reconciling JoinPipelines in namespace %s as %s", options.namespace, options.identity)
    try:
        operator.run()
    finally:
        server.shutdown()
