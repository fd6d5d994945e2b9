"""The instance's exactly-once sink: one Kafka transaction per micro-batch.

Mechanism (and why): Spark re-runs a micro-batch after a crash if the batch's commit-log entry was not
written, so a sink sees the same batch id more than once. Each instance owns a transactional producer
(`transactional.id` = pipeline + instance), so a restarted instance fences its previous incarnation and
aborts whatever it left open. Inside each transaction the sink writes the batch's results, dead letters,
metrics and a *commit marker* (instance, batch id, epoch, end offsets of the batch) to the
`sink-commits` topic. On start it reads its last marker: a batch whose id is <= the last committed one
already reached Kafka atomically; it runs again with its output discarded. Consumers read with
`isolation.level=read_committed`.
Results therefore appear exactly once without any deduplication by readers; the verifier checks it.

The marker also publishes, atomically with the output, how far each pid has been processed
(the offsets Spark logged for the batch), which is what lag and recovery cutoffs are measured against.

Handoffs ride the same transaction: a batch that releases pids writes their exported windows to the
handoff topic and `Released` to the control topic; a batch that installs taken-over pids writes
`Acquired`, and the end of a parallel-track overlap `TrackDone`. Before committing, the sink reads the
control log's assignments to its end and aborts if a newer one lists this instance as evicted (it was
declared dead and its pids recovered elsewhere): a stale owner can neither emit nor acknowledge. The
controller also fences a dead instance by initialising its `transactional.id`; a sink so fenced stops
as evicted (`Fenced`) instead of failing and restarting as though nothing had happened.

A batch's produce phase (its transaction, from begin to commit) must fit in `TRANSACTION_TIMEOUT_S`:
the broker aborts a longer one, and the sink then fails naming the overrun (`TransactionOverrun`).

After each commit the sink notes every kept pid's window `stream_max`, with the offsets it has read up to,
in a file the source reads when it plans a batch: a parallel track that begins where the last batch left
its pid is then announced before its batch runs (decision 0023).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import time
from collections import deque
from collections.abc import Callable, Container, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
from confluent_kafka import OFFSET_BEGINNING, Consumer, KafkaError, KafkaException, TopicPartition

from pipeline.codec import Malformation, decode_results
from pipeline.config import Config
from pipeline.control import StuckFetch, publish
from pipeline.instance_files import write_recent_yields, write_watermarks
from pipeline.join import Part, WindowState, window_to_bytes
from pipeline.kafka_client import CONSUMER_GROUP, kafka_config
from pipeline.operator import (
    KIND_LATE,
    KIND_MALFORMED,
    KIND_RELEASED,
    KIND_RESULT,
    KIND_STATE,
    KIND_STATS,
    KIND_TRACK_DONE,
    KIND_WATERMARK,
    HotKey,
)
from pipeline.protocol import (
    AcquiredMsg,
    AssignmentMsg,
    ProtocolError,
    ReleasedMsg,
    Snapshot,
    SnapshotMsg,
    TrackDoneMsg,
    decode,
    eviction_entries,
    handoff_from_json,
)
from pipeline.rows import TRACK_OLD
from pipeline.topics import BOUNDED_READ, broker_away, partition_offsets, read_topic

log = logging.getLogger(__name__)

LATE_REASON = "late: event time below its input partition's newest before it minus the allowed lateness"
# A batch whose transaction the broker aborted for a reason other than an outage is produced again in a
# new one, up to this many times, backing off 2, 4, 8... s; one that met an outage (the broker away,
# unreachable or timing out: `topics.broker_away`) is produced again until the broker is back, however
# long that takes, backing off up to OUTAGE_BACKOFF_S; a commit or abort the broker answers with a
# retriable error is tried again until it succeeds. An instance never gives up on a broker: its liveness
# probe and the controller's progress timeout judge a batch that does not end (decisions 0048, 0052).
TRANSACTION_ATTEMPTS = 8
OUTAGE_BACKOFF_S = 10.0
TRANSACTION_TIMEOUT_S = 15.0
"""The broker aborts a transaction open for longer. A killed instance's open transaction holds back
read_committed readers of every topic it wrote to (the control log among them) until then: keep it
short. A batch's transaction spans producing its output, not computing it."""
FENCED_ERRORS = frozenset(
    {KafkaError._FENCED, KafkaError.PRODUCER_FENCED, KafkaError.INVALID_PRODUCER_EPOCH, KafkaError._FATAL}
)
"""What the producer answers once another took its `transactional.id` or the broker aborted its
transaction for lasting too long: no later call of it can succeed. `_FATAL` is what every call answers
after the first of those, raised in librdkafka's own thread (a frozen process wakes to it)."""
LAG_TIMEOUT_S = 5.0  # how long a batch waits for the input's end offsets, a metrics figure
SNAPSHOT_CHUNK_BYTES = 900_000  # keeps each exported-window message under Kafka's 1 MB default


