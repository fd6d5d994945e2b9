"""Which client failures mean the broker is away (weather to wait out) and which are real errors."""

from __future__ import annotations

import pytest
from confluent_kafka import KafkaError, KafkaException

from pipeline.topics import broker_away


@pytest.mark.parametrize(
    "code",
    [
        KafkaError._TRANSPORT,
        KafkaError._ALL_BROKERS_DOWN,
        KafkaError._TIMED_OUT,
        KafkaError._DESTROY_BROKER,  # a broker handle dropped while the broker was stopped
    ],
)
def test_a_broker_that_went_away_is_weather(code: int) -> None:
    assert broker_away(KafkaException(KafkaError(code)))


@pytest.mark.parametrize("code", [KafkaError.UNKNOWN_TOPIC_OR_PART, KafkaError.TOPIC_AUTHORIZATION_FAILED])
def test_a_wrong_request_is_not(code: int) -> None:
    assert not broker_away(KafkaException(KafkaError(code)))
