"""The Kafka ACLs a pipeline's clients need on a cluster whose authorizer is on.

Every fluxjoin process of a pipeline (generator, instances, controller, operator, `fluxjoin verify`)
logs in as one principal; it needs, and is given, nothing beyond the pipeline's own names:
- every operation on the topics named `<pipeline>.` and on (created by the first process that
  needs them, `pipeline.topics.ensure_topics`);
- every operation on the transactional ids `<pipeline>.` (the instances' sinks, and the controller
  fencing a dead instance) and `<pipeline>/` (the controller's own, the generator's);
- reading as the consumer group `fluxjoin-unused`, which every reader names and none joins (offsets
  are never committed to Kafka; Spark's checkpoints own them).

Other pipelines' topics, other groups and the cluster itself stay closed to it. Within the pipeline,
Kafka cannot tell an instance's writes from the controller's: that needs a principal per role and
topics per writer (docs/security.md says what is and is not enforced).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from pipeline.config import Config
from pipeline.kafka_client import CONSUMER_GROUP, kafka_config

if TYPE_CHECKING:
    from confluent_kafka.admin import AclBinding


def pipeline_acls(cfg: Config, principal: str) -> list[AclBinding]:
    """The ACLs (allow, from any host) that let `principal` (e.g. `User:fluxjoin`) run `cfg`'s pipeline."""
    from confluent_kafka.admin import (
        AclBinding,
        AclOperation,
        AclPermissionType,
        ResourcePatternType,
        ResourceType,
    )

    def allow(kind: ResourceType, name: str, pattern: ResourcePatternType, op: AclOperation) -> AclBinding:
        return AclBinding(kind, name, pattern, principal, "*", op, AclPermissionType.ALLOW)

    prefixed, literal = ResourcePatternType.PREFIXED, ResourcePatternType.LITERAL
    return [
        allow(ResourceType.TOPIC, f"{cfg.pipeline}.", prefixed, AclOperation.ALL),
        allow(ResourceType.TRANSACTIONAL_ID, f"{cfg.pipeline}.", prefixed, AclOperation.ALL),
        allow(ResourceType.TRANSACTIONAL_ID, f"{cfg.pipeline}/", prefixed, AclOperation.ALL),
        allow(ResourceType.GROUP, CONSUMER_GROUP, literal, AclOperation.READ),
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