def _stream_max_columns(
    columns: dict[str, np.ndarray], rows: np.ndarray, streams: int
) -> list[tuple[int, ...]]:
    """The `stream_max` each of `rows` carries in its id columns (`released` and `watermark` rows)."""
    return list(zip(*(columns[f"id{j}"][rows].tolist() for j in range(streams)), strict=True))


def _released_stream_max(
    columns: dict[str, np.ndarray], kind: np.ndarray, pid: int, streams: int
) -> tuple[int, ...]:
    """The `stream_max` the operator's `released` row reports for `pid` (a release or an overlap's start)."""
    closing = (kind == KIND_RELEASED) & (columns["pid"] == pid)
    return tuple(int(t) for t in _stream_max_columns(columns, closing, streams)[0])


def held_after(
    held: Mapping[int, int], batch: Mapping[str, Mapping[str, Any]], kept: Container[str]
) -> dict[int, int]:
    """Each pid's window bytes after a batch: the batch's pids at their new sizes, the others at their
    newest batch's (an idle pid holds its window still), pids the batch's offsets no longer keep (moved
    away) or whose windows are empty left out."""
    sizes = {**held, **{int(p): int(stats["state_bytes"]) for p, stats in batch.items()}}
    return {p: size for p, size in sizes.items() if size and str(p) in kept}


@dataclass(frozen=True, slots=True)
class BeforeCommit:
    """What a batch's metrics need that is worked out before its transaction begins: decoding every
    results message and asking the broker for the input's end offsets would lengthen a transaction
    the broker aborts after `TRANSACTION_TIMEOUT_S`."""

    result_times_ms: np.ndarray  # each result's newest event time
    result_pids: np.ndarray  # each result's pid
    lag: dict[str, int]


class Fenced(RuntimeError):
    """This instance no longer owns a pid it processed: it was declared dead and must restart empty."""


class TransactionOverrun(RuntimeError):
    """A batch's transaction lasted longer than `TRANSACTION_TIMEOUT_S`, and the broker aborted it."""


class ProducerFailed(RuntimeError):
    """The producer met a fatal error other than a fence (seen: INVALID_TXN_STATE on an abort after a
    broker restart): its transactional state is lost, and only a new producer goes on."""


def read_logged_offsets(checkpoint: Path, batch_id: int) -> dict[str, Any]:
    """The source offset Spark logged for `batch_id` (the offset log is written before the batch runs)."""
    lines = (checkpoint / "offsets" / str(batch_id)).read_text().splitlines()
    return dict(json.loads(lines[-1]))


def newest_markers(cfg: Config, bootstrap: str) -> dict[str, dict[str, Any]]:
    """Each instance's newest marker committed before the call, by instance name. Read to the high
    watermark once the transactions below it have ended: read only to the last stable offset, another
    instance's open transaction hides every marker committed after its first message."""
    newest: dict[str, dict[str, Any]] = {}
    for _, _, value in read_topic(bootstrap, cfg.sink_commits_topic, settled=True):
        marker = json.loads(value)
        newest[marker["instance"]] = marker
    return newest


def transactional_id(cfg: Config, instance: str) -> str:
    """The `transactional.id` of `instance`'s sink: initialising it fences the instance."""
    return f"{cfg.pipeline}.{instance}"


def last_commit(cfg: Config, bootstrap: str, instance: str, incarnation: str) -> dict[str, Any] | None:
    """The newest committed marker of this incarnation of `instance` (a checkpoint's life); an older
    incarnation's markers all precede the first of a newer one, so the instance's newest marker decides."""
    marker = newest_markers(cfg, bootstrap).get(instance)
    return marker if marker is not None and marker.get("incarnation") == incarnation else None


def _sample(values: np.ndarray, n: int) -> list[float]:
    if not len(values):
        return []
    ordered = np.sort(values)
    picks = ordered[np.linspace(0, len(ordered) - 1, min(n, len(ordered))).astype(int)]
    return [round(float(v), 4) for v in picks]


