"""The instance's side of the move protocol (`pipeline.epoch_change.change_epoch`), one row per mode and
situation: what a batch that changes the epoch does to each pid that leaves, enters, overlaps or returns.

The input is a fixed fake (`Facts`): logs start at offset 0, a replay re-reads from 10 below the cutoff,
the sink noted a `stream_max` only where a test says so. The rules are the ones
`tests/unit/test_protocol_model.py` drives through random interleavings; here each is pinned by name.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import pytest

from pipeline.batch_plan import EpochChange, Release, Tracking, acquired_of, released_of, tracking_of
from pipeline.epoch_change import change_epoch
from pipeline.instance_files import OwnedPids
from pipeline.protocol import Handoff, Mode, MoveSpec, Snapshot
from pipeline.rows import DROP_ROW, TRACK_NEW, TRACK_OLD, TRACK_ROW, WATERMARK_ROW

STREAMS = ["A", "B"]
SNAPSHOT = Snapshot(topic="t.handoff", partition=0, offsets=(3,), sha256="00")


@dataclass
class Facts:
    noted: Mapping[int, tuple[int, ...]] = field(default_factory=dict)
    committed: frozenset[int] = frozenset()
    asked_earliest: list[int] = field(default_factory=list)

    def earliest(self, pids: Sequence[int]) -> dict[str, dict[str, int]]:
        self.asked_earliest.extend(pids)
        return {s: {str(p): 0 for p in pids} for s in STREAMS}

    def replay_from(self, pid: int, cutoff: Mapping[str, int]) -> dict[str, int]:
        return {s: o - 10 for s, o in cutoff.items()}

    def stream_maxes(self, cutoffs: Mapping[int, Mapping[str, int]]) -> Mapping[int, tuple[int, ...]]:
        return {p: self.noted[p] for p in cutoffs if p in self.noted}

    def refuse_unprocessed(self, query_epoch: int, epoch: int, pids: Sequence[int]) -> None:
        refused = list(pids) if query_epoch != -1 else [p for p in pids if p in self.committed]
        if refused:
            raise RuntimeError(f"refused {refused}")


def start(epoch: int, at: Mapping[int, int], **extra: Any) -> dict[str, Any]:
    """A query's offset holding each pid of `at` at that offset in both streams."""
    return {"epoch": epoch, "offsets": {s: {str(p): o for p, o in at.items()} for s in STREAMS}, **extra}


def move(pid: int, mode: Mode, source: str = "here", target: str = "there") -> MoveSpec:
    return MoveSpec(move_id=f"m{pid}", pid=pid, source=source, target=target, mode=mode)


def cut(offset: int) -> dict[str, int]:
    return dict.fromkeys(STREAMS, offset)


def plan(begin: dict[str, Any], owned: OwnedPids, facts: Facts | None = None) -> EpochChange:
    change = change_epoch(begin, owned, STREAMS, facts or Facts())
    # what Spark logs reads back as what was planned
    logged = change.to_json()
    assert released_of(logged) == change.released
    assert acquired_of(logged) == change.acquired
    assert tracking_of(logged) == change.tracking
    return change


@pytest.mark.parametrize(
    ("mode", "export", "announce"),
    [(Mode.TRANSFER, True, False), (Mode.REPLAY, False, True)],
)
def test_a_pid_in_transit_is_released_at_where_the_query_is(mode: Mode, export: bool, announce: bool) -> None:
    change = plan(
        start(4, {1: 40, 2: 50}), OwnedPids(epoch=5, pids=frozenset({2}), releasing={1: move(1, mode)})
    )
    assert change.released == {1: Release("m1", export=export, announce=announce, cutoff=cut(40))}
    assert change.offsets == {s: {"2": 50} for s in STREAMS}
    assert not change.acquired and not change.markers and not change.tracking


def test_a_pid_no_longer_owned_without_a_move_is_let_go_with_no_acknowledgement() -> None:
    change = plan(start(4, {1: 40}), OwnedPids(epoch=5, pids=frozenset()))
    assert change.released == {1: Release(None, export=False, announce=False, cutoff=cut(40))}


def test_a_kept_window_begins_an_overlap_instead_of_a_release() -> None:
    """Parallel track: the sender keeps reading the pid (old side); without a noted `stream_max` the
    `Released` waits for the batch's commit."""
    change = plan(
        start(4, {1: 40}), OwnedPids(epoch=5, pids=frozenset(), releasing={1: move(1, Mode.PARALLEL_TRACK)})
    )
    assert change.offsets == {s: {"1": 40} for s in STREAMS}
    assert change.released == {1: Release("m1", export=False, announce=False, cutoff=cut(40), track=True)}
    assert change.tracking == {1: Tracking("old", "m1")}
    assert change.markers == [(1, TRACK_ROW, 0, TRACK_OLD, 0)]


def test_an_overlap_whose_stream_max_the_sink_noted_is_announced_at_the_plan() -> None:
    change = plan(
        start(4, {1: 40}),
        OwnedPids(epoch=5, pids=frozenset(), releasing={1: move(1, Mode.PARALLEL_TRACK)}),
        Facts(noted={1: (7, 9)}),
    )
    assert change.released[1].announce and change.released[1].stream_max == [7, 9]


