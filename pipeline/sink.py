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

Handoffs ride the same transaction (`pipeline.batch_output`). Before committing, the sink reads the
control log's assignments to its end and aborts if a newer one lists this instance as evicted (it was
declared dead and its pids recovered elsewhere): a stale owner can neither emit nor acknowledge. The
controller also fences a dead instance by initialising its `transactional.id`; a sink so fenced stops
as evicted (`Fenced`) instead of failing and restarting as though nothing had happened.

A batch's produce phase (its transaction, from begin to commit) must fit in `TRANSACTION_TIMEOUT_S`:
the broker aborts a longer one, and the sink then fails naming the overrun (`TransactionOverrun`).

After each commit the sink notes every kept pid's window `stream_max`, with the offsets it has read up to,
in a file the source reads when it plans a batch: a parallel track that begins where the last batch left
its pid is then announced before its batch runs (decision 0023).

Here is the transaction and what outlives a batch; the rest is apart: the output and acknowledgements
it carries (`pipeline.batch_output`), its metrics record, a pure function (`pipeline.batch_metrics`),
and the reading back of markers, which the controller does too (`pipeline.commits`).
"""

from __future__ import annotations

import contextlib
import json
import logging
import time
from collections import deque
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
from confluent_kafka import KafkaError, KafkaException

from pipeline.batch_metrics import BatchRecord, BeforeCommit, batch_record, result_times
from pipeline.batch_output import BatchOutput, stream_max_columns
from pipeline.batch_plan import acquired_of, released_of, tracking_of
from pipeline.batch_sizing import Yield
from pipeline.batch_timings import SINK_PHASES
from pipeline.commits import Evictions, last_commit, read_logged_offsets, transactional_id
from pipeline.config import Config
from pipeline.instance_files import SpillRequests, write_recent_yields, write_spill_requests, write_watermarks
from pipeline.kafka_client import kafka_config
from pipeline.operator import KIND_LATE, KIND_MALFORMED, KIND_RESULT, KIND_WATERMARK
from pipeline.protocol import CommitMarker, eviction_entries
from pipeline.protocol_codec import marker_to_json
from pipeline.rows import MAX_SPILLS
from pipeline.signing import produce_signed
from pipeline.spill import SpillChoice, batch_room, choose_spills, spilled_of
from pipeline.topics import broker_away, partition_offsets

log = logging.getLogger(__name__)

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
KEPT_PHASES = 200  # batches whose sink phases are kept for the timings log (`ExactlyOnceSink.phases`)
FENCED_ERRORS = frozenset(
    {KafkaError._FENCED, KafkaError.PRODUCER_FENCED, KafkaError.INVALID_PRODUCER_EPOCH, KafkaError._FATAL}
)
"""What the producer answers once another took its `transactional.id` or the broker aborted its
transaction for lasting too long: no later call of it can succeed. `_FATAL` is what every call answers
after the first of those, raised in librdkafka's own thread (a frozen process wakes to it)."""
LAG_TIMEOUT_S = 5.0  # how long a batch waits for the input's end offsets, a metrics figure


class Fenced(RuntimeError):
    """This instance no longer owns a pid it processed: it was declared dead and must restart empty."""


class TransactionOverrun(RuntimeError):
    """A batch's transaction lasted longer than `TRANSACTION_TIMEOUT_S`, and the broker aborted it."""


class ProducerFailed(RuntimeError):
    """The producer met a fatal error other than a fence (seen: INVALID_TXN_STATE on an abort after a
    broker restart): its transactional state is lost, and only a new producer goes on."""


HOT_SHARE = 0.25
"""A batch that makes this share of `instance.max_results_per_batch` or more names its hottest pid and
key in the log, at most every HOT_WARNING_EVERY_S."""
HOT_WARNING_EVERY_S = 30.0
RECENT_BATCHES = 8
"""The source bounds a pid's input in a batch by this many of its recent batches' tuples and results
(`pipeline.batch_sizing.results_of`)."""


