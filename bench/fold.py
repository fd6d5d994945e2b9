"""`fluxjoin bench fold`: what a restart costs on the control log of a pipeline that has moved pids for a
long time: folding the log's messages in memory, and a `ControlLog.catch_up` of them from a real topic
(reading, decoding and folding, as an instance, its sink and the controller do when they start).

Its synthetic log (`synthetic_log`) also serves the protocol's unit tests."""

from __future__ import annotations

import itertools
import time
import uuid
from typing import Any

from pipeline.control_view import Message, fold
from pipeline.kafka_client import kafka_config
from pipeline.protocol import (
    AcquiredMsg,
    AssignmentMsg,
    Handoff,
    Mode,
    MoveRequestMsg,
    MoveSpec,
    ReleasedMsg,
    TrackDoneMsg,
)
from pipeline.protocol_codec import decode, encode


def synthetic_log(
    moves: int, partitions: int = 64, instances: int = 4
) -> tuple[list[Message], dict[int, str]]:
    """A control log of `moves` moves, one after the other, as the controller and the instances write it
    (every third a parallel track, every hundredth requested by `fluxjoin move`, every finished one
    followed by a zombie's late `Acquired`), and the owners it ends with. About 6.7 messages a move."""
    names = [f"i-{k}" for k in range(instances)]
    owners = {p: names[p % instances] for p in range(partitions)}
    log: list[Message] = [AssignmentMsg(epoch=0, owners=dict(owners))]
    epochs = itertools.count(1)

    def assign(**kwargs: Any) -> int:
        epoch = next(epochs)
        log.append(AssignmentMsg(epoch=epoch, **kwargs))
        return epoch

    for i in range(moves):
        pid = i % partitions
        source = owners[pid]
        target = names[(names.index(source) + 1) % instances]
        mode = (Mode.TRANSFER, Mode.REPLAY, Mode.PARALLEL_TRACK)[i % 3]
        move_id = f"m{i}"
        if i % 100 == 0:
            request = MoveRequestMsg(request_id=f"r{i}", pids=(pid,), target=target, mode=mode)
            log.append(request)
            move_id = request.move_id(pid)
        move = MoveSpec(move_id=move_id, pid=pid, source=source, target=target, mode=mode)
        epoch = assign(owners={p: o for p, o in owners.items() if p != pid}, moving={pid: move})
        log.append(ReleasedMsg(instance=source, epoch=epoch, pid=pid, move_id=move_id, cutoff={"A": i}))
        owners[pid] = target
        handoff = Handoff(move_id=move_id, mode=mode, cutoff={"A": i})
        tracks = {pid: move} if mode is Mode.PARALLEL_TRACK else {}
        epoch = assign(owners=dict(owners), handoffs={pid: handoff}, tracks=tracks)
        log.append(AcquiredMsg(instance=target, epoch=epoch, pid=pid, move_id=move_id))
        if tracks:
            for side, by in (("old", source), ("new", target)):
                log.append(TrackDoneMsg(instance=by, epoch=epoch, pid=pid, move_id=move_id, side=side))
        epoch = assign(owners=dict(owners))
        log.append(AcquiredMsg(instance="zombie", epoch=epoch, pid=pid, move_id=move_id))
    return log, owners


def run(moves: int, bootstrap: str | None = None, partitions: int = 64) -> dict[str, Any]:
    """Seconds to fold and to decode the control messages of `moves` moves over `partitions` pids; with
    a broker, also to catch up with them from a control topic of its own (deleted afterwards)."""
    log, _ = synthetic_log(moves, partitions)
    began = time.perf_counter()
    view = fold(log)
    fold_s = time.perf_counter() - began
    raw = [encode(msg) for msg in log]
    began = time.perf_counter()
    for value in raw:
        decode(value)
    result: dict[str, Any] = {
        "moves": moves,
        "messages": len(log),
        "partitions": partitions,
        "fold_s": round(fold_s, 3),
        "decode_s": round(time.perf_counter() - began, 3),
    }
    if bootstrap is not None:
        result["catch_up_s"], same = _catch_up_s(bootstrap, raw, view)
        assert same, "the reader's view differs from the fold's"
    return result


def _catch_up_s(bootstrap: str, raw: list[bytes], expected: Any) -> tuple[float, bool]:
    from confluent_kafka import Producer
    from confluent_kafka.admin import NewTopic

    from pipeline.config import load_config
    from pipeline.control import ControlLog
    from pipeline.topics import admin_client, delete_topics, partition_offsets, topic_specs

    cfg = load_config(None, [f"pipeline=bench-fold-{uuid.uuid4().hex[:8]}"])
    spec = next(s for s in topic_specs(cfg) if s.name == cfg.control_topic)
    admin = admin_client(bootstrap)
    admin.create_topics([NewTopic(spec.name, 1, -1, config=spec.config)])[spec.name].result()
    try:
        partition_offsets(admin, [(spec.name, 0)])  # its leader serves it
        producer = Producer(
            {**kafka_config(bootstrap), "linger.ms": 20, "queue.buffering.max.messages": 1_000_000}
        )
        for value in raw:
            producer.produce(spec.name, value=value)
        if producer.flush(120):
            raise RuntimeError("the control messages were not acknowledged within 120 s")
        reader = ControlLog(bootstrap, spec.name)
        try:
            began = time.perf_counter()
            view = reader.catch_up(timeout_s=600)
            return round(time.perf_counter() - began, 3), view == expected
        finally:
            reader.close()
    finally:
        delete_topics(bootstrap, [spec.name])
