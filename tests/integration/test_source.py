"""The source on a real broker: its reads of pid ranges, and its plans across assignment epochs."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pyarrow as pa
from confluent_kafka import Consumer, Producer, TopicPartition
from pyspark.sql.streaming.datasource import ReadAllAvailable

from pipeline.codec import encode_tuples
from pipeline.config import Config, load_config
from pipeline.control import ControlLog
from pipeline.instance_files import OwnedPids, write_assignment, write_watermarks
from pipeline.kafka_reader import PidRange, RangeKind, read_ranges
from pipeline.partitioning import pids_of
from pipeline.protocol import Handoff, Mode, MoveSpec
from pipeline.rows import DROP_ROW, SILENT_ROW, TRACK_NEW, TRACK_ROW, WINDOW_ROW
from pipeline.source import FluxjoinStreamReader, KafkaPidPartition
from pipeline.topics import ensure_topics

PARTITIONS = 4


def _produce_pid_1(cfg: Config, bootstrap: str, first: int, last: int) -> None:
    """Tuples first..last-1 of pid 1, one per message on each stream: offset i holds tuple id i and event
    time i."""
    keys = [k for k in range(4000) if pids_of([k], PARTITIONS)[0] == 1][:last]
    producer = Producer({"bootstrap.servers": bootstrap})
    for i in range(first, last):
        one = np.array([i], dtype=np.int64)
        for stream in ("A", "B"):
            body = encode_tuples(one, np.array([keys[i]]), one, np.zeros((1, 0), np.uint8))
            producer.produce(cfg.input_topic(stream), body, partition=1)
    assert producer.flush(30) == 0


def _planner(
    cfg: Config, bootstrap: str, tmp_path: Path, **options: str
) -> tuple[FluxjoinStreamReader, Callable[[dict, OwnedPids], dict]]:
    """A reader of streams A and B, and a function planning its next batch from `start` under `owned`."""
    assignment = tmp_path / "assignment.json"
    reader = FluxjoinStreamReader(
        {
            "bootstrap": bootstrap,
            "streams": "A,B",
            "topics": f"{cfg.input_topic('A')},{cfg.input_topic('B')}",
            "assignment": str(assignment),
            "partitions": str(PARTITIONS),
            "tasks": "1",
            "instance": "here",
            **options,
        }
    )

    def plan(start: dict, owned: OwnedPids) -> dict:
        write_assignment(assignment, owned)
        return reader.latestOffset(start, ReadAllAvailable())

    return reader, plan


def test_back_to_back_ranges_of_one_partition_are_each_read_whole(
    kafka_bootstrap: str, topic_prefix: str
) -> None:
    """A parallel track's side recovered on a third instance re-reads the window before the cutoff and,
    silently, the input after it, in one batch: two ranges of the same partition. Each must come back
    with every one of its tuples (the second once replaced the first, and the window came back empty)."""
    cfg = load_config(None, [f"pipeline={topic_prefix}", "streams=[A, B]", f"partitions={PARTITIONS}"])
    ensure_topics(cfg, kafka_bootstrap)
    topic = cfg.input_topic("A")
    keys = np.array([k for k in range(2000) if pids_of([k], PARTITIONS)[0] == 1][:30], dtype=np.int64)
    producer = Producer({"bootstrap.servers": kafka_bootstrap})
    for i, key in enumerate(keys):  # one tuple per message: offset i holds tuple id i
        one = np.array([i], dtype=np.int64)
        producer.produce(
            topic, encode_tuples(one, np.array([key]), one, np.zeros((1, 0), np.uint8)), partition=1
        )
    assert producer.flush(30) == 0

    window = PidRange(0, topic, 1, 2, 12, RangeKind.WINDOW)
    silent = PidRange(0, topic, 1, 12, 20, RangeKind.SILENT)
    later = PidRange(0, topic, 1, 25, 28)  # after a gap: offsets 20-24 belong to no range
    batches = list(read_ranges(kafka_bootstrap, [silent, later, window], PARTITIONS))

    table = pa.Table.from_batches(batches).to_pandas()
    by_code = {int(code): sorted(rows["id"].tolist()) for code, rows in table.groupby("stream")}
    assert by_code == {
        WINDOW_ROW: list(range(2, 12)),
        SILENT_ROW: list(range(12, 20)),
        0: list(range(25, 28)),
    }
    assert set(table["pid"]) == {1}


def test_an_old_side_that_learns_its_track_ended_with_the_pids_return_enters_it_afresh(
    kafka_bootstrap: str, topic_prefix: str, tmp_path: Path
) -> None:
    """The epochs that end pid 1's parallel track and move it back were published during one long batch
    of its old side, which next sees pid 1 owned, with a handoff. It must drop the old track's window and
    enter at the handoff's cutoff, acknowledging it; kept as an old side, it would emit only results with
    an old tuple (none are left) and never acquire the pid: every later result of pid 1 would be lost."""
    cfg = load_config(None, [f"pipeline={topic_prefix}", "streams=[A, B]", f"partitions={PARTITIONS}"])
    ensure_topics(cfg, kafka_bootstrap)
    _produce_pid_1(cfg, kafka_bootstrap, 0, 30)
    reader, plan = _planner(cfg, kafka_bootstrap, tmp_path, metrics_topic=cfg.metrics_topic)
    owning = plan(reader.initialOffset(), OwnedPids(epoch=0, pids=frozenset({0, 1})))
    out = MoveSpec(move_id="m-out", pid=1, source="here", target="there", mode=Mode.PARALLEL_TRACK)
    tracking = plan(owning, OwnedPids(epoch=1, pids=frozenset({0}), releasing={1: out}))
    assert tracking["tracking"] == {"1": {"role": "old", "move_id": "m-out"}}
    assert tracking["offsets"]["A"]["1"] == 30, "the old side reads on"

    back = Handoff(move_id="m-back", mode=Mode.PARALLEL_TRACK, cutoff={"A": 20, "B": 25}, stream_max=(7, 9))
    returned = plan(
        tracking,
        OwnedPids(epoch=5, pids=frozenset({0, 1}), handoffs={1: back}, new_tracks={1: "m-back"}),
    )
    assert list(returned["acquired"]) == ["1"]
    assert returned["tracking"] == {"1": {"role": "new", "move_id": "m-back"}}
    assert [m[:2] for m in returned["markers"] if m[0] == 1] == [
        (1, DROP_ROW),
        (1, TRACK_ROW),
        (1, TRACK_ROW),
    ]
    assert [m for m in returned["markers"] if m[1] == TRACK_ROW] == [
        (1, TRACK_ROW, 0, TRACK_NEW, 7),
        (1, TRACK_ROW, 1, TRACK_NEW, 9),
    ]
    assert {s: returned["from"][s]["1"] for s in ("A", "B")} == {"A": 20, "B": 25}
    tasks = reader.partitions(tracking, returned)
    ranges = [r for task in tasks if isinstance(task, KafkaPidPartition) for r in task.ranges if r.pid == 1]
    assert sorted((r.stream_index, r.start, r.end) for r in ranges) == [(0, 20, 30), (1, 25, 30)]

    # Reading the batch: pid 1 from the handoff's cutoff on, reported as soon as the reading ends.
    table = pa.Table.from_batches([b for task in tasks for b in reader.read(task)]).to_pandas()
    data = table[(table["pid"] == 1) & (table["stream"] >= 0)]
    assert sorted(data["id"]) == sorted([*range(20, 30), *range(25, 30)])
    consumer = Consumer({"bootstrap.servers": kafka_bootstrap, "group.id": "fluxjoin-unused"})
    consumer.assign([TopicPartition(cfg.metrics_topic, 0, 0)])
    reports = [json.loads(m.value() or b"{}") for m in consumer.consume(100, timeout=10) if m.error() is None]
    consumer.close()
    read = [r for report in reports if report["kind"] == "reading" for r in report["ranges"]]
    assert sorted((r["pid"], r["stream"], r["in"], r["newest_ms"]) for r in read) == [
        (1, 0, 10, 29),
        (1, 1, 5, 29),
    ]


def test_a_parallel_track_is_announced_when_its_batch_is_planned(
    kafka_bootstrap: str, topic_prefix: str, tmp_path: Path
) -> None:
    """Pid 1 moves by parallel track from an instance whose sink noted pid 1's window `stream_max` at the
    offsets the next batch starts from. `Released` must reach the control topic when that batch's
    partitions are planned, after Spark has logged its offsets (not from `latestOffset`: the old side
    lives in the logged plan, decision 0040), with the cutoff and `stream_max` the batch will begin the
    overlap at; the batch itself reads on. Noted at other offsets, `stream_max` is not known before
    the batch runs, and nothing is announced."""
    cfg = load_config(None, [f"pipeline={topic_prefix}", "streams=[A, B]", f"partitions={PARTITIONS}"])
    ensure_topics(cfg, kafka_bootstrap)
    _produce_pid_1(cfg, kafka_bootstrap, 0, 30)
    watermarks = tmp_path / "watermarks.json"
    options = {"watermarks": str(watermarks), "control_topic": cfg.control_topic}
    reader, plan = _planner(cfg, kafka_bootstrap, tmp_path, **options)

    owning = plan(reader.initialOffset(), OwnedPids(epoch=0, pids=frozenset({0, 1})))
    _produce_pid_1(cfg, kafka_bootstrap, 30, 40)
    out = MoveSpec(move_id="m-out", pid=1, source="here", target="there", mode=Mode.PARALLEL_TRACK)
    moving = OwnedPids(epoch=1, pids=frozenset({0}), releasing={1: out})

    write_watermarks(watermarks, {"1": {"stream_max": [27, 28], "offsets": {"A": 29, "B": 30}}})
    unknown = plan(owning, moving)
    assert unknown["released"]["1"]["track"] and "stream_max" not in unknown["released"]["1"]

    write_watermarks(watermarks, {"1": {"stream_max": [27, 28], "offsets": {"A": 30, "B": 30}}})
    log = ControlLog(kafka_bootstrap, cfg.control_topic)
    try:
        tracking = plan(owning, moving)
        assert tracking["released"]["1"] == {
            "move_id": "m-out",
            "export": False,
            "announce": True,
            "cutoff": {"A": 30, "B": 30},
            "track": True,
            "stream_max": [27, 28],
        }
        assert tracking["offsets"]["A"]["1"] == 40, "the batch reads on"
        assert "m-out" not in log.catch_up().released, "announced before Spark logged the plan"
        reader.partitions(owning, tracking)
        released = log.catch_up().released["m-out"]
    finally:
        log.close()
    assert (released.instance, released.epoch, released.pid) == ("here", 1, 1)
    assert (released.cutoff, released.stream_max, released.snapshot) == ({"A": 30, "B": 30}, (27, 28), None)


def test_a_replay_is_announced_at_its_plan_with_its_cutoff_where_the_batch_begins(
    kafka_bootstrap: str, topic_prefix: str, tmp_path: Path
) -> None:
    """Pid 1 moves by replay while 10 messages arrived since the last batch. The batch that releases it
    reads none of them: its cutoff is where the batch begins (30), and `Released` must reach the
    control log as soon as the batch's offsets are planned (decision 0040), with that cutoff. The
    receiver rebuilds the window up to 30 and reads 30-39 as new input in its first batch, without
    waiting for the sender's batch (decision 0037), in the same read task (decision 0038)."""
    cfg = load_config(None, [f"pipeline={topic_prefix}", "streams=[A, B]", f"partitions={PARTITIONS}"])
    ensure_topics(cfg, kafka_bootstrap)
    _produce_pid_1(cfg, kafka_bootstrap, 0, 30)
    options = {"control_topic": cfg.control_topic, "window_ms": "60000"}
    reader, plan = _planner(cfg, kafka_bootstrap, tmp_path, **options)
    owning = plan(reader.initialOffset(), OwnedPids(epoch=0, pids=frozenset({0, 1})))
    _produce_pid_1(cfg, kafka_bootstrap, 30, 40)
    out = MoveSpec(move_id="m-out", pid=1, source="here", target="there", mode=Mode.REPLAY)
    log = ControlLog(kafka_bootstrap, cfg.control_topic)
    try:
        assert "m-out" not in log.catch_up().released
        releasing = plan(owning, OwnedPids(epoch=1, pids=frozenset({0}), releasing={1: out}))
        released = log.catch_up().released["m-out"]
    finally:
        log.close()
    assert releasing["released"]["1"]["cutoff"] == {"A": 30, "B": 30}
    assert "1" not in releasing["offsets"]["A"], "the sender reads nothing more of the pid"
    assert released.announced
    assert released.cutoff == {"A": 30, "B": 30}

    receiver, receive = _planner(cfg, kafka_bootstrap, tmp_path / "receiver", **options)
    handoff = Handoff(move_id="m-out", mode=Mode.REPLAY, cutoff=released.cutoff)
    first = receive(receiver.initialOffset(), OwnedPids(epoch=2, pids=frozenset({1}), handoffs={1: handoff}))
    assert first["acquired"]["1"]["replay_from"] == {"A": 0, "B": 0}, "a window back from the cutoff"
    tasks = receiver.partitions(receiver.initialOffset(), first)
    assert len(tasks) == 1, "the window's replay rides with the batch's reads: no task of its own"
    table = pa.Table.from_batches([b for task in tasks for b in receiver.read(task)]).to_pandas()
    by_code = {int(code): sorted(rows["id"].tolist()) for code, rows in table.groupby("stream")}
    assert by_code == {
        0: list(range(30, 40)),
        1: list(range(30, 40)),
        WINDOW_ROW: list(range(30)),
        WINDOW_ROW + 1: list(range(30)),
    }


