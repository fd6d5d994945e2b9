"""The source's reads and plans on a real broker where the input or the assignment is not what a fresh
pipeline fed by the generator gives: a pid handed back while still held, messages spanning more than the
lateness, a transactional upstream, input deleted under a planned batch, a pid owned with no handoff."""

from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow as pa
import pytest
from confluent_kafka import IsolationLevel, Producer, TopicPartition
from confluent_kafka.admin import AdminClient, OffsetSpec

from pipeline import kafka_reader
from pipeline.codec import encode_tuples
from pipeline.config import Config, load_config
from pipeline.instance_files import OwnedPids
from pipeline.kafka_reader import PidRange, read_ranges
from pipeline.partitioning import pids_of
from pipeline.protocol import CommitMarker, Handoff, Mode
from pipeline.protocol_codec import marker_to_json
from pipeline.rows import DROP_ROW
from pipeline.source import FluxjoinStreamReader
from pipeline.topics import ensure_topics
from tests.integration.test_source import PARTITIONS, _planner, _produce_pid_1


def _config(topic_prefix: str, bootstrap: str) -> Config:
    cfg = load_config(None, [f"pipeline={topic_prefix}", "streams=[A, B]", f"partitions={PARTITIONS}"])
    ensure_topics(cfg, bootstrap)
    return cfg


def _tuples(ids: list[int], ts: list[int]) -> bytes:
    """One message of tuples of pid 1: tuple i has id ids[i] and event time ts[i]."""
    keys = [k for k in range(4000) if pids_of([k], PARTITIONS)[0] == 1][: len(ids)]
    n = len(ids)
    return encode_tuples(
        np.array(ids, np.int64), np.array(keys, np.int64), np.array(ts, np.int64), np.zeros((n, 0), np.uint8)
    )


def _open_transaction(cfg: Config, bootstrap: str, topic_prefix: str) -> Producer:
    """An upstream exactly-once producer with tuples 10-19 of pid 1 (stream A, event time = id) in a
    transaction it leaves open."""
    upstream = Producer({"bootstrap.servers": bootstrap, "transactional.id": f"{topic_prefix}-upstream"})
    upstream.init_transactions(30)
    upstream.begin_transaction()
    for i in range(10, 20):
        upstream.produce(cfg.input_topic("A"), _tuples([i], [i]), partition=1)
    assert upstream.flush(30) == 0
    return upstream


def _read(reader: FluxjoinStreamReader, start: dict, end: dict) -> pd.DataFrame:
    """Every row the batch from `start` to `end` gives the operator."""
    batches = [b for task in reader.partitions(start, end) for b in reader.read(task)]
    return pa.Table.from_batches(batches).to_pandas() if batches else pd.DataFrame(columns=["stream", "id"])


def _await_stable_end(bootstrap: str, tp: TopicPartition, end: int) -> None:
    """Wait until the last stable offset of `tp` reaches `end`: a committed transaction's markers are
    written after the commit returns."""
    admin = AdminClient({"bootstrap.servers": bootstrap})
    deadline = time.monotonic() + 30
    while True:
        request = {tp: OffsetSpec.latest()}
        futures = admin.list_offsets(request, isolation_level=IsolationLevel.READ_COMMITTED)
        if next(iter(futures.values())).result().offset >= end:
            return
        if time.monotonic() > deadline:
            raise TimeoutError(f"{tp} not committed up to {end} within 30 s")
        time.sleep(0.1)


def test_a_pid_handed_back_while_still_in_the_offsets_is_taken_over_afresh(
    kafka_bootstrap: str, topic_prefix: str, tmp_path: Path
) -> None:
    """The instance announced a replay of pid 1 at 40 and stopped before Spark logged that plan, so its
    offsets still hold pid 1 at 40; meanwhile the pid went elsewhere and came back with a handoff at 60.
    Kept at 40 with its stale window, pid 1 would emit again what the other owner emitted for [40, 60)
    and never acquire, leaving the move in flight for ever: it must drop the window and enter at 60. An
    epoch that follows while the assignment still lists the handoff it took keeps the pid."""
    cfg = _config(topic_prefix, kafka_bootstrap)
    _produce_pid_1(cfg, kafka_bootstrap, 0, 70)
    _, plan = _planner(cfg, kafka_bootstrap, tmp_path, window_ms="60000")
    held = {"epoch": 3, "offsets": {s: {"0": 0, "1": 40} for s in ("A", "B")}}
    back = Handoff(move_id="back", mode=Mode.REPLAY, cutoff={"A": 60, "B": 60})
    returned = plan(held, OwnedPids(epoch=7, pids=frozenset({0, 1}), handoffs={1: back}))
    assert list(returned["acquired"]) == ["1"]
    assert (1, DROP_ROW, 0, 0, 0) in returned["markers"]
    assert {s: returned["from"][s]["1"] for s in ("A", "B")} == {"A": 60, "B": 60}

    later = plan(returned, OwnedPids(epoch=8, pids=frozenset({0, 1}), handoffs={1: back}))
    assert later["acquired"] == {} and not any(m[1] == DROP_ROW for m in later["markers"])
    assert later["offsets"]["A"]["1"] == 70


