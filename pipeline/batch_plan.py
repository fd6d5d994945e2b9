"""A batch's plan as the source's offset carries it: typed here, JSON in Spark's offset log.

The source's offset is `{"epoch", "offsets", ...}` (`pipeline.source.FluxjoinStreamReader`); a batch
that changes the epoch adds what it does to pids that leave, enter or overlap (`pipeline.epoch_change`):
`released`, `acquired`, `tracking`, `taken`, `markers`, and `from`. Spark logs the offset as JSON, so a
restarted query plans nothing again; the source, the sink and the operator's marker rows read these
entries through the types below, never as loose dictionaries. The JSON each type writes is the one
earlier versions logged, so a checkpoint written before still reads.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from pipeline.protocol import Handoff
from pipeline.protocol_codec import handoff_from_json, handoff_to_json

Offsets = dict[str, dict[str, int]]  # stream -> str(pid) -> next offset to read
Marker = tuple[int, int, int, int, int]
"""A marker row the batch's first task yields before any input: (pid, code, id, key, ts) (`pipeline.rows`)."""


@dataclass(slots=True)
class Release:
    """A pid this batch lets go, or (`track`) whose overlap as the old side begins with it."""

    move_id: str | None  # None: no longer owned, with no move (an eviction's aftermath)
    export: bool  # the sink writes the window to the handoff topic
    announce: bool  # `Released` goes out when the batch is planned, not only with its commit
    cutoff: dict[str, int]
    track: bool = False
    stream_max: list[int] | None = None  # known at the plan: the overlap's `Released` is announced

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "move_id": self.move_id,
            "export": self.export,
            "announce": self.announce,
            "cutoff": self.cutoff,
        }
        if self.track:
            out["track"] = True
        if self.stream_max is not None:
            out["stream_max"] = self.stream_max
        return out

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> Release:
        stream_max = d.get("stream_max")
        return cls(
            move_id=d["move_id"],
            export=bool(d["export"]),
            announce=bool(d["announce"]),
            cutoff={s: int(o) for s, o in d["cutoff"].items()},
            track=bool(d.get("track", False)),
            stream_max=[int(t) for t in stream_max] if stream_max is not None else None,
        )


@dataclass(frozen=True, slots=True)
class Acquire:
    """A pid this batch takes over by `handoff`: its window installed, or rebuilt by re-reading from
    `replay_from` (the input before the cutoff), before the batch's input."""

    handoff: Handoff
    replay_from: dict[str, int] | None

    def to_json(self) -> dict[str, Any]:
        return {"handoff": handoff_to_json(self.handoff), "replay_from": self.replay_from}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> Acquire:
        replay_from = d["replay_from"]
        return cls(
            handoff=handoff_from_json(d["handoff"]),
            replay_from={s: int(o) for s, o in replay_from.items()} if replay_from is not None else None,
        )


@dataclass(frozen=True, slots=True)
class Tracking:
    """This instance's side of a pid's parallel track, carried in every offset until the track ends."""

    role: Literal["old", "new"]
    move_id: str

    def to_json(self) -> dict[str, Any]:
        return {"role": self.role, "move_id": self.move_id}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> Tracking:
        role = d["role"]
        assert role in ("old", "new"), role
        return cls(role=role, move_id=d["move_id"])


@dataclass(slots=True)
class EpochChange:
    """What a batch that changes the epoch does, before its end offsets are known (`latestOffset` reads
    them next): `offsets` holds where each kept or entering pid begins."""

    epoch: int
    offsets: Offsets
    released: dict[int, Release]
    acquired: dict[int, Acquire]
    tracking: dict[int, Tracking]
    taken: dict[int, str]  # pid -> the move id of the handoff this query took it by
    markers: list[Marker]
    begins: Offsets = field(default_factory=dict)
    """`from`: where the pids entering in the batch begin (they are not in the batch's start offset)."""

    def to_json(self) -> dict[str, Any]:
        return {
            "epoch": self.epoch,
            "offsets": self.offsets,
            "released": {str(p): r.to_json() for p, r in self.released.items()},
            "acquired": {str(p): a.to_json() for p, a in self.acquired.items()},
            "tracking": tracking_to_json(self.tracking),
            "taken": {str(p): m for p, m in self.taken.items()},
            "markers": self.markers,
            "from": self.begins,
        }


def released_of(offset: dict[str, Any]) -> dict[int, Release]:
    return {int(p): Release.from_json(r) for p, r in offset.get("released", {}).items()}


def acquired_of(offset: dict[str, Any]) -> dict[int, Acquire]:
    return {int(p): Acquire.from_json(a) for p, a in offset.get("acquired", {}).items()}


def tracking_of(offset: dict[str, Any]) -> dict[int, Tracking]:
    return {int(p): Tracking.from_json(t) for p, t in offset.get("tracking", {}).items()}


def tracking_to_json(tracking: dict[int, Tracking]) -> dict[str, Any]:
    return {str(p): t.to_json() for p, t in tracking.items()}


def taken_of(offset: dict[str, Any]) -> dict[int, str]:
    return {int(p): m for p, m in offset.get("taken", {}).items()}


def markers_of(offset: dict[str, Any]) -> list[Marker]:
    return [(int(p), int(c), int(i), int(k), int(t)) for p, c, i, k, t in offset.get("markers", [])]
