"""Kafka side of the control protocol: follow the control log, publish to it, heartbeat.

`ControlLog.catch_up()` reads `<pipeline>.control` up to its current end and folds it into a
`control_view.ControlView`; instances (their follower thread and their sink's fencing check) and the
controller use the same reader, so both sides agree on what the log says.

The topic keeps every record (`retention.ms=-1`, `pipeline/topics.py`), and a reader starts at its
first. Records deleted all the same (by hand, or by a retention someone set) are noticed, never
skipped: a reader that lacks the log's first records takes the state from before them from a snapshot
the controller wrote after them (`ControlLog.write_snapshot`), and without one refuses to answer
(`ControlLogTruncated`).
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from pipeline.config import Config
from pipeline.control_view import ControlView, Fold, Message, SnapshotMsg, author_of
from pipeline.instance_files import owned_pids, read_assignment, write_assignment
from pipeline.kafka_client import CONSUMER_GROUP, kafka_config
from pipeline.protocol import AssignmentMsg, BudgetMsg, ProtocolError, SpillGateMsg
from pipeline.protocol_codec import decode, encode
from pipeline.signing import may_say, produce_signed
from pipeline.topics import broker_away, watermark_offsets

log = logging.getLogger(__name__)

STUCK_S = 5.0
"""A reader that fetches nothing for this long while the log holds more assigns its partition again."""


class StuckFetch:
    """A reader's guard against a fetcher that stays stuck after a broker restart: the broker answered
    where the log ends, yet nothing arrives. Once the reader's next offset has not moved for STUCK_S,
    its partition is assigned again at that offset, which starts the fetcher afresh."""

    def __init__(self, consumer: Any, topic: str, offset: int) -> None:
        self.consumer, self.topic, self.at, self.since = consumer, topic, offset, time.monotonic()

    def check(self, offset: int) -> None:
        from confluent_kafka import TopicPartition

        now = time.monotonic()
        if offset != self.at:
            self.at, self.since = offset, now
        elif now - self.since > STUCK_S:
            self.consumer.assign([TopicPartition(self.topic, 0, offset)])
            self.since = now


RECONNECT_MAX_MS = 1000
"""The most a heartbeat producer waits between attempts to reach a broker that is away."""
SNAPSHOT_EVERY = 1000
"""Control messages between two of the controller's snapshots: records deleted below any but the
newest thousand messages leave a snapshot after them to start from. Reading one costs a reader that has
the whole log nothing but its decoding (it skips it)."""


FENCED_EXIT_STATUS = 3
"""The exit status of a process another one took over from: an instance evicted or fenced (its pids live
elsewhere), a controller fenced by a newer controller of its pipeline. A supervisor restarts it; an
instance then rejoins empty."""


class ControlLogTruncated(RuntimeError):
    """Records of the control log that a reader has not read are deleted, and no snapshot follows them:
    the state they held is lost, and what is left would read as another pipeline's."""