def test_a_paced_source_plans_a_trigger_apart_or_at_once_for_a_move_step(
    kafka_bootstrap: str, topic_prefix: str, tmp_path: Path
) -> None:
    """Under a 60 s trigger polled every second, a plan asked for before the trigger is due must return
    its start offset (Spark then runs no batch), even with new input or a new epoch that asks nothing
    of this instance; a new epoch that moves one of its pids out must be planned at once."""
    cfg = load_config(None, [f"pipeline={topic_prefix}", "streams=[A, B]", f"partitions={PARTITIONS}"])
    ensure_topics(cfg, kafka_bootstrap)
    _produce_pid_1(cfg, kafka_bootstrap, 0, 30)
    reader, plan = _planner(cfg, kafka_bootstrap, tmp_path, trigger_ms="60000", poll_ms="1000")
    owning = plan(reader.initialOffset(), OwnedPids(epoch=0, pids=frozenset({0, 1})))
    assert owning["offsets"]["A"]["1"] == 30

    _produce_pid_1(cfg, kafka_bootstrap, 30, 40)
    assert plan(owning, OwnedPids(epoch=0, pids=frozenset({0, 1}))) == owning, "new input, not due"
    assert plan(owning, OwnedPids(epoch=1, pids=frozenset({0, 1}))) == owning, "another instance's epoch"

    out = MoveSpec(move_id="m-out", pid=1, source="here", target="there", mode=Mode.TRANSFER)
    moving = plan(owning, OwnedPids(epoch=2, pids=frozenset({0}), releasing={1: out}))
    assert moving["epoch"] == 2 and moving["released"]["1"]["move_id"] == "m-out"
    assert moving["released"]["1"]["cutoff"] == {"A": 40, "B": 40}


