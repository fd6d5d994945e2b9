"""`topics.partition_offsets` never hands out an offset the broker did not know (decision 0052).

A broker that has just restarted answered a ListOffsets request with OFFSET_INVALID (-1001) for every
partition; an instance took it for the end of its input, committed a batch ending there, and failed on
the next one. The admin client here is a stand-in that answers as that broker did: the logic under test
is the retry, not Kafka.
"""

from __future__ import annotations

from collections.abc import Mapping
from concurrent.futures import Future
from typing import Any, cast

import pytest
from confluent_kafka import KafkaError, KafkaException, TopicPartition
from confluent_kafka.admin import AdminClient

from pipeline.topics import partition_offsets


class _Answer:
    def __init__(self, offset: int) -> None:
        self.offset = offset


class RestartingBroker:
    """Answers OFFSET_INVALID to the first `unknown_for` requests, then the real offsets."""

    def __init__(self, offsets: Mapping[tuple[str, int], int], unknown_for: int) -> None:
        self.offsets, self.unknown_for, self.requests = offsets, unknown_for, 0

    def list_offsets(
        self, request: Mapping[TopicPartition, Any], **_: Any
    ) -> dict[TopicPartition, Future[Any]]:
        self.requests += 1
        answers: dict[TopicPartition, Future[Any]] = {}
        for tp in request:
            future: Future[Any] = Future()
            known = self.requests > self.unknown_for
            future.set_result(_Answer(self.offsets[(tp.topic, tp.partition)] if known else -1001))
            answers[tp] = future
        return answers


def _admin(broker: RestartingBroker) -> AdminClient:
    return cast(AdminClient, broker)


def test_offsets_the_broker_does_not_know_yet_are_asked_again() -> None:
    broker = RestartingBroker({("in.A", 0): 500, ("in.A", 1): 0}, unknown_for=3)
    assert partition_offsets(_admin(broker), [("in.A", 0), ("in.A", 1)], timeout_s=10) == {
        ("in.A", 0): 500,
        ("in.A", 1): 0,
    }
    assert broker.requests == 4


def test_offsets_still_unknown_at_the_deadline_are_an_error_not_an_answer() -> None:
    broker = RestartingBroker({("in.A", 0): 500}, unknown_for=10**6)
    with pytest.raises(KafkaException, match="did not know the offsets") as raised:
        partition_offsets(_admin(broker), [("in.A", 0)], timeout_s=0.5)
    assert raised.value.args[0].code() == KafkaError._TIMED_OUT, "an outage, to every caller"


def test_no_offset_at_or_after_a_time_is_an_answer() -> None:
    broker = RestartingBroker({("in.A", 0): -1}, unknown_for=0)
    assert partition_offsets(_admin(broker), [("in.A", 0)], at_ms=123, timeout_s=1) == {("in.A", 0): -1}
