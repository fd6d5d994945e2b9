"""The pipeline's Kafka topics: what they must look like, and creating them idempotently.

Every process that touches the pipeline (generator, instances, verifier, controller) calls
`ensure_topics` before anything else, so whichever starts first creates the topics and the others
find them. Partition counts are checked on existing topics because a topic with the wrong count
silently breaks co-partitioning (Kafka partition index == pid): that must stop the pipeline with a
clear message, never be "fixed" by adding partitions.

Also the one place that turns an unreachable broker into a readable error (`check_reachable`),
instead of librdkafka retrying forever behind a hung command.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from functools import partial
from typing import TypeVar

from confluent_kafka import Consumer, IsolationLevel, KafkaError, KafkaException, Message, TopicPartition
from confluent_kafka.admin import AdminClient, NewTopic, OffsetSpec

from pipeline.config import Config
from pipeline.kafka_client import CONSUMER_GROUP, kafka_config
from pipeline.signing import may_say

# Seconds to wait for the broker to answer.
DEFAULT_TIMEOUT_S = 10.0

VISIBLE_TIMEOUT_S = 60.0
"""How long created topics may take to show in metadata: a broker that has just restarted over many
partitions accepts a creation at once but can take many seconds to show it (docs/benchmarks.md,
"Measurements behind the code's constants")."""

BOUNDED_READ = {"fetch.wait.max.ms": 10}
"""Consumer settings for reading offsets known to exist (a range below the end, one message). A fetch
that finds nothing new waits at the broker for up to `fetch.wait.max.ms` (500 ms by default), and the
broker answers a connection's requests in order: the next assignment's first fetch, or an
`offsets_for_times`, waited behind it (decision 0034 measures the difference)."""


def consume_ready(consumer: Consumer, up_to: int, wait_s: float) -> list[Message]:
    """Up to `up_to` messages (and events) the consumer holds already, without waiting; when it holds
    none, the first to arrive within `wait_s`.

    `consume(n, timeout)` returns early only once it has all n. Asked for the messages left in a range
    of offsets, it waited out its whole timeout whenever fewer came, and on a transactional topic fewer
    always come: its commit markers take offsets but are never delivered. That was half a second of
    every read task of every batch (docs/benchmarks.md, "Where a batch's time goes").
    """
    return consumer.consume(num_messages=up_to, timeout=0) or consumer.consume(num_messages=1, timeout=wait_s)


# librdkafka's own log lines (e.g. a connection refused every 50 ms while a broker is down) go to
# this logger instead of straight to stderr: an application that configures logging may show them, a
# command line tool shows the one clear error raised here instead (fluxjoin's own processes keep them
# out of their log: `pipeline.process_log`).
KAFKA_LOG = logging.getLogger("fluxjoin.kafka")
KAFKA_LOG.addHandler(logging.NullHandler())

log = logging.getLogger(__name__)


class TopicError(ValueError):
    """An existing topic does not match what the pipeline needs (the message says which and how)."""


class BrokerUnreachable(ConnectionError):
    """No Kafka broker answered at the bootstrap address in time."""


@dataclass(frozen=True, slots=True, kw_only=True)
class TopicSpec:
    name: str
    partitions: int
    config: dict[str, str] = field(default_factory=dict)


COMMITS_SEGMENT_MS = 10 * 60 * 1000
"""How often the commits topic rolls a segment, which compaction can then shrink to one marker per
instance."""


def topic_specs(cfg: Config) -> list[TopicSpec]:
    """All topics of a pipeline. Inputs and results have P partitions (partition index == pid);
    the bookkeeping topics have one, so their readers see a single total order."""
    p, settings = cfg.partitions, cfg.topics
    isr = settings.min_insync_replicas
    everywhere = {} if isr is None else {"min.insync.replicas": str(isr)}
    data = everywhere | (
        {} if settings.retention_ms is None else {"retention.ms": str(settings.retention_ms)}
    )
    specs = [
        # Message timestamps are event times (the replay handoff seeks by them); a max-rate run's
        # virtual clock may run ahead of the wall clock, which the broker must accept.
        *(
            TopicSpec(name=t, partitions=p, config=data | {"message.timestamp.after.max.ms": str(2**63 - 1)})
            for t in cfg.input_topics
        ),
        TopicSpec(name=cfg.results_topic, partitions=p, config=data),
        TopicSpec(name=cfg.dead_letter_topic, partitions=1, config=data),
        # Compacted: only the latest commit record per key (instance) matters. The cleaner compacts
        # closed segments only, and a segment closes at 1 GB by default (millions of markers), so it
        # rolls every 10 minutes: a controller that starts reads about that much, not the whole history.
        TopicSpec(
            name=cfg.sink_commits_topic,
            partitions=1,
            config={"cleanup.policy": "compact", "segment.ms": str(COMMITS_SEGMENT_MS)},
        ),
        # Stamped by the broker's clock: the controller ages heartbeats and windows batches by it, never
        # by an instance's clock, which its host may step (decision 0054).
        TopicSpec(name=cfg.metrics_topic, partitions=1, config={"message.timestamp.type": "LogAppendTime"}),
        # The protocol's only state: every record kept (a broker's default retention, 7 days, would delete
        # the assignment of a pipeline that has not moved a pid for a week), never compacted (its keys
        # are message types: compaction would keep one assignment and one acknowledgement of all).
        TopicSpec(
            name=cfg.control_topic, partitions=1, config={"cleanup.policy": "delete", "retention.ms": "-1"}
        ),
        TopicSpec(name=cfg.handoff_topic, partitions=1),
    ]
    return [TopicSpec(name=s.name, partitions=s.partitions, config=everywhere | s.config) for s in specs]


REQUIRED_CONFIG = {"retention.ms", "cleanup.policy", "message.timestamp.type"}
"""The topic settings fluxjoin's correctness rests on, checked on topics it finds (`check_topic_configs`):
the control log must keep everything (decision 0049), the commits topic must be compacted, the metrics
topic stamped by the broker (decision 0054)."""


def admin_client(bootstrap: str) -> AdminClient:
    """An AdminClient for `bootstrap` (does not connect until first used)."""
    return AdminClient(
        {**kafka_config(bootstrap), "socket.connection.setup.timeout.ms": 5000}, logger=KAFKA_LOG
    )


def check_reachable(bootstrap: str, timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
    """Raise BrokerUnreachable unless a broker at `bootstrap` answers a metadata request in time."""
    _metadata_topics(admin_client(bootstrap), bootstrap, timeout_s)


def _metadata_topics(admin: AdminClient, bootstrap: str, timeout_s: float) -> dict[str, int]:
    """Existing topic name -> partition count, or BrokerUnreachable."""
    try:
        md = admin.list_topics(timeout=timeout_s)
    except KafkaException as exc:
        err = exc.args[0] if exc.args else None
        detail = err.str() if isinstance(err, KafkaError) else str(exc)
        message = f"cannot reach Kafka at {bootstrap} within {timeout_s:g} s ({detail})"
        raise BrokerUnreachable(message) from None
    return {name: len(t.partitions) for name, t in md.topics.items() if t.error is None}


def _check_partitions(spec: TopicSpec, actual: int) -> None:
    if actual != spec.partitions:
        raise TopicError(
            f"topic {spec.name} exists with {actual} partitions but the pipeline needs {spec.partitions} "
            "(partition index must equal pid); delete the topic or use another pipeline name"
        )


# Errors a partition answers with while its new leader loads it, while a broker that went silent
# comes back with a newer leader epoch than the client's metadata, or while the client knows no leader
# at all (`_NOENT`, "No leaders found": the broker is away): retried until the deadline.
LEADER_NOT_READY = frozenset(
    {
        KafkaError._NOENT,
        KafkaError.NOT_LEADER_FOR_PARTITION,
        KafkaError.LEADER_NOT_AVAILABLE,
        KafkaError.UNKNOWN_TOPIC_OR_PART,
        KafkaError.FENCED_LEADER_EPOCH,
        KafkaError.UNKNOWN_LEADER_EPOCH,
        KafkaError.OFFSET_NOT_AVAILABLE,
    }
)
BROKER_AWAY = (LEADER_NOT_READY - {KafkaError.UNKNOWN_TOPIC_OR_PART}) | {
    KafkaError._TIMED_OUT,
    KafkaError._ALL_BROKERS_DOWN,
    KafkaError._TRANSPORT,
    KafkaError._MSG_TIMED_OUT,
    KafkaError._RESOLVE,
    KafkaError.REQUEST_TIMED_OUT,
    KafkaError.NETWORK_EXCEPTION,
    KafkaError.NOT_CONTROLLER,
    KafkaError._UNKNOWN_PARTITION,  # the client's own metadata, emptied while the broker was away
    # The client dropped its handle of a broker that left the metadata while it was stopped; a request
    # on it fails so (the controller exited on it in tests/integration/test_faults.py's broker stop).
    KafkaError._DESTROY_BROKER,
}
"""Answers that mean the broker is away, restarting or not serving a partition yet, not that the request
is wrong (decision 0052). A topic the broker does not know is not among them: it may be gone for good."""


def broker_away(exc: BaseException) -> bool:
    """Whether a failure says the broker is away (a timeout of the client's own, a connection refused
    or cut, no leader yet, a request that timed out): weather to wait out, not a reason to stop."""
    if isinstance(exc, TimeoutError):
        return True
    error = exc.args[0] if isinstance(exc, KafkaException) and exc.args else None
    return isinstance(error, KafkaError) and (error.retriable() or error.code() in BROKER_AWAY)


def ensure_topics(cfg: Config, bootstrap: str, timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
    """Create the pipeline's missing topics and check the partition counts of all of them.

    Safe to call concurrently from several processes: a topic another process created in the
    meantime (TOPIC_ALREADY_EXISTS) is accepted once its partition count checks out. Returns once
    every partition of every topic is served by its leader, so a producer started next neither
    misses the topic nor writes to a partition its leader has not loaded yet.
    """
    admin = admin_client(bootstrap)
    specs = topic_specs(cfg)
    existing = _metadata_topics(admin, bootstrap, timeout_s)
    for spec in specs:
        if spec.name in existing:
            _check_partitions(spec, existing[spec.name])
    check_topic_configs(admin, [s for s in specs if s.name in existing], timeout_s)
    missing = [s for s in specs if s.name not in existing]
    if missing and not cfg.topics.create:
        raise TopicError(
            f"topic {missing[0].name} is missing ({len(missing)} of the pipeline's {len(specs)} are) and "
            "topics.create is false: create them as `fluxjoin topics` lists, or set topics.create=true"
        )
    # A broker that is restarting answers a creation with a timeout (its controller not yet reachable):
    # asked again, up to VISIBLE_TIMEOUT_S, like every other request to a broker that is away.
    deadline = time.monotonic() + max(timeout_s, VISIBLE_TIMEOUT_S)
    while missing:
        # replication_factor -1 (the default): the broker's (1 on a single-node broker, 3 on a cluster).
        rf = cfg.topics.replication_factor
        futures = admin.create_topics(
            [NewTopic(s.name, s.partitions, rf, config=dict(s.config)) for s in missing],
            request_timeout=timeout_s,
        )
        again: list[str] = []
        for name, fut in futures.items():
            try:
                fut.result()
            except KafkaException as exc:
                err = exc.args[0]
                if isinstance(err, KafkaError) and err.code() == KafkaError.TOPIC_ALREADY_EXISTS:
                    continue
                if not broker_away(exc) or time.monotonic() > deadline:
                    raise TopicError(f"cannot create topic {name}: {err}") from None
                again.append(name)
        missing = [s for s in missing if s.name in again]
        if missing:
            time.sleep(1.0)
    _await_visible(admin, bootstrap, specs, max(timeout_s, VISIBLE_TIMEOUT_S))
    # Metadata names a new partition's leader before that broker has loaded the partition, and a
    # write in that gap fails with NOT_LEADER_OR_FOLLOWER. With an idempotent producer that is not a
    # harmless retry: librdkafka sends the next batch meanwhile, the broker accepts it as the first
    # sequence it has seen from this producer, and librdkafka then counts the failed batch as
    # delivered ("implicitly acked by subsequent batch success"): lost without an error. On a
    # freshly started broker about one generator run in ten lost a message this way. A partition
    # that answers ListOffsets takes writes, so no writer of ours starts inside the gap.
    every_partition = [(s.name, p) for s in specs for p in range(s.partitions)]
    try:
        partition_offsets(admin, every_partition, timeout_s=max(timeout_s, VISIBLE_TIMEOUT_S))
    except KafkaException as exc:
        raise TopicError(f"partitions without a serving leader: {exc.args[0]}") from None


def check_topic_configs(admin: AdminClient, specs: list[TopicSpec], timeout_s: float) -> None:
    """TopicError, in one line with the command that fixes it, when an existing topic's settings
    contradict one of `REQUIRED_CONFIG` that its spec sets."""
    from confluent_kafka.admin import ConfigResource, ResourceType

    wanted = {s.name: {k: v for k, v in s.config.items() if k in REQUIRED_CONFIG} for s in specs}
    resources = [ConfigResource(ResourceType.TOPIC, name) for name, config in wanted.items() if config]
    if not resources:
        return
    for resource, future in admin.describe_configs(resources, request_timeout=timeout_s).items():
        actual = future.result()
        for key, value in wanted[resource.name].items():
            found = actual[key].value if key in actual else None
            if found != value:
                raise TopicError(
                    f"topic {resource.name} has {key}={found} but the pipeline needs {value}: "
                    f"kafka-configs.sh --alter --entity-type topics --entity-name {resource.name} "
                    f"--add-config {key}={value}"
                )


def delete_topics(bootstrap: str, names: list[str]) -> None:
    """Delete `names`, best effort: a topic that is already gone (or was never created) is fine."""
    if not names:
        return
    admin = admin_client(bootstrap)  # referenced until the futures resolve: a dropped client fails them
    futures = admin.delete_topics(names, request_timeout=30)
    for fut in futures.values():
        with contextlib.suppress(KafkaException):
            fut.result()


def topics_named_after(bootstrap: str, prefix: str) -> list[str]:
    """The topics whose names start with `prefix` (a pipeline's, or a benchmark run's pipelines')."""
    return sorted(
        t
        for t in _metadata_topics(admin_client(bootstrap), bootstrap, DEFAULT_TIMEOUT_S)
        if t.startswith(prefix)
    )


def _await_visible(admin: AdminClient, bootstrap: str, specs: list[TopicSpec], timeout_s: float) -> None:
    """Wait until metadata shows every topic with its partitions (and re-check counts: a topic a
    concurrent creator made with another count is caught here)."""
    deadline = time.monotonic() + timeout_s
    while True:
        existing = _metadata_topics(admin, bootstrap, timeout_s)
        pending = [s for s in specs if s.name not in existing]
        for spec in specs:
            if spec.name in existing:
                _check_partitions(spec, existing[spec.name])
        if not pending:
            return
        if time.monotonic() > deadline:
            names = ", ".join(s.name for s in pending)
            raise TopicError(f"topics not visible in metadata after {timeout_s:g} s: {names}")
        time.sleep(0.1)


def read_topic(
    bootstrap: str,
    topic: str,
    timeout_s: float = 120.0,
    settled: bool = False,
    signed_by: Callable[[bytes], str] | None = None,
) -> Iterator[tuple[int, int, bytes]]:
    """Every committed message of `topic` up to its current end that has a value: (partition, offset,
    value). A tombstone carries nothing for the readers of fluxjoin's own topics. `signed_by` names
    the one writer that may have written a value: a record it did not sign is left out while
    signatures are checked (`pipeline.signing.may_say`)."""
    for partition, offset, value in read_records(bootstrap, topic, timeout_s, settled, signed_by):
        if value is not None:
            yield partition, offset, value


def read_records(
    bootstrap: str,
    topic: str,
    timeout_s: float = 120.0,
    settled: bool = False,
    signed_by: Callable[[bytes], str] | None = None,
) -> Iterator[tuple[int, int, bytes | None]]:
    """Every committed message of `topic` up to its current end, tombstones (None) included.

    A broker that is away, at the start or mid-read, is waited for however long, saying so once in the
    log; the read fails after `timeout_s` without a message only while the broker answers.

    The end is the last stable offset: what another producer's transaction still open holds back, even
    messages committed after its first, is left out. `settled` reads to the high watermark instead, once
    every transaction below it has ended (`await_settled`): everything committed before the call."""
    consumer = Consumer(
        {
            **kafka_config(bootstrap),
            "group.id": CONSUMER_GROUP,
            "enable.auto.commit": False,
            "enable.partition.eof": True,
            "isolation.level": "read_committed",
            "fetch.max.bytes": 64 * 1024 * 1024,
        }
        | BOUNDED_READ
    )
    away = _Away(topic)
    try:
        meta = away.wait_out(lambda: consumer.list_topics(topic, timeout=30)).topics[topic]
        if meta.error is not None:
            raise RuntimeError(f"topic {topic}: {meta.error}")
        ends: dict[int, int] = {}
        assign = []
        if settled:
            await_settled(admin_client(bootstrap), [(topic, p) for p in meta.partitions])
        for p in sorted(meta.partitions):
            low, high = away.wait_out(partial(watermark_offsets, consumer, TopicPartition(topic, p)))
            if high > low:
                ends[p] = high
                assign.append(TopicPartition(topic, p, low))
        consumer.assign(assign)
        pending = set(ends)
        progress = time.monotonic()
        while pending:
            for msg in consume_ready(consumer, 10_000, 1.0):
                err = msg.error()
                if err is not None:
                    if err.code() == KafkaError._PARTITION_EOF:
                        pending.discard(msg.partition())
                        continue
                    if broker_away(KafkaException(err)):  # the client reconnects by itself
                        away.note(err.str())
                        continue
                    raise RuntimeError(f"reading {topic}: {err}")
                partition, offset, value = msg.partition(), msg.offset(), msg.value()
                assert partition is not None and offset is not None
                progress, away.announced = time.monotonic(), False
                if offset >= ends[partition] - 1:
                    pending.discard(partition)
                if offset >= ends[partition]:
                    continue
                if (
                    signed_by is None
                    or value is None
                    or may_say(signed_by(value), topic, value, msg.headers())
                ):
                    yield partition, offset, value
            if pending and time.monotonic() - progress > timeout_s:
                if not broker_answers(consumer, TopicPartition(topic, min(pending))):
                    away.note("no answer to an offset lookup")
                    progress = time.monotonic()
                    continue
                raise TimeoutError(f"{topic}: nothing read for {timeout_s:.0f} s although the broker answers")
    finally:
        consumer.close()


T = TypeVar("T")


@dataclass(slots=True)
class _Away:
    """A reader's outages: each announced once in the log, every call retried while the broker is away."""

    topic: str
    announced: bool = False

    def note(self, why: str) -> None:
        if not self.announced:
            log.warning("reading %s: the broker is away (%s); waiting for it", self.topic, why)
            self.announced = True

    def wait_out(self, call: Callable[[], T]) -> T:
        while True:
            try:
                return call()
            except (KafkaException, TimeoutError) as exc:
                if not broker_away(exc):
                    raise
                self.note(exc.args[0].str() if isinstance(exc, KafkaException) else str(exc))
                time.sleep(1.0)


def broker_answers(consumer: Consumer, tp: TopicPartition) -> bool:
    """Whether the broker answers an offset lookup for `tp` now. Any failure counts as away: after a
    long outage the client may also report the partition unknown (its metadata expired), and a partition
    that cannot be looked up cannot be read either (decision 0052)."""
    try:
        consumer.get_watermark_offsets(tp, timeout=DEFAULT_TIMEOUT_S)
    except KafkaException:
        return False
    return True


SETTLE_TIMEOUT_S = 60.0
"""How long `await_settled` waits for the transactions open below a partition's end: fluxjoin's take
15 s at most (`pipeline.sink.TRANSACTION_TIMEOUT_S`) before the broker aborts them, and the broker looks
for expired ones every 10 s (`transaction.abort.timed.out.transaction.cleanup.interval.ms`)."""


def await_settled(
    admin: AdminClient, partitions: Iterable[tuple[str, int]], timeout_s: float = SETTLE_TIMEOUT_S
) -> None:
    """Return once each partition's last stable offset has reached the high watermark it had at the
    call: every transaction that wrote below it has then committed or aborted, so a `read_committed`
    reader misses nothing committed before the call. Transactions begun later do not hold it back."""
    wanted = list(partitions)
    high = partition_offsets(admin, wanted)
    deadline = time.monotonic() + timeout_s
    while True:
        stable = partition_offsets(admin, wanted, committed=True)
        if all(stable[tp] >= end for tp, end in high.items()):
            return
        if time.monotonic() > deadline:
            raise TimeoutError(
                f"transactions still open below the end of {sorted(high)} after {timeout_s:g} s"
            )
        time.sleep(0.1)


def watermark_offsets(consumer: Consumer, tp: TopicPartition, timeout_s: float = 30.0) -> tuple[int, int]:
    """(low, high) offsets of a partition, retrying while a new topic's leader is still being elected or
    the broker is away (`BROKER_AWAY`), up to `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            low, high = consumer.get_watermark_offsets(tp, timeout=timeout_s)
            return int(low), int(high)
        except KafkaException as exc:
            error = exc.args[0]
            if not error.retriable() and error.code() not in BROKER_AWAY | {
                KafkaError.NOT_LEADER_FOR_PARTITION
            }:
                raise
            if time.monotonic() > deadline:
                raise
            if error.code() == KafkaError._UNKNOWN_PARTITION:  # its metadata lost in an outage: ask again
                with contextlib.suppress(KafkaException):
                    consumer.list_topics(tp.topic, timeout=5)
            time.sleep(0.2)


# Of those, the answers that mean the client's metadata is older than the broker's: refreshed first.
_STALE_METADATA = frozenset({KafkaError.FENCED_LEADER_EPOCH, KafkaError.UNKNOWN_LEADER_EPOCH})


def partition_offsets(
    admin: AdminClient,
    partitions: Iterable[tuple[str, int]],
    latest: bool = True,
    timeout_s: float = 30.0,
    at_ms: int | None = None,
    committed: bool = False,
) -> dict[tuple[str, int], int]:
    """(topic, partition) -> end offset (or log start offset, or with `at_ms` the first offset whose
    timestamp is at or after it, -1 if none is), retrying while new topics elect leaders. With
    `committed`, the end is the last stable offset, where a `read_committed` consumer reaches its end:
    the high watermark lies beyond transactions still open."""
    if at_ms is not None:
        spec = OffsetSpec.for_timestamp(at_ms)
    else:
        spec = OffsetSpec.latest() if latest else OffsetSpec.earliest()
    request = {TopicPartition(t, p): spec for t, p in partitions}
    if not request:
        return {}
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            isolation = IsolationLevel.READ_COMMITTED if committed else IsolationLevel.READ_UNCOMMITTED
            futures = admin.list_offsets(request, isolation_level=isolation, request_timeout=timeout_s)
            found = {(tp.topic, tp.partition): fut.result().offset for tp, fut in futures.items()}
            # A broker that has just restarted can answer before it knows a partition's offsets:
            # OFFSET_INVALID (-1001), never an offset to read from or commit (-1 is only "no offset at
            # or after `at_ms`").
            unknown = sorted(tp for tp, offset in found.items() if offset < (-1 if at_ms is not None else 0))
            if not unknown:
                return found
            if time.monotonic() > deadline:  # what the client's own timeout raises: callers handle it
                reason = f"the broker did not know the offsets of {unknown} within {timeout_s:g} s"
                raise KafkaException(KafkaError(KafkaError._TIMED_OUT, reason))
            time.sleep(0.2)
            continue
        except KafkaException as exc:
            error = exc.args[0]
            retry = error.retriable() or error.code() in LEADER_NOT_READY
            if not retry or time.monotonic() > deadline:
                raise
            if error.code() in _STALE_METADATA:  # the client asks with the leader epoch it cached
                for topic in {tp.topic for tp in request}:
                    admin.list_topics(topic, timeout=max(1.0, deadline - time.monotonic()))
            time.sleep(0.2)
