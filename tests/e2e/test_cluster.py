"""fluxjoin on a real single-node Kubernetes cluster, as a user runs it: `helm install`, kubectl, faults.

The cluster (scripts/cluster.sh: kubelet, containerd, scheduler, controller-manager, CoreDNS, a default
StorageClass) runs real pods from the image `make image` builds. The chart installs its trial Kafka, the
operator, a JoinPipeline of two instances and the generator, with signing on (each instance pod's key
certified by the operator, every control and metrics record checked); while input flows the pipeline is scaled
2 -> 4 -> 2, rolled to a second image tag (each instance resumes from its checkpoint), rolled back with
`plannedRestart: drain` (each instance's pids move to the other before it stops), loses an instance pod
to a forced deletion and its node's kubelet for 30 s. Each pid's longest pause in each rolling update
comes from the instances' batch records. Then the generator stops and the oracle, a Job running
`fluxjoin verify` on the input topics alone, must find the results exact; `helm uninstall` must leave
nothing behind. Timings and counts go to reports/e2e.json. Two more installs: one against a Kafka that
asks for TLS and SCRAM, one whose instance runs its tasks on executor pods, which loses an executor
and then its driver on the way.
"""

from __future__ import annotations

import json
import secrets
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from confluent_kafka.admin import AdminClient

from controller.k8s.manifests import PIPELINE_LABEL
from controller.k8s.status import pod_ready
from local import kafka_runtime
from local.kafka_config import SaslSsl
from local.kafka_dist import build_broker_image
from pipeline.acls import pipeline_acls
from pipeline.config import Config
from tests.e2e.kube import (
    REPO,
    E2EError,
    Kube,
    cluster_down,
    cluster_running,
    cluster_up,
    helm_values,
    last_json_line,
    load_images,
    run_job,
    say,
    stop_kubelet,
    wait_until,
)

CHART = REPO / "charts" / "fluxjoin"
REPORT = REPO / "reports" / "e2e.json"
NAMESPACE = "fluxjoin-e2e"
RELEASE = "fj"
PIPELINE = "fj-fluxjoin"
IMAGE, TAG, SECOND_TAG = "fluxjoin", "e2e", "e2e-2"
RATE = 1000  # tuples per second over all streams
MIN_TUPLES = 300_000
METRICS_PORT = 9108
INSTANCE_METRICS = (
    "fluxjoin_instance_tuples_total",
    "fluxjoin_instance_lag_messages",
    "fluxjoin_instance_state_bytes",
    "fluxjoin_instance_batch_duration_seconds",
    "fluxjoin_instance_result_latency_seconds",
)
ORACLE_COUNTS = ("exact", "input_tuples", "expected", "missing", "duplicate", "spurious", "wrongly_late")
INSTANCES = f"app.kubernetes.io/component=instance,{PIPELINE_LABEL}={PIPELINE}"


@pytest.fixture(scope="module")
def kube() -> Iterator[Kube]:
    t0 = time.monotonic()
    was_running = cluster_running()
    kubeconfig = cluster_up()
    bin_dir = Path(
        subprocess.run(
            ["bash", str(REPO / "scripts" / "ensure-k8s-tools.sh"), "--print-bin"],
            check=True,
            capture_output=True,
            text=True,
        ).stdout.strip()
    )
    say(f"cluster up in {time.monotonic() - t0:.0f} s")
    t0 = time.monotonic()
    subprocess.run(["bash", str(REPO / "scripts" / "build-image.sh"), f"{IMAGE}:{TAG}"], check=True,
                   capture_output=True)  # fmt: skip
    subprocess.run(["docker", "tag", f"{IMAGE}:{TAG}", f"{IMAGE}:{SECOND_TAG}"], check=True)
    broker = build_broker_image(progress=False)
    load_images(f"{IMAGE}:{TAG}", f"{IMAGE}:{SECOND_TAG}", broker)
    say(f"images built and loaded in {time.monotonic() - t0:.0f} s")
    k = Kube(kubeconfig, NAMESPACE, bin_dir)
    k.run("kubectl", "delete", "namespace", NAMESPACE, "--ignore-not-found", "--wait=true", timeout=600)
    k.run("kubectl", "create", "namespace", NAMESPACE)
    # Helm installs a chart's CRDs only where none exists and never upgrades them: a cluster kept from an
    # earlier run would otherwise serve an older schema, which prunes the fields it does not know.
    k.run("kubectl", "apply", "--server-side", "--force-conflicts", "-f", str(CHART / "crds"))
    k.broker_image = broker  # type: ignore[attr-defined]
    yield k
    if was_running:  # somebody's cluster (make e2e starts one first): leave it as it was, but for the test
        k.run("kubectl", "delete", "namespace", NAMESPACE, "--ignore-not-found", "--wait=false", check=False)
    else:
        cluster_down()