def test_an_overlap_already_begun_is_carried_not_begun_again() -> None:
    begun = start(5, {1: 60}, tracking={"1": {"role": "old", "move_id": "m1"}})
    change = plan(begun, OwnedPids(epoch=6, pids=frozenset(), old_tracks={1: "m1"}))
    assert change.tracking == {1: Tracking("old", "m1")}
    assert not change.released and not change.markers


@pytest.mark.parametrize(
    ("mode", "replay_from", "track"),
    [(Mode.TRANSFER, None, False), (Mode.REPLAY, cut(20), False), (Mode.PARALLEL_TRACK, None, True)],
)
def test_a_handed_off_pid_enters_at_its_cutoff(mode: Mode, replay_from: dict | None, track: bool) -> None:
    handoff = Handoff(
        move_id="m1",
        mode=mode,
        cutoff=cut(30),
        snapshot=SNAPSHOT if mode is Mode.TRANSFER else None,
        stream_max=(5, 6) if track else None,
    )
    owned = OwnedPids(
        epoch=6, pids=frozenset({1}), handoffs={1: handoff}, new_tracks={1: "m1"} if track else {}
    )
    change = plan(start(5, {}), owned)
    assert change.offsets == {s: {"1": 30} for s in STREAMS}
    assert change.acquired[1].handoff == handoff
    assert change.acquired[1].replay_from == replay_from
    assert change.taken == {1: "m1"}
    if track:
        assert change.tracking == {1: Tracking("new", "m1")}
        assert change.markers == [(1, TRACK_ROW, 0, TRACK_NEW, 5), (1, TRACK_ROW, 1, TRACK_NEW, 6)]
    else:
        assert not change.tracking and not change.markers


def test_a_held_pid_handed_back_under_a_handoff_not_taken_drops_its_stale_window() -> None:
    """Decision 0040: a replay announced, the query stopped before Spark logged it, the pid back."""
    back = Handoff(move_id="back", mode=Mode.REPLAY, cutoff=cut(60))
    change = plan(start(3, {1: 40}), OwnedPids(epoch=7, pids=frozenset({1}), handoffs={1: back}))
    assert change.markers == [(1, DROP_ROW, 0, 0, 0)]
    assert change.offsets == {s: {"1": 60} for s in STREAMS}
    assert change.acquired[1].replay_from == cut(50)
    # once taken, the next epoch listing the same handoff keeps the pid
    again = plan(
        start(7, {1: 70}, taken={"1": "back"}), OwnedPids(epoch=8, pids=frozenset({1}), handoffs={1: back})
    )
    assert not again.markers and not again.acquired


def test_an_old_side_handed_the_pid_back_returns_it_afresh() -> None:
    was_old = start(5, {1: 60}, tracking={"1": {"role": "old", "move_id": "m1"}})
    back = Handoff(move_id="m2", mode=Mode.TRANSFER, cutoff=cut(80), snapshot=SNAPSHOT)
    change = plan(was_old, OwnedPids(epoch=9, pids=frozenset({1}), handoffs={1: back}))
    assert (1, DROP_ROW, 0, 0, 0) in change.markers
    assert not change.tracking and change.offsets == {s: {"1": 80} for s in STREAMS}


def test_a_dead_old_sides_overlap_resumes_by_rebuilding_its_window_then_rereading_silently() -> None:
    resume = Handoff(move_id="r1", mode=Mode.PARALLEL_TRACK, cutoff=cut(45), stream_max=(3, 4), since=cut(30))
    owned = OwnedPids(epoch=8, pids=frozenset(), old_tracks={1: "m1"}, track_handoffs={1: resume})
    change = plan(start(7, {}), owned)
    assert change.offsets == {s: {"1": 45} for s in STREAMS}
    assert change.acquired[1].replay_from == cut(20)  # the window at `since`
    assert change.tracking == {1: Tracking("old", "m1")}
    assert change.markers == [
        (1, WATERMARK_ROW, 0, 0, 3),
        (1, WATERMARK_ROW, 1, 0, 4),
        (1, TRACK_ROW, 0, TRACK_OLD, 0),
    ]


def test_a_fresh_query_releases_pids_in_transit_that_it_never_read_at_the_log_start() -> None:
    owned = OwnedPids(epoch=2, pids=frozenset(), releasing={1: move(1, Mode.REPLAY)})
    change = plan(start(-1, {}), owned)
    assert change.released == {1: Release("m1", export=False, announce=True, cutoff=cut(0))}


def test_a_pid_without_a_handoff_starts_at_the_log_start_only_where_nobody_processed_it() -> None:
    facts = Facts(committed=frozenset({2}))
    first = plan(start(-1, {}), OwnedPids(epoch=0, pids=frozenset({1})), facts)
    assert first.offsets == {s: {"1": 0} for s in STREAMS} and facts.asked_earliest == [1]
    with pytest.raises(RuntimeError, match=r"refused \[2\]"):
        plan(start(-1, {}), OwnedPids(epoch=0, pids=frozenset({2})), facts)
    with pytest.raises(RuntimeError, match=r"refused \[3\]"):  # a running query gains pids only by handoffs
        plan(start(4, {1: 9}), OwnedPids(epoch=5, pids=frozenset({1, 3})), facts)
