"""Kafka side of the control protocol: follow the control log, publish to it, heartbeat.

`ControlLog.catch_up()` reads `<pipeline>.control` up to its current end and folds it into a
`protocol.ControlView`; instances (their follower thread and their sink's fencing check) and the
controller use the same reader, so both sides agree on what the log says.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from pipeline.config import Config
from pipeline.protocol import AssignmentMsg, ControlView, Message, ProtocolError, decode, encode
from pipeline.source import owned_pids, read_assignment, write_assignment
from pipeline.topics import watermark_offsets


class ControlLog:
    """An incremental reader of the control topic (one partition), read_committed."""

    def __init__(self, bootstrap: str, topic: str) -> None:
        from confluent_kafka import Consumer, TopicPartition

        self._tp = TopicPartition(topic, 0, 0)
        conf = {
            "bootstrap.servers": bootstrap,
            "group.id": "fluxjoin-unused",
            "enable.auto.commit": False,
            "isolation.level": "read_committed",
        }
        self._consumer = Consumer(conf)
        self._consumer.assign([self._tp])
        # The end offset is asked on a connection of its own: the reader's connection always has a fetch
        # waiting at the broker (up to fetch.wait.max.ms, 500 ms) and the broker answers a connection's
        # requests in order, so asking there made every catch-up wait for that fetch.
        self._ends = Consumer(conf)
        self._next = 0
        self.view = ControlView()
        self._lock = threading.Lock()

    def catch_up(self, timeout_s: float = 30.0) -> ControlView:
        """Read every message committed before this call; return the folded view."""
        from confluent_kafka import TopicPartition

        with self._lock:
            _, high = watermark_offsets(self._ends, TopicPartition(self._tp.topic, 0), timeout_s)
            deadline = time.monotonic() + timeout_s
            while self._next < high:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"control log not readable up to offset {high}")
                # A short wait: consume returns early only with all the messages asked for, and the
                # transaction markers among the offsets below `high` are never delivered.
                self._fold(self._consumer.consume(num_messages=1000, timeout=0.01))
                if self._consumer.position([TopicPartition(self._tp.topic, 0)])[0].offset >= high:
                    # only transaction markers were left
                    self._next = max(self._next, high)
            return self.view

    def await_news(self, timeout_s: float) -> bool:
        """Wait up to `timeout_s` for the next message and fold it in (a caller then catches up): a
        follower takes a move's step when it is committed, not at its next poll (decision 0038)."""
        with self._lock:
            got = self._consumer.consume(num_messages=1, timeout=timeout_s)
            self._fold(got)
            return bool(got)

    def _fold(self, messages: list[Any]) -> None:
        for msg in messages:
            if msg.error() is not None:
                continue
            self._next = (msg.offset() or 0) + 1
            try:
                self.view = self.view.apply(decode(msg.value() or b""))
            except ProtocolError as exc:
                print(f"ignoring control message at offset {msg.offset()}: {exc}", flush=True)

    def add_own(self, msg: AssignmentMsg) -> ControlView:
        """Fold in an assignment this process has just published (flushed), before the log shows it.

        Read committed, the log shows a message only below the last stable offset: while a transaction
        an instance began before it is open (its `Released` or `Acquired` rides with its results), the
        publisher would not read its own assignment back, and would plan its next step, and report what
        is in flight, from the one before. Assignments apply by epoch, so reading it later changes nothing.
        """
        with self._lock:
            self.view = self.view.apply(msg)
            return self.view

    def close(self) -> None:
        self._consumer.close()
        self._ends.close()


def publish(producer: Any, topic: str, msg: Message) -> None:
    """Produce one control message (the caller flushes or commits its transaction)."""
    producer.produce(topic, value=encode(msg), key=type(msg).__name__)


class InstanceFollower:
    """An instance's link to the control plane, run in a thread of the instance process.

    Keeps the assignment file the source reads at batch boundaries equal to the newest epoch, and
    heartbeats to the metrics topic so the controller can tell a live instance from a dead one.
    """

    def __init__(
        self, cfg: Config, bootstrap: str, instance: str, incarnation: str, assignment: Path, log: ControlLog
    ) -> None:
        from confluent_kafka import Producer

        self.cfg, self.instance, self.incarnation, self.assignment = cfg, instance, incarnation, assignment
        self.log = log
        self._producer = Producer({"bootstrap.servers": bootstrap, "linger.ms": 0})
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="control-follower", daemon=True)
        self.serving = False
        """Set by the instance once its query has completed a batch. Heartbeats start before Spark
        does, so that a restarting instance is not taken for dead; until it serves, the controller
        hands it no pids, which would pause until its query had started (decision 0043)."""

    def newest(self) -> AssignmentMsg | None:
        return self.log.catch_up().assignment

    def sync(self) -> None:
        """Write the assignment file if the control log has a newer epoch than the file."""
        msg = self.newest()
        if msg is None:
            return
        if self.assignment.exists() and read_assignment(self.assignment).epoch == msg.epoch:
            return
        write_assignment(self.assignment, owned_pids(msg, self.instance))

    def heartbeat(self) -> None:
        beat = {
            "kind": "heartbeat",
            "instance": self.instance,
            "incarnation": self.incarnation,
            "serving": self.serving,
            "time_ms": int(time.time() * 1000),
        }
        self._producer.produce(self.cfg.metrics_topic, key=self.instance, value=json.dumps(beat))
        self._producer.poll(0)

    def start(self) -> None:
        self._thread.start()

    def _run(self, period_s: float = 0.1, beat_every_s: float = 1.0) -> None:
        last_beat = 0.0
        while not self._stop.is_set():
            try:
                self.sync()
                if time.monotonic() - last_beat >= beat_every_s:
                    self.heartbeat()
                    last_beat = time.monotonic()
                self.log.await_news(period_s)
            except Exception as exc:  # keep following; the next round retries
                print(f"{self.instance}: control follower: {exc!r}", flush=True)
                self._stop.wait(period_s)

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(5)
        self._producer.flush(5)


def wait_for(condition: Callable[[], bool], timeout_s: float, what: str, poll_s: float = 0.2) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout_s:.0f} s waiting for {what}")
        time.sleep(poll_s)