def _values(broker_image: str) -> list[str]:
    repository, _, tag = broker_image.partition(":")
    return helm_values(
        [
            ("image.repository", IMAGE),
            ("image.tag", TAG),
            ("image.pullPolicy", "Never"),
            ("kafka.trial.enabled", "true"),
            ("kafka.trial.image.repository", repository),
            ("kafka.trial.image.tag", tag),
            ("kafka.trial.image.pullPolicy", "Never"),
            ("kafka.trial.storage.size", "2Gi"),
            ("kafka.trial.resources.requests.cpu", "100m"),
            ("operator.resources.requests.cpu", "50m"),
            ("pipeline.create", "true"),
            ("pipeline.replicas", "2"),
            ("pipeline.partitions", "16"),
            ("pipeline.streams", "{A,B}"),
            ("pipeline.instance.sparkMaster", "local[1]"),
            ("pipeline.resources.requests.cpu", "100m"),
            ("pipeline.resources.requests.memory", "1Gi"),
            ("pipeline.checkpoint.size", "1Gi"),
            ("generator.enabled", "true"),
            ("generator.resources.requests.cpu", "50m"),
            ("generator.config.rate.rate", str(RATE)),
            ("generator.config.keys.count", "2000"),
            ("signing.enabled", "true"),
        ]
    )


def _pipeline(kube: Kube) -> dict[str, Any]:
    return kube.get("joinpipeline", PIPELINE)


def _ready(kube: Kube, replicas: int) -> bool:
    jp = _pipeline(kube)
    status = jp.get("status", {})
    ready = [
        c for c in status.get("conditions", []) if c.get("type") == "Ready" and c.get("status") == "True"
    ]
    return (
        bool(ready)
        and status.get("replicas") == replicas
        and status.get("readyReplicas") == replicas
        and not status.get("movesInFlight")
        and status.get("observedGeneration") == jp["metadata"]["generation"]
    )


def _wait_ready(kube: Kube, replicas: int, what: str, timeout_s: float = 600) -> float:
    took = wait_until(what, timeout_s, lambda: _ready(kube, replicas), kube.overview)
    say(f"{what}: {took:.0f} s")
    return took


def _instance_pods_ready(kube: Kube, replicas: int) -> bool:
    pods = kube.pods(INSTANCES)
    return len(pods) == replicas and all(pod_ready(p) for p in pods)


def _job(
    kube: Kube,
    name: str,
    container: dict[str, Any],
    pod: dict[str, Any] | None = None,
    pipeline: str = PIPELINE,
) -> dict[str, Any]:
    """Run `container` (the image, the configuration of `pipeline`'s generator mounted at /etc/fluxjoin)
    as a Job in the cluster, as a non-root user, with `pod`'s fields over the pod's (its volumes, its
    security context); the last JSON line of its log."""
    manifest = {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": {"name": name},
        "spec": {
            "backoffLimit": 0,
            "template": {
                "spec": {
                    "restartPolicy": "Never",
                    "securityContext": {"runAsNonRoot": True, "runAsUser": 10001},
                    "containers": [
                        {
                            "name": name,
                            "image": f"{IMAGE}:{TAG}",
                            "imagePullPolicy": "Never",
                            "volumeMounts": [{"name": "config", "mountPath": "/etc/fluxjoin"}],
                            **container,
                        }
                    ],
                    "volumes": [{"name": "config", "configMap": {"name": f"{pipeline}-generator"}}],
                    **(pod or {}),
                }
            },
        },
    }
    _, log = run_job(kube, name, manifest, timeout_s=600)
    return last_json_line(log)


