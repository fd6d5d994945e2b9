"""The `JoinPipeline` custom resource's spec as one schema: its fields, their types, limits and defaults.

The operator validates every spec it reads through `JoinPipelineSpec` (`controller.k8s.spec`), and the
CRD's openAPIV3Schema for `spec` is generated from it (`python -m controller.k8s.crd`), so the two cannot
drift apart. Each default is written once, where it is defined:

- the pipeline's own settings (window, lateness, partitions, replicas, `instance.*`, `kafka.topics.*`):
  the fields of `pipeline.config`, whose defaults and limits every `fluxjoin` command shares
  (`_like` copies a field's default and constraints);
- a policy's parameters: its parameters' dataclass (`FluxParams()`, `MemoryParams()`);
- the rest (liveness, the checkpoint volume, Kafka's Secret keys): the constants below.

Field names are the snake_case of the CRD's camelCase (`windowMs` is `window_ms`); a model reads either.
What the CRD adds beyond validating one object (CEL rules, list types) is in `json_schema_extra`. Pure:
imports neither Kubernetes nor Kafka.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    WithJsonSchema,
    field_validator,
)
from pydantic.alias_generators import to_camel
from pydantic.fields import FieldInfo

from controller.assignment import HandoffMode
from controller.observation.liveness import DEFAULT_HEARTBEAT_TIMEOUT_S
from controller.policies import POLICIES, FluxMemoryParams, FluxParams, MemoryParams
from pipeline.config import Config, ExecutorsConfig, InstanceConfig, TopicsConfig

DEFAULT_POLICY = "flux"
"""The policy of a pipeline that names none."""
RESTART_GRACE_S = 300
"""How long an instance whose pod Kubernetes is replacing or starting may be silent before it is dead."""
DRAIN_TIMEOUT_S = 120
"""How long a terminating instance waits for its pids to move under `plannedRestart: drain`."""
CHECKPOINT_SIZE = "5Gi"
"""The checkpoint volume of each instance."""
KafkaProtocol = Literal["PLAINTEXT", "SSL", "SASL_PLAINTEXT", "SASL_SSL"]
KAFKA_PROTOCOL: KafkaProtocol = "PLAINTEXT"
"""How instances talk to Kafka when spec.kafka.security says nothing."""
PASSWORD_KEY, CA_KEY, CERT_KEY, KEY_KEY = "password", "ca.crt", "user.crt", "user.key"
"""The keys of the Secrets spec.kafka.security names, by default: what Strimzi writes."""

STREAM_NAME = r"^[A-Za-z_][A-Za-z0-9_]*$"
QUANTITY = (
    r"^(\+|-)?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))(([KMGTPE]i)|[numkMGTPE]|([eE](\+|-)?(([0-9]+(\.[0-9]*)?)|"
    r"(\.[0-9]+))))?$"
)
"""A Kubernetes resource quantity (5Gi, 500m, 2), as the API server's own types check it."""


def _like(model: type[BaseModel], name: str, description: str, **extra: Any) -> Any:
    """A field with the default and the constraints of `model`'s field `name`, and a description.

    `extra` adds to the CRD's schema only (`format`, `minLength`, `x-kubernetes-*`); a default made by a
    factory is written into the schema as the factory makes it."""
    source = model.model_fields[name]
    if source.default_factory is not None:
        extra = {"default": source.get_default(call_default_factory=True), **extra}
    return FieldInfo.merge_field_infos(
        source, Field(description=description, json_schema_extra=extra or None)
    )


def _pattern_of(model: type[BaseModel], name: str) -> str:
    """The regular expression `model`'s field `name` must match."""
    (pattern,) = [m.pattern for m in model.model_fields[name].metadata if getattr(m, "pattern", None)]
    return str(pattern)


def _stream_name(name: str) -> str:
    if not re.fullmatch(STREAM_NAME, name):
        raise ValueError(f"stream name {name!r} must be an identifier (letters, digits, _)")
    return name


def _quantity(value: int | str) -> int | str:
    if isinstance(value, str) and not re.fullmatch(QUANTITY, value):
        raise ValueError(f"{value!r} is not a Kubernetes quantity (e.g. 5Gi, 500m, 2)")
    return value


