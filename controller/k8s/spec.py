"""What the operator is told: a JoinPipeline read into a `PipelineSpec`, and the `InstanceSettings` its own
Deployment gives for instance pods.

Apart from the rendering (`controller.k8s.manifests`) and the status (`controller.k8s.status`) because
both read it, as do the reconciler and the `PidMover`. Pure: it knows the CRD's field names and defaults,
and calls neither the API server nor Kafka.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from controller.assignment import HandoffMode
from controller.policies.params import policy_params
from controller.scaling import instance_name
from pipeline.config import Config, InstanceConfig, TopicsConfig
from pipeline.health import DEFAULT_METRICS_PORT

GROUP, VERSION, PLURAL, KIND = "fluxjoin.io", "v1alpha1", "joinpipelines", "JoinPipeline"
API_VERSION = f"{GROUP}/{VERSION}"
FINALIZER = "fluxjoin.io/cleanup"
FIELD_MANAGER = "fluxjoin-operator"
WORK_DIR = "/var/lib/fluxjoin/work"
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
