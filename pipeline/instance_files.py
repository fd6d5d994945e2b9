"""The files an instance's processes share on its disk: the assignment file, and what the sink notes
for the source after every batch.

The control follower writes the assignment file and the source reads it at every batch boundary; the
sink writes each kept pid's window `stream_max` with the offsets it has read up to (the watermarks
file), recent batches' tuples and results (the recent-yields file) and the pids to spill with the
room the budget leaves (the spill-requests file), which the source reads when it plans a batch.
Apart from the source because the control follower, the sink and the health endpoint write or read
them too, without Spark. Every file is replaced atomically (`_replace_json`).
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pipeline.batch_sizing import Yield
from pipeline.protocol import AssignmentMsg, Handoff, MoveSpec
from pipeline.protocol_codec import handoff_from_json, handoff_to_json, move_from_json, move_to_json


def _replace_json(path: Path, value: Any) -> None:
    """Atomically replace `path` with `value` as JSON: a reader never sees a half-written file."""
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(value))
    os.replace(tmp, path)


def _read_json(path: Path) -> Any:
    """What `_replace_json` wrote at `path`; None when nothing has been written yet."""
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        return None


# --- the assignment file: written by the instance's control follower, read at batch boundaries ---


@dataclass(frozen=True, slots=True)
class OwnedPids:
    """This instance's part of one assignment epoch."""

    epoch: int
    pids: frozenset[int]
    # Pids being taken over: where to continue and how to get the window. A pid new to this instance
    # without a handoff starts at the earliest offsets with an empty window (a fresh pipeline; refused
    # where the instance processed it before, `KafkaInputFacts.refuse_unprocessed`).
    handoffs: Mapping[int, Handoff] = field(default_factory=dict)
    # Pids in transit from this instance: released at the next batch boundary (parallel_track: the
    # overlap begins there instead).
    releasing: Mapping[int, MoveSpec] = field(default_factory=dict)
    # Parallel-track overlaps: pids whose old tuples this instance still holds (it keeps reading them),
    # and owned pids whose old tuples another instance still holds.
    old_tracks: Mapping[int, str] = field(default_factory=dict)  # pid -> the track's move id
    new_tracks: Mapping[int, str] = field(default_factory=dict)
    # Old tracks this instance takes over from a holder that died: where to resume, how to rebuild.
    track_handoffs: Mapping[int, Handoff] = field(default_factory=dict)


def owned_pids(msg: AssignmentMsg, instance: str) -> OwnedPids:
    pids = msg.pids_of(instance)
    return OwnedPids(
        epoch=msg.epoch,
        pids=pids,
        handoffs={p: h for p, h in msg.handoffs.items() if p in pids},
        releasing={p: m for p, m in msg.moving.items() if m.source == instance},
        old_tracks={p: m.move_id for p, m in msg.tracks.items() if m.source == instance},
        new_tracks={p: m.move_id for p, m in msg.tracks.items() if m.target == instance},
        track_handoffs={
            p: h
            for p, h in msg.track_handoffs.items()
            if p in msg.tracks and msg.tracks[p].source == instance
        },
    )


def move_steps(owned: OwnedPids) -> frozenset[tuple[str, int, str]]:
    """What an assignment asks of the instance, step by step: each pid to own, to release and to take
    over (by move); a paced source plans a batch at once for a step it has not planned yet."""
    return frozenset(
        [("own", p, "") for p in owned.pids]
        + [("release", p, m.move_id) for p, m in owned.releasing.items()]
        + [("take", p, h.move_id) for p, h in owned.handoffs.items()]
        + [("resume", p, h.move_id) for p, h in owned.track_handoffs.items()]
    )


