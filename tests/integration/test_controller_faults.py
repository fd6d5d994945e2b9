"""The controller under partial failure, on a real broker: a clock edge inside a step, instances it never
hears from, a dead instance's open transaction, a second controller, `fluxjoin move`'s report."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from confluent_kafka import KafkaException, Producer
from typer.testing import CliRunner

from controller.assignment import initial_assignment
from controller.moves.kafka_mover import KafkaPidMover
from controller.observation.liveness import PROGRESS_TIMEOUT_S
from fluxjoin.cli import app
from pipeline.config import Config, load_config
from pipeline.control import ControlLog, publish, wait_for
from pipeline.protocol import AcquiredMsg, AssignmentMsg, CommitMarker, Handoff, Mode, MoveSpec, ReleasedMsg
from pipeline.protocol_codec import marker_to_json
from pipeline.sink import ExactlyOnceSink
from pipeline.topics import ensure_topics

TIMEOUT_S = 10.0


class FakeClock:
    """The controller's monotonic clock, set by the test; `then` queues the values of the next calls."""

    def __init__(self) -> None:
        self.now = 0.0
        self.then: list[float] = []

    def __call__(self) -> float:
        if self.then:
            self.now = self.then.pop(0)
        return self.now


def _cfg(prefix: str) -> Config:
    return load_config(None, [f"pipeline={prefix}", "streams=[A, B]", "partitions=4", "instances=2"])


def _heartbeat(producer: Producer, cfg: Config, instance: str) -> None:
    beat = {"kind": "heartbeat", "instance": instance, "incarnation": f"i{instance}", "serving": True}
    stamped = {**beat, "time_ms": int(time.time() * 1000)}
    producer.produce(cfg.metrics_topic, key=instance, value=json.dumps(stamped))
    assert producer.flush(30) == 0


def _hear(
    mover: KafkaPidMover, clock: FakeClock, at: float, producer: Producer, cfg: Config, who: str
) -> None:
    """`who` heartbeats, and the controller takes the heartbeat in at `at` on its clock."""
    clock.now = at
    _heartbeat(producer, cfg, who)

    def heard() -> bool:
        mover.observer.poll(0.1)
        return who in mover.observer.liveness().live

    wait_for(heard, 30, f"{who}'s heartbeat")


def _marker(producer: Producer, cfg: Config, instance: str, offsets: dict[str, dict[str, int]]) -> None:
    by_pid = {s: {int(p): o for p, o in o_s.items()} for s, o_s in offsets.items()}
    marker = CommitMarker(
        instance=instance, incarnation=f"i{instance}", batch=3, epoch=0, offsets=by_pid, time_ms=0
    )
    producer.produce(cfg.sink_commits_topic, key=instance, value=json.dumps(marker_to_json(marker)))
    assert producer.flush(30) == 0


@pytest.fixture
def plain(kafka_bootstrap: str) -> Iterator[Producer]:
    producer = Producer({"bootstrap.servers": kafka_bootstrap})
    yield producer
    producer.flush(5)


def test_a_clock_edge_inside_a_step_never_recovers_a_pid_from_the_log_start(
    kafka_bootstrap: str, topic_prefix: str, plain: Producer
) -> None:
    """Liveness read twice in one step: x alive when the step decides whether to read commit markers, dead
    when it plans. Its pids must be recovered from its marker, never from the log start."""
    cfg, clock = _cfg(topic_prefix), FakeClock()
    mover = KafkaPidMover(cfg, kafka_bootstrap, TIMEOUT_S, clock=clock, say=lambda line: None)
    try:
        mover.start(initial_assignment(4, ["x", "y"]))
        _marker(plain, cfg, "x", {"A": {"0": 5, "1": 6}, "B": {"0": 7, "1": 8}})
        _hear(mover, clock, 100.0, plain, cfg, "x")
        _hear(mover, clock, 105.0, plain, cfg, "y")
        clock.then = [108.0, 111.0]  # x is 8 s silent, then 11 s: past the timeout
        mover.step()
        mover.step()
        a = mover.log.catch_up().assignment
        assert a is not None and a.owners[0] == a.owners[1] == "y" and "x@ix" in a.evicted
        assert dict(a.handoffs[0].cutoff) == {"A": 5, "B": 7}
        assert dict(a.handoffs[1].cutoff) == {"A": 6, "B": 8}
    finally:
        mover.close()


