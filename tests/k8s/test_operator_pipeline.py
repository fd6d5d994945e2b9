"""`kubectl scale` end to end: the operator on a real kube-apiserver moves pids between real join instances
on a real broker, and the results stay exact.

No kubelet runs here, so `Kubelet` stands in for it: it starts a local `fluxjoin instance` process for each
ordinal the StatefulSet asks for (named like the pod would be) and stops the ones above it. The operator
uses its production mover (`controller.k8s.ports.make_mover`, the Kafka control protocol), and the
generator keeps the input flowing through a scale-out from 2 to 4 instances and a scale-in back to 2.
"""

from __future__ import annotations

import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import kubernetes

from controller.k8s.ports import PidMover, make_mover
from controller.k8s.reconciler import Operator
from controller.k8s.spec import InstanceSettings, PipelineSpec
from local.processes import LocalPipeline, wait_drained
from pipeline.oracle import verify_pipeline
from tests.k8s.cluster import GROUP, PLURAL, VERSION, KubeCluster, pipeline_manifest

NAME = "jp"
SETTINGS = InstanceSettings(image="registry.example.com/fluxjoin:0.1.0")


class Kubelet:
    """Runs one instance process per StatefulSet ordinal, as a kubelet would run the pods."""

    def __init__(self, kube: KubeCluster, namespace: str, pipeline: LocalPipeline) -> None:
        self.apps = kubernetes.client.AppsV1Api(kube.api_client)
        self.namespace, self.pipeline = namespace, pipeline
        self.running: set[int] = set()
        self.stopped_owning: list[str] = []

    def sync(self, owned_by: Callable[[str], bool]) -> None:
        replicas = self.apps.read_namespaced_stateful_set(NAME, self.namespace).spec.replicas or 0
        for ordinal in sorted(self.running - set(range(replicas)), reverse=True):
            name = f"{NAME}-{ordinal}"
            if owned_by(name):
                self.stopped_owning.append(name)
            self.pipeline.kill(name, signal.SIGTERM)
            self.running.discard(ordinal)
        for ordinal in sorted(set(range(replicas)) - self.running):
            self.pipeline.start_instance(f"{NAME}-{ordinal}")
            self.running.add(ordinal)


def _pipeline(kube: KubeCluster, namespace: str) -> dict[str, Any]:
    custom = kubernetes.client.CustomObjectsApi(kube.api_client)
    obj = custom.get_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, NAME)
    assert isinstance(obj, dict)
    return obj


def _status(kube: KubeCluster, namespace: str) -> dict[str, Any]:
    status: dict[str, Any] = _pipeline(kube, namespace).get("status") or {}
    return status


def _settled_on(count: int) -> Callable[[dict[str, Any]], bool]:
    """Status shows `count` instances owning P / count pids each, nothing in flight, Ready."""

    def check(status: dict[str, Any]) -> bool:
        conditions = status.get("conditions") or [{}]
        owned = [row["count"] for row in status.get("assignment", []) if row["count"]]
        return (
            conditions[0].get("status") == "True"
            and status.get("movesInFlight") == 0
            and owned == [8 // count] * count
        )

    return check


def test_kubectl_scale_moves_pids_between_live_instances_and_the_output_stays_exact(
    kube: KubeCluster, namespace: str, crd: None, kafka_bootstrap: str, topic_prefix: str, tmp_path: Path
) -> None:
    manifest = pipeline_manifest(
        NAME,
        streams=["A", "B"],
        partitions=8,
        replicas=2,
        windowMs=3000,
        allowedLatenessMs=1000,
        handoffMode="transfer",
        policy={"name": "static"},
        kafka={"bootstrapServers": kafka_bootstrap, "topicPrefix": topic_prefix},
        instance={
            "triggerMs": 200,
            "sparkMaster": "local[1]",
            "shufflePartitions": 1,
            "maxRowsPerBatch": 20000,
        },
    )
    kube.kubectl("apply", "-n", namespace, "-f", "-", input_text=manifest)
    spec = PipelineSpec.from_object(_pipeline(kube, namespace))
    cfg = spec.to_config().with_overrides(
        **{
            "generator.mode": "real_time",
            "generator.duration_s": 150,
            "generator.max_tuples": None,
            "generator.rate": {"kind": "constant", "rate": 600},
            "generator.keys": {"kind": "uniform", "count": 3000},
            "generator.tuples_per_message": 32,
        }
    )
    movers: list[PidMover] = []

    def production_mover(spec: PipelineSpec) -> PidMover:
        movers.append(make_mover(spec))
        return movers[-1]

    operator = Operator(kube.api_client, namespace, production_mover, SETTINGS)
    operator.reconcile_once()  # a new pipeline: the operator creates its topics and publishes epoch 0
    assert _status(kube, namespace).get("epoch") == 0, _status(kube, namespace)
    pipeline = LocalPipeline(cfg, kafka_bootstrap, tmp_path)
    kubelet = Kubelet(kube, namespace, pipeline)

    def owns(name: str) -> bool:
        current = movers[-1].assignment()
        return current is not None and name in current.owners.values()

    def until(done: Callable[[dict[str, Any]], bool], timeout_s: float, what: str) -> dict[str, Any]:
        deadline = time.monotonic() + timeout_s
        while True:
            operator.reconcile_once()
            kubelet.sync(owns)
            status = _status(kube, namespace)
            if done(status):
                return status
            crashed = {n: c for n, c in pipeline.failed().items() if n != "generator"}
            assert not crashed, f"{crashed}: {pipeline.log_tail(next(iter(crashed)), 40)}"
            assert time.monotonic() < deadline, f"timed out waiting for {what}; status: {status}"
            time.sleep(1.0)

    try:
        until(lambda s: s.get("epoch") == 0, 30, "the first instances")
        pipeline.wait_running([f"{NAME}-0", f"{NAME}-1"])
        pipeline.start_generator()
        until(_settled_on(2), 120, "two instances running")

        kube.kubectl("scale", "-n", namespace, f"joinpipeline/{NAME}", "--replicas=4")
        status = until(_settled_on(4), 300, "the scale-out to 4 instances")
        assert [row["instance"] for row in status["assignment"]] == [f"{NAME}-{i}" for i in range(4)]

        kube.kubectl("scale", "-n", namespace, f"joinpipeline/{NAME}", "--replicas=2")
        until(lambda s: _settled_on(2)(s) and kubelet.running == {0, 1}, 300, "the scale-in to 2 instances")
        assert kubelet.stopped_owning == [], "an instance was stopped while it still owned pids"

        generator = pipeline.procs["generator"]
        assert generator.wait(400) == 0, pipeline.log_tail("generator")
        wait_drained(pipeline, timeout_s=300)
    finally:
        for mover in movers:
            mover.close()
        pipeline.stop()

    report = verify_pipeline(pipeline.cfg, kafka_bootstrap)
    assert report.expected > 10_000, "the workload must produce a meaningful number of results"
    assert (report.missing, report.duplicate, report.spurious) == (0, 0, 0), report.describe()
    events = kubernetes.client.CoreV1Api(kube.api_client).list_namespaced_event(
        namespace, field_selector=f"involvedObject.name={NAME}"
    )
    reasons = [event.reason for event in events.items]
    completed = sorted(str(event.message) for event in events.items if event.reason == "MoveCompleted")
    assert len(completed) == 8, completed  # 4 pids spread onto the new instances, 4 drained back
    assert all("?" not in message for message in completed), completed
    assert {"ScaledOut", "ScaledIn", "Spreading", "Draining"} <= set(reasons), reasons