def _bytes_per_window_tuple(metrics: BatchRecord) -> float | None:
    """What a window tuple costs, from the pids this batch read; None before any window holds one."""
    figures = metrics["pids"].values()
    window_tuples = sum(f["window_tuples"] for f in figures)
    return sum(f["state_bytes"] for f in figures) / window_tuples if window_tuples else None


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
        on_commit: Callable[[BatchRecord], None] | None = None,
        state_budget: Callable[[], int] | None = None,
        spill_requests: Path | None = None,
        spill_gate: Callable[[], bool] | None = None,
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
        self._read_to: dict[tuple[str, str], int] = {}
        """Where the previous batch's input ended, per (stream, pid): what a batch read, in messages."""
        # Kept across restarts: it describes the workload, not this incarnation's state.
        self.recent_yields_path = recent_yields
        self._recent_yields: dict[int, deque[Yield]] = {}
        self.spill_requests_path = spill_requests
        if spill_requests is not None:  # asked by a previous incarnation, of windows it may not hold
            spill_requests.unlink(missing_ok=True)
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
        self.last_batch = marker.batch if marker else -1
        self.completed = -1
        """The newest batch this process completed (committed, or already committed and run again)."""
        names = eviction_entries(instance, incarnation)
        self.evictions = Evictions(bootstrap, cfg.control_topic, names, self.admin)
        self._begun = time.monotonic()  # when the batch's transaction began
        self._in_transaction = False
        self.output = BatchOutput(self.producer, cfg, instance)
        self.last_end = time.monotonic()
        self.broker_away = ""
        """Why the batch in flight cannot reach the broker ("" while it can): the instance's /metrics."""
        self._warned_at = -HOT_WARNING_EVERY_S
        self.streams = cfg.streams
        self.on_commit = on_commit
        """Called with each committed batch's metrics record, after its commit (the instance's /metrics)."""
        self.state_budget = state_budget or cfg.instance.state_budget
        """The bytes of window state the instance may hold now (`InstanceFollower.state_budget`)."""
        self.spill_gate = spill_gate or (lambda: True)
        """Whether to spill at the configured threshold now, or only past the whole budget
        (`InstanceFollower.spill_at_threshold`)."""
        self._held: dict[int, int] = {}
        """Each kept pid's window state in bytes, as its newest batch left it: a batch reports only the
        pids it read, and an idle pid holds its window still."""
        self.phases: dict[int, dict[str, float]] = {}
        """Seconds each of the newest batches spent in the sink's phases (`batch_timings.SINK_PHASES`),
        by batch: the instance's `BatchTimingsLog` reads them."""
        self._committing_at = 0.0
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
        collected = time.monotonic()
        offsets = read_logged_offsets(self.checkpoint, batch_id)
        columns = {name: table.column(name).to_numpy() for name in table.column_names}
        kind = columns.get("kind", np.empty(0, dtype=np.int8))
        # Before the transaction begins: the broker bounds its length, and neither needs it.
        ready = BeforeCommit(*result_times(columns, kind), lag=self._lag(offsets["offsets"]))
        prepared = time.monotonic()
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
        committed = time.monotonic()
        self.last_batch = self.completed = batch_id
        if self.on_commit is not None:
            self.on_commit(metrics)
        self._note_watermarks(offsets, columns, kind)
        self._note_yields(offsets, metrics)
        self._note_spills(offsets, metrics)
        self._warn_hot(metrics)
        self._warn_over_budget(metrics)
        marks = (started, collected, prepared, self._committing_at, committed, time.monotonic())
        self.phases[batch_id] = {name: marks[i + 1] - marks[i] for i, name in enumerate(SINK_PHASES)}
        for old in sorted(self.phases)[:-KEPT_PHASES]:
            del self.phases[old]

    def _note_yields(self, offsets: dict[str, Any], metrics: BatchRecord) -> None:
        """Note each pid's tuples, results and key combinations within, for the source to bound the next
        batches by (`pipeline.batch_sizing.pids_within`); pids no longer kept are forgotten."""
        kept = offsets["offsets"].get(self.streams[0], {})
        fed = {int(p): s for p, s in metrics["pids"].items() if s["in"]}
        for p, stats in fed.items():
            recent = self._recent_yields.setdefault(p, deque(maxlen=RECENT_BATCHES))
            recent.append((int(stats["in"]), int(stats["results"]), int(stats["within"])))
        self._recent_yields = {p: r for p, r in self._recent_yields.items() if str(p) in kept}
        if fed:
            write_recent_yields(self.recent_yields_path, self._recent_yields)

    def _note_spills(self, offsets: dict[str, Any], metrics: BatchRecord) -> None:
        """Ask the next batch to spill pids while the windows hold more than the spill threshold of the
        budget (`pipeline.spill.choose_spills`): pids in a move or an overlap, or spilled `MAX_SPILLS`
        times already, are not candidates; a spilled pid's newest generation is one. While the
        controller closes the spill gate (another instance has room, `SpillGateMsg`), only past the
        whole budget. And bound the next batch's input by the room the budget leaves after those spills
        (`pipeline.spill.batch_room`): an instance behind its input would otherwise read a batch larger
        than the budget itself. The next batch's plan decides (`FluxjoinStreamReader`), and Spark logs
        it."""
        settings = self.cfg.instance
        if self.spill_requests_path is None or settings.spill_threshold <= 0:
            return
        spilled = spilled_of(offsets)
        busy = {*tracking_of(offsets), *released_of(offsets), *acquired_of(offsets)}
        busy |= {p for p, spill in spilled.items() if len(spill.cutoffs) >= MAX_SPILLS}
        recent = {p: sum(r for _, r, _ in batches) for p, batches in self._recent_yields.items()}
        per_tuple = _bytes_per_window_tuple(metrics)
        budget = metrics["state_budget_bytes"]
        read = self._read_since_last(offsets["offsets"])
        waiting = sum(metrics["lag"].values()) * metrics["tuples_in"] // read if read > 0 else 0
        wanted = max(metrics["tuples_in"], min(waiting, settings.max_rows_per_batch))
        chosen = choose_spills(
            self._held,
            recent,
            budget,
            settings.spill_threshold if self.spill_gate() else 1.0,
            settings.spill_fraction,
            SpillChoice(settings.spill_choice),
            [p for p in self._held if p not in busy],
            # What the next batch is expected to add: as much as this one read, or the input waiting
            # now (`lag`, at the tuples per message this batch read) up to a whole batch of
            # `max_rows_per_batch`: room for a batch that keeps up, not for the whole of a backlog.
            incoming=int(wanted * (per_tuple or 0)),
        )
        room = None if per_tuple is None else batch_room(self._held, chosen, budget, per_tuple)
        write_spill_requests(
            self.spill_requests_path, SpillRequests({p: self._held[p] for p in chosen}, room)
        )

    def _read_since_last(self, ends: Mapping[str, Mapping[str, int]]) -> int:
        """Messages this batch read: its end offsets against the previous batch's."""
        read_to = {(s, p): o for s, by_pid in ends.items() for p, o in by_pid.items()}
        read = sum(o - self._read_to[k] for k, o in read_to.items() if k in self._read_to)
        self._read_to = read_to
        return read

    def _warn_hot(self, metrics: BatchRecord) -> None:
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

    def _warn_over_budget(self, metrics: BatchRecord) -> None:
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

    def _attempts(self, batch_id: int, write: Callable[[], BatchRecord]) -> BatchRecord:
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
    ) -> BatchRecord:
        """One transaction with the batch's whole output, its commit marker and its metrics; returns
        the metrics."""
        self.producer.begin_transaction()
        self._begun, self._in_transaction = time.monotonic(), True
        results = self.output.produce_results(columns, kind == KIND_RESULT)
        late = self.output.produce_dead_letters(columns, kind == KIND_LATE, "late")
        malformed = self.output.produce_dead_letters(columns, kind == KIND_MALFORMED, "malformed")
        self.output.acknowledge_handoffs(offsets, columns, kind, self._begun + TRANSACTION_TIMEOUT_S)
        marker = CommitMarker(
            instance=self.instance,
            incarnation=self.incarnation,
            batch=batch_id,
            epoch=int(offsets["epoch"]),
            offsets={s: {int(p): o for p, o in by_pid.items()} for s, by_pid in offsets["offsets"].items()},
            time_ms=int(time.time() * 1000),
            spilled={p: spill.cutoffs for p, spill in spilled_of(offsets).items()},
        )
        self._produce_signed(self.cfg.sink_commits_topic, marker_to_json(marker))
        metrics = self._metrics(batch_id, offsets, columns, kind, started, results, late, malformed, ready)
        self._produce_signed(self.cfg.metrics_topic, metrics)
        evicted_in = self._evicted_in(offsets)
        if evicted_in is not None:
            self._retrying(self.producer.abort_transaction)
            raise Fenced(f"{self.instance} was declared dead in epoch {evicted_in}; not committing")
        self._committing_at = time.monotonic()
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
        maxima = stream_max_columns(columns, rows, len(self.streams))
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

    def _produce_signed(self, topic: str, record: Mapping[str, Any]) -> None:
        """One record of this batch's transaction, under the instance's key and signed when it has one."""
        produce_signed(self.producer, topic, self.instance, json.dumps(record).encode())

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
    ) -> BatchRecord:
        """Per-batch metrics, written in the batch's transaction (latency measured just before commit).
        The record is `batch_record`'s; the clocks, the previous batch's end and the windows held are
        the sink's, as they outlive the batch."""
        now, ended = time.time(), time.monotonic()
        last_end, self.last_end = self.last_end, ended
        metrics, self._held = batch_record(
            self.instance,
            batch_id,
            offsets,
            columns,
            kind,
            results,
            late,
            malformed,
            ready,
            now=now,
            started=started,
            ended=ended,
            last_end=last_end,
            held=self._held,
            kept=offsets["offsets"].get(self.streams[0], {}),
            state_budget_bytes=self.state_budget(),
        )
        return metrics

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
