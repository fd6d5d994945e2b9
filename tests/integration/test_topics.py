"""The pipeline's topics on a real broker: made with the configured settings, or, with
topics.create=false, only checked; a topic whose settings fluxjoin's correctness rests on is refused
in one line naming the command that fixes it."""

from __future__ import annotations

import pytest
from confluent_kafka.admin import AdminClient, AlterConfigOpType, ConfigEntry, ConfigResource

from pipeline.config import Config, load_config
from pipeline.topics import TopicError, ensure_topics


def _config(prefix: str, *extra: str) -> Config:
    return load_config(None, [f"pipeline={prefix}", "streams=[A, B]", "partitions=4", *extra])


def _topic_config(bootstrap: str, topic: str) -> dict[str, str]:
    resource = ConfigResource(ConfigResource.Type.TOPIC, topic)
    admin = AdminClient({"bootstrap.servers": bootstrap})  # held until the answer: a dropped client fails it
    entries = admin.describe_configs([resource])[resource].result()
    return {name: entry.value for name, entry in entries.items()}


def test_topics_are_made_with_the_configured_settings(kafka_bootstrap: str, topic_prefix: str) -> None:
    cfg = _config(topic_prefix, "topics.retention_ms=3600000", "topics.min_insync_replicas=1")
    ensure_topics(cfg, kafka_bootstrap)
    for topic in (cfg.input_topic("A"), cfg.results_topic, cfg.dead_letter_topic):
        assert _topic_config(kafka_bootstrap, topic)["retention.ms"] == "3600000", topic
    control = _topic_config(kafka_bootstrap, cfg.control_topic)
    assert (control["retention.ms"], control["min.insync.replicas"]) == ("-1", "1")


def test_without_creation_missing_topics_are_an_error_naming_the_fix(
    kafka_bootstrap: str, topic_prefix: str
) -> None:
    with pytest.raises(TopicError, match=r"missing \(8 of the pipeline's 8 are\) and topics.create is false"):
        ensure_topics(_config(topic_prefix, "topics.create=false"), kafka_bootstrap)
    ensure_topics(_config(topic_prefix), kafka_bootstrap)
    ensure_topics(_config(topic_prefix, "topics.create=false"), kafka_bootstrap)  # all there: checked only


def test_a_control_topic_that_would_expire_is_refused_with_the_command_that_fixes_it(
    kafka_bootstrap: str, topic_prefix: str
) -> None:
    """A control topic made by hand (or before decision 0049) with the broker's default retention would
    lose the pipeline's assignment after a week: refused at the next start, not met a week later."""
    cfg = _config(topic_prefix)
    ensure_topics(cfg, kafka_bootstrap)
    admin = AdminClient({"bootstrap.servers": kafka_bootstrap})
    resource = ConfigResource(
        ConfigResource.Type.TOPIC,
        cfg.control_topic,
        incremental_configs=[
            ConfigEntry("retention.ms", "604800000", incremental_operation=AlterConfigOpType.SET)
        ],
    )
    admin.incremental_alter_configs([resource])[resource].result()
    with pytest.raises(TopicError) as refused:
        ensure_topics(cfg, kafka_bootstrap)
    assert str(refused.value) == (
        f"topic {cfg.control_topic} has retention.ms=604800000 but the pipeline needs -1: kafka-configs.sh "
        f"--alter --entity-type topics --entity-name {cfg.control_topic} --add-config retention.ms=-1"
    )