def _by_pid(pids: np.ndarray, values: np.ndarray) -> dict[int, np.ndarray]:
    """`values` split by the pid of each."""
    if not len(pids):
        return {}
    order = np.argsort(pids, kind="stable")
    found, starts = np.unique(pids[order], return_index=True)
    return {int(p): part for p, part in zip(found, np.split(values[order], starts[1:]), strict=True)}


HOT_SHARE = 0.25
"""A batch that makes this share of `instance.max_results_per_batch` or more names its hottest pid and
key in the log, at most every HOT_WARNING_EVERY_S."""
HOT_WARNING_EVERY_S = 30.0
RECENT_BATCHES = 8
"""The source bounds a pid's input in a batch by this many of its recent batches' tuples and results
(`pipeline.batch_sizing.results_of`)."""


class Evictions:
    """The newest epoch whose assignment lists one of `names` as evicted, read from the control log to its
    high watermark, uncommitted assignments included.

    Read committed, the log ends at its last stable offset, before a batch's own acknowledgements (they
    are in its open transaction) and before any other open transaction's: an eviction published after
    them would be invisible until they end. Assignments are all that is read here, and reading one
    before it commits errs on the safe side: an eviction in a transaction that then aborts stops a live
    instance, which restarts from its checkpoint."""

    def __init__(self, bootstrap: str, topic: str, names: frozenset[str], admin: Any) -> None:
        self._consumer = Consumer(
            {
                **kafka_config(bootstrap),
                "group.id": CONSUMER_GROUP,
                "enable.auto.commit": False,
                "isolation.level": "read_uncommitted",
                "auto.offset.reset": "earliest",
            }
            | BOUNDED_READ
        )
        self._consumer.assign([TopicPartition(topic, 0, OFFSET_BEGINNING)])
        self._topic, self._names, self._admin = topic, names, admin
        self._next = 0
        self.newest: int | None = None

    def catch_up(self, timeout_s: float = 30.0) -> int | None:
        """Read every message appended before this call; the newest epoch that evicts `names`."""
        end = partition_offsets(self._admin, [(self._topic, 0)], timeout_s=timeout_s)[(self._topic, 0)]
        deadline = time.monotonic() + timeout_s
        stuck = StuckFetch(self._consumer, self._topic, self._next)
        while self._next < end:
            if time.monotonic() > deadline:
                raise TimeoutError(f"{self._topic} not readable up to offset {end}")
            stuck.check(self._next)
            for msg in self._consumer.consume(num_messages=1000, timeout=0.1):
                if msg.error() is not None:
                    continue
                self._next = (msg.offset() or 0) + 1
                self._note(msg.value() or b"")
            position = self._consumer.position([TopicPartition(self._topic, 0)])[0].offset
            self._next = max(self._next, position)  # past transaction markers, which are not delivered
        return self.newest

    def _note(self, raw: bytes) -> None:
        try:
            msg = decode(raw)
        except ProtocolError:
            return
        # A snapshot stands for the assignments before it, which the log may no longer hold.
        assignment = msg.view.assignment if isinstance(msg, SnapshotMsg) else msg
        if isinstance(assignment, AssignmentMsg) and self._names & set(assignment.evicted):
            epoch = assignment.epoch
            self.newest = max(epoch, self.newest if self.newest is not None else epoch)

    def close(self) -> None:
        self._consumer.close()


