"""What the operator asks Kubernetes for: a JoinPipeline read into a spec, the objects it owns, its status.

Pure: every function here takes observed values and returns plain JSON-ready dicts (the shape the API
server sends and accepts), so that the reconcile loop in `controller/operator.py` only compares and sends
them, and so that re-rendering from unchanged inputs gives an identical object (no write is needed).

Owned objects, all named after the pipeline and labelled with `fluxjoin.io/pipeline`:
- a StatefulSet of join instances (pod `<name>-<ordinal>` is instance `<name>-<ordinal>`), each with a
  PersistentVolumeClaim `checkpoint-<name>-<ordinal>` for its Spark checkpoint;
- a ConfigMap holding the instances' configuration file, mounted into every instance pod;
- a headless Service giving the instance pods stable DNS names;
- a PodDisruptionBudget letting a voluntary disruption (a node drain) take one instance pod at a time.

This module must not call the API server or the `PidMover`; it knows the CRD's field names and nothing
about how a move is carried out.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import yaml

from controller.assignment import Assignment, HandoffMode, Move
from controller.policies.base import InstanceStats
from controller.rounds import policy_params
from controller.scaling import Plan, StepKind, instance_name, ordinal_of
from pipeline.config import Config, InstanceConfig, TopicsConfig
from pipeline.health import DEFAULT_METRICS_PORT

GROUP, VERSION, PLURAL, KIND = "fluxjoin.io", "v1alpha1", "joinpipelines", "JoinPipeline"
API_VERSION = f"{GROUP}/{VERSION}"
FINALIZER = "fluxjoin.io/cleanup"
FIELD_MANAGER = "fluxjoin-operator"
PIPELINE_LABEL = "fluxjoin.io/pipeline"
SPEC_HASH_ANNOTATION = "fluxjoin.io/spec-hash"
CONFIG_HASH_ANNOTATION = "fluxjoin.io/config-hash"
CHECKPOINT_VOLUME = "checkpoint"
WORK_DIR = "/var/lib/fluxjoin/work"
CONFIG_VOLUME = "config"
CONFIG_DIR = "/etc/fluxjoin"
CONFIG_FILE = "instance.yaml"
STARTUP_ALLOWANCE_S = 600
"""How long an instance pod may take from its start until its query serves (/readyz) before the kubelet
restarts it: a JVM, a Spark session and a first batch, 20-60 s on a core, several minutes under a CPU
limit of a fraction of a core. Liveness is checked only from then on."""
POLICY_FIELDS = {
    "flux": {
        "thImb": "th_imb",
        "thUtil": "th_util",
        "deltaS": "delta_s",
        "deltaMinS": "delta_min_s",
        "maxMovesPerPair": "max_moves_per_pair",
        "minMoveShare": "min_move_share",
        "donorCost": "donor_cost",
        "phaseInterval": "phase_interval",
    },
    "memory": {"thetaD": "theta_d", "minSpanS": "min_span_s"},
}
"""spec.policy.<name>.<field> -> the parameter of that policy it sets."""


@dataclass(frozen=True, slots=True, kw_only=True)
class PipelineSpec:
    """One JoinPipeline as the operator and a `PidMover` need it; defaults are the CRD's.

    The API server fills in the CRD's defaults, so they matter here only for objects written before a
    field existed.
    """

    name: str
    namespace: str
    uid: str
    generation: int
    streams: tuple[str, ...]
    window_ms: int
    allowed_lateness_ms: int
    partitions: int
    replicas: int
    handoff_mode: HandoffMode
    bootstrap_servers: str
    topic_prefix: str
    instance: InstanceConfig = field(default_factory=InstanceConfig)
    image: str | None = None
    resources: Mapping[str, Any] = field(default_factory=dict)
    checkpoint_size: str = "5Gi"
    storage_class: str | None = None
    policy: str = "flux"
    policy_settings: Mapping[str, float] = field(default_factory=dict)
    """The policy's parameters set in the spec, by their `controller.policies` field names."""
    heartbeat_timeout_s: float = 10.0
    restart_grace_s: float = 300.0
    topics: TopicsConfig = field(default_factory=TopicsConfig)
    kafka_security: Mapping[str, Any] = field(default_factory=dict)
    """spec.kafka.security: how the instances log in to Kafka (`kafka_credentials`)."""
    drain_timeout_s: float = 0.0
    """How long a stopping instance pod waits for its pids to be moved away (spec.liveness
    plannedRestart `drain`, decision 0056); 0: it stops at once and resumes on return (`resume`)."""

    @classmethod
    def from_object(cls, obj: Mapping[str, Any]) -> PipelineSpec:
        meta, spec = obj["metadata"], obj.get("spec", {})
        instance = spec.get("instance", {})
        checkpoint = spec.get("checkpoint", {})
        kafka = spec["kafka"]
        mode = spec.get("handoffMode", HandoffMode.TRANSFER.value)
        supported = [m.value for m in HandoffMode]
        if mode not in supported:
            raise ValueError(
                f"spec.handoffMode {mode!r} is not supported by this operator: use one of {supported}"
            )
        policy = spec.get("policy", {})
        policy_name = policy.get("name", "flux")
        liveness, topics = spec.get("liveness", {}), kafka.get("topics", {})
        drain_timeout_s = (
            int(liveness.get("drainTimeoutSeconds", 120)) if liveness.get("plannedRestart") == "drain" else 0
        )
        fields = POLICY_FIELDS.get(policy_name, {})
        given = policy.get(policy_name, {})
        return cls(
            name=meta["name"],
            namespace=meta["namespace"],
            uid=meta["uid"],
            generation=int(meta.get("generation", 0)),
            streams=tuple(spec.get("streams", ("A", "B", "C"))),
            window_ms=int(spec.get("windowMs", 10_000)),
            allowed_lateness_ms=int(spec.get("allowedLatenessMs", 2_000)),
            partitions=int(spec.get("partitions", 64)),
            replicas=int(spec.get("replicas", 3)),
            handoff_mode=HandoffMode(mode),
            bootstrap_servers=kafka["bootstrapServers"],
            kafka_security=kafka.get("security", {}),
            topics=TopicsConfig(
                create=bool(topics.get("create", True)),
                replication_factor=int(topics.get("replicationFactor", -1)),
                min_insync_replicas=topics.get("minInsyncReplicas"),
                retention_ms=topics.get("retentionMs"),
            ),
            # Topics and transactional ids derive from the prefix: namespaced, so that pipelines of one
            # name in two namespaces never share a topic or fence each other's transactions.
            topic_prefix=kafka.get("topicPrefix") or f"{meta['namespace']}.{meta['name']}",
            instance=InstanceConfig(
                trigger_ms=int(instance.get("triggerMs", 500)),
                max_rows_per_batch=int(instance.get("maxRowsPerBatch", 200_000)),
                max_results_per_batch=int(instance.get("maxResultsPerBatch", 4_000_000)),
                shuffle_partitions=int(instance.get("shufflePartitions", 2)),
                spark_master=instance.get("sparkMaster", "local[2]"),
                driver_memory=instance.get("driverMemory", "1g"),
                work_dir=WORK_DIR,
                drain_timeout_s=drain_timeout_s,
            ),
            image=spec.get("image"),
            resources=spec.get("resources", {}),
            checkpoint_size=str(checkpoint.get("size", "5Gi")),
            storage_class=checkpoint.get("storageClassName") or None,
            policy=policy_name,
            policy_settings={fields[k]: float(v) for k, v in given.items() if k in fields},
            heartbeat_timeout_s=float(liveness.get("heartbeatTimeoutSeconds", 10)),
            restart_grace_s=float(liveness.get("restartGraceSeconds", 300)),
            drain_timeout_s=float(drain_timeout_s),
        )

    def policy_params(self) -> Any:
        """The policy's parameters: its defaults, the spec's settings, the pipeline's handoff mode.

        Raises ValueError for settings the policy rejects (the CRD's validation catches most first).
        """
        return policy_params(self.policy, self.handoff_mode, **self.policy_settings)

    def to_config(self) -> Config:
        """The pipeline in the configuration schema every `fluxjoin` process shares (topic names included)."""
        return Config(
            pipeline=self.topic_prefix,
            bootstrap=self.bootstrap_servers,
            streams=list(self.streams),
            window_ms=self.window_ms,
            allowed_lateness_ms=self.allowed_lateness_ms,
            partitions=self.partitions,
            instances=self.replicas,
            instance=self.instance,
            topics=self.topics,
        )

    def instances(self, width: int) -> list[str]:
        """Instance ids of ordinals 0..width-1."""
        return [instance_name(self.name, ordinal) for ordinal in range(width)]


