"""The control protocol's JSON codecs: its messages (`pipeline.protocol`, and the snapshot of the view,
`pipeline.control_view.SnapshotMsg`) to the bytes of a record on `<pipeline>.control` and back, and the
handoffs, moves and snapshot references inside them. Versioned: a reader refuses a message newer than
itself (`ProtocolError`). Pure: no I/O.
"""

from __future__ import annotations

import json
from typing import Any, TypeVar

from pipeline.control_view import ControlView, Message, SnapshotMsg, moves_of
from pipeline.protocol import (
    PROTOCOL_VERSION,
    AcquiredMsg,
    AssignmentMsg,
    BudgetMsg,
    CommitMarker,
    Handoff,
    Mode,
    MoveRequestMsg,
    MoveSpec,
    ProtocolError,
    ReleasedMsg,
    Snapshot,
    SpillGateMsg,
    TrackDoneMsg,
)
from pipeline.spill import spill_points


def snapshot_to_json(s: Snapshot | None) -> dict[str, Any] | None:
    if s is None:
        return None
    return {"topic": s.topic, "partition": s.partition, "offsets": list(s.offsets), "sha256": s.sha256}


def snapshot_from_json(d: dict[str, Any] | None) -> Snapshot | None:
    if d is None:
        return None
    return Snapshot(
        topic=d["topic"], partition=int(d["partition"]), offsets=tuple(d["offsets"]), sha256=d["sha256"]
    )


def _stream_max(v: list[int] | None) -> tuple[int, ...] | None:
    return tuple(int(t) for t in v) if v is not None else None


def _flag(v: Any) -> bool:
    """A JSON boolean, refused if it is anything else (a string "false" would read as True)."""
    if not isinstance(v, bool):
        raise ValueError(f"expected true or false, got {v!r}")
    return v


def handoff_to_json(h: Handoff) -> dict[str, Any]:
    return {
        "move_id": h.move_id,
        "mode": h.mode.value,
        "cutoff": dict(h.cutoff),
        "snapshot": snapshot_to_json(h.snapshot),
        "stream_max": list(h.stream_max) if h.stream_max is not None else None,
        "since": dict(h.since) if h.since is not None else None,
        **({"spilled": [dict(c) for c in h.spilled]} if h.spilled is not None else {}),
    }


def handoff_from_json(d: dict[str, Any]) -> Handoff:
    return Handoff(
        move_id=d["move_id"],
        mode=Mode(d["mode"]),
        cutoff={s: int(o) for s, o in d["cutoff"].items()},
        snapshot=snapshot_from_json(d.get("snapshot")),
        stream_max=_stream_max(d.get("stream_max")),
        since={s: int(o) for s, o in d["since"].items()} if d.get("since") is not None else None,
        spilled=spill_points(d["spilled"]) if d.get("spilled") is not None else None,
    )


def move_to_json(m: MoveSpec) -> dict[str, Any]:
    return {"move_id": m.move_id, "pid": m.pid, "source": m.source, "target": m.target, "mode": m.mode.value}


def move_from_json(d: dict[str, Any]) -> MoveSpec:
    return MoveSpec(
        move_id=d["move_id"], pid=int(d["pid"]), source=d["source"], target=d["target"], mode=Mode(d["mode"])
    )


def encode(msg: Message) -> bytes:
    return json.dumps(message_to_json(msg), sort_keys=True).encode()


def message_to_json(msg: Message) -> dict[str, Any]:
    body: dict[str, Any]
    if isinstance(msg, AssignmentMsg):
        body = {
            "kind": "assignment",
            "epoch": msg.epoch,
            "owners": {str(p): o for p, o in sorted(msg.owners.items())},
            "moving": {str(p): move_to_json(m) for p, m in sorted(msg.moving.items())},
            "handoffs": {str(p): handoff_to_json(h) for p, h in sorted(msg.handoffs.items())},
            "tracks": {str(p): move_to_json(m) for p, m in sorted(msg.tracks.items())},
            "track_handoffs": {str(p): handoff_to_json(h) for p, h in sorted(msg.track_handoffs.items())},
            "evicted": list(msg.evicted),
        }
    elif isinstance(msg, ReleasedMsg):
        body = {
            "kind": "released",
            "instance": msg.instance,
            "epoch": msg.epoch,
            "pid": msg.pid,
            "move_id": msg.move_id,
            "cutoff": dict(msg.cutoff),
            "snapshot": snapshot_to_json(msg.snapshot),
            "stream_max": list(msg.stream_max) if msg.stream_max is not None else None,
            "announced": msg.announced,
        }
    elif isinstance(msg, TrackDoneMsg):
        body = {
            "kind": "track_done",
            "instance": msg.instance,
            "epoch": msg.epoch,
            "pid": msg.pid,
            "move_id": msg.move_id,
            "side": msg.side,
        }
    elif isinstance(msg, MoveRequestMsg):
        body = {
            "kind": "move_request",
            "request_id": msg.request_id,
            "pids": list(msg.pids),
            "target": msg.target,
            "mode": msg.mode.value,
            "expires_ms": msg.expires_ms,
        }
    elif isinstance(msg, BudgetMsg):
        body = {"kind": "budget", "instance": msg.instance, "state_budget_bytes": msg.state_budget_bytes}
    elif isinstance(msg, SpillGateMsg):
        body = {"kind": "spill_gate", "spill": msg.spill}
    elif isinstance(msg, SnapshotMsg):
        view = msg.view
        body = {
            "kind": "snapshot",
            "read_to": msg.read_to,
            "assignment": message_to_json(view.assignment) if view.assignment is not None else None,
            "released": [message_to_json(m) for _, m in sorted(view.released.items())],
            "acquired": [message_to_json(m) for _, m in sorted(view.acquired.items())],
            "track_done": [message_to_json(m) for _, m in sorted(view.track_done.items())],
            "requests": [message_to_json(m) for m in view.requests],
            "budgets": dict(sorted(view.budgets.items())),
            "spill": view.spill,
        }
    else:
        body = {
            "kind": "acquired",
            "instance": msg.instance,
            "epoch": msg.epoch,
            "pid": msg.pid,
            "move_id": msg.move_id,
        }
    return {"version": msg.version, **body}


