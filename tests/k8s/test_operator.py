"""The JoinPipeline operator against a real kube-apiserver: owned objects, status, scaling in both
directions, deletion, leader election and the chart's RBAC.

Moves are carried out by `RecordingMover`, an in-memory `PidMover` the tests drive by hand (which
instances are ready, when moves complete); these tests check the Kubernetes side, not the moves
(test_operator_pipeline.py runs the operator with its real mover and real instances). The
reconcile loop runs one round at a time (`reconcile_once`, `step`), except in the one test of `run()`.
There is no controller-manager: StatefulSets never create pods or volumes, so the tests create the
checkpoint volumes themselves where it matters.
"""

from __future__ import annotations

import json
import threading
import time
import urllib.request
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import kubernetes
import pytest
import yaml
from typer.testing import CliRunner

from controller.assignment import Assignment, FinishedMove, HandoffMode, Move
from controller.k8s.health import serve_health
from controller.k8s.lease import LeaseElector
from controller.k8s.main import OperatorOptions
from controller.k8s.manifests import selector_labels
from controller.k8s.ports import PidMover
from controller.k8s.reconciler import Operator
from controller.k8s.spec import FINALIZER, InstanceSettings, PipelineSpec
from controller.policies.base import InstanceStats, PidStats, Snapshot
from controller.rounds import FIRST_ROUND_DELAY_S
from fluxjoin.cli import app
from tests.k8s.cluster import GROUP, PLURAL, REPO, VERSION, KubeCluster, free_port, pipeline_manifest

CHART = REPO / "charts" / "fluxjoin"
SETTINGS = InstanceSettings(image="registry.example.com/fluxjoin:0.1.0", pull_secrets=("registry",))


@dataclass
class RecordingMover:
    """A `PidMover` whose moves complete and whose instances become ready when the test says so."""

    spec: PipelineSpec
    current: Assignment | None = None
    moving: list[Move] = field(default_factory=list)
    tails: list[Move] = field(default_factory=list)
    """Moves past their release (handoffs not yet acquired, parallel tracks' tails): in flight, not
    releasing."""
    snapshots: int = 0
    ready: set[str] = field(default_factory=set)
    stats: dict[str, InstanceStats] = field(default_factory=dict)
    tuples: dict[int, int] = field(default_factory=dict)
    calls: list[tuple[str, Any]] = field(default_factory=list)
    done: list[FinishedMove] = field(default_factory=list)
    ticks: int = 0
    complete_at_next_step: bool = False
    """Set by a test: the next `step()` completes the moves (in the thread that steps, as a real
    mover's step completes them when their last message has arrived)."""
    closed: bool = False
    restarts: tuple[set[str], float] = (set(), 0.0)
    pods_ready: set[str] | None = None
    """What the operator last said of the instances whose pods are (re)starting, and their grace."""

    def assignment(self) -> Assignment | None:
        return self.current

    def start(self, initial: Assignment) -> None:
        self.calls.append(("start", initial))
        if self.current is None:
            self.current = initial

    def request(self, moves: Sequence[Move]) -> None:
        self.calls.append(("request", tuple(moves)))
        self.moving.extend(m for m in moves if m not in self.moving)

    def gate_spills(self, spill: bool) -> None:
        self.calls.append(("gate_spills", spill))

    def in_flight(self) -> Sequence[Move]:
        return tuple(self.moving + self.tails)

    def releasing(self) -> Sequence[Move]:
        return tuple(self.moving)

    def finished(self) -> Sequence[FinishedMove]:
        done, self.done = self.done, []
        return done

    def ready_instances(self) -> set[str]:
        return set(self.ready)

    def pods(self, ready: Collection[str] | None, restarting: Collection[str], grace_s: float) -> None:
        self.restarts = (set(restarting), grace_s)
        self.pods_ready = None if ready is None else set(ready)

    def step(self) -> None:
        self.ticks += 1
        if self.complete_at_next_step:
            self.complete_at_next_step = False
            self.complete()

    def await_news(self) -> bool:
        time.sleep(0.02)
        return False

    def instance_stats(self) -> Mapping[str, InstanceStats]:
        return self.stats

    def snapshot(self, interval_s: float, now_s: float, last_adaptation_s: float | None) -> Snapshot | None:
        if self.current is None:
            return None
        self.snapshots += 1
        return Snapshot(
            now_s=now_s,
            instances=tuple(self.stats[name] for name in sorted(self.stats)),
            pids={p: PidStats(pid=p, tuples=n, state_bytes=0, results=0) for p, n in self.tuples.items()},
            assignment=self.current,
            moves_in_flight=frozenset(m.pid for m in self.moving + self.tails),
            interval_s=interval_s,
            last_adaptation_s=last_adaptation_s,
        )

    def close(self) -> None:
        self.closed = True

    def complete(self) -> None:
        assert self.current is not None
        self.current = self.current.with_moves(self.moving)
        self.done += [FinishedMove(m, self.current.epoch, m.target) for m in self.moving]
        self.moving.clear()


class Movers:
    """The operator's mover factory: one RecordingMover per pipeline name, kept for the test to drive."""

    def __init__(self) -> None:
        self.by_name: dict[str, RecordingMover] = {}

    def __call__(self, spec: PipelineSpec) -> PidMover:
        self.by_name[spec.name] = RecordingMover(spec)
        return self.by_name[spec.name]


@pytest.fixture
def movers() -> Movers:
    return Movers()


@pytest.fixture
def operator(kube: KubeCluster, namespace: str, crd: None, movers: Movers) -> Operator:
    return Operator(kube.api_client, namespace, movers, SETTINGS)


def _apply(kube: KubeCluster, namespace: str, name: str, **spec: Any) -> None:
    kube.kubectl("apply", "-n", namespace, "-f", "-", input_text=pipeline_manifest(name, **spec))