def test_a_replay_reaches_back_to_a_message_whose_later_tuples_the_window_still_holds(
    kafka_bootstrap: str, topic_prefix: str, tmp_path: Path
) -> None:
    """W = 1 s, L = 100 ms. Each stream of pid 1 has a tuple at t0 - 1 s, then one message of tuples from
    t0 to t0 + 400 ms (stamped t0, its first event time), then one tuple every 100 ms up to t0 + 1.5 s,
    the cutoff. The window at the cutoff holds the tuples from t0 + 400 ms on, so the replay must
    re-read the long message, and not the tuple before it."""
    cfg = _config(topic_prefix, kafka_bootstrap)
    t0 = 1_700_000_000_000
    producer = Producer({"bootstrap.servers": kafka_bootstrap})
    messages = [([0], [t0 - 1000]), ([1, 2, 3, 4, 5], [t0 + 100 * i for i in range(5)])]
    messages += [([i], [t0 + 100 * i]) for i in range(5, 16)]
    for ids, ts in messages:
        for stream in ("A", "B"):
            producer.produce(cfg.input_topic(stream), _tuples(ids, ts), partition=1, timestamp=ts[0])
    assert producer.flush(30) == 0
    reader, _ = _planner(cfg, kafka_bootstrap, tmp_path, window_ms="1000", lateness_ms="100")
    try:
        assert reader.facts.replay_from(1, {"A": len(messages), "B": len(messages)}) == {"A": 1, "B": 1}
    finally:
        reader.stop()


def test_input_of_an_upstream_transaction_open_at_the_plan_is_read_once_it_commits(
    kafka_bootstrap: str, topic_prefix: str, tmp_path: Path
) -> None:
    """An exactly-once upstream producer has tuples 10-19 of pid 1 in a transaction still open when a
    batch is planned. The batch reads what is committed; once the transaction commits, the next batch
    reads those tuples: every tuple reaches the operator exactly once."""
    cfg = _config(topic_prefix, kafka_bootstrap)
    _produce_pid_1(cfg, kafka_bootstrap, 0, 10)
    upstream = _open_transaction(cfg, kafka_bootstrap, topic_prefix)
    reader, plan = _planner(cfg, kafka_bootstrap, tmp_path)
    owned = OwnedPids(epoch=0, pids=frozenset({1}))
    first = plan(reader.initialOffset(), owned)
    rows = [_read(reader, reader.initialOffset(), first)]
    upstream.commit_transaction(30)
    _await_stable_end(kafka_bootstrap, TopicPartition(cfg.input_topic("A"), 1), 21)
    second = plan(first, owned)
    rows.append(_read(reader, first, second))
    table = pd.concat(rows)
    assert sorted(table[table["stream"] == 0]["id"]) == list(range(20))
    assert sorted(table[table["stream"] == 1]["id"]) == list(range(10))