StreamName = Annotated[
    str,
    Field(min_length=1, max_length=63, json_schema_extra={"pattern": STREAM_NAME}),
    AfterValidator(_stream_name),
]
"""A stream's name: the CRD's pattern, checked here with the message `pipeline.config` gives."""
Quantity = Annotated[
    int | str,
    AfterValidator(_quantity),
    WithJsonSchema(
        {
            "anyOf": [{"type": "integer"}, {"type": "string"}],
            "pattern": QUANTITY,
            "x-kubernetes-int-or-string": True,
        }
    ),
]
"""An integer or a quantity string; the CRD's `x-kubernetes-int-or-string`."""


def _immutable(field: str, why: str) -> dict[str, Any]:
    return {
        "x-kubernetes-validations": [{"rule": "self == oldSelf", "message": f"{field} is immutable ({why})"}]
    }


class _Spec(BaseModel):
    """A part of the spec: camelCase in the resource, snake_case in Python. A field the model lacks is
    ignored, as the CRD has the API server prune it (no part of spec preserves unknown fields): one that
    reaches the operator comes from a newer CRD, applied before the operator is upgraded, whose defaults
    the API server fills into every stored pipeline, and must not fail their reconciles meanwhile."""

    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True, extra="ignore", frozen=True)


# --- policies ---

_FLUX, _MEMORY, _FLUX_MEMORY = FluxParams(), MemoryParams(), FluxMemoryParams()


class FluxSettings(_Spec):
    """`FluxParams` as spec.policy.flux sets them (the handoff mode is the pipeline's)."""

    th_imb: float = Field(
        _FLUX.th_imb,
        ge=1,
        description="Imbalance ratio (busiest over idlest utilization) that triggers a move.",
    )
    th_util: float = Field(
        _FLUX.th_util, gt=0, le=1, description="Utilization above which an instance counts as overloaded."
    )
    delta_s: float = Field(
        _FLUX.delta_s, gt=0, description="First statistics collection interval in seconds."
    )
    delta_min_s: float = Field(
        _FLUX.delta_min_s,
        gt=0,
        description="Smallest collection interval in seconds (below ~0.2 s Flux thrashes).",
    )
    max_moves_per_pair: int = Field(
        _FLUX.max_moves_per_pair,
        ge=1,
        description="Pids one busiest/idlest pair may move per round (1 is the paper's rule).",
    )
    min_move_share: float = Field(
        _FLUX.min_move_share,
        ge=0,
        le=1,
        description="A pid moves only if it processed at least this share of the tuples of the donor's "
        "largest pid (0 is the paper's rule).",
    )
    donor_cost: bool = Field(
        _FLUX.donor_cost,
        description="Charge a moved pid at the donor's cost per tuple (instances alike, tuples not).",
    )
    phase_interval: bool = Field(
        _FLUX.phase_interval,
        description="The interval after a move phase lasts as long as the phase (the paper's rule); "
        "false is deltaMinS.",
    )


class MemorySettings(_Spec):
    """`MemoryParams` as spec.policy.memory sets them."""

    theta_d: float = Field(
        _MEMORY.theta_d,
        gt=0,
        le=1,
        description="Smallest/largest state ratio below which state is rebalanced.",
    )
    min_span_s: float = Field(
        _MEMORY.min_span_s, ge=0, description="Seconds between two adaptations at least."
    )
    spill_room: float = Field(
        _MEMORY.spill_room,
        ge=0,
        le=1,
        description="Above 0, instances spill only when none has room, that is holds less than this "
        "share of its state budget (set it to instance.spillThreshold); 0 leaves spilling to each.",
    )


def settings_section(policy: str) -> str:
    """The field of spec.policy that holds the named policy's settings: the hybrid's are flux's."""
    return {"hybrid": "flux"}.get(policy, policy).replace("-", "_")


class FluxMemorySettings(_Spec):
    """`FluxMemoryParams` as spec.policy.fluxMemory sets them (the handoff mode is the pipeline's)."""

    th_imb: float = Field(
        _FLUX_MEMORY.th_imb,
        ge=1,
        description="Ratio of the fuller instance's fill (state over budget) to the emptier's that triggers "
        "a move.",
    )
    max_moves_per_pair: int = Field(
        _FLUX_MEMORY.max_moves_per_pair, ge=1, description="Pids one pair may move per round."
    )


