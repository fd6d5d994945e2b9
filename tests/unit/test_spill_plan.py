"""The source's plan of spills and clean-ups (`FluxjoinStreamReader._with_spills`), without Kafka or
Spark: the input's offsets and the sink's requests are set by hand, `replay_from` answers a fixed
offset. Which pids spill, which stay spilled, and that a pid leaving the instance is always cleaned up."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from pipeline.instance_files import OwnedPids, SpillRequests, write_assignment, write_spill_requests
from pipeline.rows import DROP_ROW, MAX_SPILLS, SPILL_ROW
from pipeline.source import FluxjoinStreamReader
from pipeline.spill import Spill, cleanups_of, spilled_of

STREAMS = ("A", "B")


@dataclass
class Facts:
    """What the plan asks of the input: where a replay re-reads from (the log's start here), and the
    input's end offsets (`latest`)."""

    window_ms: int = 10_000
    lateness_ms: int = 1_000
    watermarks_path: Path | None = None
    latest: dict[str, dict[str, int]] = field(default_factory=dict)

    def replay_from(self, pid: int, cutoff: Mapping[str, int]) -> dict[str, int]:
        return {s: 0 for s in cutoff}

    def offsets(self, pids: list[int], latest: bool) -> dict[str, dict[str, int]]:
        return {s: {str(p): by_pid[str(p)] for p in pids} for s, by_pid in self.latest.items()}


def reader(tmp_path: Path, cleanup: str = "lazy") -> FluxjoinStreamReader:
    r = FluxjoinStreamReader(
        {
            "bootstrap": "unused:9092",
            "streams": ",".join(STREAMS),
            "topics": "a,b",
            "assignment": str(tmp_path / "assignment.json"),
            "partitions": "8",
            "tasks": "1",
            "trigger_ms": "1000",
            "spill_requests": str(tmp_path / "spill_requests.json"),
            "spill_cleanup": cleanup,
        }
    )
    r.facts = Facts()  # type: ignore[assignment]
    return r


def offsets(**by_pid: int) -> dict[str, dict[str, int]]:
    return {s: {p.removeprefix("p"): o for p, o in by_pid.items()} for s in STREAMS}


def plan(start: dict[str, Any], end: dict[str, dict[str, int]], **extra: Any) -> dict[str, Any]:
    return {"epoch": start["epoch"], "tracking": {}, "taken": {}, "offsets": end, **extra}


def test_the_pids_asked_for_spill_at_where_the_batch_begins_unless_busy(tmp_path: Path) -> None:
    r = reader(tmp_path)
    start = {"epoch": 3, "offsets": offsets(p1=100, p2=200, p3=300, p4=400)}
    r._latest = offsets(p1=150, p2=250, p3=350, p4=400)  # pid 4: nothing waiting
    for p in ("1", "2", "3", "4"):
        r._input_at[p] = 0.0  # long ago: pid 4's input has paused
    asked = {1: 5000, 2: 4000, 3: 3000, 4: 2000}
    released = {"3": {"move_id": "m", "export": True, "announce": False, "cutoff": {"A": 350, "B": 350}}}
    got = r._with_spills(start, plan(start, offsets(p1=150, p2=250, p4=400), released=released), asked)
    spilled = spilled_of(got)
    assert sorted(spilled) == [1, 2, 4], "pid 3 is leaving; pid 4, paused, is parked"
    assert spilled[1].cutoffs == ({"A": 100, "B": 100},) and spilled[1].state_bytes == 5000
    assert sorted(m[0] for m in got["markers"] if m[1] == SPILL_ROW) == [1, 2, 4]
    assert "cleanups" not in got


def test_a_spilled_pid_is_carried_until_it_leaves_and_cleaned_up_in_that_batch(tmp_path: Path) -> None:
    r = reader(tmp_path)
    asked: dict[int, int] = {}  # the sink asks for no spill
    spill = {"cutoff": {"A": 100, "B": 90}, "state_bytes": 5000, "stream_max": [7, 8]}
    start = {"epoch": 3, "offsets": offsets(p1=160), "spilled": {"1": spill}}
    r._latest, r._input_at["1"] = offsets(p1=200), 1e12  # input keeps coming
    carried = r._with_spills(start, plan(start, offsets(p1=200)), asked)
    assert spilled_of(carried) == spilled_of(start) and "cleanups" not in carried
    released = {"1": {"move_id": "m", "export": False, "announce": True, "cutoff": {"A": 160, "B": 160}}}
    leaving = r._with_spills(start, plan(start, offsets(), released=released), asked)
    assert spilled_of(leaving) == {}
    cleanup = cleanups_of(leaving)[1]
    assert (cleanup.replay_from, cleanup.cutoffs, cleanup.to) == (
        {"A": 0, "B": 0},
        ({"A": 100, "B": 90},),
        {"A": 160, "B": 160},
    ), "the window at the spill point, then the new generation up to where the batch begins"
    assert (1, DROP_ROW, 0, 0, 0) in leaving["markers"], "the new generation goes first"
    assert [m for m in leaving["markers"] if m[1] != DROP_ROW] == [(1, -3, 0, 0, 7), (1, -3, 1, 0, 8)]


@pytest.mark.parametrize(("cleanup", "paused", "due"), [("lazy", False, False), ("lazy", True, True)])
def test_lazy_clean_up_waits_for_the_pids_input_to_pause(
    tmp_path: Path, cleanup: str, paused: bool, due: bool
) -> None:
    r = reader(tmp_path, cleanup)
    asked: dict[int, int] = {}  # the sink asks for no spill
    spill = {"cutoff": {"A": 100, "B": 100}, "state_bytes": 5000, "stream_max": None}
    start = {"epoch": 3, "offsets": offsets(p1=160), "spilled": {"1": spill}}
    r._latest = offsets(p1=160)  # nothing waiting at this plan
    r._input_at["1"] = 0.0 if paused else 1e12  # its input's end last moved long ago, or just now
    got = r._with_spills(start, plan(start, offsets(p1=160)), asked)
    assert (1 in cleanups_of(got)) is due
    assert (1 in spilled_of(got)) is not due


def test_a_spilled_pid_asked_again_spills_its_newest_generation_up_to_max_spills(tmp_path: Path) -> None:
    """A spilled pid's new generation grows back to a whole window within W: asked again, it adds a
    spill point (a third generation begins), and its clean-up re-reads every generation in turn from
    the first spill point, whose `stream_max` the rebuilt window starts from."""
    r = reader(tmp_path, "lazy")
    first = Spill(({"A": 100, "B": 90},), 5000, [7, 8])
    start = {"epoch": 3, "offsets": offsets(p1=160), "spilled": {"1": first.to_json()}}
    r._latest, r._input_at["1"] = offsets(p1=200), 1e12  # input keeps coming
    asked = {1: 3000}
    again = spilled_of(r._with_spills(start, plan(start, offsets(p1=200)), asked))[1]
    assert again.cutoffs == ({"A": 100, "B": 90}, {"A": 160, "B": 160})
    assert (again.state_bytes, again.stream_max) == (8000, [7, 8])
    at_most = Spill(tuple({"A": 10 * i, "B": 10 * i} for i in range(MAX_SPILLS)), 5000, None)
    start = {"epoch": 3, "offsets": offsets(p1=160), "spilled": {"1": at_most.to_json()}}
    got = r._with_spills(start, plan(start, offsets(p1=200)), asked)
    assert spilled_of(got)[1] == at_most, "no codes left for one more generation"
    assert not [m for m in got["markers"] if m[1] == SPILL_ROW]
    released = {"1": {"move_id": "m", "export": False, "announce": True, "cutoff": {"A": 160, "B": 160}}}
    start = {"epoch": 3, "offsets": offsets(p1=160), "spilled": {"1": again.to_json()}}
    leaving = r._with_spills(start, plan(start, offsets(), released=released), asked)
    cleanup = cleanups_of(leaving)[1]
    assert cleanup.generations("A") == [(100, 160), (160, 160)]
    assert [m for m in leaving["markers"] if m[1] != DROP_ROW] == [(1, -3, 0, 0, 7), (1, -3, 1, 0, 8)]


@pytest.mark.parametrize("cleanup", ["lazy", "active"])
def test_a_pid_spilled_while_paused_is_parked_until_it_reads_again(tmp_path: Path, cleanup: str) -> None:
    """Spilled where its input paused, a pid has nothing spanning generations: it is not cleaned up
    (its window would come back into memory for nothing, batch after batch), until input it read
    since the spill point makes a clean-up due again."""
    r = reader(tmp_path, cleanup)
    asked: dict[int, int] = {}  # the sink asks for no spill
    parked = Spill(({"A": 160, "B": 160},), 5000, [7, 8])
    start = {"epoch": 3, "offsets": offsets(p1=160), "spilled": {"1": parked.to_json()}}
    r._latest, r._input_at["1"] = offsets(p1=160), 0.0  # paused long ago
    got = r._with_spills(start, plan(start, offsets(p1=160)), asked)
    assert spilled_of(got) == {1: parked} and "cleanups" not in got
    start = {"epoch": 3, "offsets": offsets(p1=180), "spilled": {"1": parked.to_json()}}
    r._latest = offsets(p1=180)
    got = r._with_spills(start, plan(start, offsets(p1=180)), asked)
    assert 1 in cleanups_of(got), "it read 20 messages since, then paused: their results span generations"


def test_a_batch_reads_no_more_tuples_than_the_room_the_sink_noted(tmp_path: Path) -> None:
    """An instance behind its input, spilling: the sink notes what room the budget leaves after its
    spills, and the next batch reads within it however large the backlog and the configured cap."""
    from pyspark.sql.streaming.datasource import ReadMaxRows

    r = reader(tmp_path)
    write_assignment(tmp_path / "assignment.json", OwnedPids(epoch=3, pids=frozenset({1, 2})))
    start = {"epoch": 3, "offsets": offsets(p1=0, p2=0)}
    r.facts.latest = offsets(p1=5_000, p2=5_000)  # type: ignore[attr-defined]
    r._per_message, r._sampled_at = 1.0, 1e12  # a tuple a message, sampled just now
    r.max_results = 10**15  # results bound nothing here

    def read(limit: int) -> int:
        end = r.latestOffset(start, ReadMaxRows(limit))["offsets"]
        r._planned_at = None  # due again
        return sum(o for by_pid in end.values() for o in by_pid.values())

    assert read(20_000) == 20_000, "no room noted yet (no window measured): the configured cap"
    write_spill_requests(tmp_path / "spill_requests.json", SpillRequests({}, room_tuples=3_000))
    assert read(20_000) == 3_000, "pid 1 cut at the room, half of it from each stream"
    write_spill_requests(tmp_path / "spill_requests.json", SpillRequests({}, room_tuples=0))
    assert read(20_000) == 1, "no room left: a message, so the batch still moves on"