class ControlLog:
    """An incremental reader of the control topic (one partition), read_committed, from its first record."""

    def __init__(self, bootstrap: str, topic: str) -> None:
        from confluent_kafka import Consumer

        self.topic = topic
        conf = {
            **kafka_config(bootstrap),
            "group.id": CONSUMER_GROUP,
            "enable.auto.commit": False,
            "isolation.level": "read_committed",
            # A read at an offset whose record is deleted ends with an error rather than going on from
            # the log's new start ("earliest") or its end ("latest"): either would skip records unseen.
            "auto.offset.reset": "error",
        }
        self._consumer = Consumer(conf)  # assigned at the log's first record by the first catch-up
        # The end offset is asked on a connection of its own: the reader's connection always has a fetch
        # waiting at the broker (up to fetch.wait.max.ms, 500 ms) and the broker answers a connection's
        # requests in order, so asking there made every catch-up wait for that fetch.
        self._ends = Consumer(conf)
        self._next: int | None = None  # the offset read up to; None: read from the log's first record
        self._first = 0  # the log's first record when the fold began
        self._skipped = False  # the consumer's offset was deleted before it read it
        self._fold = Fold()
        self._view: ControlView | None = None  # the fold's view, until the fold changes
        self._since_snapshot = 0
        self._lock = threading.Lock()

    @property
    def view(self) -> ControlView:
        if self._view is None:
            self._view = self._fold.view()
        return self._view

    def catch_up(self, timeout_s: float = 30.0) -> ControlView:
        """Read every message committed before this call; return the folded view.

        Raises `ControlLogTruncated` when records this reader has not read are deleted and no snapshot
        after them is committed yet, and `ConflictingAssignments` when the log holds two assignments of
        one epoch (on every call: the reader then starts from the log's first record again)."""
        from confluent_kafka import TopicPartition

        with self._lock:
            deadline = time.monotonic() + timeout_s
            while True:
                low, high = watermark_offsets(self._ends, TopicPartition(self.topic, 0), timeout_s)
                if self._next is None or self._skipped or low > self._next:
                    self._restart(low)
                self._read_to(high, deadline)
                if not self._skipped:
                    break
            if not self._fold.complete:
                raise self._truncated(low, high)
            return self.view

    def await_news(self, timeout_s: float) -> bool:
        """Wait up to `timeout_s` for the next message and fold it in (a caller then catches up): a
        follower takes a move's step when it is committed, not at its next poll (decision 0038)."""
        with self._lock:
            got = self._consumer.consume(num_messages=1, timeout=timeout_s)
            self._fold_in(got)
            return bool(got)

    def add_own(self, msg: AssignmentMsg | SpillGateMsg) -> ControlView:
        """Fold in what this process has just published (flushed), before the log shows it.

        Read committed, the log shows a message only below the last stable offset: while a transaction
        an instance began before it is open (its `Released` or `Acquired` rides with its results), the
        publisher would not read its own assignment back, and would plan its next step, and report what
        is in flight, from the one before. Reading it later again changes nothing.
        """
        with self._lock:
            self._fold.add(msg)
            self._view = None
            return self.view

    def snapshot_due(self) -> bool:
        """Whether `SNAPSHOT_EVERY` messages have been read since the newest snapshot (or since the
        first record, with none): the controller then writes one (`write_snapshot`)."""
        return self._since_snapshot >= SNAPSHOT_EVERY

    def write_snapshot(self, producer: Any) -> None:
        """Publish the view as a `SnapshotMsg` (the caller flushes or commits its transaction): the state
        a reader takes when the records before it are deleted. The controller calls it at its start,
        after catching up, and whenever `snapshot_due()`."""
        with self._lock:
            if not self._fold.complete:
                raise ControlLogTruncated(f"control log {self.topic}: no snapshot of a partial view")
            assert self._next is not None
            publish(producer, self.topic, SnapshotMsg(view=self.view.pruned(), read_to=self._next))
            self._since_snapshot = 0

    def _restart(self, low: int) -> None:
        """Fold afresh from the log's first record, `low`: at the first catch-up, or once records this
        reader had not read are deleted. Started past offset 0, the fold waits for a snapshot."""
        from confluent_kafka import TopicPartition

        if self._next is not None:
            log.warning(
                "control log %s: records below offset %s deleted unread; reading again", self.topic, low
            )
        own = self._fold.assignment  # maybe this process's own (`add_own`), not readable yet
        self._fold = Fold(ControlView(assignment=own) if own is not None else None, complete=low == 0)
        self._view = None
        self._consumer.assign([TopicPartition(self.topic, 0, low)])
        self._first, self._next, self._skipped = low, low, False

    def _read_to(self, high: int, deadline: float) -> None:
        from confluent_kafka import TopicPartition

        assert self._next is not None
        stuck = StuckFetch(self._consumer, self.topic, self._next)
        while self._next < high and not self._skipped:
            if time.monotonic() > deadline:
                raise TimeoutError(f"control log not readable up to offset {high}")
            stuck.check(self._next)
            # A short wait: consume returns early only with all the messages asked for, and the
            # transaction markers among the offsets below `high` are never delivered (the position
            # passes them).
            self._fold_in(self._consumer.consume(num_messages=1000, timeout=0.01))
            position = self._consumer.position([TopicPartition(self.topic, 0)])[0].offset
            self._next = max(self._next, position)

    def _fold_in(self, messages: list[Any]) -> None:
        from confluent_kafka import KafkaError

        for msg in messages:
            error = msg.error()
            if error is not None:
                self._skipped |= error.code() == KafkaError._AUTO_OFFSET_RESET
                continue
            self._next = (msg.offset() or 0) + 1
            value = msg.value() or b""
            try:
                decoded = decode(value)
            except ProtocolError as exc:
                log.warning("ignoring control message at offset %s: %s", msg.offset(), exc)
                continue
            if not may_say(author_of(decoded), self.topic, value, msg.headers()):
                continue
            if isinstance(decoded, SnapshotMsg):
                self._since_snapshot = 0
                if decoded.read_to < self._first:
                    continue  # its writer had not read records deleted since: it lacks them too
            else:
                self._since_snapshot += 1
            try:
                self._fold.add(decoded)
            except ProtocolError:
                self._next = None  # the offending records stay in the log, and so does the error
                raise
            self._view = None

    def _truncated(self, low: int, high: int) -> ControlLogTruncated:
        return ControlLogTruncated(
            f"records of the control log {self.topic} below offset {low} are deleted, and no snapshot of "
            f"the state follows them up to offset {high}: the pipeline's assignment is lost (its control "
            "topic must keep every record: retention.ms=-1)"
        )

    def close(self) -> None:
        self._consumer.close()
        self._ends.close()