class PolicySpec(_Spec):
    name: str = Field(
        DEFAULT_POLICY,
        description="static (never move), flux (utilization rounds), memory (state balancing), "
        "flux-memory (spare-memory rounds) or hybrid (flux-memory while an instance is over its state "
        "budget, else flux within the receivers' budgets; its settings are flux's).",
        json_schema_extra={"enum": list(POLICIES)},
    )
    flux: FluxSettings = Field(
        default_factory=FluxSettings,
        description="Thresholds of the Flux utilization rounds.",
        json_schema_extra={
            "default": {},
            "x-kubernetes-validations": [
                {
                    "rule": "!has(self.deltaMinS) || !has(self.deltaS) || self.deltaMinS <= self.deltaS",
                    "message": "policy.flux.deltaMinS must be <= policy.flux.deltaS",
                }
            ],
        },
    )
    memory: MemorySettings = Field(
        default_factory=MemorySettings,
        description="Parameters of the memory-balancing distributed adaptation.",
        json_schema_extra={"default": {}},
    )
    flux_memory: FluxMemorySettings = Field(
        default_factory=FluxMemorySettings,
        description="Thresholds of the Flux memory-constrained rounds.",
        json_schema_extra={"default": {}},
    )

    @field_validator("name")
    @classmethod
    def _known(cls, name: str) -> str:
        if name not in POLICIES:
            raise ValueError(f"policy {name!r} is not one of {list(POLICIES)}")
        return name

    def settings(self) -> dict[str, Any]:
        """The named policy's parameters the spec sets, by their `controller.policies` names (the hybrid
        takes flux's)."""
        chosen = getattr(self, settings_section(self.name), None)
        return chosen.model_dump(exclude_unset=True) if isinstance(chosen, _Spec) else {}


# --- liveness, Kafka, instances, volumes ---


class LivenessSpec(_Spec):
    heartbeat_timeout_seconds: int = Field(
        int(DEFAULT_HEARTBEAT_TIMEOUT_S),
        ge=2,
        le=600,
        description="An instance whose pod is Ready and that has not heartbeated for this long is dead.",
    )
    restart_grace_seconds: int = Field(
        RESTART_GRACE_S,
        ge=0,
        le=3600,
        description="An instance whose pod Kubernetes is replacing or starting (a rolling update, a deleted "
        "or not-yet-Ready pod) may be silent this long before it is dead, so that it resumes from its "
        "checkpoint instead of having its pids recovered elsewhere. 0: no grace.",
    )
    planned_restart: Literal["resume", "drain"] = Field(
        "resume",
        description="What a terminating instance pod (a rolling update, a pod deleted with a grace period) "
        "does with its pids: resume (stop at once, resume them from its checkpoint when back) or drain "
        "(stay up while the operator moves them to the other instances, then stop; it takes pids again "
        "once back and Ready).",
    )
    drain_timeout_seconds: int = Field(
        DRAIN_TIMEOUT_S,
        ge=1,
        le=3600,
        description="Under plannedRestart drain, how long a terminating instance waits for its pids to move "
        "before it stops anyway (and resumes what it still holds when back).",
    )


class TopicsSpec(_Spec):
    create: bool = _like(
        TopicsConfig, "create", "false - the topics must exist already; fluxjoin only checks them."
    )
    replication_factor: int = _like(
        TopicsConfig, "replication_factor", "Of every topic fluxjoin creates; -1 - the broker's default."
    )
    min_insync_replicas: int | None = _like(
        TopicsConfig, "min_insync_replicas", "Of every topic fluxjoin creates; unset - the broker's default."
    )
    retention_ms: int | None = _like(
        TopicsConfig,
        "retention_ms",
        "Of the input, results and dead-letter topics; unset - the broker's default.",
    )


class PasswordSecret(_Spec):
    name: str | None = None
    key: str = PASSWORD_KEY


class CaSecret(_Spec):
    name: str | None = None
    key: str = CA_KEY


class ClientCertSecret(_Spec):
    name: str | None = None
    cert_key: str = CERT_KEY
    key_key: str = KEY_KEY


class KafkaSecurity(_Spec):
    """How a pod logs in to Kafka (`controller.k8s.manifests.kafka_credentials` renders it)."""

    protocol: KafkaProtocol = KAFKA_PROTOCOL
    sasl_mechanism: Literal["", "PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512"] | None = None
    username: str | None = None
    password_secret: PasswordSecret | None = Field(
        None, description="The Secret key holding the SASL password."
    )
    ca_secret: CaSecret | None = Field(
        None, description="The Secret key holding the CA (PEM) that signed the brokers' certificates."
    )
    client_cert_secret: ClientCertSecret | None = Field(
        None, description="The Secret holding a client certificate and its key (PEM), for mutual TLS."
    )


