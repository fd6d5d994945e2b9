"""The controller's reading of each pid's arrivals from the input's tail, on a real broker."""

from __future__ import annotations

import time

import numpy as np
from confluent_kafka import Producer

from controller.arrivals import REREAD_S, TAIL_SPAN_S, InputTail
from pipeline.codec import encode_tuples
from pipeline.config import load_config
from pipeline.topics import ensure_topics


def test_the_input_tail_counts_each_pids_tuples_of_the_last_seconds(
    kafka_bootstrap: str, topic_prefix: str
) -> None:
    """Tuples whose messages are stamped within the last TAIL_SPAN_S seconds count, over both streams; an
    older message does not, nor does one that does not decode. An event time ahead of the clock is not
    real-time input: no rates. Nor are there any before input arrives."""
    cfg = load_config(None, [f"pipeline={topic_prefix}", "streams=[A, B]", "partitions=4"])
    ensure_topics(cfg, kafka_bootstrap)
    tail = InputTail(cfg, kafka_bootstrap)
    producer = Producer({"bootstrap.servers": kafka_bootstrap})
    now = int(time.time() * 1000)

    def produce(stream: str, pid: int, tuples: int, at_ms: int) -> None:
        ids = np.arange(tuples, dtype=np.int64)
        body = encode_tuples(ids, ids, np.full(tuples, at_ms, np.int64), np.zeros((tuples, 0), np.uint8))
        producer.produce(cfg.input_topic(stream), body, partition=pid, timestamp=at_ms)

    try:
        assert tail.rates(now) is None, "nothing arrived"
        produce("A", 1, 50, now - 60_000)
        for k in range(3):
            produce("A", 1, 20, now - 5_000 + k)
        produce("B", 1, 10, now - 4_000)
        produce("B", 2, 10, now - 2_000)
        producer.produce(cfg.input_topic("A"), b"junk", partition=3, timestamp=now - 1_000)
        assert producer.flush(30) == 0
        assert tail.rates(now + 1) is None, "read again only after REREAD_S"
        later = now + REREAD_S * 1000
        rates = tail.rates(later)
        assert rates == {0: 0.0, 1: 70 / TAIL_SPAN_S, 2: 10 / TAIL_SPAN_S, 3: 0.0}

        produce("B", 0, 5, now + 60_000)
        assert producer.flush(30) == 0
        assert tail.rates(later + REREAD_S * 500) == rates, "read again only after REREAD_S"
        assert tail.rates(later + REREAD_S * 1000) is None, "event times ahead of the clock"
    finally:
        tail.close()