def _verify_job(kube: Kube, attempt: int) -> dict[str, Any]:
    """`fluxjoin verify --json` in the cluster, with the generator's configuration (same topics)."""
    return _job(
        kube, f"oracle-{attempt}", {"args": ["verify", "--config", "/etc/fluxjoin/fluxjoin.yaml", "--json"]}
    )


PAUSES = """
import json, sys
from itertools import pairwise
from pipeline.config import load_config
from pipeline.topics import read_records

cfg = load_config("/etc/fluxjoin/fluxjoin.yaml")
windows = json.loads(sys.argv[1])
records = [json.loads(v) for _, _, v in read_records(cfg.bootstrap, cfg.metrics_topic) if v]
records = [r for r in records if r.get("kind") == "batch"]
report = {}
for name, (start_ms, end_ms) in windows.items():
    longest = {}
    for pid in range(cfg.partitions):
        times = sorted(r["time_ms"] for r in records if r["pids"].get(str(pid), {}).get("in", 0) > 0
                       and start_ms - 5000 <= r["time_ms"] <= end_ms + 5000)
        longest[pid] = max([b - a for a, b in pairwise(times)], default=end_ms - start_ms) / 1000
    ordered = sorted(longest.values())
    report[name] = {"max_s": round(ordered[-1], 1), "median_s": round(ordered[len(ordered) // 2], 1)}
print(json.dumps(report))
"""
"""Each pid's longest gap between two batches that read its input, within each named window of wall-clock
milliseconds (from 5 s before to 5 s after): the pause an action caused. Run in the cluster, on the
metrics topic."""


def _pauses(kube: Kube, windows: dict[str, tuple[int, int]]) -> dict[str, Any]:
    return _job(kube, "pauses", {"command": ["python", "-c", PAUSES, json.dumps(windows)]})


def _events(kube: Kube, reason: str) -> list[str]:
    """The messages of the pipeline's events of `reason`, oldest first."""
    listed = json.loads(kube.kubectl("get", "events", "--field-selector", f"reason={reason}", "-o", "json"))
    ordered = sorted(
        listed["items"], key=lambda e: e.get("lastTimestamp") or e["metadata"]["creationTimestamp"]
    )
    return [str(e["message"]) for e in ordered]


def _roll(kube: Kube, tag: str, *settings: str) -> tuple[float, tuple[int, int]]:
    """`helm upgrade` to an image tag (a new pod template: every instance restarts); the seconds until
    every instance runs it and the pipeline is Ready again, and that span in wall-clock milliseconds."""
    start_ms = int(time.time() * 1000)
    kube.helm("upgrade", RELEASE, str(CHART), "--reuse-values", "--set", f"image.tag={tag}", *settings)

    def rolled() -> bool:
        pods = kube.pods(INSTANCES)
        images = {c["image"] for p in pods for c in p["spec"]["containers"]}
        return images == {f"{IMAGE}:{tag}"} and _ready(kube, 2) and _instance_pods_ready(kube, 2)

    took = wait_until(f"helm upgrade to {tag} -> every instance rolled", 900, rolled, kube.overview)
    return took, (start_ms, int(time.time() * 1000))