def decode(raw: bytes) -> Message:
    try:
        d = json.loads(raw)
    except ValueError as exc:
        raise ProtocolError(f"malformed control message: {exc!r}") from None
    return message_from_json(d)


def message_from_json(d: Any) -> Message:
    try:
        version = int(d["version"])
        if version > PROTOCOL_VERSION:
            raise ProtocolError(f"control message version {version} is newer than {PROTOCOL_VERSION}")
        kind = d["kind"]
        if kind == "assignment":
            return AssignmentMsg(
                epoch=int(d["epoch"]),
                owners={int(p): o for p, o in d["owners"].items()},
                moving={int(p): move_from_json(m) for p, m in d["moving"].items()},
                handoffs={int(p): handoff_from_json(h) for p, h in d["handoffs"].items()},
                tracks={int(p): move_from_json(m) for p, m in d.get("tracks", {}).items()},
                track_handoffs={int(p): handoff_from_json(h) for p, h in d.get("track_handoffs", {}).items()},
                evicted=tuple(d["evicted"]),
            )
        if kind == "released":
            return ReleasedMsg(
                instance=d["instance"],
                epoch=int(d["epoch"]),
                pid=int(d["pid"]),
                move_id=d["move_id"],
                cutoff={s: int(o) for s, o in d["cutoff"].items()},
                snapshot=snapshot_from_json(d.get("snapshot")),
                stream_max=_stream_max(d.get("stream_max")),
                announced=bool(d.get("announced", False)),
            )
        if kind == "track_done":
            return TrackDoneMsg(
                instance=d["instance"],
                epoch=int(d["epoch"]),
                pid=int(d["pid"]),
                move_id=d["move_id"],
                side=d["side"],
            )
        if kind == "acquired":
            return AcquiredMsg(
                instance=d["instance"], epoch=int(d["epoch"]), pid=int(d["pid"]), move_id=d["move_id"]
            )
        if kind == "move_request":
            return MoveRequestMsg(
                request_id=d["request_id"],
                pids=tuple(int(p) for p in d["pids"]),
                target=d["target"],
                mode=Mode(d["mode"]),
                expires_ms=int(d["expires_ms"]) if d.get("expires_ms") is not None else None,
            )
        if kind == "budget":
            return BudgetMsg(instance=d["instance"], state_budget_bytes=int(d["state_budget_bytes"]))
        if kind == "spill_gate":
            return SpillGateMsg(spill=_flag(d["spill"]))
        if kind == "snapshot":
            assignment = _decoded(AssignmentMsg, d["assignment"]) if d["assignment"] is not None else None
            released = [_decoded(ReleasedMsg, m) for m in d["released"]]
            acquired = [_decoded(AcquiredMsg, m) for m in d["acquired"]]
            track_done = [_decoded(TrackDoneMsg, m) for m in d["track_done"]]
            return SnapshotMsg(
                view=ControlView(
                    assignment=assignment,
                    released={m.move_id: m for m in released},
                    acquired={m.move_id: m for m in acquired},
                    track_done={m.key: m for m in track_done},
                    requests=tuple(_decoded(MoveRequestMsg, m) for m in d["requests"]),
                    started=moves_of(assignment) if assignment is not None else frozenset(),
                    budgets={str(i): int(b) for i, b in d.get("budgets", {}).items()},
                    spill=None if d.get("spill") is None else _flag(d["spill"]),
                ),
                read_to=int(d["read_to"]),
            )
        raise ProtocolError(f"unknown control message kind {kind!r}")
    except (KeyError, TypeError, ValueError) as exc:
        if isinstance(exc, ProtocolError):
            raise
        raise ProtocolError(f"malformed control message: {exc!r}") from None


M = TypeVar("M", bound="Message")


def _decoded(kind: type[M], d: Any) -> M:
    """A message a snapshot carries, which must be of `kind`."""
    msg = message_from_json(d)
    if not isinstance(msg, kind):
        raise ProtocolError(f"a snapshot holds a {type(msg).__name__} where a {kind.__name__} belongs")
    return msg


def marker_to_json(m: CommitMarker) -> dict[str, Any]:
    return {
        "instance": m.instance,
        "incarnation": m.incarnation,
        "batch": m.batch,
        "epoch": m.epoch,
        "offsets": {s: {str(p): o for p, o in by_pid.items()} for s, by_pid in m.offsets.items()},
        "time_ms": m.time_ms,
        **({"spilled": {str(p): [dict(c) for c in cs] for p, cs in m.spilled.items()}} if m.spilled else {}),
    }


def marker_from_json(d: dict[str, Any]) -> CommitMarker:
    return CommitMarker(
        instance=d["instance"],
        incarnation=d["incarnation"],
        batch=int(d["batch"]),
        epoch=int(d["epoch"]),
        offsets={s: {int(p): int(o) for p, o in by_pid.items()} for s, by_pid in d["offsets"].items()},
        time_ms=int(d["time_ms"]),
        spilled={int(p): spill_points(c) for p, c in d.get("spilled", {}).items()},
    )


def marker_author(value: bytes) -> str:
    """The instance a commit marker's record speaks for: the one writer that may write it (decision 0064)."""
    return str(json.loads(value)["instance"])