def test_a_range_read_that_meets_the_committed_end_short_of_its_own_is_not_finished_there(
    kafka_bootstrap: str, topic_prefix: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A batch planned up to the high watermark (by an earlier version, and logged by Spark) reads input
    an upstream transaction still holds open: the read must not end at the committed end as if the range
    were done (its last tuples would never be read), but fail while the transaction is open, and read
    them all once it has committed."""
    cfg = _config(topic_prefix, kafka_bootstrap)
    topic = cfg.input_topic("A")
    _produce_pid_1(cfg, kafka_bootstrap, 0, 10)
    upstream = _open_transaction(cfg, kafka_bootstrap, topic_prefix)
    planned = [PidRange(0, topic, 1, 0, 20)]
    monkeypatch.setattr(kafka_reader, "_READ_TIMEOUT_S", 2.0)
    with pytest.raises(TimeoutError, match=rf"{topic}\[1\] 10-20"):
        list(read_ranges(kafka_bootstrap, planned, PARTITIONS))
    upstream.commit_transaction(30)
    table = pa.Table.from_batches(read_ranges(kafka_bootstrap, planned, PARTITIONS)).to_pandas()
    assert sorted(table["id"]) == list(range(20))


def test_a_planned_range_whose_input_was_deleted_fails_naming_it(
    kafka_bootstrap: str, topic_prefix: str, tmp_path: Path
) -> None:
    """Retention (here `delete_records`) moves the log start of A[1] past the start of a planned batch.
    Its read must fail, naming the partition and the offsets, instead of going on from the log's end."""
    cfg = _config(topic_prefix, kafka_bootstrap)
    _produce_pid_1(cfg, kafka_bootstrap, 0, 30)
    reader, plan = _planner(cfg, kafka_bootstrap, tmp_path, window_ms="60000")
    planned = plan(reader.initialOffset(), OwnedPids(epoch=0, pids=frozenset({1})))
    topic = cfg.input_topic("A")
    admin = AdminClient({"bootstrap.servers": kafka_bootstrap})
    for future in admin.delete_records([TopicPartition(topic, 1, 20)], request_timeout=30).values():
        future.result()
    with pytest.raises(RuntimeError, match=rf"{topic}\[1\].* 0 .*20"):
        _read(reader, reader.initialOffset(), planned)
    # A replay of pid 1 re-reads from the log start, what is left of the window.
    assert reader.facts.replay_from(1, {"A": 30, "B": 30}) == {"A": 20, "B": 0}


def test_a_running_query_refuses_a_pid_owned_without_a_handoff(
    kafka_bootstrap: str, topic_prefix: str, tmp_path: Path
) -> None:
    """A running query gains pids only by handoffs: a pid new to it with none would be read from the log
    start with an empty window, emitting every retained result of it again. It refuses, naming the pid
    and the epoch (the instance exits)."""
    cfg = _config(topic_prefix, kafka_bootstrap)
    _produce_pid_1(cfg, kafka_bootstrap, 0, 30)
    _, plan = _planner(cfg, kafka_bootstrap, tmp_path, commits_topic=cfg.sink_commits_topic)
    running = {"epoch": 2, "offsets": {s: {"0": 0} for s in ("A", "B")}}
    with pytest.raises(RuntimeError, match=r"pid 1 owned in epoch 3 .*since epoch 2"):
        plan(running, OwnedPids(epoch=3, pids=frozenset({0, 1})))


def test_a_fresh_query_takes_a_pid_without_a_handoff_only_if_its_instance_never_committed_it(
    kafka_bootstrap: str, topic_prefix: str, tmp_path: Path
) -> None:
    """A fresh query starts the pipeline's first assignment, or an instance started after the first
    epochs: its pids with no handoff start at the log start. But an instance whose commit marker holds
    the pid processed it under a checkpoint it no longer has (wiped when it rejoined after an eviction
    it outlived, still owning the pid): starting over would emit every retained result again, so it
    refuses, naming the pid and the epoch."""
    cfg = _config(topic_prefix, kafka_bootstrap)
    _produce_pid_1(cfg, kafka_bootstrap, 0, 30)
    options = {"commits_topic": cfg.sink_commits_topic}
    offsets = {s: {1: 30} for s in ("A", "B")}
    marker = CommitMarker(instance="here", incarnation="before", batch=4, epoch=2, offsets=offsets, time_ms=0)
    producer = Producer({"bootstrap.servers": kafka_bootstrap})
    producer.produce(cfg.sink_commits_topic, key="here", value=json.dumps(marker_to_json(marker)))
    assert producer.flush(30) == 0

    reader, plan = _planner(cfg, kafka_bootstrap, tmp_path, **options)
    with pytest.raises(RuntimeError, match=r"pid 1 owned in epoch 3 .*committed by this instance"):
        plan(reader.initialOffset(), OwnedPids(epoch=3, pids=frozenset({0, 1})))

    other, plan_other = _planner(cfg, kafka_bootstrap, tmp_path / "other", instance="there", **options)
    late_start = plan_other(other.initialOffset(), OwnedPids(epoch=3, pids=frozenset({0, 1})))
    assert late_start["offsets"]["A"] == {"0": 0, "1": 30}, "never processed: from the log start"