def test_helm_install_scale_roll_and_faults_stay_exact(kube: Kube) -> None:
    report: dict[str, Any] = {"rate": RATE}
    t_start = time.monotonic()
    kube.helm("install", RELEASE, str(CHART), *_values(kube.broker_image))  # type: ignore[attr-defined]
    report["ready_s"] = _wait_ready(kube, 2, "helm install -> Ready with 2 instances", timeout_s=900)
    assert _instance_pods_ready(kube, 2), kube.overview()

    steps: dict[str, float] = {}
    for replicas in (4, 2):
        kube.kubectl("scale", "joinpipeline", PIPELINE, f"--replicas={replicas}")
        steps[f"scale_to_{replicas}_s"] = _wait_ready(kube, replicas, f"kubectl scale --replicas={replicas}")
    report["scale"] = steps

    # A rolling update: the same image under a second tag (a new pod template, every instance restarts),
    # each instance resuming its pids from its checkpoint. Then `plannedRestart: drain`, back on the first
    # tag: the pods that roll for it were started under `resume` and resume once more; from then on each
    # instance drains its pids to the other before it stops, as the third rolling update shows
    # (decision 0056).
    report["rolling_update_s"], resume_window = _roll(kube, SECOND_TAG)
    say(f"rolling update, resume: {report['rolling_update_s']:.0f} s")
    switched_s, _ = _roll(kube, TAG, "--set", "pipeline.liveness.plannedRestart=drain")
    say(f"rolling update to plannedRestart: drain: {switched_s:.0f} s")
    assert _pipeline(kube)["spec"]["liveness"]["plannedRestart"] == "drain"
    draining_before = _events(kube, "Draining")
    report["rolling_update_drain_s"], drain_window = _roll(kube, SECOND_TAG)
    say(f"rolling update, drain: {report['rolling_update_drain_s']:.0f} s")
    drained = _events(kube, "Draining")[len(draining_before) :]
    assert any("fj-fluxjoin-1" in m for m in drained) and any("fj-fluxjoin-0" in m for m in drained), drained

    victim = sorted(kube.pods(INSTANCES), key=lambda p: str(p["metadata"]["name"]))[0]["metadata"]
    kube.kubectl("delete", "pod", victim["name"], "--grace-period=0", "--force")

    def replaced() -> bool:
        pods = {p["metadata"]["name"]: p for p in kube.pods(INSTANCES)}
        new = pods.get(victim["name"])
        return (
            new is not None and new["metadata"]["uid"] != victim["uid"] and pod_ready(new) and _ready(kube, 2)
        )

    took = wait_until(
        f"forced deletion of {victim['name']} -> replaced and Ready", 600, replaced, kube.overview
    )
    report["forced_delete_s"] = took
    say(f"forced deletion of {victim['name']} -> replaced and Ready: {took:.0f} s")

    stop_kubelet()
    time.sleep(30)
    t0 = time.monotonic()
    cluster_up()
    report["kubelet_restart_s"] = _wait_ready(kube, 2, "kubelet back after 30 s -> Ready") + (
        time.monotonic() - t0
    )

    # The operator (restarted by the upgrade, before it rolled the instances) saw every restart resume
    # from the instance's checkpoint within the restart grace: no instance was declared dead and
    # rejoined empty, no pid was recovered by replay elsewhere.
    # The kubelet serves container logs; just back, it may answer NotFound for a few seconds.
    logs: list[str] = []

    def read_operator_log() -> bool:
        try:
            logs.append(kube.kubectl("logs", f"deployment/{PIPELINE}-operator"))
        except E2EError:
            return False
        return True

    wait_until("the operator's log readable", 120, read_operator_log, kube.overview)
    operator_log = logs[-1]
    report["instances_rejoined_empty"] = operator_log.count("rejoined as a new, empty instance")
    assert report["instances_rejoined_empty"] == 0, operator_log[-5000:]
    # Signing on: every record the operator read carried its writer's valid signature, and every
    # instance pod signs under a key the operator certified for it, through its restarts.
    assert "dropping records" not in operator_log, operator_log[-5000:]
    for pod in kube.pods(INSTANCES):
        name = pod["metadata"]["name"]
        assert f"{name}: signing as {name}, certified by" in kube.kubectl("logs", f"pod/{name}"), name

    # Every instance pod is Ready through its probes, and serves Prometheus text (through the API server's
    # pod proxy, as a scraper inside the cluster would reach it).
    pods = kube.pods(INSTANCES)
    for pod in pods:
        (container,) = pod["spec"]["containers"]
        assert {"startupProbe", "livenessProbe", "readinessProbe"} <= container.keys(), container
        assert pod_ready(pod)
    name = pods[0]["metadata"]["name"]
    proxy = f"/api/v1/namespaces/{NAMESPACE}/pods/{name}:{METRICS_PORT}/proxy"
    assert kube.kubectl("get", "--raw", f"{proxy}/readyz").strip()
    metrics = kube.kubectl("get", "--raw", f"{proxy}/metrics")
    missing = [m for m in INSTANCE_METRICS if f"\n{m}" not in metrics]
    assert not missing, f"{name}'s /metrics lacks {missing}:\n{metrics[:3000]}"
    report["metrics_sample"] = [line for line in metrics.splitlines() if line.startswith(INSTANCE_METRICS)][
        :12
    ]

    # Enough input, then the generator stops (its pod's SIGTERM ends the producer cleanly).
    min_s = MIN_TUPLES / RATE - (time.monotonic() - t_start)
    if min_s > 0:
        say(f"generating {min_s:.0f} s more for at least {MIN_TUPLES} tuples")
        time.sleep(min_s)
    kube.kubectl("scale", "deployment", f"{PIPELINE}-generator", "--replicas=0")
    wait_until(
        "generator stopped",
        120,
        lambda: not kube.pods("app.kubernetes.io/component=generator"),
        kube.overview,
    )

    # The oracle until the pipeline has caught up (exact), or until it is plainly not going to be.
    verdict: dict[str, Any] = {}
    t0 = time.monotonic()
    for attempt in range(1, 11):
        verdict = _verify_job(kube, attempt)
        counts = {k: verdict.get(k) for k in ORACLE_COUNTS}
        say(f"oracle attempt {attempt}: {json.dumps(counts)}")
        if verdict.get("exact") or time.monotonic() - t0 > 900:
            break
        time.sleep(20)
    report["oracle"] = verdict
    report["pid_pauses"] = _pauses(
        kube, {"rolling_update": resume_window, "rolling_update_drain": drain_window}
    )
    say(f"each pid's longest pause: {json.dumps(report['pid_pauses'])}")

    t0 = time.monotonic()
    kube.helm("uninstall", RELEASE, "--wait", "--timeout", "5m")

    def gone() -> bool:
        left = kube.kubectl("get", "jp,sts,deploy,pods,pvc,svc,cm,pdb", "-o", "name", check=False)
        return not [
            line
            for line in left.splitlines()
            if line and "kube-root-ca.crt" not in line and "/oracle-" not in line and "/pauses" not in line
        ]

    report["uninstall_s"] = wait_until("helm uninstall leaves nothing", 300, gone, kube.overview)
    REPORT.parent.mkdir(parents=True, exist_ok=True)
    REPORT.write_text(json.dumps(report, indent=2) + "\n")
    say(f"report: {REPORT}")

    assert verdict.get("exact") is True, f"the oracle found the results not exact: {verdict}"
    assert verdict.get("missing") == 0 and verdict.get("duplicate") == 0 and verdict.get("spurious") == 0
    assert verdict["input_tuples"] >= MIN_TUPLES


