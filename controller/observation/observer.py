"""The controller's one reader of the metrics topic: heartbeats, batch records and read reports.

Apart from the rules it applies (`controller.observation.liveness`, `controller.observation.estimates`)
because it holds the Kafka consumer and the records of the last minutes, which the Kafka mover
(`controller.moves.kafka_mover`) and `fluxjoin status` read.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterable
from typing import Any

from controller.observation.estimates import shortest_empty_s
from controller.observation.liveness import (
    PROGRESS_TIMEOUT_S,
    Liveness,
    judge_liveness,
    query_stalled_s,
)
from pipeline.config import Config
from pipeline.kafka_client import CONSUMER_GROUP, kafka_config
from pipeline.signing import fresh, may_say

HEARING_CHECK_S = 1.0
HEARING_TIMEOUT_S = 2.0
"""How often, and how long, a controller step asks the broker where the metrics topic ends: whether it can
hear the instances at all (`Observer._check_hearing`)."""


def appended_ms(timestamp: tuple[int, int]) -> int | None:
    """When the broker appended a message, by the broker's clock (the metrics topic's timestamps are
    `LogAppendTime`, decision 0054), from the message's `timestamp()`. None on a topic whose messages
    carry their producer's clock (one created before): then the record's own `time_ms` serves, as
    before, and a step of an instance's wall clock ages its heartbeats by as much."""
    from confluent_kafka import TIMESTAMP_LOG_APPEND_TIME

    kind, ms = timestamp
    return ms if kind == TIMESTAMP_LOG_APPEND_TIME else None