@dataclass(frozen=True, slots=True, kw_only=True)
class InstanceSettings:
    """How instance pods are run, from the operator's own Deployment (the chart's FLUXJOIN_* variables)."""

    image: str | None = None
    pull_policy: str = "IfNotPresent"
    pull_secrets: tuple[str, ...] = ()
    metrics_port: int = DEFAULT_METRICS_PORT
    scrape_annotations: bool = True


def selector_labels(pipeline: str) -> dict[str, str]:
    """The labels that select a pipeline's instance pods (and their checkpoint volumes)."""
    return {
        "app.kubernetes.io/name": "fluxjoin",
        "app.kubernetes.io/component": "instance",
        PIPELINE_LABEL: pipeline,
    }


def selector_string(pipeline: str) -> str:
    """The selector in `kubectl -l` form, for status.selector (the scale subresource's labelSelectorPath)."""
    return ",".join(f"{k}={v}" for k, v in sorted(selector_labels(pipeline).items()))


def _labels(pipeline: str) -> dict[str, str]:
    return {
        **selector_labels(pipeline),
        "app.kubernetes.io/part-of": "fluxjoin",
        "app.kubernetes.io/managed-by": FIELD_MANAGER,
    }


def owner_reference(spec: PipelineSpec) -> dict[str, Any]:
    """Makes the pipeline the controller of what it owns (cluster garbage collection, `kubectl describe`)."""
    return {
        "apiVersion": API_VERSION,
        "kind": KIND,
        "name": spec.name,
        "uid": spec.uid,
        "controller": True,
        "blockOwnerDeletion": True,
    }