class KafkaSpec(_Spec):
    bootstrap_servers: str = Field(
        description="Kafka bootstrap servers, host:port[,host:port...].",
        min_length=1,
        max_length=1024,
        pattern=r"^[^,\s]+:[0-9]+(,[^,\s]+:[0-9]+)*$",
    )
    topic_prefix: str | None = Field(
        None,
        description="Prefix of the pipeline's topics (<prefix>.in.<stream>, <prefix>.results, "
        "<prefix>.control, <prefix>.metrics, ...) and of its Kafka transactional ids; defaults to "
        "<namespace>.<name>, so two namespaces may run pipelines of the same name on one Kafka cluster. "
        "Immutable.",
        pattern=_pattern_of(Config, "pipeline"),
    )
    topics: TopicsSpec = Field(
        default_factory=TopicsSpec,
        description="How the pipeline's topics are made (`fluxjoin topics` lists them). The control, commits "
        "and metrics topics' own settings are fluxjoin's and checked on topics it finds.",
    )
    security: KafkaSecurity = Field(
        default_factory=KafkaSecurity,
        description="How the instances log in to Kafka: FLUXJOIN_KAFKA_* variables and the named Secrets' "
        "keys mounted as files at /etc/fluxjoin/kafka (docs/security.md). The operator itself logs in with "
        "its own pod's settings.",
    )


class ExecutorsSpec(_Spec):
    """spec.instance.executors: Spark executors as pods (`pipeline.executors`)."""

    count: int = _like(ExecutorsConfig, "count", "Executor pods each instance keeps running.")
    cores: int = _like(ExecutorsConfig, "cores", "Task slots (spark.executor.cores) of each executor.")
    memory: str = _like(ExecutorsConfig, "memory", "Heap of each executor, e.g. 1g or 512m.")
    cpu_request: str | None = _like(
        ExecutorsConfig, "cpu_request", "CPU each executor pod requests, e.g. 500m; unset - cores whole CPUs."
    )


class InstanceSpec(_Spec):
    trigger_ms: int = _like(
        InstanceConfig,
        "trigger_ms",
        "Micro-batch trigger interval in milliseconds (0 = as fast as possible).",
    )
    max_rows_per_batch: int = _like(
        InstanceConfig,
        "max_rows_per_batch",
        "At most how many input tuples a micro-batch reads.",
        format="int64",
    )
    max_results_per_batch: int = _like(
        InstanceConfig,
        "max_results_per_batch",
        "About how many results a micro-batch may make, which bounds its memory; each pid's input is "
        "judged by its recent batches' results.",
        format="int64",
    )
    shuffle_partitions: int = _like(
        InstanceConfig,
        "shuffle_partitions",
        "Partitions of the stateful stage and read tasks of the source: one per core of sparkMaster.",
    )
    spark_master: str = _like(
        InstanceConfig,
        "spark_master",
        "Without executors: Spark's local mode in the instance pod, local[cores].",
    )
    driver_memory: str = _like(
        InstanceConfig,
        "driver_memory",
        "Spark driver heap, e.g. 1g or 1536m.",
    )
    state_budget_bytes: int = _like(
        InstanceConfig,
        "state_budget_bytes",
        "Bytes of window state an instance may hold (0: a quarter of driverMemory); the memory "
        "policies move state away from an instance over it. `fluxjoin budget` changes it while it runs.",
        format="int64",
    )
    executors: ExecutorsSpec | None = Field(
        None,
        description="Run each instance's Spark tasks on executor pods that Spark creates from the instance "
        "image, the instance pod being the driver; needs the instances' ServiceAccount "
        "(docs/kubernetes.md, 'Executor pods'). Unset: local mode (sparkMaster).",
    )
    spill_threshold: float = _like(
        InstanceConfig,
        "spill_threshold",
        "Spill window state out of memory when it passes this share of the state budget, and clean up "
        "later, exactly (docs/memory.md); 0 never spills.",
    )
    spill_fraction: float = _like(
        InstanceConfig, "spill_fraction", "About what share of the window state one spill takes out."
    )
    spill_choice: Literal["least-productive", "most-productive"] = _like(
        InstanceConfig, "spill_choice", "Which pids spill first: fewest results per byte, or the most."
    )
    spill_cleanup: Literal["active", "lazy"] = _like(
        InstanceConfig,
        "spill_cleanup",
        "When a spilled pid is cleaned up: active, once its old generation has left the window; lazy, "
        "once its input pauses. Always before it moves.",
    )


class ResourcesSpec(_Spec):
    requests: dict[str, Quantity] | None = None
    limits: dict[str, Quantity] | None = None


