"""What the operator is told: a JoinPipeline read into a `PipelineSpec`, and the `InstanceSettings` its own
Deployment gives for instance pods.

Apart from the rendering (`controller.k8s.manifests`) and the status (`controller.k8s.status`) because
both read it, as do the reconciler and the `PidMover`. Pure: the spec's fields, limits and defaults are
the schema of `controller.k8s.resource` (from which the CRD is generated); calls neither the API server
nor Kafka.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from controller.assignment import HandoffMode
from controller.k8s.resource import JoinPipelineSpec
from controller.policies.params import policy_params
from controller.scaling import instance_name
from pipeline.config import Config, InstanceConfig, PolicyConfig, TopicsConfig
from pipeline.health import DEFAULT_METRICS_PORT

GROUP, VERSION, PLURAL, KIND = "fluxjoin.io", "v1alpha1", "joinpipelines", "JoinPipeline"
API_VERSION = f"{GROUP}/{VERSION}"
FINALIZER = "fluxjoin.io/cleanup"
FIELD_MANAGER = "fluxjoin-operator"
WORK_DIR = "/var/lib/fluxjoin/work"


@dataclass(frozen=True, slots=True, kw_only=True)
class PipelineSpec:
    """One JoinPipeline as the operator and a `PidMover` need it, read through the CRD's schema
    (`controller.k8s.resource.JoinPipelineSpec`, whose defaults fill in what the object leaves out).

    The API server fills in the CRD's defaults, so the model's matter only for objects written before a
    field existed (and for parts the CRD gives no default, such as `liveness`).
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
    instance: InstanceConfig
    image: str | None
    resources: Mapping[str, Any]
    checkpoint_size: str
    storage_class: str | None
    policy: str
    policy_settings: Mapping[str, float]
    """The policy's parameters set in the spec, by their `controller.policies` field names."""
    heartbeat_timeout_s: float
    restart_grace_s: float
    topics: TopicsConfig
    kafka_security: Mapping[str, Any]
    """spec.kafka.security as set: how the instances log in to Kafka (`kafka_credentials`)."""
    drain_timeout_s: float
    """How long a stopping instance pod waits for its pids to be moved away (spec.liveness
    plannedRestart `drain`, decision 0056); 0: it stops at once and resumes on return (`resume`)."""

    @classmethod
    def from_object(cls, obj: Mapping[str, Any]) -> PipelineSpec:
        """The pipeline of a JoinPipeline object. ValueError names each field the schema refuses, a
        handoff mode this operator does not support, and settings the pipeline's configuration refuses."""
        meta = obj["metadata"]
        spec = JoinPipelineSpec.read(obj.get("spec", {}))
        liveness, kafka = spec.liveness, spec.kafka
        drain_timeout_s = liveness.drain_timeout_seconds if liveness.planned_restart == "drain" else 0
        return cls(
            name=meta["name"],
            namespace=meta["namespace"],
            uid=meta["uid"],
            generation=int(meta.get("generation", 0)),
            streams=tuple(spec.streams),
            window_ms=spec.window_ms,
            allowed_lateness_ms=spec.allowed_lateness_ms,
            partitions=spec.partitions,
            replicas=spec.replicas,
            handoff_mode=spec.handoff_mode,
            bootstrap_servers=kafka.bootstrap_servers,
            kafka_security=kafka.security.model_dump(by_alias=True, exclude_unset=True),
            topics=TopicsConfig(**kafka.topics.model_dump()),
            # Topics and transactional ids derive from the prefix: namespaced, so that pipelines of one
            # name in two namespaces never share a topic or fence each other's transactions.
            topic_prefix=kafka.topic_prefix or f"{meta['namespace']}.{meta['name']}",
            instance=InstanceConfig(
                **spec.instance.model_dump(), work_dir=WORK_DIR, drain_timeout_s=drain_timeout_s
            ),
            image=spec.image,
            resources=spec.resources.model_dump(by_alias=True, exclude_unset=True),
            checkpoint_size=str(spec.checkpoint.size),
            storage_class=spec.checkpoint.storage_class_name or None,
            policy=spec.policy.name,
            policy_settings={k: float(v) for k, v in spec.policy.settings().items()},
            heartbeat_timeout_s=float(liveness.heartbeat_timeout_seconds),
            restart_grace_s=float(liveness.restart_grace_seconds),
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
            policy=PolicyConfig(
                name=self.policy, handoff_mode=self.handoff_mode.value, params=dict(self.policy_settings)
            ),
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
    signing_issuer: str | None = None
    """Where instance pods ask for their signing certificates (the operator's Service); None: no signing."""
    controller_public_key: str | None = None
    """The controller's public key (PEM) instance pods trust; set together with `signing_issuer`."""
    executor_service_account: str | None = None
    """The ServiceAccount of instance pods whose pipeline runs executor pods (`spec.instance.executors`):
    its Role lets Spark's driver create, watch and delete pods. None: such pipelines fail to reconcile."""