def _plain(kube: KubeCluster, obj: object) -> dict[str, Any]:
    plain = kube.api_client.sanitize_for_serialization(obj)
    assert isinstance(plain, dict)
    return plain


def _jp(kube: KubeCluster, namespace: str, name: str = "x") -> dict[str, Any]:
    custom = kubernetes.client.CustomObjectsApi(kube.api_client)
    return _plain(kube, custom.get_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, name))


def _sts(kube: KubeCluster, namespace: str, name: str = "x") -> dict[str, Any]:
    return _plain(
        kube, kubernetes.client.AppsV1Api(kube.api_client).read_namespaced_stateful_set(name, namespace)
    )


def _svc(kube: KubeCluster, namespace: str, name: str = "x") -> dict[str, Any]:
    return _plain(kube, kubernetes.client.CoreV1Api(kube.api_client).read_namespaced_service(name, namespace))


def _cm(kube: KubeCluster, namespace: str, name: str = "x") -> dict[str, Any]:
    return _plain(
        kube, kubernetes.client.CoreV1Api(kube.api_client).read_namespaced_config_map(name, namespace)
    )


def _pdb(kube: KubeCluster, namespace: str, name: str = "x") -> dict[str, Any]:
    policy = kubernetes.client.PolicyV1Api(kube.api_client)
    return _plain(kube, policy.read_namespaced_pod_disruption_budget(name, namespace))


def _instance_config(kube: KubeCluster, namespace: str, name: str = "x") -> dict[str, Any]:
    """The configuration file the pipeline's instance pods read, as `fluxjoin instance --config` parses it."""
    (text,) = _cm(kube, namespace, name)["data"].values()
    parsed = yaml.safe_load(text)
    assert isinstance(parsed, dict)
    return parsed


def _missing(read: Callable[[], object]) -> bool:
    try:
        read()
    except kubernetes.client.ApiException as exc:
        return exc.status == 404
    return False


def _events(kube: KubeCluster, namespace: str, name: str = "x") -> list[tuple[str, str]]:
    """(reason, message) of the events on pipeline `name`, oldest first."""
    found = kubernetes.client.CoreV1Api(kube.api_client).list_namespaced_event(
        namespace, field_selector=f"involvedObject.name={name},involvedObject.kind=JoinPipeline"
    )
    items = sorted(_plain(kube, found)["items"], key=lambda e: int(e["metadata"]["resourceVersion"]))
    return [(e["reason"], e["message"]) for e in items]  # in creation order


def _reasons(kube: KubeCluster, namespace: str, name: str = "x") -> list[str]:
    return [reason for reason, _ in _events(kube, namespace, name)]


def _versions(kube: KubeCluster, namespace: str) -> tuple[str, ...]:
    return tuple(
        read(kube, namespace)["metadata"]["resourceVersion"] for read in (_jp, _sts, _svc, _cm, _pdb)
    )


def _ready(status: dict[str, Any]) -> tuple[str, str]:
    (condition,) = status["conditions"]
    assert condition["type"] == "Ready"
    return condition["status"], condition["reason"]


def _claim(kube: KubeCluster, namespace: str, name: str, pipeline: str = "x") -> None:
    """A checkpoint volume as the StatefulSet controller would make it (labels from the claim template)."""
    labels = _sts(kube, namespace, pipeline)["spec"]["volumeClaimTemplates"][0]["metadata"]["labels"]
    body = {
        "apiVersion": "v1",
        "kind": "PersistentVolumeClaim",
        "metadata": {"name": name, "labels": labels},
        "spec": {"accessModes": ["ReadWriteOnce"], "resources": {"requests": {"storage": "1Gi"}}},
    }
    kube.kubectl("apply", "-n", namespace, "-f", "-", input_text=yaml.safe_dump(body))


def _claims(kube: KubeCluster, namespace: str) -> dict[str, bool]:
    """Checkpoint volume name -> whether it is being deleted (kept by pvc-protection without a
    controller-manager)."""
    found = kubernetes.client.CoreV1Api(kube.api_client).list_namespaced_persistent_volume_claim(namespace)
    return {c["metadata"]["name"]: "deletionTimestamp" in c["metadata"] for c in _plain(kube, found)["items"]}


# --- create ---


