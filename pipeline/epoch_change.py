"""The instance's side of the move protocol, as a pure function: what a batch that changes the epoch
does to the pids that leave, enter or overlap (`change_epoch`).

No Kafka, no files, no clock: what it needs of the input (a pid's earliest offsets, where a replay
re-reads from, the window's `stream_max` the sink noted) it asks of an `InputFacts`, which
`pipeline.input_facts.KafkaInputFacts` answers from Kafka and a model-based test answers from a
simulated log. How each handoff mode treats the window is `pipeline.protocol.MODE_RULES`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Protocol

from pipeline.batch_plan import (
    Acquire,
    EpochChange,
    Marker,
    Offsets,
    Release,
    Tracking,
    taken_of,
    tracking_of,
)
from pipeline.instance_files import OwnedPids
from pipeline.protocol import MODE_RULES
from pipeline.rows import DROP_ROW, TRACK_NEW, TRACK_OLD, TRACK_ROW, WATERMARK_ROW


class InputFacts(Protocol):
    """What `change_epoch` asks of the input and of the instance's own history."""

    def earliest(self, pids: Sequence[int]) -> Offsets:
        """Each stream's log start offsets of `pids`."""
        ...

    def replay_from(self, pid: int, cutoff: Mapping[str, int]) -> dict[str, int]:
        """Where re-reading `pid`'s input rebuilds the window its previous owner had at `cutoff`."""
        ...

    def stream_maxes(self, cutoffs: Mapping[int, Mapping[str, int]]) -> Mapping[int, tuple[int, ...]]:
        """Per pid of `cutoffs`, the window's `stream_max` the sink noted with its input at that cutoff;
        a pid it did not note is left out. Asked once per plan: the sink's notes are one file."""
        ...

    def refuse_unprocessed(self, query_epoch: int, epoch: int, pids: Sequence[int]) -> None:
        """Raise unless nobody has processed `pids`, owned in `epoch` with no handoff and new to a query
        that runs since `query_epoch` (-1: its first batch): read from the log start, they would emit
        every retained result again."""
        ...