def test_a_replay_reaches_back_a_window_below_the_other_streams_newest_tuple_before_the_cutoff(
    kafka_bootstrap: str, topic_prefix: str, tmp_path: Path
) -> None:
    """A replay re-reads each stream from W below the other streams' newest event time before the cutoff,
    or from its own newest when that is lower (decision 0047): message i of pid 1 is stamped 100 ms after
    message i - 1, W = 1 s, lateness 0. Cutoffs 30 (A) and 20 (B): B, at message 19, may still bring
    partners of A's tuples from message 9 on, and A, at message 29, none of B's before message 19. A
    stream with nothing before its cutoff keeps every tuple of the other in the window. The reader's
    one probe consumer answers again, the same, when reused."""
    cfg = load_config(None, [f"pipeline={topic_prefix}", "streams=[A, B]", f"partitions={PARTITIONS}"])
    ensure_topics(cfg, kafka_bootstrap)
    base = 1_700_000_000_000
    producer = Producer({"bootstrap.servers": kafka_bootstrap})
    for i in range(40):
        for stream in ("A", "B"):
            producer.produce(cfg.input_topic(stream), b"x", partition=1, timestamp=base + 100 * i)
    assert producer.flush(30) == 0
    reader, _ = _planner(cfg, kafka_bootstrap, tmp_path, window_ms="1000", lateness_ms="0")
    try:
        assert reader.facts.replay_from(1, {"A": 30, "B": 20}) == {"A": 9, "B": 19}
        assert reader.facts.replay_from(1, {"A": 30, "B": 15}) == {"A": 4, "B": 14}
        assert reader.facts.replay_from(1, {"A": 5, "B": 0}) == {"A": 0, "B": 0}
    finally:
        reader.stop()
