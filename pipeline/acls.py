"""The Kafka ACLs a pipeline's clients need on a cluster whose authorizer is on.

The fluxjoin processes of a pipeline log in as one principal (role `pipeline`) or as one per role:
- the controller (and the operator, `fluxjoin verify`, an administrator): every operation on the
  topics named `<pipeline>.` (it creates them, `pipeline.topics.ensure_topics`) and on the
  transactional ids `<pipeline>.` (the instances' sinks, which it fences when one dies) and
  `<pipeline>/` (its own, the generator's);
- an instance: reading every topic of the pipeline, writing only the results, dead letters, sink
  commits, metrics, control acknowledgements and handoff snapshots, and the sinks' transactional ids;
  never creating, deleting or truncating a topic, writing input, or taking the controller's or the
  generator's transactional id;
- the generator: writing (and reading back) the inputs, under its own transactional id;
- each reads as the consumer group `fluxjoin-unused`, which every reader names and none joins
  (offsets are never committed to Kafka; Spark's checkpoints own them).

Other pipelines' topics, other groups and the cluster itself stay closed to all of them. Kafka checks
who may write to a topic, not what a record says: an instance writes to the control and metrics topics,
so what it may say there is checked by signatures (`pipeline.signing`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from pipeline.config import Config
from pipeline.kafka_client import CONSUMER_GROUP, kafka_config

if TYPE_CHECKING:
    from confluent_kafka.admin import AclBinding


ROLES = ("pipeline", "controller", "instance", "generator")
"""`pipeline`: one principal for every process. The others split it: each role's principal may do only
what that role does (decision 0064)."""


def pipeline_acls(cfg: Config, principal: str, role: str = "pipeline") -> list[AclBinding]:
    """The ACLs (allow, from any host) that let `principal` (e.g. `User:fluxjoin`) play `role` in
    `cfg`'s pipeline (`ROLES`)."""
    from confluent_kafka.admin import (
        AclBinding,
        AclOperation,
        AclPermissionType,
        ResourcePatternType,
        ResourceType,
    )

    if role not in ROLES:
        raise ValueError(f"role {role!r}: use one of {', '.join(ROLES)}")

    def allow(kind: ResourceType, name: str, pattern: ResourcePatternType, op: AclOperation) -> AclBinding:
        return AclBinding(kind, name, pattern, principal, "*", op, AclPermissionType.ALLOW)

    prefixed, literal = ResourcePatternType.PREFIXED, ResourcePatternType.LITERAL
    topic, txn, op = ResourceType.TOPIC, ResourceType.TRANSACTIONAL_ID, AclOperation
    group = allow(ResourceType.GROUP, CONSUMER_GROUP, literal, op.READ)
    if role in ("pipeline", "controller"):  # the controller creates the topics and fences instances
        return [
            allow(topic, f"{cfg.pipeline}.", prefixed, op.ALL),
            allow(txn, f"{cfg.pipeline}.", prefixed, op.ALL),
            allow(txn, f"{cfg.pipeline}/", prefixed, op.ALL),
            group,
        ]
    looks = [allow(topic, f"{cfg.pipeline}.", prefixed, o) for o in (op.DESCRIBE, op.DESCRIBE_CONFIGS)]
    if role == "generator":
        return [
            *looks,
            *(allow(topic, t, literal, o) for t in cfg.input_topics for o in (op.READ, op.WRITE)),
            *(allow(txn, f"{cfg.pipeline}/generator", literal, o) for o in (op.DESCRIBE, op.WRITE)),
            group,
        ]
    writes = (
        cfg.results_topic,
        cfg.dead_letter_topic,
        cfg.sink_commits_topic,
        cfg.metrics_topic,
        cfg.control_topic,
        cfg.handoff_topic,
    )
    return [
        *looks,
        allow(topic, f"{cfg.pipeline}.", prefixed, op.READ),
        *(allow(topic, t, literal, op.WRITE) for t in writes),
        *(allow(txn, f"{cfg.pipeline}.", prefixed, o) for o in (op.DESCRIBE, op.WRITE)),
        group,
    ]


def describe_acl(binding: AclBinding) -> str:
    """One line, as `kafka-acls --list` would say it."""

    def name(value: object) -> str:  # an enum member (the library's stubs also allow its str or int)
        return str(getattr(value, "name", value))

    return (
        f"{name(binding.permission_type)} {binding.principal} {name(binding.operation)} on "
        f"{name(binding.restype)} {name(binding.resource_pattern_type).lower()} {binding.name!r}"
    )


def create_acls(bootstrap: str, bindings: list[AclBinding], timeout_s: float = 30.0) -> None:
    """Create `bindings` with this process's credentials (an administrator's); creating one that
    exists already is no error."""
    from confluent_kafka.admin import AdminClient

    admin = AdminClient(kafka_config(bootstrap))
    for future in admin.create_acls(bindings, request_timeout=timeout_s).values():
        future.result()