def test_an_instance_the_controller_never_heard_from_is_dead_after_the_timeout(
    kafka_bootstrap: str, topic_prefix: str, plain: Producer
) -> None:
    """x owns pids in the assignment but never heartbeats (it never started, or died while no controller
    ran): counted from the controller's start, it is dead after the timeout and its pids go to y."""
    cfg, clock = _cfg(topic_prefix), FakeClock()
    mover = KafkaPidMover(cfg, kafka_bootstrap, TIMEOUT_S, clock=clock, say=lambda line: None)
    try:
        mover.start(initial_assignment(4, ["x", "y"]))
        _hear(mover, clock, 1.0, plain, cfg, "y")
        mover.step()
        _hear(mover, clock, TIMEOUT_S + 1, plain, cfg, "y")
        mover.step()
        a = mover.log.catch_up().assignment
        assert a is not None and set(a.owners.values()) == {"y"}, "x's pids recovered on y"
        assert a.handoffs[0].cutoff == {"A": 0, "B": 0}, "x never committed: from the log start"
        assert a.evicted == ("x@?",), "never heard: any incarnation restarts empty"
    finally:
        mover.close()


def test_an_instance_whose_query_makes_no_progress_is_dead_though_it_heartbeats(
    kafka_bootstrap: str, topic_prefix: str, plain: Producer
) -> None:
    """x heartbeats on time, but its query has neither completed a batch nor waited between triggers for
    longer than the progress timeout (hung in a task): its pids go to y, and x is evicted."""
    cfg, clock = _cfg(topic_prefix), FakeClock()
    mover = KafkaPidMover(cfg, kafka_bootstrap, TIMEOUT_S, clock=clock, say=lambda line: None)
    try:
        mover.start(initial_assignment(4, ["x", "y"]))
        now_ms = int(time.time() * 1000)
        stuck = {"kind": "heartbeat", "instance": "x", "incarnation": "ix", "serving": True, "batch": 7}
        stuck |= {"time_ms": now_ms, "progress_ms": now_ms - int((PROGRESS_TIMEOUT_S + 10) * 1000)}
        plain.produce(cfg.metrics_topic, key="x", value=json.dumps(stuck))
        _hear(mover, clock, TIMEOUT_S + 1, plain, cfg, "y")
        assert "x" not in mover.observer.liveness().live, "a query stuck past the progress timeout"
        mover.step()
        a = mover.log.catch_up().assignment
        assert a is not None and set(a.owners.values()) == {"y"}, "x's pids recovered on y"
        assert a.evicted == ("x@ix",)
    finally:
        mover.close()


def test_a_dead_instance_is_fenced_in_kafka_before_its_pids_are_recovered(
    kafka_bootstrap: str, topic_prefix: str, plain: Producer, tmp_path: Path
) -> None:
    """x stalls with a batch's transaction open and is declared dead; once its pids are recovered, that
    transaction can never commit (the broker aborted it when the controller fenced x's transactional id)."""
    cfg, clock = _cfg(topic_prefix), FakeClock()
    mover = KafkaPidMover(cfg, kafka_bootstrap, TIMEOUT_S, clock=clock, say=lambda line: None)
    sink = ExactlyOnceSink(
        cfg, kafka_bootstrap, "x", "ix", tmp_path, tmp_path / "watermarks", tmp_path / "results-per-tuple"
    )
    zombie = sink.producer
    try:
        mover.start(initial_assignment(4, ["x", "y"]))
        _hear(mover, clock, 1.0, plain, cfg, "x")
        _hear(mover, clock, 1.0, plain, cfg, "y")
        zombie.begin_transaction()
        zombie.produce(cfg.results_topic, value=b"a batch's results")
        assert zombie.flush(30) == 0
        _hear(mover, clock, 2 + TIMEOUT_S, plain, cfg, "y")
        mover.step()
        a = mover.log.catch_up().assignment
        assert a is not None and "x@ix" in a.evicted and set(a.owners.values()) == {"y"}
        with pytest.raises(KafkaException) as failed:
            zombie.commit_transaction(30)
        assert failed.value.args[0].fatal(), f"fenced, not a passing failure: {failed.value}"
    finally:
        mover.close()