def test_a_new_pipeline_gets_its_statefulset_service_and_status(
    kube: KubeCluster, namespace: str, operator: Operator, movers: Movers
) -> None:
    _apply(
        kube, namespace, "x", partitions=8, replicas=3,
        resources={"requests": {"cpu": "1", "memory": "2Gi"}},
        checkpoint={"size": "1Gi", "storageClassName": "fast"},
        kafka={"bootstrapServers": "kafka.kafka.svc:9092", "topicPrefix": "orders"},
    )  # fmt: skip
    operator.reconcile_once()
    jp = _jp(kube, namespace)
    uid = jp["metadata"]["uid"]

    sts = _sts(kube, namespace)
    selector = {
        "app.kubernetes.io/name": "fluxjoin",
        "app.kubernetes.io/component": "instance",
        "fluxjoin.io/pipeline": "x",
    }
    assert sts["spec"]["replicas"] == 3
    assert sts["spec"]["serviceName"] == "x"
    assert sts["spec"]["selector"] == {"matchLabels": selector}
    assert selector.items() <= sts["metadata"]["labels"].items()
    assert sts["metadata"]["ownerReferences"] == [
        {"apiVersion": "fluxjoin.io/v1alpha1", "kind": "JoinPipeline", "name": "x", "uid": uid,
         "controller": True, "blockOwnerDeletion": True}
    ]  # fmt: skip
    pod = sts["spec"]["template"]
    assert selector.items() <= pod["metadata"]["labels"].items()
    assert pod["metadata"]["annotations"]["prometheus.io/scrape"] == "true"
    assert pod["spec"]["imagePullSecrets"] == [{"name": "registry"}]
    assert pod["spec"]["automountServiceAccountToken"] is False
    (container,) = pod["spec"]["containers"]
    assert container["image"] == "registry.example.com/fluxjoin:0.1.0"
    assert container["resources"] == {"requests": {"cpu": "1", "memory": "2Gi"}}
    assert container["args"] == [
        "instance", "--name", "$(FLUXJOIN_POD_NAME)", "--config", "/etc/fluxjoin/instance.yaml",
        "--metrics-port", "9108",
    ]  # fmt: skip
    assert {"name": "checkpoint", "mountPath": "/var/lib/fluxjoin/work"} in container["volumeMounts"]
    assert {"name": "config", "mountPath": "/etc/fluxjoin", "readOnly": True} in container["volumeMounts"]
    assert {"name": "config", "configMap": {"name": "x", "defaultMode": 420}} in pod["spec"]["volumes"]
    assert container["startupProbe"]["httpGet"] == {"path": "/readyz", "port": "metrics", "scheme": "HTTP"}
    assert container["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "metrics", "scheme": "HTTP"}
    assert container["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "metrics", "scheme": "HTTP"}

    cm = _cm(kube, namespace)
    assert cm["metadata"]["ownerReferences"] == sts["metadata"]["ownerReferences"]
    assert selector.items() <= cm["metadata"]["labels"].items()
    config = _instance_config(kube, namespace)
    assert (config["pipeline"], config["bootstrap"], config["partitions"]) == (
        "orders",
        "kafka.kafka.svc:9092",
        8,
    )
    assert "pids" not in config, "pids come from the control topic: a move never changes a pod"

    pdb = _pdb(kube, namespace)
    assert pdb["spec"]["maxUnavailable"] == 1
    assert pdb["spec"]["selector"] == {"matchLabels": selector}
    assert pdb["metadata"]["ownerReferences"] == sts["metadata"]["ownerReferences"]
    (claim,) = sts["spec"]["volumeClaimTemplates"]
    assert claim["metadata"]["name"] == "checkpoint"
    assert claim["spec"]["resources"] == {"requests": {"storage": "1Gi"}}
    assert claim["spec"]["storageClassName"] == "fast"
    assert sts["spec"]["persistentVolumeClaimRetentionPolicy"] == {
        "whenDeleted": "Delete",
        "whenScaled": "Delete",
    }

    svc = _svc(kube, namespace)
    assert svc["spec"]["clusterIP"] == "None"
    assert svc["spec"]["selector"] == selector
    assert svc["metadata"]["ownerReferences"][0]["uid"] == uid

    assert not jp["metadata"].get("finalizers"), "the garbage collector cleans up, not a finalizer"
    status = jp["status"]
    assert status["epoch"] == 0
    assert status["assignment"] == [
        {"instance": "x-0", "pids": "0-2", "count": 3},
        {"instance": "x-1", "pids": "3-5", "count": 3},
        {"instance": "x-2", "pids": "6-7", "count": 2},
    ]
    assert (status["replicas"], status["readyReplicas"], status["movesInFlight"]) == (3, 0, 0)
    assert (
        status["selector"]
        == "app.kubernetes.io/component=instance,app.kubernetes.io/name=fluxjoin,fluxjoin.io/pipeline=x"
    )
    assert status["observedGeneration"] == jp["metadata"]["generation"]
    assert _ready(status) == ("False", "InstancesNotReady")
    assert status["lastDecision"] == "publish epoch 0: 8 pids on 3 instances"
    assert movers.by_name["x"].calls == [("start", movers.by_name["x"].current)]

    # The scale subresource reads status.replicas and status.selector.
    scale = _plain(
        kube,
        kubernetes.client.CustomObjectsApi(kube.api_client).get_namespaced_custom_object_scale(
            GROUP, VERSION, namespace, PLURAL, "x"
        ),
    )
    assert scale["status"] == {"replicas": 3, "selector": status["selector"]}
    assert _reasons(kube, namespace) == ["Started", "Created"]

    # The instance pods show up as ready: status follows; then a round with nothing new writes nothing.
    movers.by_name["x"].ready = {"x-0", "x-1", "x-2"}
    movers.by_name["x"].stats = {
        "x-1": InstanceStats("x-1", busy_fraction=0.5, state_bytes=4096, tuples_per_s=812.25, lag=17)
    }
    operator.reconcile_once()
    status = _jp(kube, namespace)["status"]
    assert _ready(status) == ("True", "Running")
    assert status["instances"] == [
        {"name": "x-0", "ready": True, "pids": 3},
        {"name": "x-1", "ready": True, "pids": 3, "load": 0.5, "stateBytes": 4096, "tuplesPerSecond": 812.2,
         "lag": 17},
        {"name": "x-2", "ready": True, "pids": 2},
    ]  # fmt: skip
    assert (status["tuplesPerSecond"], status["lag"]) == (812.2, 17)
    assert movers.by_name["x"].ticks == 2, "the mover is ticked once per round"
    versions, events = _versions(kube, namespace), _events(kube, namespace)
    operator.reconcile_once()
    operator.reconcile_once()
    assert _versions(kube, namespace) == versions
    assert _events(kube, namespace) == events
    assert len(movers.by_name["x"].calls) == 1

    row = kube.kubectl("get", "-n", namespace, "jp/x", "--no-headers").stdout.split()
    assert row[:11] == ["x", "3", "3", "8", "10000", "flux", "0", "0", "812.2", "17", "Running"]


def test_the_instance_image_defaults_to_the_operators_and_spec_changes_update_the_template(
    kube: KubeCluster, namespace: str, operator: Operator
) -> None:
    _apply(kube, namespace, "x", partitions=4, replicas=1)
    operator.reconcile_once()
    assert _sts(kube, namespace)["spec"]["template"]["spec"]["containers"][0]["image"] == SETTINGS.image
    config_hash = _sts(kube, namespace)["spec"]["template"]["metadata"]["annotations"][
        "fluxjoin.io/config-hash"
    ]
    kube.kubectl(
        "patch", "-n", namespace, "jp/x", "--type=merge",
        "-p", '{"spec":{"image":"fluxjoin:2","windowMs":5000}}',
    )  # fmt: skip
    operator.reconcile_once()
    template = _sts(kube, namespace)["spec"]["template"]
    (container,) = template["spec"]["containers"]
    assert container["image"] == "fluxjoin:2"
    assert _instance_config(kube, namespace)["window_ms"] == 5000
    assert template["metadata"]["annotations"]["fluxjoin.io/config-hash"] != config_hash, "the pods roll"
    assert _reasons(kube, namespace)[-1] == "Updated"
    status = _jp(kube, namespace)["status"]
    assert status["observedGeneration"] == 2

    # Claim templates are immutable: a new checkpoint size is refused, and said so.
    kube.kubectl(
        "patch", "-n", namespace, "jp/x", "--type=merge", "-p", '{"spec":{"checkpoint":{"size":"9Gi"}}}'
    )
    operator.reconcile_once()
    (condition,) = _jp(kube, namespace)["status"]["conditions"]
    assert condition["reason"] == "ReconcileFailed"
    assert "Forbidden" in condition["message"]


def test_problems_are_reported_on_the_pipeline_once_and_do_not_stop_the_others(
    kube: KubeCluster, namespace: str, crd: None
) -> None:
    clock = FakeClock()
    operator = Operator(kube.api_client, namespace, Movers(), InstanceSettings(), clock=clock)
    _apply(kube, namespace, "x", partitions=4, replicas=1)
    _apply(kube, namespace, "pt", partitions=4, replicas=1, handoffMode="parallel_track", image="fluxjoin:1")
    _apply(kube, namespace, "fine", partitions=4, replicas=1, image="fluxjoin:1")
    operator.reconcile_once()
    assert operator.metrics.failures == 1
    status = _jp(kube, namespace)["status"]
    assert _ready(status) == ("False", "ReconcileFailed")
    assert "no image for the join instances" in status["conditions"][0]["message"]
    assert _sts(kube, namespace, "pt")["spec"]["replicas"] == 1  # every handoff mode is supported
    assert _sts(kube, namespace, "fine")["spec"]["replicas"] == 1
    assert _reasons(kube, namespace).count("ReconcileFailed") == 1
    operator.reconcile_once()
    assert _reasons(kube, namespace).count("ReconcileFailed") == 1, "one event per new failure, not per round"
    # The failing pipeline waits (1 s, then 2, 4 ...) while the others are reconciled every round.
    assert (operator.metrics.failures, operator.metrics.reconciles) == (1, 5)
    clock.now += 1.0
    operator.reconcile_once()
    assert (operator.metrics.failures, operator.metrics.reconciles) == (2, 8)
    clock.now += 1.0
    operator.reconcile_once()
    assert (operator.metrics.failures, operator.metrics.reconciles) == (2, 10)
    kube.kubectl("patch", "-n", namespace, "jp/x", "--type=merge", "-p", '{"spec":{"image":"fluxjoin:1"}}')
    operator.reconcile_once()  # a changed spec is tried at once
    assert (operator.metrics.failures, operator.metrics.reconciles) == (2, 13)


# --- scale ---


def test_kubectl_scale_out_grows_the_statefulset_then_moves_pids_onto_ready_instances(
    kube: KubeCluster, namespace: str, operator: Operator, movers: Movers
) -> None:
    _apply(kube, namespace, "x", partitions=8, replicas=3)
    operator.reconcile_once()
    mover = movers.by_name["x"]
    mover.ready = {"x-0", "x-1", "x-2"}
    operator.reconcile_once()

    kube.kubectl("scale", "-n", namespace, "joinpipeline/x", "--replicas=4")
    operator.reconcile_once()
    assert _sts(kube, namespace)["spec"]["replicas"] == 4
    assert [call for call, _ in mover.calls] == ["start"], "no move before x-3 reports ready"
    status = _jp(kube, namespace)["status"]
    assert _ready(status) == ("False", "ScalingOut")
    assert status["replicas"] == 4
    assert "waiting for x-3 to report ready" in status["conditions"][0]["message"]
    assert _events(kube, namespace)[-1] == ("ScaledOut", "StatefulSet x: 3 -> 4 instances")

    mover.ready.add("x-3")
    operator.reconcile_once()
    requested = [Move(2, "x-0", "x-3"), Move(5, "x-1", "x-3")]
    assert mover.calls[-1] == ("request", tuple(requested))
    status = _jp(kube, namespace)["status"]
    assert status["movesInFlight"] == 2
    assert [(m["pid"], m["from"], m["to"], m["mode"]) for m in status["moves"]] == [
        (2, "x-0", "x-3", "transfer"),
        (5, "x-1", "x-3", "transfer"),
    ]
    assert status["lastDecision"] == "spread 2 pids onto x-3"
    assert _events(kube, namespace)[-3:] == [
        ("Spreading", "spread 2 pids onto x-3"),
        ("MoveRequested", "pid 2: x-0 -> x-3 (transfer)"),
        ("MoveRequested", "pid 5: x-1 -> x-3 (transfer)"),
    ]

    versions = _versions(kube, namespace)
    operator.reconcile_once()
    assert len(mover.calls) == 2, "moves in flight are not requested again"
    assert _versions(kube, namespace) == versions

    mover.complete()
    operator.reconcile_once()
    status = _jp(kube, namespace)["status"]
    assert status["epoch"] == 1
    assert status["assignment"][3] == {"instance": "x-3", "pids": "2,5", "count": 2}
    assert (status["movesInFlight"], status["moves"]) == (0, [])
    assert _ready(status) == ("True", "Running")
    assert status["lastDecision"] == "spread 2 pids onto x-3", "the last action stays on record"
    assert _events(kube, namespace)[-2:] == [
        ("MoveCompleted", "pid 2: x-0 -> x-3 (epoch 1)"),
        ("MoveCompleted", "pid 5: x-1 -> x-3 (epoch 1)"),
    ]
    row = kube.kubectl("get", "-n", namespace, "jp/x", "--no-headers").stdout.split()
    assert row[:9] == ["x", "4", "4", "8", "10000", "flux", "1", "0", "Running"]  # no figures yet: blank


def test_kubectl_scale_in_drains_first_and_shrinks_only_when_the_ordinals_own_nothing(
    kube: KubeCluster, namespace: str, operator: Operator, movers: Movers
) -> None:
    _apply(kube, namespace, "x", partitions=8, replicas=4, handoffMode="replay")
    operator.reconcile_once()
    mover = movers.by_name["x"]
    mover.ready = {"x-0", "x-1", "x-2", "x-3"}
    operator.reconcile_once()
    for ordinal in range(4):
        _claim(kube, namespace, f"checkpoint-x-{ordinal}")
    _claim(kube, namespace, "scratch-x-3")

    kube.kubectl("scale", "-n", namespace, "joinpipeline/x", "--replicas=2")
    operator.reconcile_once()
    replay = HandoffMode.REPLAY
    drains = [(4, "x-2", "x-0"), (5, "x-2", "x-1"), (6, "x-3", "x-0"), (7, "x-3", "x-1")]
    assert mover.calls[-1] == ("request", tuple(Move(p, s, t, replay) for p, s, t in drains))
    assert _sts(kube, namespace)["spec"]["replicas"] == 4, (
        "drained instances keep running until their pids left"
    )
    status = _jp(kube, namespace)["status"]
    assert _ready(status) == ("False", "ScalingIn")
    assert status["movesInFlight"] == 4
    assert _claims(kube, namespace) == {f"checkpoint-x-{i}": False for i in range(4)} | {"scratch-x-3": False}

    operator.reconcile_once()
    assert _sts(kube, namespace)["spec"]["replicas"] == 4
    assert len(mover.calls) == 2

    mover.complete()
    operator.reconcile_once()
    assert _sts(kube, namespace)["spec"]["replicas"] == 2
    status = _jp(kube, namespace)["status"]
    assert status["assignment"] == [
        {"instance": "x-0", "pids": "0-1,4,6", "count": 4},
        {"instance": "x-1", "pids": "2-3,5,7", "count": 4},
    ]
    assert (status["replicas"], status["epoch"]) == (2, 1)
    assert [i["name"] for i in status["instances"]] == ["x-0", "x-1"]
    assert _ready(status) == ("True", "Running")
    assert _claims(kube, namespace) == {
        "checkpoint-x-0": False, "checkpoint-x-1": False, "checkpoint-x-2": True, "checkpoint-x-3": True,
        "scratch-x-3": False,
    }  # fmt: skip
    reasons = _reasons(kube, namespace)
    assert reasons[-3:] == ["ScaledIn", "VolumeDeleted", "VolumeDeleted"]
    assert reasons.count("MoveCompleted") == 4

    operator.reconcile_once()
    assert _reasons(kube, namespace) == reasons


# --- policy ---


@pytest.mark.parametrize("policy", ["flux", "static"])
def test_the_pipelines_policy_moves_pids_once_no_scaling_step_is_under_way(
    kube: KubeCluster, namespace: str, crd: None, movers: Movers, policy: str
) -> None:
    clock = FakeClock()
    operator = Operator(kube.api_client, namespace, movers, SETTINGS, clock=clock)
    _apply(kube, namespace, "x", partitions=4, replicas=2, policy={"name": policy, "flux": {"thImb": 1.5}})
    operator.reconcile_once()
    mover = movers.by_name["x"]
    mover.ready = {"x-0", "x-1"}
    mover.stats = {"x-0": InstanceStats("x-0", 1.0, 0), "x-1": InstanceStats("x-1", 0.1, 0)}
    mover.tuples = {0: 900, 1: 100, 2: 50, 3: 50}  # x-0 owns 0 and 1
    operator.reconcile_once()
    clock.now += FIRST_ROUND_DELAY_S - 0.1
    operator.reconcile_once()
    assert [call for call, _ in mover.calls] == ["start"], "the first round waits for statistics"

    clock.now += 0.1
    operator.reconcile_once()
    if policy == "static":
        assert [call for call, _ in mover.calls] == ["start"]
        assert "Rebalancing" not in _reasons(kube, namespace)
        return
    # Moving pid 0 (900 of x-0's 1000 tuples) would only swap the imbalance; pid 1 reduces it.
    assert mover.calls[-1] == ("request", (Move(1, "x-0", "x-1"),))
    status = _jp(kube, namespace)["status"]
    assert status["lastDecision"].startswith("policy flux: ")
    assert status["movesInFlight"] == 1
    assert _reasons(kube, namespace)[-2:] == ["Rebalancing", "MoveRequested"]

    clock.now += 60
    operator.reconcile_once()
    assert len(mover.calls) == 2 and mover.snapshots == 1, "no round while the move phase lasts"
    mover.complete()
    operator.reconcile_once()
    assert _jp(kube, namespace)["status"]["assignment"][1]["pids"] == "1-3"


def test_a_released_pid_holds_up_no_policy_round(
    kube: KubeCluster, namespace: str, crd: None, movers: Movers
) -> None:
    """Once a moved pid left its source, the next round runs while the move goes on (the receiver
    reading it, the source finishing its old tuples); the move stays in flight in the status."""
    clock = FakeClock()
    operator = Operator(kube.api_client, namespace, movers, SETTINGS, clock=clock)
    _apply(kube, namespace, "x", partitions=4, replicas=2, policy={"name": "flux", "flux": {"thImb": 1.5}})
    operator.reconcile_once()
    mover = movers.by_name["x"]
    mover.ready = {"x-0", "x-1"}
    mover.stats = {"x-0": InstanceStats("x-0", 1.0, 0), "x-1": InstanceStats("x-1", 0.1, 0)}
    mover.tuples = {0: 900, 1: 100, 2: 50, 3: 50}
    operator.reconcile_once()
    clock.now += FIRST_ROUND_DELAY_S
    operator.reconcile_once()
    assert mover.snapshots == 1 and mover.moving
    assert mover.current is not None
    mover.current = mover.current.with_moves(mover.moving)
    mover.tails, mover.moving = mover.moving, []
    clock.now += 60
    operator.reconcile_once()  # the move phase ends
    clock.now += 60
    operator.reconcile_once()
    assert mover.snapshots == 2, "a round ran while the tail is in flight"
    assert _jp(kube, namespace)["status"]["movesInFlight"] == 1


# --- restarts ---


def test_only_ready_pods_may_take_pids_and_missing_or_unready_ones_get_the_restart_grace(
    kube: KubeCluster, namespace: str, operator: Operator, movers: Movers
) -> None:
    _apply(kube, namespace, "x", partitions=4, replicas=2, liveness={"restartGraceSeconds": 90})
    operator.reconcile_once()
    assert movers.by_name["x"].restarts == (set(), 90.0), "no StatefulSet yet: nobody restarts"
    operator.reconcile_once()
    assert movers.by_name["x"].restarts == (set(), 90.0), "no pod is seen: heartbeats alone decide"
    assert movers.by_name["x"].pods_ready is None

    core = kubernetes.client.CoreV1Api(kube.api_client)
    V1ObjectMeta = kubernetes.client.V1ObjectMeta
    # No controller-manager here to make the default service account; no kubelet to run the pod.
    core.create_namespaced_service_account(
        namespace, kubernetes.client.V1ServiceAccount(metadata=V1ObjectMeta(name="default"))
    )
    container = kubernetes.client.V1Container(name="instance", image="fluxjoin:test")
    pod = kubernetes.client.V1Pod(
        metadata=V1ObjectMeta(name="x-0", labels=selector_labels("x")),
        spec=kubernetes.client.V1PodSpec(containers=[container]),
    )
    core.create_namespaced_pod(namespace, pod)
    ready = {"status": {"conditions": [{"type": "Ready", "status": "True"}]}}
    core.patch_namespaced_pod_status("x-0", namespace, ready)
    operator.reconcile_once()
    assert movers.by_name["x"].restarts == ({"x-1"}, 90.0)
    assert movers.by_name["x"].pods_ready == {"x-0"}
    assert _jp(kube, namespace)["spec"]["liveness"] == {
        "heartbeatTimeoutSeconds": 10,
        "restartGraceSeconds": 90,
        "plannedRestart": "resume",
        "drainTimeoutSeconds": 120,
    }


# --- delete ---


def test_what_a_pipeline_owns_names_it_as_owner_so_the_garbage_collector_deletes_it_with_the_pipeline(
    kube: KubeCluster, namespace: str, operator: Operator, movers: Movers
) -> None:
    # This API server has no garbage collector; the e2e on a real cluster (tests/e2e) shows it deleting.
    _apply(kube, namespace, "x", partitions=4, replicas=2)
    operator.reconcile_once()
    uid = _jp(kube, namespace)["metadata"]["uid"]
    for owned in (
        _sts(kube, namespace, "x"),
        _svc(kube, namespace),
        _cm(kube, namespace),
        _pdb(kube, namespace),
    ):
        assert owned["metadata"]["ownerReferences"] == [
            {"apiVersion": "fluxjoin.io/v1alpha1", "kind": "JoinPipeline", "name": "x", "uid": uid,
             "controller": True, "blockOwnerDeletion": True}
        ]  # fmt: skip
    # The checkpoint volumes belong to the StatefulSet, and go with it.
    assert (
        _sts(kube, namespace, "x")["spec"]["persistentVolumeClaimRetentionPolicy"]["whenDeleted"] == "Delete"
    )

    kube.kubectl("delete", "-n", namespace, "jp/x", "--wait=false")
    assert _missing(lambda: _jp(kube, namespace)), "no finalizer holds the pipeline"
    operator.reconcile_once()
    assert movers.by_name["x"].closed


def test_a_pipeline_holding_the_finalizer_of_an_older_operator_is_let_go(
    kube: KubeCluster, namespace: str, operator: Operator, movers: Movers
) -> None:
    _apply(kube, namespace, "x", partitions=4, replicas=1)
    operator.reconcile_once()
    kube.kubectl(
        "patch",
        "-n",
        namespace,
        "jp/x",
        "--type=merge",
        "-p",
        json.dumps({"metadata": {"finalizers": [FINALIZER]}}),
    )
    kube.kubectl("delete", "-n", namespace, "jp/x", "--wait=false")
    assert _jp(kube, namespace)["metadata"]["deletionTimestamp"], "the old finalizer holds the pipeline"
    operator.reconcile_once()
    assert _missing(lambda: _jp(kube, namespace))
    assert movers.by_name["x"].closed


# --- leader election ---


@dataclass
class FakeClock:
    now: float = 1000.0

    def __call__(self) -> float:
        return self.now


def test_only_the_lease_holder_reconciles_and_a_silent_leader_is_replaced(
    kube: KubeCluster, namespace: str, crd: None
) -> None:
    coordination = kubernetes.client.CoordinationV1Api(kube.api_client)
    clock_a, clock_b = FakeClock(), FakeClock()
    movers_a, movers_b = Movers(), Movers()
    elector_a = LeaseElector(coordination, namespace, "fj", "op-a", clock=clock_a)
    a = Operator(kube.api_client, namespace, movers_a, SETTINGS, elector=elector_a, identity="op-a")
    elector_b = LeaseElector(coordination, namespace, "fj", "op-b", clock=clock_b)
    b = Operator(kube.api_client, namespace, movers_b, SETTINGS, elector=elector_b, identity="op-b")
    _apply(kube, namespace, "x", partitions=4, replicas=2)

    assert a.step() is True
    assert b.step() is False
    assert "x" in movers_a.by_name and movers_b.by_name == {}
    assert _sts(kube, namespace)["spec"]["replicas"] == 2

    def lease() -> dict[str, Any]:
        return _plain(kube, coordination.read_namespaced_lease("fj", namespace))["spec"]

    assert (lease()["holderIdentity"], lease()["leaseTransitions"]) == ("op-a", 0)
    assert elector_a.holds()
    clock_a.now += 9.9
    assert elector_a.holds(), "within two thirds of the duration of its last renewal"
    clock_a.now += 0.2
    assert not elector_a.holds(), "too close to the time another candidate may take over"
    assert not elector_b.holds()
    for _ in range(3):  # a renews every round, so b never sees an expired lease
        clock_a.now += 10
        clock_b.now += 10
        assert a.step() is True
        assert b.step() is False
    assert movers_b.by_name == {}

    # a stops renewing: b waits a whole lease duration on its own clock, then takes over.
    clock_b.now += 10
    assert b.step() is False
    clock_b.now += 6
    assert b.step() is True
    assert (lease()["holderIdentity"], lease()["leaseTransitions"]) == ("op-b", 1)
    assert "x" in movers_b.by_name
    assert a.step() is False, "the old leader sees the new holder and stands down"
    assert movers_a.by_name["x"].closed

    # A holder that shuts down releases the Lease: the other takes over at once.
    elector_b.release()
    assert a.step() is True
    assert lease()["holderIdentity"] == "op-a"


def test_run_reconciles_on_watch_events_until_stopped(
    kube: KubeCluster, namespace: str, crd: None, movers: Movers
) -> None:
    coordination = kubernetes.client.CoordinationV1Api(kube.api_client)
    operator = Operator(
        kube.api_client, namespace, movers, SETTINGS,
        elector=LeaseElector(coordination, namespace, "fj", "op-run"), identity="op-run",
    )  # fmt: skip
    runner = threading.Thread(target=operator.run, kwargs={"period_s": 30.0}, daemon=True)
    runner.start()
    try:
        _apply(kube, namespace, "x", partitions=4, replicas=2)
        _wait_for(
            lambda: "x" in movers.by_name and _status_epoch(kube, namespace) == 0, "the first assignment"
        )
        movers.by_name["x"].ready = {"x-0", "x-1", "x-2"}
        kube.kubectl("scale", "-n", namespace, "joinpipeline/x", "--replicas=3")
        _wait_for(lambda: movers.by_name["x"].moving != [], "moves onto x-2 after the scale event")
        assert {m.target for m in movers.by_name["x"].moving} == {"x-2"}
        # Between rounds (30 s apart here) the moves in flight are stepped, and their completion brings
        # the next round, with its events and status, forward.
        ticks = movers.by_name["x"].ticks
        _wait_for(lambda: movers.by_name["x"].ticks > ticks + 5, "steps of the moves between rounds")
        movers.by_name["x"].complete_at_next_step = True
        _wait_for(lambda: _status_epoch(kube, namespace) == 1, "the next round, with the moves done", 10)
        assert "MoveCompleted" in _reasons(kube, namespace)
        port = free_port()
        server = serve_health(operator.healthy, operator.metrics, port, host="127.0.0.1")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=5) as answer:
                assert answer.status == 200
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as answer:
                assert "fluxjoin_operator_leader 1" in answer.read().decode()
        finally:
            server.shutdown()
    finally:
        operator.request_stop()
        runner.join(timeout=30)
    assert not runner.is_alive()
    released = _plain(kube, coordination.read_namespaced_lease("fj", namespace))["spec"]
    assert "holderIdentity" not in released, "a stopping leader releases the Lease"


def _status_epoch(kube: KubeCluster, namespace: str) -> int | None:
    epoch = (_jp(kube, namespace).get("status") or {}).get("epoch")
    return int(epoch) if epoch is not None else None


def _wait_for(condition: Callable[[], bool], what: str, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return
        time.sleep(0.1)
    pytest.fail(f"timed out after {timeout:.0f} s waiting for {what}")


# --- RBAC: the chart's Role is enough for everything above, and no more is needed ---

# Every request the operator makes, as (verb, resource) for `kubectl auth can-i`.
OPERATOR_REQUESTS = [
    ["list", "joinpipelines.fluxjoin.io"],
    ["watch", "joinpipelines.fluxjoin.io"],
    ["patch", "joinpipelines.fluxjoin.io"],
    ["patch", "joinpipelines.fluxjoin.io", "--subresource=status"],
    ["get", "statefulsets.apps"],
    ["create", "statefulsets.apps"],
    ["patch", "statefulsets.apps"],
    ["get", "services"],
    ["create", "services"],
    ["patch", "services"],
    ["get", "configmaps"],
    ["create", "configmaps"],
    ["patch", "configmaps"],
    ["get", "poddisruptionbudgets.policy"],
    ["create", "poddisruptionbudgets.policy"],
    ["patch", "poddisruptionbudgets.policy"],
    ["list", "pods"],
    ["list", "persistentvolumeclaims"],
    ["delete", "persistentvolumeclaims"],
    ["create", "leases.coordination.k8s.io"],
    ["get", "leases.coordination.k8s.io/fj-fluxjoin-operator"],
    ["patch", "leases.coordination.k8s.io/fj-fluxjoin-operator"],
    ["create", "events"],
    ["update", "joinpipelines.fluxjoin.io", "--subresource=finalizers"],
]
NOT_GRANTED = [
    ["list", "joinpipelines.fluxjoin.io", "--all-namespaces"],
    ["list", "statefulsets.apps", "--all-namespaces"],
    ["create", "leases.coordination.k8s.io", "-n", "kube-system"],
    ["get", "secrets"],
]


def test_the_charts_role_covers_every_request_of_a_full_lifecycle(
    kube: KubeCluster, namespace: str, crd: None
) -> None:
    kube.helm("install", "fj", str(CHART), "-n", namespace)
    subject = f"system:serviceaccount:{namespace}:fj-fluxjoin-operator"
    for args in OPERATOR_REQUESTS + NOT_GRANTED:
        extra = [] if "-n" in args else ["-n", namespace]
        answer = kube.kubectl("auth", "can-i", *args, *extra, f"--as={subject}", check=False).stdout.strip()
        assert answer == ("yes" if args in OPERATOR_REQUESTS else "no"), args

    # The operator itself, every request impersonating the service account: create, scale out, scale
    # in, delete, with leader election; any Forbidden would show as a failed reconcile or a lost Lease.
    as_operator = kubernetes.config.new_client_from_config(config_file=str(kube.kubeconfig))
    as_operator.set_default_header("Impersonate-User", subject)
    movers = Movers()
    elector = LeaseElector(
        kubernetes.client.CoordinationV1Api(as_operator), namespace, "fj-fluxjoin-operator", "op-0"
    )
    operator = Operator(as_operator, namespace, movers, SETTINGS, elector=elector, identity="op-0")

    def round_() -> None:
        assert operator.step() is True
        assert operator.metrics.failures == 0, _jp(kube, namespace).get("status")

    _apply(kube, namespace, "x", partitions=4, replicas=2)
    round_()
    mover = movers.by_name["x"]
    mover.ready = {"x-0", "x-1", "x-2"}
    kube.kubectl("scale", "-n", namespace, "joinpipeline/x", "--replicas=3")
    round_()
    mover.complete()
    round_()
    for ordinal in range(3):
        _claim(kube, namespace, f"checkpoint-x-{ordinal}")
    kube.kubectl("scale", "-n", namespace, "joinpipeline/x", "--replicas=1")
    round_()
    mover.complete()
    round_()
    assert _sts(kube, namespace)["spec"]["replicas"] == 1
    kube.kubectl("delete", "-n", namespace, "jp/x", "--wait=false")
    round_()
    assert _missing(lambda: _jp(kube, namespace))
    assert {
        "Started",
        "Created",
        "ScaledOut",
        "MoveRequested",
        "MoveCompleted",
        "ScaledIn",
        "VolumeDeleted",
    } <= set(_reasons(kube, namespace))
    elector.release()


# --- the CLI and the chart's contract ---


def test_operator_command_takes_its_settings_from_the_charts_environment(
    k8s_bin: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every variable the chart's Deployment sets is read by `fluxjoin operator`, into the right option."""
    import subprocess

    import controller.k8s.main

    rendered = subprocess.run(
        [str(k8s_bin / "helm"), "template", "fj", str(CHART), "-n", "streams",
         "--set", "imagePullSecrets[0].name=r1,imagePullSecrets[1].name=r2,operator.logLevel=debug"],
        check=True, capture_output=True, text=True,
    ).stdout  # fmt: skip
    deployment = next(d for d in yaml.safe_load_all(rendered) if d and d["kind"] == "Deployment")
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    assert container["args"] == ["operator"]
    from_fields = {"metadata.namespace": "streams", "metadata.name": "fj-fluxjoin-operator-7d9f-abcde"}
    env = {
        e["name"]: e["value"] if "value" in e else from_fields[e["valueFrom"]["fieldRef"]["fieldPath"]]
        for e in container["env"]
    }
    started: list[OperatorOptions] = []
    monkeypatch.setattr(controller.k8s.main, "run_operator", started.append)
    result = CliRunner().invoke(app, ["operator"], env=env)
    assert result.exit_code == 0, result.output
    (options,) = started
    assert options == OperatorOptions(
        namespace="streams",
        identity="fj-fluxjoin-operator-7d9f-abcde",
        leader_election=True,
        lease_name="fj-fluxjoin-operator",
        kubeconfig=None,
        metrics_port=9108,
        instance=InstanceSettings(
            image="fluxjoin:0.1.0",
            pull_policy="IfNotPresent",
            pull_secrets=("r1", "r2"),
            metrics_port=9108,
            scrape_annotations=True,
        ),
    )
    result = CliRunner().invoke(
        app,
        ["operator"],
        env={**env, "FLUXJOIN_LEADER_ELECTION": "false", "FLUXJOIN_SCRAPE_ANNOTATIONS": "false"},
    )
    assert (started[1].leader_election, started[1].instance.scrape_annotations) == (False, False)


def test_operator_command_with_a_bad_kubeconfig_exits_with_a_clear_message(tmp_path: Any) -> None:
    missing = tmp_path / "nope"
    result = CliRunner().invoke(app, ["operator", "--kubeconfig", str(missing), "--namespace", "x"])
    assert result.exit_code == 2
    assert "cannot configure the Kubernetes client" in result.output
