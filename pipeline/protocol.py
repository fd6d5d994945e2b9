"""The control protocol: versioned messages on `<pipeline>.control` (one partition, one ordered log).

Shared wire contract between the controller (which writes `AssignmentMsg`) and the instances (which write
`ReleasedMsg` / `AcquiredMsg` inside the Kafka transaction of the micro-batch that did the work, so an
acknowledgement is visible exactly when the batch's output is). Pure: value objects, JSON codecs and the
fold that turns the log into the current view; no I/O.

A move of pid p from S to T takes two assignment epochs (an offset barrier, as in Flux):

1. epoch e+1 lists p as *in transit* (no owner) with the move. S, at its next batch boundary, stops reading
   p; the batch that does so exports p's window (mode `transfer`) and commits `Released(p, cutoff)`, the
   offsets up to which S processed p.
2. epoch e+2 gives p to T with a `Handoff` (cutoff offsets, snapshot reference, mode). T, at its next batch
   boundary, installs the window (from the snapshot, or by re-reading the input before the cutoff for
   `replay`) and continues at the cutoff; its batch commits `Acquired(p)`.

A `replay` needs nothing from S's batch but its cutoff, where that batch begins (S reads no more of p):
S announces `Released(p, cutoff)` when it plans the batch, and T starts while S's batch runs.

A `parallel_track` move (PTLB) replaces step 1's barrier by an overlap: S does not stop reading p; its
batch at the boundary marks its window old and commits `Released(p, cutoff, stream_max)` (announced
already when the batch is planned, if the window's `stream_max` at the cutoff is known then). Epoch
e+2 gives p to T (empty window, from the cutoff) and lists p in `tracks`: S keeps reading p and emits
the results with an old tuple until its old tuples have left the window, then commits
`TrackDone(p, old)`, and the epoch after lets S go (the track's source becomes ""); T commits
`TrackDone(p, new)` once no new tuple can join an old one; once both are in, the track is dropped.

Every message carries the complete map, not a diff (a reader needs only the newest assignment), and an
epoch; instances act on assignments only at batch boundaries and never read or emit a pid they do not own
in the epoch they act on.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from enum import Enum
from typing import Any

PROTOCOL_VERSION = 1


class Mode(Enum):
    """How a moved pid's window reaches its new owner."""

    TRANSFER = "transfer"
    """The sender exports the window at the cutoff; the receiver installs it (Flux, MSLB)."""
    REPLAY = "replay"
    """The receiver rebuilds the window by re-reading the input before the cutoff; nothing is shipped."""
    PARALLEL_TRACK = "parallel_track"
    """The receiver starts empty at the cutoff; the sender keeps the pid until its old tuples expire
    (PTLB). Nothing is shipped and the pid never pauses."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Snapshot:
    """Where an exported window lies: messages of the handoff topic, and the SHA-256 of their bytes."""

    topic: str
    partition: int
    offsets: tuple[int, ...]
    sha256: str


@dataclass(frozen=True, slots=True, kw_only=True)
class Handoff:
    """What a receiver needs to take a pid over: where to continue, and how to get the window."""

    move_id: str
    mode: Mode
    cutoff: Mapping[str, int]  # stream -> first offset the receiver reads
    snapshot: Snapshot | None = None  # transfer only
    # parallel_track only: the sender's largest event time per stream at the cutoff (decision 0047)
    stream_max: tuple[int, ...] | None = None
    # parallel_track recovery: the overlap began at `since`; [since, cutoff) is re-read silently (processed
    # as the dead instance processed it, emitting nothing) before reading on from the cutoff.
    since: Mapping[str, int] | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class MoveSpec:
    """A move as the controller announced it."""

    move_id: str
    pid: int
    source: str
    target: str
    mode: Mode


@dataclass(frozen=True, slots=True, kw_only=True)
class AssignmentMsg:
    """The complete assignment of one epoch. A pid absent from `owners` is in transit (being released)."""

    epoch: int
    owners: Mapping[int, str]
    moving: Mapping[int, MoveSpec] = field(default_factory=dict)  # pid -> move, for pids in transit
    handoffs: Mapping[int, Handoff] = field(default_factory=dict)  # pid -> handoff, for pids being taken
    # pid -> its parallel_track move while the move's source still holds the old tuples (the overlap)
    tracks: Mapping[int, MoveSpec] = field(default_factory=dict)
    # pid -> where a new holder of the old tuples resumes (the previous holder died in the overlap)
    track_handoffs: Mapping[int, Handoff] = field(default_factory=dict)
    evicted: tuple[str, ...] = ()  # "instance@incarnation" declared dead; on return they restart empty
    version: int = PROTOCOL_VERSION

    def pids_of(self, instance: str) -> frozenset[int]:
        return frozenset(p for p, owner in self.owners.items() if owner == instance)


@dataclass(frozen=True, slots=True, kw_only=True)
class ReleasedMsg:
    """An instance stopped processing `pid`: everything before `cutoff` is in committed output.

    `announced`: published when the batch that releases the pid was planned, outside its transaction
    (a replay, or a parallel track whose `stream_max` is known then). The cutoff is where that batch
    begins, so everything before it is in committed output already."""

    instance: str
    epoch: int
    pid: int
    move_id: str
    cutoff: Mapping[str, int]
    snapshot: Snapshot | None = None
    stream_max: tuple[int, ...] | None = None  # parallel_track: the receiver's lateness rule goes on from it
    announced: bool = False
    version: int = PROTOCOL_VERSION


@dataclass(frozen=True, slots=True, kw_only=True)
class TrackDoneMsg:
    """One side of a parallel_track overlap is over: the sender (`side` "old") holds no old tuple of
    `pid` any more and can let it go; the receiver ("new") is back to the plain lateness rule."""

    instance: str
    epoch: int
    pid: int
    move_id: str
    side: str
    version: int = PROTOCOL_VERSION

    @property
    def key(self) -> str:
        return track_key(self.move_id, self.side)


def track_key(move_id: str, side: str) -> str:
    """How `ControlView.track_done` names one side's end of one parallel track."""
    return f"{move_id}/{side}"