SECURED_RELEASE = "fjs"
SECURED_PIPELINE = f"{SECURED_RELEASE}-fluxjoin"


def _node_ip() -> str:
    """This machine's address on the way out, the one pods of the node reach it at (as scripts/cluster.sh
    gives the kubelet)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect(("1.0.0.0", 9))
        return str(s.getsockname()[0])


def test_helm_install_on_a_kafka_with_tls_scram_and_acls_stays_exact(kube: Kube, tmp_path: Path) -> None:
    """The chart against a Kafka outside the cluster that asks for TLS and SCRAM and authorizes every
    request (the embedded broker on this node, as a managed Kafka would be): the password and the CA come
    from a Secret and reach the operator, the generator and every instance pod as files; signing on;
    scaled 2 -> 3 while input flows; the oracle, a Job logged in alike, finds the results exact."""
    ip, password = _node_ip(), secrets.token_urlsafe(16)
    secured = SaslSsl(tmp_path / "tls", {"fluxjoin": password}, host=ip)
    port = kafka_runtime._free_port()
    bootstrap = kafka_runtime.start(port, data_dir=tmp_path / "broker", secured=secured)
    try:
        prefix = f"{NAMESPACE}.{SECURED_PIPELINE}"
        admin = AdminClient({"bootstrap.servers": bootstrap, **secured.client()})
        for future in admin.create_acls(pipeline_acls(Config(pipeline=prefix), "User:fluxjoin")).values():
            future.result()
        kube.kubectl(
            "create", "secret", "generic", "fluxjoin-kafka", f"--from-literal=password={password}",
            f"--from-file=ca.crt={secured.ca_file}",
        )  # fmt: skip
        values = [
            ("image.repository", IMAGE), ("image.tag", TAG), ("image.pullPolicy", "Never"),
            ("kafka.bootstrapServers", bootstrap),
            ("kafka.security.protocol", "SASL_SSL"), ("kafka.security.saslMechanism", "SCRAM-SHA-512"),
            ("kafka.security.username", "fluxjoin"), ("kafka.security.passwordSecret.name", "fluxjoin-kafka"),
            ("kafka.security.caSecret.name", "fluxjoin-kafka"),
            ("operator.resources.requests.cpu", "50m"),
            ("pipeline.create", "true"), ("pipeline.replicas", "2"), ("pipeline.partitions", "8"),
            ("pipeline.streams", "{A,B}"), ("pipeline.instance.sparkMaster", "local[1]"),
            ("pipeline.resources.requests.cpu", "100m"), ("pipeline.resources.requests.memory", "1Gi"),
            ("pipeline.checkpoint.size", "1Gi"),
            ("generator.enabled", "true"), ("generator.resources.requests.cpu", "50m"),
            ("generator.config.rate.rate", str(RATE // 2)), ("generator.config.keys.count", "2000"),
            ("signing.enabled", "true"),
        ]  # fmt: skip
        kube.helm("install", SECURED_RELEASE, str(CHART), *helm_values(values))
        instances = f"app.kubernetes.io/component=instance,{PIPELINE_LABEL}={SECURED_PIPELINE}"

        def ready(replicas: int) -> bool:
            status = kube.get("joinpipeline", SECURED_PIPELINE).get("status", {})
            pods = kube.pods(instances)
            return (
                status.get("readyReplicas") == replicas
                and not status.get("movesInFlight")
                and len(pods) == replicas
                and all(pod_ready(p) for p in pods)
            )

        took = wait_until("secured install", 900, lambda: ready(2), kube.overview)
        say(f"secured: Ready with 2 instances: {took:.0f} s")
        kube.kubectl("scale", "joinpipeline", SECURED_PIPELINE, "--replicas=3")
        took = wait_until("secured scale to 3", 600, lambda: ready(3), kube.overview)
        say(f"secured: scaled to 3: {took:.0f} s")
        time.sleep(30)  # input over the new layout
        kube.kubectl("scale", "deployment", f"{SECURED_PIPELINE}-generator", "--replicas=0")
        generators = f"app.kubernetes.io/component=generator,app.kubernetes.io/instance={SECURED_RELEASE}"
        wait_until("secured generator stopped", 120, lambda: not kube.pods(generators), kube.overview)

        # The oracle as a Job with the generator's configuration and credentials.
        generator = kube.get("deployment", f"{SECURED_PIPELINE}-generator")["spec"]["template"]["spec"]
        (container,) = generator["containers"]
        credentials = [v for v in generator["volumes"] if v["name"] == "kafka-credentials"]
        assert credentials, generator["volumes"]
        # TLS on every request, three Spark instances and the oracle on two cores: an instance may be
        # restarted on the way (its checkpoint resumes), so the oracle is asked for longer.
        verdict: dict[str, Any] = {}
        for attempt in range(1, 16):
            oracle = {
                "args": ["verify", "--config", "/etc/fluxjoin/fluxjoin.yaml", "--json"],
                "env": [e for e in container["env"] if e["name"].startswith("FLUXJOIN_KAFKA_")],
                "volumeMounts": container["volumeMounts"],
            }
            pod = {"securityContext": generator.get("securityContext", {}), "volumes": generator["volumes"]}
            verdict = _job(kube, f"secured-oracle-{attempt}", oracle, pod)
            say(f"secured oracle attempt {attempt}: {json.dumps({k: verdict.get(k) for k in ORACLE_COUNTS})}")
            if verdict.get("exact"):
                break
            time.sleep(20)
        for pod in kube.pods(instances):
            name = pod["metadata"]["name"]
            env = {e["name"] for e in pod["spec"]["containers"][0]["env"]}
            assert "FLUXJOIN_KAFKA_SASL_PASSWORD_FILE" in env and password not in json.dumps(pod), name
            assert f"{name}: signing as {name}, certified by" in kube.kubectl("logs", f"pod/{name}"), name
        kube.helm("uninstall", SECURED_RELEASE, "--wait", "--timeout", "5m")
    finally:
        kafka_runtime.stop(port)
    assert verdict.get("exact") is True, f"the oracle found the results not exact: {verdict}"
    assert verdict["input_tuples"] > 10_000


EXECUTORS_RELEASE = "fjx"
EXECUTORS_PIPELINE = f"{EXECUTORS_RELEASE}-fluxjoin"
EXECUTORS_RATE = 1000
EXECUTORS_MIN_TUPLES = 60_000


def test_an_instance_on_two_executor_pods_loses_one_and_stays_exact(kube: Kube) -> None:
    """One instance pod as Spark's driver, its tasks on two executor pods that Spark's Kubernetes backend
    creates from the same image (spec.instance.executors, the chart's executors.enabled): the executors
    run as the instance pods do, belong to the driver's pod, and do the tasks; the instances' identity may
    manage pods and nothing else. One executor pod is deleted while input flows: Spark replaces it and
    reruns its tasks. Then the driver's pod is deleted: its executors go with it, and the instance comes
    back with new ones. The oracle finds the results exact."""
    broker_repository, _, broker_tag = kube.broker_image.partition(":")  # type: ignore[attr-defined]
    values = [
        ("image.repository", IMAGE), ("image.tag", TAG), ("image.pullPolicy", "Never"),
        ("kafka.trial.enabled", "true"), ("kafka.trial.image.repository", broker_repository),
        ("kafka.trial.image.tag", broker_tag), ("kafka.trial.image.pullPolicy", "Never"),
        ("kafka.trial.storage.size", "2Gi"), ("kafka.trial.resources.requests.cpu", "100m"),
        ("operator.resources.requests.cpu", "50m"),
        ("executors.enabled", "true"),
        ("pipeline.create", "true"), ("pipeline.replicas", "1"), ("pipeline.partitions", "8"),
        ("pipeline.streams", "{A,B}"),
        ("pipeline.instance.executors.count", "2"),
        ("pipeline.instance.executors.cpuRequest", "100m"),
        ("pipeline.resources.requests.cpu", "100m"), ("pipeline.resources.requests.memory", "1Gi"),
        ("pipeline.checkpoint.size", "1Gi"),
        ("generator.enabled", "true"), ("generator.resources.requests.cpu", "50m"),
        ("generator.config.rate.rate", str(EXECUTORS_RATE)), ("generator.config.keys.count", "2000"),
    ]  # fmt: skip
    t_start = time.monotonic()
    kube.helm("install", EXECUTORS_RELEASE, str(CHART), *helm_values(values))
    instances = f"app.kubernetes.io/component=instance,{PIPELINE_LABEL}={EXECUTORS_PIPELINE}"
    executors = f"app.kubernetes.io/component=executor,{PIPELINE_LABEL}={EXECUTORS_PIPELINE}"

    def running_executors() -> list[dict[str, Any]]:
        return [
            p for p in kube.pods(executors) if pod_ready(p) and not p["metadata"].get("deletionTimestamp")
        ]

    def ready() -> bool:
        status = kube.get("joinpipeline", EXECUTORS_PIPELINE).get("status", {})
        pods = kube.pods(instances)
        return (
            status.get("readyReplicas") == 1
            and len(pods) == 1
            and pod_ready(pods[0])
            and len(running_executors()) == 2
        )

    took = wait_until("executors: Ready with 1 instance and 2 executor pods", 900, ready, kube.overview)
    say(f"executors: Ready with 1 instance and 2 executor pods: {took:.0f} s")
    (driver,) = kube.pods(instances)
    instance_pod = driver["spec"]
    for pod in running_executors():
        owners = pod["metadata"].get("ownerReferences", [])
        assert [o["uid"] for o in owners] == [driver["metadata"]["uid"]], owners
        assert pod["spec"]["securityContext"] == instance_pod["securityContext"]
        (container,) = pod["spec"]["containers"]
        assert container["securityContext"] == instance_pod["containers"][0]["securityContext"]
        assert container["image"] == f"{IMAGE}:{TAG}"
    # The instances' identity manages pods, and only pods.
    account = f"system:serviceaccount:{NAMESPACE}:{EXECUTORS_PIPELINE}-instance"
    assert instance_pod["serviceAccountName"] == f"{EXECUTORS_PIPELINE}-instance"
    rights = [
        ("create", "pods", "yes"),
        ("delete", "pods", "yes"),
        ("create", "configmaps", "no"),
        ("create", "services", "no"),
        ("get", "secrets", "no"),
        ("create", "persistentvolumeclaims", "no"),
    ]
    for verb, resource, allowed in rights:
        answer = kube.kubectl("auth", "can-i", verb, resource, f"--as={account}", check=False).strip()
        assert answer == allowed, (verb, resource, answer)

    # The tasks run on the executors: each has finished tasks, of the join's stage too.
    def tasks_on_both() -> bool:
        logs = [
            kube.kubectl("logs", f"pod/{p['metadata']['name']}", check=False) for p in running_executors()
        ]
        return len(logs) == 2 and all("Finished task" in log for log in logs)

    wait_until("executors: both have run tasks", 300, tasks_on_both, kube.overview)

    # One executor pod goes while input flows: Spark creates another, gives it tasks, and the query
    # carries on.
    time.sleep(20)
    victim = running_executors()[0]["metadata"]
    kube.kubectl("delete", "pod", victim["name"], "--wait=false")

    def replaced() -> bool:
        names = {p["metadata"]["name"] for p in running_executors()}
        return len(names) == 2 and victim["name"] not in names and ready()

    took = wait_until(f"executor {victim['name']} deleted -> replaced", 600, replaced, kube.overview)
    say(f"executors: {victim['name']} deleted -> replaced in {took:.0f} s")
    wait_until("executors: the replacement runs tasks", 300, tasks_on_both, kube.overview)

    # The driver's pod goes too: its executors go with it, the StatefulSet starts it again, and the
    # instance resumes from its checkpoint on executors of its own.
    kube.kubectl("delete", "pod", driver["metadata"]["name"], "--wait=false")

    def driver_back() -> bool:
        pods = kube.pods(instances)
        if len(pods) != 1 or pods[0]["metadata"]["uid"] == driver["metadata"]["uid"] or not ready():
            return False
        owners = {o["uid"] for p in running_executors() for o in p["metadata"].get("ownerReferences", [])}
        return owners == {pods[0]["metadata"]["uid"]}

    took = wait_until(
        "executors: driver pod deleted -> back with new executors", 600, driver_back, kube.overview
    )
    say(f"executors: driver pod deleted -> back with new executors in {took:.0f} s")
    wait_until("executors: the new executors run tasks", 300, tasks_on_both, kube.overview)

    min_s = EXECUTORS_MIN_TUPLES / EXECUTORS_RATE - (time.monotonic() - t_start)
    if min_s > 0:
        time.sleep(min_s)
    kube.kubectl("scale", "deployment", f"{EXECUTORS_PIPELINE}-generator", "--replicas=0")
    generators = f"app.kubernetes.io/component=generator,app.kubernetes.io/instance={EXECUTORS_RELEASE}"
    wait_until("executors: generator stopped", 120, lambda: not kube.pods(generators), kube.overview)
    verdict: dict[str, Any] = {}
    for attempt in range(1, 11):
        verify = {"args": ["verify", "--config", "/etc/fluxjoin/fluxjoin.yaml", "--json"]}
        verdict = _job(kube, f"executors-oracle-{attempt}", verify, pipeline=EXECUTORS_PIPELINE)
        say(f"executors: oracle attempt {attempt}: {json.dumps({k: verdict.get(k) for k in ORACLE_COUNTS})}")
        if verdict.get("exact"):
            break
        time.sleep(20)
    driver_log = kube.kubectl("logs", f"pod/{driver['metadata']['name']}")
    kube.helm("uninstall", EXECUTORS_RELEASE, "--wait", "--timeout", "5m")
    wait_until("executors: executor pods gone with the pipeline", 300, lambda: not kube.pods(executors),
               kube.overview)  # fmt: skip
    assert "forbidden" not in driver_log.lower(), driver_log[-5000:]
    assert verdict.get("exact") is True, f"the oracle found the results not exact: {verdict}"
    assert verdict["input_tuples"] >= EXECUTORS_MIN_TUPLES