def _digest(value: object) -> str:
    return hashlib.sha256(json.dumps(value, sort_keys=True).encode()).hexdigest()[:16]


def _with_hash(manifest: dict[str, Any]) -> dict[str, Any]:
    """Stamp the manifest with a hash of everything but spec.replicas (a ConfigMap's data included), so a
    changed object is seen by comparing one annotation, and a scale step alone by comparing replicas."""
    content = {k: v for k, v in manifest.items() if k not in ("apiVersion", "kind", "metadata", "spec")}
    if "spec" in manifest:
        content["spec"] = {k: v for k, v in manifest["spec"].items() if k != "replicas"}
    manifest["metadata"].setdefault("annotations", {})[SPEC_HASH_ANNOTATION] = _digest(
        [manifest["metadata"], content]
    )
    return manifest


def _metadata(spec: PipelineSpec) -> dict[str, Any]:
    return {
        "name": spec.name,
        "namespace": spec.namespace,
        "labels": _labels(spec.name),
        "ownerReferences": [owner_reference(spec)],
    }


def instance_config(spec: PipelineSpec) -> dict[str, Any]:
    """The configuration every instance pod of the pipeline reads from its ConfigMap (`--config`).

    One document in the schema of `pipeline.config` rather than `--set key=value` arguments: an
    argument's value is read as YAML, so a pipeline named `123` or a stream named `on` reached the
    instance as a number or a boolean and the pods crash-looped, while the operator, which builds its
    configuration directly, carried on. A YAML file written by `yaml.safe_dump` quotes such strings.

    The pod template is shared by all ordinals and must not change when pids move (a change would restart
    every instance), so this carries the pipeline's configuration but no pids: an instance learns the
    pids it owns from the control topic. `instances=1` because each process is one instance; how many run
    is the StatefulSet's business. Raises ValueError (pydantic's) when the configuration is invalid, so
    the pipeline reports it instead of its pods crash-looping.
    """
    document: dict[str, Any] = {
        "pipeline": spec.topic_prefix,
        "bootstrap": spec.bootstrap_servers,
        "streams": list(spec.streams),
        "window_ms": spec.window_ms,
        "allowed_lateness_ms": spec.allowed_lateness_ms,
        "partitions": spec.partitions,
        "instances": 1,
        "instance": spec.instance.model_dump(exclude_none=True),
        "topics": spec.topics.model_dump(exclude_none=True),
    }
    Config.model_validate(document)
    return document