class CheckpointSpec(_Spec):
    size: Quantity = Field(CHECKPOINT_SIZE, description="Volume size per instance, e.g. 5Gi.")
    storage_class_name: str | None = Field(
        None, description="StorageClass of the volumes; empty or absent uses the cluster's default."
    )


# --- the spec ---


class JoinPipelineSpec(_Spec):
    """spec of a JoinPipeline."""

    model_config = ConfigDict(
        json_schema_extra={
            "x-kubernetes-validations": [
                {
                    "rule": "!has(self.partitions) || !has(self.replicas) "
                    "|| self.partitions >= self.replicas",
                    "message": "partitions must be >= replicas (every instance owns at least one pid)",
                    "fieldPath": ".replicas",
                    "reason": "FieldValueInvalid",
                }
            ]
        }
    )

    streams: list[StreamName] = _like(
        Config,
        "streams",
        "Names of the joined streams; each reads topic <topicPrefix>.in.<stream>. Immutable.",
        **{"x-kubernetes-list-type": "set"},
        **_immutable("streams", "create a new JoinPipeline to join other streams"),
    )
    window_ms: int = _like(
        Config,
        "window_ms",
        "Window length W in milliseconds; tuples join when their event times lie within W.",
        format="int64",
    )
    allowed_lateness_ms: int = _like(
        Config,
        "allowed_lateness_ms",
        "How late (event time behind the newest seen) a tuple may arrive and still join.",
        format="int64",
    )
    partitions: int = _like(
        Config,
        "partitions",
        "Mini-partitions (pids) P; every input topic has exactly P partitions. Immutable.",
        **_immutable("partitions", "the input topics and the pid function depend on it"),
    )
    replicas: int = _like(
        Config,
        "instances",
        "Join instances. Raising it adds instances and moves pids onto them; lowering it drains the "
        "highest ordinals first and only then shrinks the StatefulSet.",
    )
    policy: PolicySpec = Field(
        default_factory=PolicySpec,
        description="The rule that decides which pids move.",
        json_schema_extra={"default": {}},
    )
    liveness: LivenessSpec = Field(
        default_factory=LivenessSpec,
        description="When the operator counts an instance as dead and recovers its pids elsewhere.",
    )
    handoff_mode: HandoffMode = Field(
        HandoffMode.TRANSFER,
        description="How a moved pid's window reaches its new owner: transfer (ship the state at an offset "
        "barrier), parallel_track (both run until the old tuples expire) or replay (rebuild from the log).",
    )
    kafka: KafkaSpec = Field(
        json_schema_extra={
            "x-kubernetes-validations": [
                {
                    "rule": "has(self.topicPrefix) == has(oldSelf.topicPrefix) && (!has(self.topicPrefix) "
                    "|| self.topicPrefix == oldSelf.topicPrefix)",
                    "message": "kafka.topicPrefix is immutable",
                }
            ]
        }
    )
    instance: InstanceSpec = Field(
        default_factory=InstanceSpec,
        description="Settings of each join instance's Spark query.",
        json_schema_extra={"default": {}},
    )
    image: str | None = Field(
        None, min_length=1, description="Image of the join instances; defaults to the operator's own image."
    )
    resources: ResourcesSpec = Field(
        default_factory=ResourcesSpec,
        description="CPU and memory requests and limits of each join instance container.",
    )
    checkpoint: CheckpointSpec = Field(
        default_factory=CheckpointSpec,
        description="The PersistentVolumeClaim each instance keeps its Spark checkpoint on.",
        json_schema_extra={"default": {}},
    )

    @field_validator("handoff_mode", mode="before")
    @classmethod
    def _supported(cls, mode: Any) -> Any:
        supported = [m.value for m in HandoffMode]
        if isinstance(mode, HandoffMode) or mode in supported:
            return mode
        raise ValueError(
            f"spec.handoffMode {mode!r} is not supported by this operator: use one of {supported}"
        )

    @classmethod
    def read(cls, spec: Any) -> JoinPipelineSpec:
        """The spec of a JoinPipeline object; ValueError naming each field in error (`spec.windowMs: ...`)."""
        try:
            return cls.model_validate(spec)
        except ValidationError as exc:
            raise ValueError("; ".join(_problem(err) for err in exc.errors())) from None


def _problem(err: Any) -> str:
    """One validation error as `spec.<field>: <what is wrong>` (a check's own message as it says it)."""
    where = ".".join(["spec", *(str(p) for p in err["loc"])])
    if err["type"] == "value_error":
        message = str(err["ctx"]["error"])
        return message if message.startswith(where) else f"{where}: {message}"
    return f"{where}: {err['msg']}"