class Observer:
    """Tails the metrics topic: heartbeats (liveness), per-batch records and the read reports of batches
    in flight (load), from a minute ago.

    Every record's `time_ms` is replaced by the time the broker appended it (`appended_ms`), and ages
    and windows are measured from it: the one clock all instances' records share, right for the records
    a controller that has just started reads from a minute back, and never an instance's own, whose
    host's clock may run wrong or step (decision 0054)."""

    def __init__(
        self,
        cfg: Config,
        bootstrap: str,
        heartbeat_timeout_s: float,
        clock: Callable[[], float],
        progress_timeout_s: float = PROGRESS_TIMEOUT_S,
    ) -> None:
        from confluent_kafka import Consumer, TopicPartition

        from pipeline.topics import admin_client, partition_offsets

        self.clock = clock
        self.timeout_s = heartbeat_timeout_s
        self.progress_timeout_s = progress_timeout_s
        # instance -> seconds its query had gone without progress at its last heartbeat (timed by the
        # instance on its monotonic clock, `query_stalled_s`)
        self.stalled_s: dict[str, float] = {}
        self.started = clock()
        self.hearing_since = self.started
        """Since when the controller has reached the broker without a break (`poll`)."""
        self.deaf = False
        """Whether the broker failed to answer the last end-offset lookup (`_check_hearing`)."""
        self._hearing_checked = self._broker_answered = time.monotonic()
        self.seen: dict[str, tuple[float, str]] = {}  # instance -> (last heartbeat, incarnation)
        self.epochs: dict[str, int] = {}  # instance -> the newest epoch it had read at its last heartbeat
        # Instances the assignment names: one never heard from is dead once the start grace is over.
        self.expected: set[str] = set()
        # Instances whose pods the platform is (re)starting (a rolling update, a deleted pod): silent for
        # up to `restart_grace_s` before they count as dead, so that a restart resumes from the
        # instance's checkpoint instead of recovering its pids elsewhere (decision 0051).
        self.restarting: frozenset[str] = frozenset()
        self.restart_grace_s = 0.0
        self.serving: set[str] = set()  # instances whose last heartbeat says their query has run a batch
        self.batches: list[dict[str, Any]] = []
        self.readings: list[dict[str, Any]] = []  # what batches in flight have read (`report_reading`)
        self.empty_s: dict[str, float] = {}  # instance -> its shortest batch that read nothing, ever
        # (instance, incarnation) -> its newest heartbeat's number (`pipeline.signing.fresh`)
        self._beat_seq: dict[tuple[str, str], tuple[int, int]] = {}
        # read_uncommitted: heartbeats are not transactional, and a dead instance's open transaction on
        # this topic must not hide the others' heartbeats (load figures from aborted batches are harmless).
        self._consumer = Consumer(
            {
                **kafka_config(bootstrap),
                "group.id": CONSUMER_GROUP,
                "enable.auto.commit": False,
                "isolation.level": "read_uncommitted",
            }
        )
        admin, metrics = admin_client(bootstrap), [(cfg.metrics_topic, 0)]
        start = partition_offsets(admin, metrics, at_ms=int(time.time() * 1000) - 60_000)[metrics[0]]
        if start < 0:  # nothing in the last minute
            start = partition_offsets(admin, metrics)[metrics[0]]
        self._metrics = TopicPartition(cfg.metrics_topic, 0)
        self._consumer.assign([TopicPartition(cfg.metrics_topic, 0, start)])

    def _check_hearing(self) -> None:
        """Ask the broker for the metrics topic's end, about once a second. An answer means what the
        instances write reaches this controller; none (a broker stopped or frozen), or a gap since the
        last answer (this controller blocked on a silent broker, or frozen itself), means their silence
        meanwhile says nothing about them: hearing starts again with the next answer. Gaps are real
        time (`time.monotonic`), whatever clock the observer judges by."""
        from confluent_kafka import KafkaException

        asked = time.monotonic()
        if asked - self._hearing_checked < HEARING_CHECK_S:
            return
        self._hearing_checked = asked
        try:
            self._consumer.get_watermark_offsets(self._metrics, timeout=HEARING_TIMEOUT_S)
        except KafkaException:  # away, restarting, or not serving the partition yet: none reaches us
            self.deaf = True
            return
        answered = time.monotonic()
        if self.deaf or answered - self._broker_answered > HEARING_CHECK_S + 2 * HEARING_TIMEOUT_S:
            self.deaf, self.hearing_since = False, self.clock()
        self._broker_answered = answered

    def poll(self, wait_s: float = 0.0) -> None:
        """Take in what has arrived, waiting up to `wait_s` for it (a controller step does not wait)."""
        self._check_hearing()
        now_ms = time.time() * 1000
        for msg in self._consumer.consume(num_messages=10_000, timeout=wait_s):
            if msg.error() is not None or msg.value() is None:
                continue
            value = msg.value() or b"{}"
            record = json.loads(value)
            if not may_say(str(record.get("instance")), self._metrics.topic, value, msg.headers()):
                continue
            if record.get("kind") == "heartbeat" and not self._fresh(record):
                continue
            stalled = query_stalled_s(record)  # before `time_ms` is the broker's
            record["time_ms"] = appended_ms(msg.timestamp()) or record.get("time_ms", now_ms)
            age_s = max(0.0, (now_ms - record["time_ms"]) / 1000)
            if record.get("kind") == "heartbeat":
                self.seen[record["instance"]] = (self.clock() - age_s, record["incarnation"])
                self.epochs[record["instance"]] = record.get("epoch", -1)
                # An instance of a version before decision 0043 says nothing: it counts as serving.
                if record.get("serving", True):
                    self.serving.add(record["instance"])
                else:
                    self.serving.discard(record["instance"])
                if record.get("serving", True) and stalled is not None:
                    self.stalled_s[record["instance"]] = stalled
                else:  # not serving yet (starting up), or an instance that does not report progress
                    self.stalled_s.pop(record["instance"], None)
            elif record.get("kind") == "batch":
                self.batches.append(record)
                empty = shortest_empty_s([record])
                if empty is not None:
                    name = record["instance"]
                    self.empty_s[name] = min(self.empty_s.get(name, empty), empty)
            elif record.get("kind") == "reading":
                self.readings.append(record)
        cutoff = now_ms - 120_000
        if self.batches and self.batches[0]["time_ms"] < cutoff:
            self.batches = [b for b in self.batches if b["time_ms"] >= cutoff]
        if self.readings and self.readings[0]["time_ms"] < cutoff:
            self.readings = [r for r in self.readings if r["time_ms"] >= cutoff]

    def _fresh(self, beat: dict[str, Any]) -> bool:
        """Whether a heartbeat is newer than the last one taken from its incarnation: a copy appended
        again (a replay, which keeps its valid signature) is not."""
        key, numbered = (beat["instance"], beat["incarnation"]), beat.get("seq")
        if not isinstance(numbered, list) or len(numbered) != 2:  # a version before decision 0064
            return True
        seq = (int(numbered[0]), int(numbered[1]))
        if not fresh(seq, self._beat_seq.get(key)):
            return False
        self._beat_seq[key] = seq
        return True

    def expect(self, instances: Iterable[str]) -> None:
        """Count these instances as heard from at this observer's start, never as live: one that never
        heartbeats (it never started, or died while no controller ran) is dead after the timeout."""
        self.expected.update(instances)

    def liveness(self) -> Liveness:
        """Who is live and who is dead now: read once per controller step, so that one step never
        acts on two answers (a silence crossing the timeout in between)."""
        self._check_hearing()  # a step may have waited on the broker since its `poll`
        now = self.clock()
        # Silence counts only while the controller could have heard: after it could not reach the
        # broker, every instance has a whole timeout from then on to be heard again (decision 0052).
        hearing = now if self.deaf else self.hearing_since
        live, dead = judge_liveness(
            now,
            started=hearing,
            heard={i: max(t, hearing) for i, (t, _) in self.seen.items()},
            expected=self.expected,
            stalled_s=self.stalled_s,
            timeout_s=self.timeout_s,
            progress_timeout_s=self.progress_timeout_s,
            restarting=self.restarting,
            restart_grace_s=self.restart_grace_s,
        )
        incarnations = {i: inc for i, (_, inc) in self.seen.items()}
        return Liveness({i: incarnations[i] for i in live}, dead, incarnations, dict(self.epochs))

    def close(self) -> None:
        self._consumer.close()