def change_epoch(
    start: dict[str, Any], owned: OwnedPids, streams: Sequence[str], facts: InputFacts
) -> EpochChange:
    """Release pids no longer owned (at their current offsets, the cutoff); enter acquired ones at
    their handoff's cutoff (or the earliest offsets when there is none).

    A mode whose sender keeps the window (parallel track): a pid in transit in that mode is not released
    but kept, its overlap beginning here (`tracking` role "old", carried in every later offset until the
    track ends); a pid taken over in that mode is tracked "new" until the assignment drops its track.

    A pid this query still holds can come back to it with a handoff it has not taken (`taken`: the
    handoffs each offset since the taking carries, until the assignment drops them). It returns: its
    stale window is dropped (a `DROP_ROW` marker, first in the batch) and it enters at its handoff's
    cutoff like any pid taken over. That happens to an old side that learns its track ended only
    together with the pid's move back to it (the epochs between were published during one long
    batch), and to a query that announced a replay's release and stopped before Spark logged it
    (decision 0040), when the pid is handed back to it before it plans again.

    A pid new to the query with no handoff starts at the earliest offsets with an empty window: right
    where nobody processed it (`InputFacts.refuse_unprocessed`).
    """
    current: Offsets = start["offsets"]
    first = streams[0]
    before = tracking_of(start)
    taken = taken_of(start)
    tracking: dict[int, Tracking] = {}
    markers: list[Marker] = []
    held_now = {int(p) for p in current.get(first, {})}
    kept_moves = {p: m for p, m in owned.releasing.items() if MODE_RULES[m.mode].sender_keeps_window}
    starting = {p: m for p, m in kept_moves.items() if p not in before or before[p].role != "old"}
    returning = {p for p in owned.pids if p in before and before[p].role == "old"} | {
        p for p, h in owned.handoffs.items() if p in held_now and taken.get(p) != h.move_id
    }
    held = set(owned.pids) | set(owned.old_tracks) | set(kept_moves)
    kept = held - returning  # the held pids read on from where this query is
    keep: Offsets = {s: {p: o for p, o in current.get(s, {}).items() if int(p) in kept} for s in streams}
    for p, t in before.items():
        if p in kept and (t.role == "old" or p in owned.new_tracks):
            tracking[p] = t
    markers.extend((p, DROP_ROW, 0, 0, 0) for p in sorted(returning))
    released: dict[int, Release] = {}
    for p in sorted(held_now - held):
        move = owned.releasing.get(p)
        rules = MODE_RULES[move.mode] if move else None
        released[p] = Release(
            move_id=move.move_id if move else None,
            export=rules is not None and rules.sender_exports_window,
            announce=rules is not None and rules.released_at_plan,
            cutoff={s: current[s][str(p)] for s in streams},
        )
    new = sorted(p for p in owned.pids if str(p) not in keep[first])
    # A query's first batch may see pids already in transit from it that it never read (the move began
    # while the instance was starting): it releases them where nobody has read them yet.
    fresh = start["epoch"] == -1
    unread = sorted(p for p in owned.releasing if str(p) not in keep[first]) if fresh else []
    unhanded = [p for p in new if p not in owned.handoffs]
    if unhanded:
        facts.refuse_unprocessed(start["epoch"], owned.epoch, unhanded)
    earliest = facts.earliest(unhanded + unread) if unhanded or unread else {s: {} for s in streams}
    for p in unread:
        move = owned.releasing[p]
        rules = MODE_RULES[move.mode]
        cutoff = {s: earliest[s][str(p)] for s in streams}
        if rules.sender_keeps_window:
            for s in streams:
                keep[s][str(p)] = cutoff[s]
        released[p] = Release(
            move_id=move.move_id,
            export=rules.sender_exports_window,
            announce=rules.released_at_plan,
            cutoff=cutoff,
        )
    # an overlap of a pid this query does not read has nothing to track
    overlaps = {p: {s: keep[s][str(p)] for s in streams} for p in sorted(starting) if str(p) in keep[first]}
    noted = facts.stream_maxes(overlaps) if overlaps else {}
    for p, cutoff in overlaps.items():
        move = starting[p]
        release = released.setdefault(p, Release(move.move_id, export=False, announce=False, cutoff=cutoff))
        release.track = True
        stream_max = noted.get(p)
        if stream_max is not None:  # announced when the batch is planned (`partitions`)
            release.stream_max, release.announce = list(stream_max), True
        tracking[p] = Tracking("old", move.move_id)
        markers.append((p, TRACK_ROW, 0, TRACK_OLD, 0))
    acquired: dict[int, Acquire] = {}
    for p, resume in sorted(owned.track_handoffs.items()):
        if str(p) in keep[first]:
            continue  # resumed already
        assert resume.since is not None and resume.stream_max is not None
        for s in streams:
            keep[s][str(p)] = resume.cutoff[s]
        acquired[p] = Acquire(resume, facts.replay_from(p, resume.since))
        markers.extend((p, WATERMARK_ROW, j, 0, t) for j, t in enumerate(resume.stream_max))
        markers.append((p, TRACK_ROW, 0, TRACK_OLD, 0))
        tracking[p] = Tracking("old", owned.old_tracks[p])
    for p in new:
        handoff = owned.handoffs.get(p)
        if handoff is None:
            for s in streams:
                keep[s][str(p)] = earliest[s][str(p)]
            continue
        for s in streams:
            keep[s][str(p)] = handoff.cutoff[s]
        rules = MODE_RULES[handoff.mode]
        # a pid its dead owner had spilled: the window at the spill point (`pipeline.spill`)
        rebuilt_at = handoff.spilled[0] if handoff.spilled else handoff.cutoff
        replay = facts.replay_from(p, rebuilt_at) if rules.receiver_rebuilds_from_log else None
        acquired[p] = Acquire(handoff, replay)
        if rules.sender_keeps_window:  # the new side of an overlap: only results of new tuples
            assert handoff.stream_max is not None, "a kept window's handoff carries stream_max"
            markers.extend((p, TRACK_ROW, j, TRACK_NEW, t) for j, t in enumerate(handoff.stream_max))
            tracking[p] = Tracking("new", owned.new_tracks[p])
    return EpochChange(
        epoch=owned.epoch,
        offsets=keep,
        released=released,
        acquired=acquired,
        tracking=tracking,
        taken={p: h.move_id for p, h in sorted(owned.handoffs.items())},
        markers=markers,
    )