def config_map(spec: PipelineSpec) -> dict[str, Any]:
    """The ConfigMap holding the instances' configuration file (`CONFIG_FILE`)."""
    text = (
        f"# fluxjoin instance configuration of JoinPipeline {spec.namespace}/{spec.name}, written by the\n"
        "# operator from the pipeline's spec: edit the JoinPipeline, not this file.\n"
    ) + yaml.safe_dump(instance_config(spec), sort_keys=False)
    return _with_hash(
        {"apiVersion": "v1", "kind": "ConfigMap", "metadata": _metadata(spec), "data": {CONFIG_FILE: text}}
    )


def instance_args(settings: InstanceSettings) -> list[str]:
    """`fluxjoin instance` arguments for every pod of the StatefulSet: its name, the mounted configuration
    file and the metrics port the pod's probes and scrape annotations use."""
    return [
        "instance",
        "--name",
        "$(FLUXJOIN_POD_NAME)",
        "--config",
        f"{CONFIG_DIR}/{CONFIG_FILE}",
        "--metrics-port",
        str(settings.metrics_port),
    ]


def _probes() -> dict[str, Any]:
    """Startup, liveness and readiness of an instance container, on its metrics port (`pipeline.health`).

    The startup probe waits for /readyz (the query has run a batch) for up to `STARTUP_ALLOWANCE_S`;
    until it passes, liveness is not checked. From then on /healthz fails once the query has made no
    progress for the instance's stall timeout, and three failures 10 s apart restart the container.
    /readyz gates a rolling update, which replaces the next pod only when this one serves again.
    """
    period_s = 5
    return {
        "startupProbe": {
            "httpGet": {"path": "/readyz", "port": "metrics"},
            "periodSeconds": period_s,
            "timeoutSeconds": 5,
            "failureThreshold": STARTUP_ALLOWANCE_S // period_s,
        },
        "livenessProbe": {
            "httpGet": {"path": "/healthz", "port": "metrics"},
            "periodSeconds": 10,
            "timeoutSeconds": 5,
            "failureThreshold": 3,
        },
        "readinessProbe": {
            "httpGet": {"path": "/readyz", "port": "metrics"},
            "periodSeconds": period_s,
            "timeoutSeconds": 5,
            "failureThreshold": 3,
        },
    }


KAFKA_CREDENTIALS_DIR = "/etc/fluxjoin/kafka"
"""Where an instance pod finds the Kafka credentials of spec.kafka.security, as files."""


def kafka_credentials(security: Mapping[str, Any]) -> tuple[list[dict[str, Any]], dict[str, Any] | None]:
    """The `FLUXJOIN_KAFKA_*` environment (`pipeline.kafka_client`) and the volume of Secret files that
    log a pod in to Kafka as spec.kafka.security says (the chart renders the same for the operator and
    the generator: `fluxjoin.kafkaCredentials`). The password and keys reach the pod only as files of
    a projected Secret volume: never in the pod's spec, its arguments or its environment."""
    env: list[dict[str, Any]] = []
    items: list[dict[str, Any]] = []

    def put(variable: str, value: str) -> None:
        env.append({"name": f"FLUXJOIN_KAFKA_{variable}", "value": value})

    def secret_file(variable: str, secret: Mapping[str, Any] | None, key: str, path: str) -> None:
        if secret and secret.get("name"):
            items.append({"secret": {"name": secret["name"], "items": [{"key": key, "path": path}]}})
            put(variable, f"{KAFKA_CREDENTIALS_DIR}/{path}")

    protocol = security.get("protocol", "PLAINTEXT")
    if protocol == "PLAINTEXT":
        return env, None
    put("SECURITY_PROTOCOL", protocol)
    if security.get("saslMechanism"):
        put("SASL_MECHANISM", security["saslMechanism"])
    if security.get("username"):
        put("SASL_USERNAME", security["username"])
    password = security.get("passwordSecret") or {}
    secret_file("SASL_PASSWORD_FILE", password, password.get("key", "password"), "password")
    ca = security.get("caSecret") or {}
    secret_file("SSL_CA_FILE", ca, ca.get("key", "ca.crt"), "ca.crt")
    client = security.get("clientCertSecret") or {}
    secret_file("SSL_CERT_FILE", client, client.get("certKey", "user.crt"), "user.crt")
    secret_file("SSL_KEY_FILE", client, client.get("keyKey", "user.key"), "user.key")
    volume = (
        {"name": "kafka-credentials", "projected": {"sources": items, "defaultMode": 0o440}}
        if items
        else None
    )
    return env, volume