def write_assignment(path: Path, owned: OwnedPids) -> None:
    """Atomically replace the assignment file (readers never see a half-written file)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    body = {
        "epoch": owned.epoch,
        "pids": sorted(owned.pids),
        "handoffs": {str(p): handoff_to_json(h) for p, h in sorted(owned.handoffs.items())},
        "releasing": {str(p): move_to_json(m) for p, m in sorted(owned.releasing.items())},
        "old_tracks": {str(p): m for p, m in sorted(owned.old_tracks.items())},
        "new_tracks": {str(p): m for p, m in sorted(owned.new_tracks.items())},
        "track_handoffs": {str(p): handoff_to_json(h) for p, h in sorted(owned.track_handoffs.items())},
    }
    _replace_json(path, body)


def read_assignment(path: Path) -> OwnedPids:
    body = json.loads(path.read_text())
    return OwnedPids(
        epoch=int(body["epoch"]),
        pids=frozenset(int(p) for p in body["pids"]),
        handoffs={int(p): handoff_from_json(h) for p, h in body["handoffs"].items()},
        releasing={int(p): move_from_json(m) for p, m in body["releasing"].items()},
        old_tracks={int(p): m for p, m in body["old_tracks"].items()},
        new_tracks={int(p): m for p, m in body["new_tracks"].items()},
        track_handoffs={int(p): handoff_from_json(h) for p, h in body["track_handoffs"].items()},
    )


# --- files the sink writes after every batch and the source reads when it plans one ---


def write_watermarks(path: Path, noted: Mapping[str, Mapping[str, Any]]) -> None:
    """The file of each kept pid's window `stream_max` and the offsets it has read up to:
    `{pid: {"stream_max": [t_0, ...], "offsets": {stream: next}}}`."""
    _replace_json(path, noted)


def read_watermarks(path: Path) -> dict[str, Any]:
    """The file `write_watermarks` wrote; empty when there is none yet."""
    return dict(_read_json(path) or {})


Yields = dict[int, list[Yield]]
"""Per pid, recent batches' (tuples in, results out, key combinations within), newest last."""


def write_recent_yields(path: Path, yields: Mapping[int, Sequence[Yield]]) -> None:
    """The file of each pid's recent batches' tuples, results and key combinations within (the sink
    notes them)."""
    _replace_json(path, {str(p): [list(r) for r in recent] for p, recent in yields.items()})


def read_recent_yields(path: Path) -> Yields:
    """What `write_recent_yields` wrote; empty before any batch with input."""
    noted = _read_json(path)
    if not isinstance(noted, dict):
        return {}
    # A file of an earlier version holds (tuples, results): every result counts as made within.
    return {int(p): [(int(y[0]), int(y[1]), int(y[-1])) for y in recent] for p, recent in noted.items()}


@dataclass(frozen=True, slots=True)
class SpillRequests:
    """What the sink asks of the next batch while spilling is on: the pids to spill, each with its
    window's bytes (`pipeline.spill.choose_spills`), and how many tuples the batch may read
    (`pipeline.spill.batch_room`; None before the sink has measured a window: no bound)."""

    pids: Mapping[int, int] = field(default_factory=dict)
    room_tuples: int | None = None


def write_spill_requests(path: Path, requests: SpillRequests) -> None:
    _replace_json(
        path, {"spill": {str(p): b for p, b in requests.pids.items()}, "room_tuples": requests.room_tuples}
    )


def read_spill_requests(path: Path) -> SpillRequests:
    """What `write_spill_requests` wrote; nothing asked before the first batch."""
    noted = _read_json(path)
    if not isinstance(noted, dict):
        return SpillRequests()
    room = noted.get("room_tuples")
    return SpillRequests(
        {int(p): int(b) for p, b in noted["spill"].items()}, None if room is None else int(room)
    )


def stream_max_at(noted: Mapping[str, Any], pid: int, cutoff: Mapping[str, int]) -> tuple[int, ...] | None:
    """Pid's window `stream_max` where its input reaches `cutoff`, if the file noted it there (else None:
    the window at the cutoff is not known before the batch runs)."""
    entry = noted.get(str(pid))
    if entry is None or entry["offsets"] != dict(cutoff):
        return None
    return tuple(int(t) for t in entry["stream_max"])