def publish(producer: Any, topic: str, msg: Message) -> None:
    """Produce one control message, signed when this process has a key (the caller flushes or commits
    its transaction)."""
    produce_signed(producer, topic, type(msg).__name__, encode(msg))


def set_state_budget(cfg: Config, bootstrap: str, instance: str, state_budget_bytes: int) -> None:
    """Set the bytes of window state `instance` may hold, from its next batch on (`BudgetMsg`; 0: its
    configured budget again). Raises RuntimeError when Kafka did not take it within 30 s."""
    from confluent_kafka import Producer

    producer = Producer(kafka_config(bootstrap))
    publish(producer, cfg.control_topic, BudgetMsg(instance=instance, state_budget_bytes=state_budget_bytes))
    if producer.flush(30):
        raise RuntimeError("the budget was not acknowledged by Kafka within 30 s")


class InstanceFollower:
    """An instance's link to the control plane, run in a thread of the instance process.

    Keeps the assignment file the source reads at batch boundaries equal to the newest epoch, and
    heartbeats to the metrics topic so the controller can tell a live instance from a dead one.
    """

    def __init__(
        self,
        cfg: Config,
        bootstrap: str,
        instance: str,
        incarnation: str,
        assignment: Path,
        log: ControlLog,
        stalled_s: Callable[[], float] | None = None,
        boot: int = 1,
    ) -> None:
        from confluent_kafka import Producer

        self.cfg, self.instance, self.incarnation, self.assignment = cfg, instance, incarnation, assignment
        self.log = log
        # Back within a second of the broker: after a long outage the client's reconnect backoff has grown
        # to its default maximum of 10 s, the controller's heartbeat timeout (decision 0052).
        self._producer = Producer(
            {**kafka_config(bootstrap), "linger.ms": 0, "reconnect.backoff.max.ms": RECONNECT_MAX_MS}
        )
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="control-follower", daemon=True)
        self._beating = threading.Thread(target=self._beat, name="heartbeat", daemon=True)
        self._beat_lock = threading.Lock()  # an eviction read and a heartbeat never cross
        self._epoch_read = -1
        """The newest epoch read and found not to evict this incarnation: what a heartbeat names."""
        self.boot, self._beats = boot, 0
        """The process's start on this incarnation's directory (`instance._boot`) and its heartbeats so
        far: each heartbeat carries both, so a copy of one appended again is told from a new one
        (`pipeline.signing.fresh`)."""
        self.broker_away = ""
        """Why the control log cannot be read now because the broker is away ("" while it can)."""
        self.serving = False
        """Set by the instance once its query has completed a batch. Heartbeats start before Spark
        does, so that a restarting instance is not taken for dead; until it serves, the controller
        hands it no pids, which would pause until its query had started (decision 0043)."""
        self.progress: dict[str, int] = {}
        """How far the instance's query has got (`pipeline.instance.QueryProgress.fields`), set by the
        instance's main loop twice a second; a heartbeat carries it."""
        self.stalled_s = stalled_s
        """Seconds since the query last progressed: the instance's one stall clock
        (`pipeline.health.InstanceHealth.progress_age_s`), which its /healthz judges too."""
        self.evicted = threading.Event()
        """Set once the log evicts this incarnation: the instance stops (`FENCED_EXIT_STATUS`) even when
        no batch of its query would meet the sink's fence (it holds no pid, or its query is idle)."""
        self._unseen: bool | None = None  # whether "name@?" was already listed when this incarnation began
        self.state_budget = cfg.instance.state_budget()
        """The bytes of window state this instance may hold: set while it runs (`BudgetMsg`), else
        configured. The sink reports it next to the state its windows hold."""
        self.spill_at_threshold = True
        """Whether the sink spills at the configured threshold, or only past the whole budget while
        another instance has room (`SpillGateMsg`)."""

    def sync(self) -> None:
        """Write the assignment file if the control log has a newer epoch than the file. Never an older
        one: the query acts on the file, and an older epoch would give it back pids it has released.
        Take in the state budget and the spill gate the log sets."""
        view = self.log.catch_up()
        self.state_budget = view.budgets.get(self.instance) or self.cfg.instance.state_budget()
        self.spill_at_threshold = view.spill is not False
        msg = view.assignment
        if msg is None:
            return
        unseen = f"{self.instance}@?" in msg.evicted  # a controller that never heard it evicted the name
        if self._unseen is None:
            self._unseen = unseen  # listed before this incarnation began: not about it
        with self._beat_lock:
            if f"{self.instance}@{self.incarnation}" in msg.evicted or (unseen and not self._unseen):
                self.evicted.set()
                return
            self._epoch_read = msg.epoch
        if self.assignment.exists() and read_assignment(self.assignment).epoch >= msg.epoch:
            return
        write_assignment(self.assignment, owned_pids(msg, self.instance))

    def heartbeat(self) -> None:
        """One heartbeat, unless this incarnation has read its eviction: one more would pass for a
        rejoin (it names the newest epoch read, `_epoch_read`)."""
        with self._beat_lock:
            if self.evicted.is_set():
                return
            beat = {
                "kind": "heartbeat",
                "instance": self.instance,
                "incarnation": self.incarnation,
                "serving": self.serving,
                "epoch": self._epoch_read,
                **self.progress,
                "time_ms": int(time.time() * 1000),  # the controller ages it by the broker's clock
            }
            if self.progress and self.stalled_s is not None:
                beat["stalled_ms"] = int(self.stalled_s() * 1000)
            self._beats += 1
            beat["seq"] = [self.boot, self._beats]
            produce_signed(self._producer, self.cfg.metrics_topic, self.instance, json.dumps(beat).encode())
        self._producer.poll(0)

    def start(self) -> None:
        self._thread.start()
        self._beating.start()

    def _beat(self, every_s: float = 1.0) -> None:
        """Heartbeat on a thread of its own: reading the control log can block for many seconds after an
        outage (its client reconnecting, a lookup retried), and a heartbeat held behind it made the
        controller declare a live instance dead once the broker was back (decision 0052)."""
        while not self._stop.is_set() and not self.evicted.is_set():
            try:
                self.heartbeat()
            except Exception as exc:  # BufferError while the broker is away: the next beat retries
                log.warning("%s: heartbeat not sent (%r)", self.instance, exc)
            self._stop.wait(every_s)

    def _run(self, period_s: float = 0.1) -> None:
        """Follow the control log: write each newer assignment to the file the query reads, and stop at
        this incarnation's eviction. A failure (a broker away, a full disk) is said once and retried."""
        said = ""
        while not self._stop.is_set() and not self.evicted.is_set():
            try:
                self.sync()
                self.broker_away = ""
                if not self.evicted.is_set():
                    self.log.await_news(period_s)
            except Exception as exc:
                away = broker_away(exc)  # a TimeoutError is an OSError too: not the full disk below
                if away:
                    self.broker_away = repr(exc)
                what = (
                    "assignment not written"
                    if isinstance(exc, OSError) and not away
                    else "control log not read"
                )
                if f"{what}{exc!r}" != said:
                    log.warning("%s: %s (%r); trying again", self.instance, what, exc)
                said = f"{what}{exc!r}"
                self._stop.wait(period_s)

    def stop(self) -> None:
        self._stop.set()
        for thread in (self._thread, self._beating):
            if thread.is_alive():
                thread.join(5)
        self._producer.flush(5)


def wait_for(condition: Callable[[], bool], timeout_s: float, what: str, poll_s: float = 0.2) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout_s:.0f} s waiting for {what}")
        time.sleep(poll_s)
