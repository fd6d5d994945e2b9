"""Each pid's arrival rate now, read from the tail of the input topics (docs/load-model.md, "Arrival rates").

The rates the controller measures from the instances' batch records
(`controller.observation.rates.arrival_rates`) describe what an instance has read, and an instance that
is behind reads input that arrived half a minute ago: when a hot set moves, a loaded owner goes on
reporting the pids that were hot, and a round moves pids that have just gone cold. The input's last
`TAIL_SPAN_S` seconds tell each pid's arrivals now, whoever owns it and however far behind that owner
is.

Only for input that arrives in real time: a message's timestamp is the event time of its first tuple,
which only a real-time producer keeps near the clock. A pre-loaded or max-rate input has nothing in the
last seconds, or event times ahead of the clock; `InputTail.rates` then says None and the batch records
decide.
"""

from __future__ import annotations

import time
from typing import Any

from pipeline.codec import MalformedRecord, tuple_count
from pipeline.config import Config
from pipeline.kafka_client import CONSUMER_GROUP, kafka_config
from pipeline.topics import BOUNDED_READ, admin_client, consume_ready, partition_offsets

TAIL_SPAN_S = 10.0
"""The span of input a rate covers: as `controller.observation.rates.RATE_SPAN_S`, enough for a cold
pid's count not to be noise."""
CLOCK_SLACK_S = 5.0
"""Event times up to this far ahead of the controller's clock still count as real time (clock skew)."""
READ_TIMEOUT_S = 10.0
MAX_TAIL_MESSAGES = 200_000
"""More messages than this in the span is not real-time input but a log whose event times run ahead of the
clock (a max-rate producer): not read. A real-time producer writes one message per pid and stream per
tick (`generator.producer.TICK_S`) and its transaction's marker after it: 51,200 offsets per 10 s at 64
pids and two streams."""
REREAD_S = 2.0
"""A tail read this recently is reused: a round waiting for an instance to warm up is tried every tick."""


class InputTail:
    """Reads the last seconds of every input partition (pid) and counts their tuples."""

    def __init__(self, cfg: Config, bootstrap: str) -> None:
        from confluent_kafka import Consumer

        self.partitions = [(t, p) for t in cfg.input_topics for p in range(cfg.partitions)]
        self._admin = admin_client(bootstrap)
        self._consumer = Consumer(
            {
                **kafka_config(bootstrap),
                "group.id": CONSUMER_GROUP,
                "enable.auto.commit": False,
                "enable.partition.eof": True,
                "isolation.level": "read_committed",
            }
            | BOUNDED_READ
        )
        self._last: tuple[float, dict[int, float] | None] = (float("-inf"), None)

    def rates(self, now_ms: float | None = None) -> dict[int, float] | None:
        """Tuples per second each pid received over the last `TAIL_SPAN_S` seconds (every pid, 0 for one
        that received none), or None when the input does not arrive in real time (nothing arrived in
        that span, or an event time is ahead of the clock) or the tail was not read whole in time."""
        now_ms = time.time() * 1000 if now_ms is None else now_ms
        read_at, rates = self._last
        if 0 <= now_ms - read_at < REREAD_S * 1000:
            return rates
        rates = self._read(now_ms)
        self._last = (now_ms, rates)
        return rates

    def _read(self, now_ms: float) -> dict[int, float] | None:
        from confluent_kafka import KafkaError, TopicPartition

        since = partition_offsets(self._admin, self.partitions, at_ms=int(now_ms - TAIL_SPAN_S * 1000))
        ends = partition_offsets(self._admin, self.partitions)
        todo = {tp: (start, ends[tp]) for tp, start in since.items() if 0 <= start < ends[tp]}
        if not todo or sum(end - start for start, end in todo.values()) > MAX_TAIL_MESSAGES:
            return None
        counts = {p: 0 for _, p in self.partitions}
        newest = 0
        pending = set(todo)
        self._consumer.assign([TopicPartition(t, p, start) for (t, p), (start, _) in todo.items()])
        deadline = time.monotonic() + READ_TIMEOUT_S
        try:
            while pending and time.monotonic() < deadline:
                for msg in consume_ready(self._consumer, 10_000, 0.5):
                    tp, offset = (msg.topic(), msg.partition()), msg.offset()
                    err: Any = msg.error()
                    if err is not None:
                        if err.code() == KafkaError._PARTITION_EOF:
                            pending.discard(tp)
                        continue
                    assert offset is not None
                    if tp not in pending or offset >= todo[tp][1]:
                        pending.discard(tp)
                        continue
                    try:
                        counts[tp[1]] += tuple_count(msg.value() or b"")
                    except MalformedRecord:
                        continue  # the instances dead-letter it
                    newest = max(newest, msg.timestamp()[1])
                    if offset + 1 >= todo[tp][1]:
                        pending.discard(tp)
        finally:
            self._consumer.unassign()
        if pending or newest > now_ms + CLOCK_SLACK_S * 1000:
            return None  # not read whole in time, or not real time
        return {p: n / TAIL_SPAN_S for p, n in counts.items()}

    def close(self) -> None:
        self._consumer.close()