def test_a_second_controller_fences_the_first(kafka_bootstrap: str, topic_prefix: str) -> None:
    """Assignments have one writer: once a second controller of the pipeline has started, the first one's
    publication fails, and it says so, rather than write a second epoch beside the other's."""
    cfg = _cfg(topic_prefix)
    first = KafkaPidMover(cfg, kafka_bootstrap, TIMEOUT_S, say=lambda line: None)
    second = KafkaPidMover(cfg, kafka_bootstrap, TIMEOUT_S, say=lambda line: None)
    try:
        with pytest.raises(RuntimeError, match="another controller"):
            first.start(initial_assignment(4, ["x", "y"]))
        second.start(initial_assignment(4, ["y", "x"]))
        a = ControlLog(kafka_bootstrap, cfg.control_topic).catch_up().assignment
        assert a is not None and a.epoch == 0 and a.owners[0] == "y", "the second controller's epoch 0"
    finally:
        first.close()
        second.close()


@pytest.mark.parametrize("json_", [False, True], ids=["text", "json"])
def test_fluxjoin_move_reports_the_owner_of_record_when_its_target_died(
    kafka_bootstrap: str, topic_prefix: str, json_: bool
) -> None:
    """The move's target b died after the source released the pid; the pid went to c. `fluxjoin move`
    names c, the owner in the assignment, not b (as text, or in its JSON object)."""
    cfg = _cfg(topic_prefix)
    ensure_topics(cfg, kafka_bootstrap)
    writer = Producer({"bootstrap.servers": kafka_bootstrap})
    publish(writer, cfg.control_topic, AssignmentMsg(epoch=0, owners={0: "a", 1: "a", 2: "b", 3: "c"}))
    assert writer.flush(30) == 0

    def controller() -> None:
        """The steps a controller takes for the request, b dying in between (published by hand)."""
        log = ControlLog(kafka_bootstrap, cfg.control_topic)
        wait_for(lambda: bool(log.catch_up().requests), 60, "the move request")
        move_id = log.view.requests[0].move_id(1)
        move = MoveSpec(move_id=move_id, pid=1, source="a", target="b", mode=Mode.REPLAY)
        handoff = Handoff(move_id=move_id, mode=Mode.REPLAY, cutoff={"A": 3, "B": 3})
        owners = {0: "a", 2: "b", 3: "c"}
        recovered = {0: "a", 1: "c", 2: "c", 3: "c"}
        for msg in (
            AssignmentMsg(epoch=1, owners=owners, moving={1: move}),
            ReleasedMsg(instance="a", epoch=1, pid=1, move_id=move_id, cutoff={"A": 3, "B": 3}),
            AssignmentMsg(epoch=2, owners={**owners, 1: "b"}, handoffs={1: handoff}),
            AssignmentMsg(epoch=3, owners=recovered, handoffs={1: handoff}, evicted=("b@ib",)),
            AcquiredMsg(instance="c", epoch=3, pid=1, move_id=move_id),
            AssignmentMsg(epoch=4, owners=recovered, evicted=("b@ib",)),
        ):
            publish(writer, cfg.control_topic, msg)
            assert writer.flush(30) == 0
        log.close()

    thread = threading.Thread(target=controller, daemon=True)
    thread.start()
    sets = ["--set", f"pipeline={topic_prefix}", "--set", "streams=[A, B]", "--set", "partitions=4"]
    args = ["move", "--pids", "1", "--to", "b", "--mode", "replay", "--wait", "60", *sets]
    result = CliRunner().invoke(app, [*args, "--bootstrap", kafka_bootstrap, *(["--json"] if json_ else [])])
    thread.join(60)
    assert result.exit_code == 0, result.output
    if json_:
        answer = json.loads(result.output)
        assert (answer["pids"], answer["to"], answer["owners"]) == ([1], "b", {"1": "c"}), answer
    else:
        assert "pid 1 is processed by c" in result.output, result.output