class ExactlyOnceSink:
    """`foreachBatch` target: writes one micro-batch's output in one Kafka transaction."""

    def __init__(
        self,
        cfg: Config,
        bootstrap: str,
        instance: str,
        incarnation: str,
        checkpoint: Path,
        watermarks: Path,
        recent_yields: Path,
        on_commit: Callable[[dict[str, Any]], None] | None = None,
        state_budget: Callable[[], int] | None = None,
    ) -> None:
        from confluent_kafka import Producer
        from confluent_kafka.admin import AdminClient

        self.cfg, self.instance, self.incarnation, self.checkpoint = cfg, instance, incarnation, checkpoint
        # Noted from this process's batches only: a previous one may have died between its commit and
        # its note, and a batch replayed with its output discarded notes nothing.
        self.watermarks_path = watermarks
        self.watermarks_path.unlink(missing_ok=True)
        self._watermarks: dict[int, tuple[int, ...]] = {}
        self._last_lag: dict[str, int] = {}
        # Kept across restarts: it describes the workload, not this incarnation's state.
        self.recent_yields_path = recent_yields
        self._recent_yields: dict[int, deque[tuple[int, int]]] = {}
        self.producer = Producer(
            {
                **kafka_config(bootstrap),
                "transactional.id": transactional_id(cfg, instance),
                "linger.ms": 5,
                "batch.size": 1_000_000,
                "compression.type": "lz4",
                "transaction.timeout.ms": int(TRANSACTION_TIMEOUT_S * 1000),
            }
        )
        self.producer.init_transactions(60)  # fences any previous incarnation of this instance
        self.admin = AdminClient(kafka_config(bootstrap))
        # After init_transactions: the previous incarnation's open transaction is aborted by now.
        marker = last_commit(cfg, bootstrap, instance, incarnation)
        self.last_batch = int(marker["batch"]) if marker else -1
        self.completed = -1
        """The newest batch this process completed (committed, or already committed and run again)."""
        names = eviction_entries(instance, incarnation)
        self.evictions = Evictions(bootstrap, cfg.control_topic, names, self.admin)
        self._begun = time.monotonic()  # when the batch's transaction began
        self._in_transaction = False
        self._delivered: dict[int, int] = {}
        self._undelivered: dict[int, KafkaError] = {}
        self.last_end = time.monotonic()
        self.broker_away = ""
        """Why the batch in flight cannot reach the broker ("" while it can): the instance's /metrics."""
        self._warned_at = -HOT_WARNING_EVERY_S
        self.streams = cfg.streams
        self.on_commit = on_commit
        """Called with each committed batch's metrics record, after its commit (the instance's /metrics)."""
        self.state_budget = state_budget or cfg.instance.state_budget
        """The bytes of window state the instance may hold now (`InstanceFollower.state_budget`)."""
        self._held: dict[int, int] = {}
        """Each kept pid's window state in bytes, as its newest batch left it: a batch reports only the
        pids it read, and an idle pid holds its window still."""
        self._over_budget_said_at = -HOT_WARNING_EVERY_S

    def __call__(self, batch_df: Any, batch_id: int) -> None:
        started = time.monotonic()
        if batch_id <= self.last_batch:
            # Already in Kafka from an attempt that crashed before Spark logged the batch as done. The
            # batch still runs, output discarded: Spark re-derives the same state version from the same
            # logged offsets, and it fails a batch whose state stores did not all commit.
            batch_df.write.format("noop").mode("append").save()
            self._watermarks.clear()  # its windows changed unseen
            self.watermarks_path.unlink(missing_ok=True)
            self.completed = batch_id
            return
        # One pass over the batch: collecting as Arrow runs the stateful operator, which commits its
        # state stores when each task's partition is consumed (a second action would recompute or need
        # a cache: measured slower).
        table: pa.Table = batch_df.toArrow()
        offsets = read_logged_offsets(self.checkpoint, batch_id)
        columns = {name: table.column(name).to_numpy() for name in table.column_names}
        kind = columns.get("kind", np.empty(0, dtype=np.int8))
        # Before the transaction begins: the broker bounds its length, and neither needs it.
        ready = BeforeCommit(*self._result_times(columns, kind), lag=self._lag(offsets["offsets"]))

        try:
            metrics = self._attempts(
                batch_id, lambda: self._write(batch_id, offsets, columns, kind, started, ready)
            )
        except KafkaException as exc:
            error = exc.args[0]
            if error.code() in FENCED_ERRORS:
                raise self._taken_over(batch_id, error) from exc
            if error.fatal():
                raise ProducerFailed(
                    f"batch {batch_id}: the producer failed for good ({error.str()})"
                ) from exc
            raise
        self.last_batch = self.completed = batch_id
        if self.on_commit is not None:
            self.on_commit(metrics)
        self._note_watermarks(offsets, columns, kind)
        self._note_yields(offsets, metrics)
        self._warn_hot(metrics)
        self._warn_over_budget(metrics)

    def _note_yields(self, offsets: dict[str, Any], metrics: dict[str, Any]) -> None:
        """Note each pid's tuples and results, for the source to bound the next batches by
        (`pipeline.batch_sizing.pids_within`); pids no longer kept are forgotten."""
        kept = offsets["offsets"].get(self.streams[0], {})
        fed = {int(p): s for p, s in metrics["pids"].items() if s["in"]}
        for p, stats in fed.items():
            recent = self._recent_yields.setdefault(p, deque(maxlen=RECENT_BATCHES))
            recent.append((int(stats["in"]), int(stats["results"])))
        self._recent_yields = {p: r for p, r in self._recent_yields.items() if str(p) in kept}
        if fed:
            write_recent_yields(self.recent_yields_path, self._recent_yields)

    def _warn_hot(self, metrics: dict[str, Any]) -> None:
        """Name the pid and key behind a batch that made a large share of the results bound: later
        batches take fewer tuples (`pipeline.batch_sizing.tuples_within`), and the operator should know
        why."""
        bound = self.cfg.instance.max_results_per_batch
        now = time.monotonic()
        if metrics["results"] < HOT_SHARE * bound or now - self._warned_at < HOT_WARNING_EVERY_S:
            return
        self._warned_at = now
        pid, stats = max(metrics["pids"].items(), key=lambda item: int(item[1]["results"]))
        key, by_key = stats["hot_key"] or (None, 0)
        log.warning(
            "%s: hot key: batch %s made %s results from %s tuples (%s of instance.max_results_per_batch); "
            "pid %s made %s of them, %s on key %s. Batches take fewer tuples while it lasts.",
            self.instance,
            metrics["batch"],
            f"{metrics['results']:,}",
            f"{metrics['tuples_in']:,}",
            f"{metrics['results'] / bound:.0%}",
            pid,
            f"{int(stats['results']):,}",
            f"{by_key:,}",
            key,
        )

    def _warn_over_budget(self, metrics: dict[str, Any]) -> None:
        """Say when the windows hold more than the budget, at most every HOT_WARNING_EVERY_S: the
        controller's memory policies move state away from such an instance (docs/memory.md)."""
        held, budget = metrics["state_bytes"], metrics["state_budget_bytes"]
        now = time.monotonic()
        if held <= budget or now - self._over_budget_said_at < HOT_WARNING_EVERY_S:
            return
        self._over_budget_said_at = now
        log.warning(
            "%s: its windows hold %s bytes, over its state budget of %s (%d pids)",
            self.instance,
            f"{held:,}",
            f"{budget:,}",
            len(self._held),
        )

    def _held_state(self, offsets: dict[str, Any], pids: dict[str, dict[str, Any]]) -> int:
        """The bytes all kept pids' windows hold after this batch (`held_after`)."""
        self._held = held_after(self._held, pids, offsets["offsets"].get(self.streams[0], {}))
        return sum(self._held.values())

    def _attempts(self, batch_id: int, write: Callable[[], dict[str, Any]]) -> dict[str, Any]:
        """`write` (the batch's `_write`), again in a new transaction while the broker aborts it or is
        away (decisions 0048, 0052). The output is the same every time; an aborted attempt is invisible
        to read_committed readers."""
        aborted = outages = 0
        while True:
            try:
                metrics = write()
                self.broker_away = ""
                return metrics
            except (KafkaException, TimeoutError) as exc:
                error = exc.args[0] if isinstance(exc, KafkaException) else None
                if error is not None and error.code() in FENCED_ERRORS:
                    raise
                reason = error.str() if error is not None else str(exc)
                if broker_away(exc):
                    outages += 1
                    pause_s = min(OUTAGE_BACKOFF_S, 2.0**outages)
                    self.broker_away = reason
                else:
                    aborted += 1
                    if error is None or not error.txn_requires_abort() or aborted >= TRANSACTION_ATTEMPTS:
                        raise
                    pause_s = min(30.0, 2.0**aborted)
                log.warning(
                    "%s: batch %s not committed (%s); again in %g s", self.instance, batch_id, reason, pause_s
                )
                if self._in_transaction:
                    self._retrying(self.producer.abort_transaction)
                time.sleep(pause_s)

    def _taken_over(self, batch_id: int, error: KafkaError) -> RuntimeError:
        """Why the producer reads as fenced. The broker answers alike when another producer initialised
        this `transactional.id` (the controller fencing a dead instance, or a second process under this
        name) and when it aborted a transaction open for longer than its timeout: an eviction in the log,
        or a transaction open for less than the timeout, says it was the former."""
        open_s = time.monotonic() - self._begun
        if open_s > TRANSACTION_TIMEOUT_S and self._eviction_unread():
            return TransactionOverrun(
                f"batch {batch_id}: its transaction was open {open_s:.1f} s, longer than the transaction "
                f"timeout ({TRANSACTION_TIMEOUT_S:g} s), and the broker aborted it ({error.str()})"
            )
        return Fenced(f"{self.instance}'s transactional id was taken over ({error.str()}); not committing")

    def _eviction_unread(self) -> bool:
        """No eviction of this incarnation in the control log, or the log not readable now (after an
        outage): then the query starts again, and its new sink, or the follower, meets any eviction."""
        try:
            return self.evictions.catch_up() is None
        except (KafkaException, TimeoutError):
            return True

    def _write(
        self,
        batch_id: int,
        offsets: dict[str, Any],
        columns: dict[str, np.ndarray],
        kind: np.ndarray,
        started: float,
        ready: BeforeCommit,
    ) -> dict[str, Any]:
        """One transaction with the batch's whole output, its commit marker and its metrics; returns
        the metrics."""
        self.producer.begin_transaction()
        self._begun, self._in_transaction = time.monotonic(), True
        results = self._produce_results(columns, kind == KIND_RESULT)
        late = self._produce_dead_letters(columns, kind == KIND_LATE, "late")
        malformed = self._produce_dead_letters(columns, kind == KIND_MALFORMED, "malformed")
        self._acknowledge_handoffs(offsets, columns, kind)
        marker = {
            "instance": self.instance,
            "incarnation": self.incarnation,
            "batch": batch_id,
            "epoch": offsets["epoch"],
            "offsets": offsets["offsets"],
            "time_ms": int(time.time() * 1000),
        }
        self.producer.produce(self.cfg.sink_commits_topic, key=self.instance, value=json.dumps(marker))
        metrics = self._metrics(batch_id, offsets, columns, kind, started, results, late, malformed, ready)
        self.producer.produce(self.cfg.metrics_topic, key=self.instance, value=json.dumps(metrics))
        evicted_in = self._evicted_in(offsets)
        if evicted_in is not None:
            self._retrying(self.producer.abort_transaction)
            raise Fenced(f"{self.instance} was declared dead in epoch {evicted_in}; not committing")
        self._retrying(self.producer.commit_transaction)
        return metrics

    def _retrying(self, call: Callable[[float], None]) -> None:
        """Commit or abort, again while the broker answers that it may yet succeed (it is away: a
        restart, a network silence), however long that takes; either ends the transaction."""
        while True:
            try:
                call(60)
                break
            except KafkaException as exc:
                if not exc.args[0].retriable():
                    raise
                log.warning("%s: %s; trying again", self.instance, exc.args[0].str())
                time.sleep(1.0)
        self._in_transaction = False

    def _note_watermarks(
        self, offsets: dict[str, Any], columns: dict[str, np.ndarray], kind: np.ndarray
    ) -> None:
        """Note each kept pid's window `stream_max` and the offsets its input reaches after this batch, for
        the source to announce a parallel track at its plan (`pipeline.instance_files.stream_max_at`). A
        pid the operator was not called for kept its window, and its `stream_max`, whatever its offsets
        did."""
        rows = kind == KIND_WATERMARK
        maxima = _stream_max_columns(columns, rows, len(self.streams))
        self._watermarks.update(zip(columns["pid"][rows].tolist(), maxima, strict=True))
        held = offsets["offsets"]
        kept = held.get(self.streams[0], {})
        self._watermarks = {p: w for p, w in self._watermarks.items() if str(p) in kept}
        noted = {
            str(p): {"stream_max": list(w), "offsets": {s: held[s][str(p)] for s in self.streams}}
            for p, w in self._watermarks.items()
        }
        write_watermarks(self.watermarks_path, noted)

    def _evicted_in(self, offsets: dict[str, Any]) -> int | None:
        """The epoch of an assignment newer than the batch's that evicts this incarnation (its pids went
        elsewhere)."""
        newest = self.evictions.catch_up()
        return newest if newest is not None and newest > offsets["epoch"] else None

    def _acknowledge_handoffs(
        self, offsets: dict[str, Any], columns: dict[str, np.ndarray], kind: np.ndarray
    ) -> None:
        """Released (with the exported window) and Acquired messages for this batch's epoch change."""
        epoch = int(offsets["epoch"])
        for p, released in offsets.get("released", {}).items():
            if released["move_id"] is None:
                continue
            snapshot = self._export(int(p), columns, kind) if released["export"] else None
            track = bool(released.get("track"))
            stream_max = _released_stream_max(columns, kind, int(p), len(self.streams)) if track else None
            announced = released.get("stream_max")
            if announced is not None and tuple(announced) != stream_max:
                raise RuntimeError(
                    f"pid {p}'s parallel track began at stream_max {stream_max}, not at the {announced} "
                    "its plan announced"
                )
            msg = ReleasedMsg(
                instance=self.instance,
                epoch=epoch,
                pid=int(p),
                move_id=released["move_id"],
                cutoff=released["cutoff"],
                snapshot=snapshot,
                stream_max=stream_max,
            )
            publish(self.producer, self.cfg.control_topic, msg)
        ended = kind == KIND_TRACK_DONE
        for p, side in zip(columns["pid"][ended].tolist(), columns["aux"][ended].tolist(), strict=True):
            track = offsets["tracking"][str(p)]
            done = TrackDoneMsg(
                instance=self.instance,
                epoch=epoch,
                pid=int(p),
                move_id=track["move_id"],
                side="old" if side == TRACK_OLD else "new",
            )
            publish(self.producer, self.cfg.control_topic, done)
        for p, acquired in offsets.get("acquired", {}).items():
            handoff = handoff_from_json(acquired["handoff"])
            msg2 = AcquiredMsg(instance=self.instance, epoch=epoch, pid=int(p), move_id=handoff.move_id)
            publish(self.producer, self.cfg.control_topic, msg2)

    def _export(self, pid: int, columns: dict[str, np.ndarray], kind: np.ndarray) -> Snapshot:
        """Write a released pid's window to the handoff topic in chunks; flush to learn their offsets
        (inside the transaction: readers see them only once it commits). Chunks the broker has not taken
        while the transaction lasts fail the attempt, for another to produce them again: `Released` must
        not name a snapshot whose checksum its receiver would reject for ever."""
        rows = (kind == KIND_STATE) & (columns["pid"] == pid)
        stream = columns["aux"][rows]
        parts = tuple(
            Part(
                columns["id0"][rows][stream == j],
                columns["key"][rows][stream == j],
                columns["ts"][rows][stream == j],
            )
            for j in range(len(self.streams))
        )
        stream_max = _released_stream_max(columns, kind, pid, len(self.streams))
        blob = window_to_bytes(WindowState(parts, stream_max))
        topic = self.cfg.handoff_topic
        self._delivered, self._undelivered = {}, {}
        starts = range(0, max(1, len(blob)), SNAPSHOT_CHUNK_BYTES)
        for i, start in enumerate(starts):
            chunk = blob[start : start + SNAPSHOT_CHUNK_BYTES]
            self.producer.produce(topic, value=chunk, partition=0, on_delivery=self._on_chunk(i))
        self.producer.flush(max(0.0, self._begun + TRANSACTION_TIMEOUT_S - time.monotonic()))
        missing = [i for i in range(len(starts)) if i not in self._delivered]
        if missing:
            failed = next(iter(self._undelivered.values()), None)
            reason = failed.str() if failed is not None else "the transaction's time ran out"
            raise KafkaException(
                KafkaError(
                    failed.code() if failed is not None else KafkaError._MSG_TIMED_OUT,
                    f"pid {pid}'s snapshot: {len(missing)} of {len(starts)} chunks not delivered ({reason})",
                    txn_requires_abort=True,
                )
            )
        offsets = tuple(self._delivered[i] for i in range(len(starts)))
        return Snapshot(topic=topic, partition=0, offsets=offsets, sha256=hashlib.sha256(blob).hexdigest())

    def _on_chunk(self, index: int) -> Any:
        def record(err: KafkaError | None, msg: Any) -> None:
            if err is not None:
                self._undelivered[index] = err
            else:
                self._delivered[index] = msg.offset()

        return record

    def _metrics(
        self,
        batch_id: int,
        offsets: dict[str, Any],
        columns: dict[str, np.ndarray],
        kind: np.ndarray,
        started: float,
        results: int,
        late: int,
        malformed: int,
        ready: BeforeCommit,
    ) -> dict[str, Any]:
        """Per-batch metrics, written in the batch's transaction (latency measured just before commit)."""
        now = time.time()
        latency, by_pid = np.empty(0), {}
        if results:
            latency = now - ready.result_times_ms / 1000.0
            by_pid = _by_pid(ready.result_pids, latency)
        stats = kind == KIND_STATS
        ended = time.monotonic()
        busy = (ended - started) / max(ended - self.last_end, 1e-3)
        self.last_end = ended
        pids = {
            str(p): {
                "in": int(n),
                "results": int(r),
                "state_bytes": int(b),
                "window_tuples": int(w),
                "newest_ms": int(t),
                "latency_sample": _sample(by_pid.get(int(p), np.empty(0)), 20),
                "hot_key": HotKey.decode(hot),
            }
            for p, n, r, b, w, t, hot in zip(
                columns["pid"][stats],
                columns["id0"][stats],
                columns["id1"][stats],
                columns["aux"][stats],
                columns["key"][stats],
                columns["ts"][stats],
                columns["payload"][stats],
                strict=True,
            )
        }
        return {
            "kind": "batch",
            "instance": self.instance,
            "batch": batch_id,
            "epoch": offsets["epoch"],
            "time_ms": int(now * 1000),
            "duration_s": ended - started,
            "busy": min(1.0, busy),
            "tuples_in": int(columns["id0"][stats].sum()) if stats.any() else 0,
            "results": results,
            "late": late,
            "malformed": malformed,
            "latency_p50_s": float(np.percentile(latency, 50)) if len(latency) else None,
            "latency_p99_s": float(np.percentile(latency, 99)) if len(latency) else None,
            # An evenly spaced sample of this batch's sorted latencies, for run-wide percentiles.
            "latency_sample": _sample(latency, 200),
            "pids": pids,
            "state_bytes": self._held_state(offsets, pids),
            "state_budget_bytes": self.state_budget(),
            "lag": ready.lag,
        }

    @staticmethod
    def _result_times(columns: dict[str, np.ndarray], kind: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Each result's newest event time (ms) and its pid, decoded from the results messages."""
        rows = kind == KIND_RESULT
        if not rows.any():
            return np.empty(0), np.empty(0, dtype=np.int64)
        times = [decode_results(payload).max_event_times for payload in columns["payload"][rows]]
        return np.concatenate(times).astype(np.float64), np.repeat(columns["pid"][rows], columns["key"][rows])

    def _produce_results(self, columns: dict[str, np.ndarray], mask: np.ndarray) -> int:
        """Each `result` row's payload is a results message already (`operator.RESULTS_PER_MESSAGE`)."""
        if not mask.any():
            return 0
        for pid, payload in zip(columns["pid"][mask], columns["payload"][mask], strict=True):
            self._produce(self.cfg.results_topic, int(pid), payload)
        return int(columns["key"][mask].sum())

    def _produce_dead_letters(self, columns: dict[str, np.ndarray], mask: np.ndarray, what: str) -> int:
        for i in np.flatnonzero(mask):
            pid = int(columns["pid"][i])
            if what == "late":
                stream = self.streams[int(columns["aux"][i])]
                record = {
                    "reason": LATE_REASON,
                    "stream": stream,
                    "pid": pid,
                    "id": int(columns["id0"][i]),
                    "key": int(columns["key"][i]),
                    "event_time_ms": int(columns["ts"][i]),
                }
            else:
                stream = self.streams[int(columns["key"][i])]
                record = {
                    "reason": f"malformed: {Malformation(int(columns['ts'][i])).name.lower()}",
                    "stream": stream,
                    "pid": pid,
                    "topic": self.cfg.input_topic(stream),
                    "partition": pid,
                    "offset": int(columns["id0"][i]),
                }
            self._produce(self.cfg.dead_letter_topic, None, json.dumps(record).encode())
        return int(mask.sum())

    def _produce(self, topic: str, partition: int | None, value: bytes) -> None:
        kwargs: dict[str, Any] = {"value": value}
        if partition is not None:
            kwargs.update(partition=partition, key=str(partition))
        while True:
            try:
                self.producer.produce(topic, **kwargs)
                return
            except BufferError:
                self.producer.poll(0.05)

    def _lag(self, offsets: dict[str, dict[str, int]]) -> dict[str, int]:
        """Per pid: messages in the input topics beyond what this batch processed. A figure for the
        metrics only, so a broker that cannot tell (an outage, a leader change) never fails the batch:
        the last known figure stands, and the log says why."""
        topic_stream = {self.cfg.input_topic(s): s for s in self.streams}
        wanted = [(self.cfg.input_topic(s), int(p)) for s, by_pid in offsets.items() for p in by_pid]
        try:
            ends = partition_offsets(self.admin, wanted, timeout_s=LAG_TIMEOUT_S)
        except KafkaException as exc:
            log.warning("%s: input lag unknown, the last known is reported (%s)", self.instance, exc)
            return self._last_lag
        lag: dict[str, int] = {}
        for (topic, pid), end in ends.items():
            done = offsets[topic_stream[topic]][str(pid)]
            lag[str(pid)] = lag.get(str(pid), 0) + max(0, end - done)
        self._last_lag = lag
        return lag

    def close(self) -> None:
        """Deliver what is queued and let go; a fenced producer (its epoch taken) has nothing left to
        deliver, and says so by raising."""
        with contextlib.suppress(KafkaException):
            self.producer.flush(30)
        self.evictions.close()