@dataclass(frozen=True, slots=True, kw_only=True)
class AcquiredMsg:
    """An instance installed `pid`'s window and committed its first batch as the owner."""

    instance: str
    epoch: int
    pid: int
    move_id: str
    version: int = PROTOCOL_VERSION


@dataclass(frozen=True, slots=True, kw_only=True)
class MoveRequestMsg:
    """A request for moves (`fluxjoin move`); only the controller turns requests into assignments."""

    request_id: str
    pids: tuple[int, ...]
    target: str
    mode: Mode
    version: int = PROTOCOL_VERSION

    def move_id(self, pid: int) -> str:
        return f"{self.request_id}-{pid}"


Message = AssignmentMsg | ReleasedMsg | AcquiredMsg | TrackDoneMsg | MoveRequestMsg


class ProtocolError(ValueError):
    """A control message that cannot be decoded (unknown kind, newer version, missing field)."""


# --- JSON codec ---


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


def handoff_to_json(h: Handoff) -> dict[str, Any]:
    return {
        "move_id": h.move_id,
        "mode": h.mode.value,
        "cutoff": dict(h.cutoff),
        "snapshot": snapshot_to_json(h.snapshot),
        "stream_max": list(h.stream_max) if h.stream_max is not None else None,
        "since": dict(h.since) if h.since is not None else None,
    }


def handoff_from_json(d: dict[str, Any]) -> Handoff:
    return Handoff(
        move_id=d["move_id"],
        mode=Mode(d["mode"]),
        cutoff={s: int(o) for s, o in d["cutoff"].items()},
        snapshot=snapshot_from_json(d.get("snapshot")),
        stream_max=_stream_max(d.get("stream_max")),
        since={s: int(o) for s, o in d["since"].items()} if d.get("since") is not None else None,
    )


def move_to_json(m: MoveSpec) -> dict[str, Any]:
    return {"move_id": m.move_id, "pid": m.pid, "source": m.source, "target": m.target, "mode": m.mode.value}


def move_from_json(d: dict[str, Any]) -> MoveSpec:
    return MoveSpec(
        move_id=d["move_id"], pid=int(d["pid"]), source=d["source"], target=d["target"], mode=Mode(d["mode"])
    )


def encode(msg: Message) -> bytes:
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
        }
    else:
        body = {
            "kind": "acquired",
            "instance": msg.instance,
            "epoch": msg.epoch,
            "pid": msg.pid,
            "move_id": msg.move_id,
        }
    return json.dumps({"version": msg.version, **body}, sort_keys=True).encode()


def decode(raw: bytes) -> Message:
    try:
        d = json.loads(raw)
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
            )
        raise ProtocolError(f"unknown control message kind {kind!r}")
    except (KeyError, TypeError, ValueError, json.JSONDecodeError) as exc:
        if isinstance(exc, ProtocolError):
            raise
        raise ProtocolError(f"malformed control message: {exc!r}") from None


# --- the log folded into the current view ---


@dataclass(frozen=True, slots=True)
class ControlView:
    """What the control log says now: the newest assignment, the acknowledgements by move id, the
    move requests, and every move id any assignment has started (so a request is served once).

    `released` keeps one `Released` per move: the committed one once it is in, else the announced one."""

    assignment: AssignmentMsg | None = None
    released: Mapping[str, ReleasedMsg] = field(default_factory=dict)
    acquired: Mapping[str, AcquiredMsg] = field(default_factory=dict)
    track_done: Mapping[str, TrackDoneMsg] = field(default_factory=dict)  # by "move_id/side"
    requests: tuple[MoveRequestMsg, ...] = ()
    started: frozenset[str] = frozenset()

    def apply(self, msg: Message) -> ControlView:
        """The view after one more message. Older epochs never replace a newer assignment."""
        if isinstance(msg, AssignmentMsg):
            if self.assignment is not None and msg.epoch <= self.assignment.epoch:
                return self
            ids = {m.move_id for m in [*msg.moving.values(), *msg.tracks.values()]}
            ids |= {h.move_id for h in [*msg.handoffs.values(), *msg.track_handoffs.values()]}
            return replace(self, assignment=msg, started=self.started | ids)
        if isinstance(msg, ReleasedMsg):
            known = self.released.get(msg.move_id)
            if msg.announced and known is not None and not known.announced:
                return self
            return replace(self, released={**self.released, msg.move_id: msg})
        if isinstance(msg, AcquiredMsg):
            return replace(self, acquired={**self.acquired, msg.move_id: msg})
        if isinstance(msg, TrackDoneMsg):
            return replace(self, track_done={**self.track_done, msg.key: msg})
        return replace(self, requests=(*self.requests, msg))

    def track_ended(self, move_id: str, side: str) -> bool:
        return track_key(move_id, side) in self.track_done

    def pending_requests(self) -> list[tuple[MoveRequestMsg, int]]:
        """(request, pid) pairs no assignment has started yet, in request order."""
        return [(r, p) for r in self.requests for p in r.pids if r.move_id(p) not in self.started]


def fold(messages: Iterable[Message], start: ControlView | None = None) -> ControlView:
    view = start or ControlView()
    for msg in messages:
        view = view.apply(msg)
    return view