def statefulset(spec: PipelineSpec, settings: InstanceSettings, replicas: int) -> dict[str, Any]:
    """The instance StatefulSet with `replicas` pods; ValueError when no image is known."""
    image = spec.image or settings.image
    if not image:
        raise ValueError(
            "no image for the join instances: set spec.image or run the operator with --instance-image"
        )
    labels = _labels(spec.name)
    annotations = (
        {"prometheus.io/scrape": "true", "prometheus.io/port": str(settings.metrics_port),
         "prometheus.io/path": "/metrics"}
        if settings.scrape_annotations else {}
    )  # fmt: skip
    # The file's content changes no argument: its hash in the template rolls the pods when it changes.
    annotations[CONFIG_HASH_ANNOTATION] = _digest(config_map(spec)["data"])
    kafka_env, kafka_volume = kafka_credentials(spec.kafka_security)
    container: dict[str, Any] = {
        "name": "instance",
        "image": image,
        "imagePullPolicy": settings.pull_policy,
        "args": instance_args(settings),
        "env": [
            {"name": "FLUXJOIN_POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
            {"name": "FLUXJOIN_NAMESPACE", "valueFrom": {"fieldRef": {"fieldPath": "metadata.namespace"}}},
            *kafka_env,
        ],
        "ports": [{"name": "metrics", "containerPort": settings.metrics_port, "protocol": "TCP"}],
        **_probes(),
        "resources": dict(spec.resources),
        "securityContext": {
            "allowPrivilegeEscalation": False,
            "readOnlyRootFilesystem": True,
            "capabilities": {"drop": ["ALL"]},
        },
        "volumeMounts": [
            {"name": CHECKPOINT_VOLUME, "mountPath": WORK_DIR},
            {"name": CONFIG_VOLUME, "mountPath": CONFIG_DIR, "readOnly": True},
            {"name": "tmp", "mountPath": "/tmp"},
        ],
    }
    pod_spec: dict[str, Any] = {
        "automountServiceAccountToken": False,
        # A draining instance must finish before the kubelet's SIGKILL: its timeout and a margin to stop.
        "terminationGracePeriodSeconds": int(max(60, spec.drain_timeout_s + 30)),
        "securityContext": {
            "runAsNonRoot": True,
            "runAsUser": 10001,
            "runAsGroup": 10001,
            "fsGroup": 10001,
            "seccompProfile": {"type": "RuntimeDefault"},
        },
        "containers": [container],
        "volumes": [
            {"name": CONFIG_VOLUME, "configMap": {"name": spec.name}},
            {"name": "tmp", "emptyDir": {}},
        ],
    }
    if kafka_volume is not None:
        pod_spec["volumes"].append(kafka_volume)
        container["volumeMounts"].append(
            {"name": kafka_volume["name"], "mountPath": KAFKA_CREDENTIALS_DIR, "readOnly": True}
        )
    if settings.pull_secrets:
        pod_spec["imagePullSecrets"] = [{"name": name} for name in settings.pull_secrets]
    claim_spec: dict[str, Any] = {
        "accessModes": ["ReadWriteOnce"],
        "resources": {"requests": {"storage": spec.checkpoint_size}},
    }
    if spec.storage_class:
        claim_spec["storageClassName"] = spec.storage_class
    return _with_hash(
        {
            "apiVersion": "apps/v1",
            "kind": "StatefulSet",
            "metadata": _metadata(spec),
            "spec": {
                "replicas": replicas,
                "serviceName": spec.name,
                # Pods of a scale step start together; the operator, not pod order, decides who owns what.
                "podManagementPolicy": "Parallel",
                "selector": {"matchLabels": selector_labels(spec.name)},
                # A removed instance's checkpoint holds offsets of pids it no longer owns: never reuse it.
                "persistentVolumeClaimRetentionPolicy": {"whenDeleted": "Delete", "whenScaled": "Delete"},
                "template": {"metadata": {"labels": labels, "annotations": annotations}, "spec": pod_spec},
                "volumeClaimTemplates": [
                    {"metadata": {"name": CHECKPOINT_VOLUME, "labels": labels}, "spec": claim_spec}
                ],
            },
        }
    )


def service(spec: PipelineSpec, settings: InstanceSettings) -> dict[str, Any]:
    """The headless Service that gives each instance pod a stable DNS name (the StatefulSet's serviceName)."""
    return _with_hash(
        {
            "apiVersion": "v1",
            "kind": "Service",
            "metadata": _metadata(spec),
            "spec": {
                "clusterIP": "None",
                "publishNotReadyAddresses": True,
                "selector": selector_labels(spec.name),
                "ports": [
                    {
                        "name": "metrics",
                        "port": settings.metrics_port,
                        "targetPort": "metrics",
                        "protocol": "TCP",
                    }
                ],
            },
        }
    )


def pod_disruption_budget(spec: PipelineSpec) -> dict[str, Any]:
    """At most one instance pod down at a time by a voluntary disruption (a node drain, an eviction).

    Each instance down pauses its pids until it is back or the controller recovers them elsewhere, and
    every recovery replays input; one at a time keeps that to the pids of one instance. A pod that is
    not ready (crash-looping, or still starting) may always be evicted (`AlwaysAllow`): it serves
    nothing, and would otherwise block the drain.
    """
    return _with_hash(
        {
            "apiVersion": "policy/v1",
            "kind": "PodDisruptionBudget",
            "metadata": _metadata(spec),
            "spec": {
                "maxUnavailable": 1,
                "selector": {"matchLabels": selector_labels(spec.name)},
                "unhealthyPodEvictionPolicy": "AlwaysAllow",
            },
        }
    )


def restarting_instances(pods: Sequence[Mapping[str, Any]], instances: Collection[str]) -> set[str]:
    """The instances whose pod Kubernetes is replacing or starting: missing (deleted, not yet recreated),
    terminating, or not Ready. Their silence is a restart, not a death, for a while (decision 0051)."""
    by_name = {pod["metadata"]["name"]: pod for pod in pods}
    restarting = set()
    for name in instances:
        pod = by_name.get(name)
        if pod is None or pod["metadata"].get("deletionTimestamp") or not pod_ready(pod):
            restarting.add(name)
    return restarting


def stopping_instances(pods: Sequence[Mapping[str, Any]]) -> set[str]:
    """The instances whose pod is terminating (deleted, by a rolling update, a drain or by hand): under
    a `drain` planned restart their pids move to the others while they wait (decision 0056)."""
    return {pod["metadata"]["name"] for pod in pods if pod["metadata"].get("deletionTimestamp")}


def pod_ready(pod: Mapping[str, Any]) -> bool:
    conditions = (pod.get("status") or {}).get("conditions") or []
    return any(c.get("type") == "Ready" and c.get("status") == "True" for c in conditions)


def checkpoint_claim_ordinal(pipeline: str, claim_name: str) -> int | None:
    """The ordinal of a checkpoint volume `checkpoint-<pipeline>-<ordinal>`, None for any other claim."""
    prefix = f"{CHECKPOINT_VOLUME}-"
    if not claim_name.startswith(prefix):
        return None
    try:
        return ordinal_of(pipeline, claim_name[len(prefix) :])
    except ValueError:
        return None


def format_pids(pids: Iterable[int]) -> str:
    """Pids as ranges and single pids, ascending: (0, 1, 2, 5, 7, 8) -> '0-2,5,7-8'."""
    ordered = sorted(set(pids))
    parts: list[str] = []
    start = 0
    while start < len(ordered):
        end = start
        while end + 1 < len(ordered) and ordered[end + 1] == ordered[end] + 1:
            end += 1
        first, last = ordered[start], ordered[end]
        parts.append(str(first) if first == last else f"{first}-{last}")
        start = end + 1
    return ",".join(parts)


def _move_key(move: Mapping[str, Any]) -> tuple[int, str, str]:
    return (int(move["pid"]), str(move["from"]), str(move["to"]))


@dataclass(frozen=True, slots=True, kw_only=True)
class Observed:
    """What one reconcile saw after it acted: the inputs of `render_status`.

    plan: the plan for the state after the action (what the pipeline waits for now); decision: what
    this round did, None when it did nothing (status.lastDecision then keeps the previous one).
    """

    spec: PipelineSpec
    plan: Plan
    decision: str | None
    statefulset_replicas: int  # the plan's width, never below replicas or an owner's ordinal + 1
    assignment: Assignment | None
    in_flight: Sequence[Move]
    ready: Collection[str]
    stats: Mapping[str, InstanceStats]


def ready_reason(observed: Observed) -> tuple[bool, str]:
    """The Ready condition's status and reason (the STATUS column of `kubectl get jp`).

    Ready means every wanted instance exists, owns pids and reports ready, and no extra instance is left;
    the reason says what is going on either way (moves between ready instances keep Ready true).
    """
    spec, plan, assignment = observed.spec, observed.plan, observed.assignment
    if assignment is None or plan.kind is StepKind.START:
        return False, "Starting"
    owners = set(assignment.owners.values())
    wanted = spec.instances(spec.replicas)
    if observed.statefulset_replicas > spec.replicas:
        return False, "ScalingIn"
    if any(name not in owners for name in wanted):
        return False, "ScalingOut"
    if any(name not in observed.ready for name in wanted):
        return False, "InstancesNotReady"
    return True, "MovingPids" if observed.in_flight else "Running"


def ready_condition(
    ready: bool, reason: str, message: str, generation: int, previous: Mapping[str, Any], now: str
) -> dict[str, Any]:
    """The Ready condition; lastTransitionTime moves only when its status changes."""
    status = "True" if ready else "False"
    since = now
    for old in previous.get("conditions", []):
        if old.get("type") == "Ready" and old.get("status") == status:
            since = old.get("lastTransitionTime", now)
    return {
        "type": "Ready",
        "status": status,
        "observedGeneration": generation,
        "reason": reason,
        "message": message,
        "lastTransitionTime": since,
    }


def failure_status(generation: int, message: str, previous: Mapping[str, Any], now: str) -> dict[str, Any]:
    """The status fields a failed reconcile changes: everything else keeps what was last observed."""
    return {
        "lastDecision": message,
        "conditions": [ready_condition(False, "ReconcileFailed", message, generation, previous, now)],
    }


def render_status(observed: Observed, previous: Mapping[str, Any], now: str) -> dict[str, Any]:
    """The status subresource for what was observed; `previous` supplies the times that must not change
    while nothing changes (a move's startedAt, the Ready condition's lastTransitionTime)."""
    spec, assignment = observed.spec, observed.assignment
    status: dict[str, Any] = {
        "observedGeneration": spec.generation,
        "replicas": observed.statefulset_replicas,
        "selector": selector_string(spec.name),
    }
    holdings = assignment.by_instance() if assignment is not None else {}
    if assignment is not None:
        status["epoch"] = assignment.epoch
        status["assignment"] = [
            {"instance": name, "pids": format_pids(pids), "count": len(pids)}
            for name, pids in sorted(holdings.items(), key=lambda item: ordinal_of(spec.name, item[0]))
        ]
    status["readyReplicas"] = sum(1 for name in holdings if name in observed.ready)

    started = {_move_key(m): m.get("startedAt", now) for m in previous.get("moves", [])}
    moves = []
    for move in sorted(observed.in_flight, key=lambda m: m.pid):
        entry: dict[str, Any] = {"pid": move.pid, "from": move.source, "to": move.target}
        entry["mode"] = move.mode.value
        entry["startedAt"] = started.get(_move_key(entry), now)
        moves.append(entry)
    status["movesInFlight"] = len(moves)
    status["moves"] = moves

    instances = []
    for name in spec.instances(observed.statefulset_replicas):
        entry = {"name": name, "ready": name in observed.ready, "pids": len(holdings.get(name, ()))}
        stats = observed.stats.get(name)
        if stats is not None:
            entry["load"] = stats.busy_fraction
            entry["stateBytes"] = stats.state_bytes
            if stats.tuples_per_s is not None:
                entry["tuplesPerSecond"] = round(stats.tuples_per_s, 1)
            if stats.lag is not None:
                entry["lag"] = stats.lag
        instances.append(entry)
    status["instances"] = instances
    reported = [observed.stats[e["name"]] for e in instances if e["name"] in observed.stats]
    if reported:
        status["tuplesPerSecond"] = round(sum(s.tuples_per_s or 0.0 for s in reported), 1)
        status["lag"] = sum(s.lag or 0 for s in reported)

    status["lastDecision"] = observed.decision or previous.get("lastDecision") or observed.plan.reason
    ready, reason = ready_reason(observed)
    status["conditions"] = [
        ready_condition(ready, reason, observed.plan.reason, spec.generation, previous, now)
    ]
    return status
