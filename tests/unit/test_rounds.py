"""Policy rounds over time: when a round runs, what it requests, and how a move phase sets the next one."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import pytest

from controller.assignment import Assignment, HandoffMode, Move
from controller.observation.estimates import (
    busy_fraction,
    cost_per_tuple_s,
    demand_from_progress,
    fixed_cost_s,
)
from controller.observation.rates import arrival_rates, warming_up
from controller.observation.snapshot import snapshot_of
from controller.policies import POLICIES, InstanceStats, PidStats, Snapshot
from controller.policies.params import policy_params
from controller.rounds import FIRST_ROUND_DELAY_S, PolicyRounds

ASSIGNMENT = Assignment(epoch=0, owners={0: "a", 1: "a", 2: "b", 3: "b"})


@dataclass
class Mover:
    """Serves a fixed imbalance: "a" busy with two pids, "b" idle."""

    moving: list[Move] = field(default_factory=list)
    """Moves whose pid its source has not released yet."""
    tails: list[Move] = field(default_factory=list)
    """Moves past their release: handoffs not yet acquired, parallel tracks' tails."""
    requested: list[Move] = field(default_factory=list)
    gates: list[bool] = field(default_factory=list)
    snapshots: list[tuple[float, float | None]] = field(default_factory=list)
    assignment: Assignment | None = ASSIGNMENT
    warming: frozenset[str] = frozenset()

    def releasing(self) -> Sequence[Move]:
        return self.moving

    def request(self, moves: Sequence[Move]) -> None:
        self.requested += moves
        self.moving += moves

    def gate_spills(self, spill: bool) -> None:
        self.gates.append(spill)

    def snapshot(self, interval_s: float, now_s: float, last_adaptation_s: float | None) -> Snapshot | None:
        self.snapshots.append((interval_s, last_adaptation_s))
        if self.assignment is None:
            return None
        return Snapshot(
            now_s=now_s,
            instances=(InstanceStats("a", 1.0, 2000), InstanceStats("b", 0.1, 100)),
            pids={
                0: PidStats(pid=0, tuples=900, state_bytes=1000, results=0),
                1: PidStats(pid=1, tuples=100, state_bytes=1000, results=0),
                2: PidStats(pid=2, tuples=50, state_bytes=50, results=0),
                3: PidStats(pid=3, tuples=50, state_bytes=50, results=0),
            },
            assignment=self.assignment,
            moves_in_flight=frozenset(m.pid for m in self.moving + self.tails),
            interval_s=interval_s,
            last_adaptation_s=last_adaptation_s,
            warming=self.warming,
        )


def test_the_first_round_waits_for_the_instances_to_report() -> None:
    rounds = PolicyRounds.begin("flux", policy_params("flux", HandoffMode.REPLAY), now_s=100.0)
    mover = Mover()
    assert rounds.tick(mover, now_s=100.0 + FIRST_ROUND_DELAY_S - 0.1) is None
    assert mover.snapshots == []
    decision = rounds.tick(mover, now_s=100.0 + FIRST_ROUND_DELAY_S)
    assert decision is not None and decision.moves
    assert mover.requested == list(decision.moves)
    assert {m.mode for m in mover.requested} == {HandoffMode.REPLAY}, "moves use the pipeline's handoff mode"


def test_no_round_runs_while_an_instance_warms_up_and_the_next_tick_tries_again() -> None:
    rounds = PolicyRounds.begin("flux", policy_params("flux", HandoffMode.REPLAY), now_s=100.0)
    mover = Mover(warming=frozenset({"a"}))
    due = 100.0 + FIRST_ROUND_DELAY_S
    assert rounds.tick(mover, now_s=due) is None
    assert mover.requested == []
    mover.warming = frozenset()
    decision = rounds.tick(mover, now_s=due + 0.25)
    assert decision is not None and decision.moves, "not put off by a whole interval"


def test_flux_waits_out_the_move_phase_and_makes_it_the_next_interval() -> None:
    rounds = PolicyRounds.begin("flux", policy_params("flux", HandoffMode.TRANSFER), now_s=0.0)
    mover = Mover()
    assert rounds.tick(mover, now_s=10.0) is not None
    assert rounds.tick(mover, now_s=50.0) is None, "no round while the moves are in flight"
    assert len(mover.snapshots) == 1
    mover.moving.clear()
    assert rounds.tick(mover, now_s=13.0) is None, "the phase ends; the next round collects first"
    assert rounds.interval_s == 3.0 and rounds.next_round_s == 16.0
    rounds.tick(mover, now_s=16.0)
    assert mover.snapshots[-1] == (3.0, 10.0)


def test_a_released_pid_does_not_hold_up_the_next_round() -> None:
    """Once the moved pid left its source the phase is over, though its receiver may not have read it
    yet or the source still finishes its old tuples; the next round runs and leaves that pid alone."""
    rounds = PolicyRounds.begin("flux", policy_params("flux", HandoffMode.PARALLEL_TRACK), now_s=0.0)
    mover = Mover()
    first = rounds.tick(mover, now_s=10.0)
    assert first is not None and first.moves
    mover.tails, mover.moving = mover.moving, []
    assert rounds.tick(mover, now_s=12.0) is None, "the phase ends; the next round collects first"
    second = rounds.tick(mover, now_s=12.0 + rounds.interval_s)
    assert second is not None, "a round runs while the tail is in flight"
    assert not {m.pid for m in first.moves} & {m.pid for m in second.moves}, "the tail's pid stays put"


def test_without_phase_interval_the_next_round_comes_delta_min_after_the_moves_unreleased() -> None:
    """A loaded donor releases at the end of its batch in flight; the next round need not wait for it,
    and leaves the moving pids alone."""
    params = policy_params("flux", HandoffMode.TRANSFER, delta_s=2.0, delta_min_s=2.0, phase_interval=0.0)
    rounds = PolicyRounds.begin("flux", params, now_s=0.0)
    mover = Mover()
    first = rounds.tick(mover, now_s=10.0)
    assert first is not None and first.moves
    assert (rounds.interval_s, rounds.next_round_s) == (2.0, 12.0)
    assert mover.releasing(), "the first round's moves are still being released"
    second = rounds.tick(mover, now_s=12.0)
    assert second is not None, "a round runs while the moves are released"
    assert not {m.pid for m in first.moves} & {m.pid for m in second.moves}, "the moving pids stay put"


def test_a_short_move_phase_is_floored_at_delta_min() -> None:
    params = policy_params("flux", HandoffMode.TRANSFER, delta_min_s=0.5)
    rounds = PolicyRounds.begin("flux", params, now_s=0.0)
    mover = Mover()
    rounds.tick(mover, now_s=10.0)
    mover.moving.clear()
    rounds.tick(mover, now_s=10.1)
    assert rounds.interval_s == 0.5


def test_command_line_floats_become_the_ints_and_bools_parameters_need() -> None:
    params = policy_params("flux", HandoffMode.TRANSFER, max_moves_per_pair=3.0)
    assert params.max_moves_per_pair == 3 and isinstance(params.max_moves_per_pair, int)
    with pytest.raises(ValueError, match="whole number"):
        policy_params("flux", HandoffMode.TRANSFER, max_moves_per_pair=2.5)
    assert policy_params("flux", HandoffMode.TRANSFER, donor_cost=1.0).donor_cost is True
    assert policy_params("flux", HandoffMode.TRANSFER, donor_cost=0.0).donor_cost is False
    with pytest.raises(ValueError, match="yes"):
        policy_params("flux", HandoffMode.TRANSFER, donor_cost=0.5)


def test_a_dry_run_requests_nothing_and_keeps_its_rhythm() -> None:
    rounds = PolicyRounds.begin("flux", policy_params("flux", HandoffMode.TRANSFER), now_s=0.0)
    mover = Mover()
    decision = rounds.tick(mover, now_s=10.0, dry_run=True)
    assert decision is not None and decision.moves
    assert mover.requested == [] and rounds.move_phase_since_s is None
    assert rounds.next_round_s == 10.0 + rounds.interval_s


def test_static_never_moves_and_no_assignment_means_no_round() -> None:
    rounds = PolicyRounds.begin("static", policy_params("static", HandoffMode.TRANSFER), now_s=0.0)
    mover = Mover()
    decision = rounds.tick(mover, now_s=10.0)
    assert decision is not None and not decision.moves
    waiting = PolicyRounds.begin("memory", policy_params("memory", HandoffMode.TRANSFER), now_s=0.0)
    assert waiting.tick(Mover(assignment=None), now_s=10.0) is None


def _batch(
    instance: str,
    end_s: float,
    duration_s: float,
    period_s: float,
    pids: dict[int, int],
    newest_s: float | None = None,
) -> dict[str, Any]:
    """A batch record; by default its tuples' newest event time is the batch's start (it reads what
    arrived before it began)."""
    newest_ms = round(1000 * (end_s - duration_s if newest_s is None else newest_s))
    return {
        "instance": instance,
        "time_ms": end_s * 1000,
        "duration_s": duration_s,
        "busy": min(1.0, duration_s / period_s),
        "tuples_in": sum(pids.values()),
        "pids": {str(p): {"in": n, "state_bytes": 10 * n, "newest_ms": newest_ms} for p, n in pids.items()},
    }


def test_busy_fraction_is_batch_time_over_the_periods_the_batches_cover() -> None:
    batches = [_batch("a", 2, 1.0, 2.0, {}), _batch("a", 5, 2.0, 3.0, {})]
    assert busy_fraction(batches) == 3.0 / 5.0
    assert busy_fraction([]) == 0.0


def test_a_window_shorter_than_a_batch_reads_the_latest_batch_not_idle() -> None:
    """`b`'s 4 s batches overrun a 1 s window: no batch of b ends in it, yet b is the busy one. Tuple
    counts are per interval at the rate of the batches that describe each instance (a's two batches
    cover 2 s, b's one 4 s)."""
    batches = [
        _batch("a", 9.0, 0.2, 1.0, {0: 5, 1: 5}),
        _batch("a", 10.0, 0.2, 1.0, {0: 5, 1: 5}),
        _batch("b", 8.0, 4.0, 4.0, {2: 400, 3: 10}),
    ]
    snap = snapshot_of(batches, ["a", "b"], ASSIGNMENT, frozenset(), 10_000, 1.0, 10.0, None)
    busy = {i.instance: i.busy_fraction for i in snap.instances}
    assert busy == {"a": 0.2, "b": 1.0}
    assert {p: s.tuples for p, s in snap.pids.items()} == {0: 5, 1: 5, 2: 100, 3: 2}


def _timed(duration_s: float, tuples: int) -> dict[str, Any]:
    return {"duration_s": duration_s, "tuples_in": tuples, "busy": 0.5}


def test_the_fixed_cost_of_a_batch_is_the_intercept_of_duration_against_tuples() -> None:
    line = [_timed(2.0 + 0.0001 * n, n) for n in (0, 1000, 5000, 8000, 20_000)]
    assert fixed_cost_s(line) == pytest.approx(2.0)
    assert fixed_cost_s(line[1:]) == 0.0, "too few batches to fit, none without input: unknown"
    assert fixed_cost_s([_timed(2.0 + i / 10, 100) for i in range(5)]) == 0.0, "tuple counts all alike"
    falling = [_timed(3.0 - 0.0001 * n, n) for n in (0, 1000, 5000, 8000, 20_000)]
    assert fixed_cost_s(falling) == pytest.approx(1.0), "never more than the shortest batch"


def test_no_fixed_cost_is_longer_than_a_batch_that_read_nothing() -> None:
    """Run Y of docs/load-model.md, "Busy fraction and fixed cost": in a steady spell every batch reads about
    as many tuples, and a CPU quota makes their durations noisy, so the line's intercept comes out above what
    the instance's batch before its input took; that batch is the fixed cost measured directly."""
    steady = [_timed(d, n) for d, n in ((5.6, 13000), (4.9, 14000), (5.0, 13500), (4.4, 14200), (6.1, 13100))]
    fitted = fixed_cost_s(steady)
    assert fitted > 3.0, "the line alone"
    assert fixed_cost_s(steady, empty_s=2.41) == 2.41, "the instance's empty batch, out of the history"
    assert fixed_cost_s([_timed(2.41, 0), *steady]) == 2.41, "or one at hand"
    assert fixed_cost_s(steady, empty_s=9.0) == fitted, "a bound above the line changes nothing"


def test_before_a_fit_the_shortest_batch_without_input_is_the_fixed_cost() -> None:
    """An instance 30 s into the input: its warm-up batch, a batch before the input started, two with
    input. The warm-up batch read nothing too, but it pays for Spark's start; the shortest one is the
    per-batch cost."""
    early = [_timed(15.0, 0), _timed(2.4, 0), _timed(9.0, 900), _timed(5.0, 1600)]
    assert fixed_cost_s(early) == 2.4
    started = [{**_timed(18.8, 0), "batch": 0}, _timed(12.7, 17), _timed(9.2, 2107)]
    assert fixed_cost_s(started) == 0.0, "input began right after the query's first batch: unknown"
    assert fixed_cost_s([_timed(18.8, 0), _timed(9.2, 2107)]) == 9.2, "no more than the shortest batch"
    assert fixed_cost_s([*early[1:], _timed(4.0, 1600), _timed(5.0, 1600)]) == pytest.approx(2.4), "fitted"


def test_a_near_idle_receiver_early_in_the_input_has_room_for_a_hot_pid() -> None:
    """`b` has run a 2.4 s batch before the input and two 5 s batches reading 1,200 tuples each, 12 s
    apart. Charged all to its tuples, its U 0.42 would all be per-tuple work, and a pid that doubles
    its input would double it (`flux.estimate_after_move` scales that part only). With the empty
    batch's 2.4 s a batch fixed, 0.2 of it is fixed, and the pid adds 0.22, not 0.42."""
    batches = [
        _batch("b", 5, 2.4, 5.0, {}),
        *(_batch("b", t, 5.0, 12.0, {2: 600, 3: 600}, newest_s=t - 5.0) for t in (17, 29)),
    ]
    snap = snapshot_of(batches, ["a", "b"], ASSIGNMENT, frozenset(), 30_000, 24.0, 30.0, None)
    b = snap.instances[1]
    assert b.fixed_busy == pytest.approx(4.8 / 24)
    assert b.load == pytest.approx(4.8 / 24 + 100 * 2.6 / 1200), "100 tuples/s at 2.6 s per 1,200"


def test_a_tuples_cost_leaves_out_the_batches_that_read_nothing() -> None:
    """A near-idle instance early in the input: a 15 s warm-up batch and a 2.2 s one before the input,
    then 679 tuples in 8.7 s. With the empty batches' time it would cost 28 ms a tuple."""
    batches = [_timed(15.0, 0), _timed(2.2, 0), _timed(8.7, 679)]
    assert cost_per_tuple_s(batches, 2.2) == pytest.approx(6.5 / 679)
    assert cost_per_tuple_s(batches[:2], 2.2) is None


def test_an_instance_warms_up_from_its_first_batch_with_input_to_the_next_ones_reads() -> None:
    empty, full = _batch("a", 5, 2.4, 5.0, {}), _batch("a", 15, 9.0, 10.0, {0: 500, 1: 400})

    def reading(*pids: int) -> dict[str, Any]:
        return {"pids": {str(p): {"in": 100, "newest_ms": 1} for p in pids}}

    assert warming_up([empty], reading(0)) and warming_up([], reading(0)), "inside the first"
    assert warming_up([empty, full], None), "it has ended, the next has read nothing yet"
    assert warming_up([empty, full], reading(0)), "the next has read pid 0, not yet pid 1"
    assert not warming_up([empty, full], reading(0, 1))
    assert not warming_up([empty, full, empty], None), "the next ended empty"
    assert not warming_up([empty, full, full], None)
    assert not warming_up([full], None), "a loaded instance's one long batch at hand"
    assert not warming_up([empty], None) and not warming_up([], None), "no input yet"
    assert not warming_up([empty], {"pids": {"0": {"in": 0, "newest_ms": 0}}})


def test_a_tuples_cost_leaves_out_the_first_batch_of_new_input_where_it_can() -> None:
    """A near-idle instance's first batch with input took 11.8 s for 800 tuples (the join being
    compiled), its next 4.4 s for 2,000; its fixed cost is its 2.4 s empty batch. Nor is it busy
    for compiling: as a receiver it would take nothing (docs/load-model.md, "Thresholds and the estimate after
    a move")."""
    batches = [_batch("b", 5, 2.4, 5.0, {}), _batch("b", 17, 11.8, 12.0, {2: 800})]
    batches.append(_batch("b", 29, 4.4, 12.0, {2: 2000}, newest_s=25))
    snap = snapshot_of(batches, ["b"], ASSIGNMENT, frozenset(), 30_000, 24.0, 30.0, None)
    rate = 2000 / (25 - 5.2)  # since the first batch's tuples, newest at its start
    assert snap.instances[0].load == pytest.approx(2 * 2.4 / 24 + rate * 2.0 / 2000), "1 ms a tuple, not 4.7"
    assert snap.instances[0].busy_fraction == pytest.approx(4.4 / 12), "busy 0.37, not 0.68"
    early = snapshot_of(batches[:2], ["b"], ASSIGNMENT, frozenset(), 18_000, 24.0, 18.0, None)
    assert early.instances[0].fixed_busy > 0, "with no other batch, the first one's cost stands"


def test_a_hot_instance_inside_its_first_batch_with_input_holds_the_round() -> None:
    """The input began at 100 s. `b` has read input twice; `a` is inside its first batch with input,
    which has read 8,000 tuples so far: its pid has no rate and a tuple no cost yet, so it would
    look idle."""
    batches = [_batch("a", 100, 2.0, 4.0, {}), _batch("b", 100, 4.0, 4.0, {})]
    batches += [_batch("b", t, 6.0, 10.0, {2: 1000}, newest_s=t - 6) for t in (110, 120)]
    body = [{"pid": 0, "stream": 0, "in": 8000, "newest_ms": 104_000}]
    reading = {"kind": "reading", "instance": "a", "time_ms": 106_000, "ranges": body}
    snap = snapshot_of(batches, ["a", "b"], ASSIGNMENT, frozenset(), 121_000, 20.0, 121.0, None, [reading])
    assert snap.warming == {"a"}
    assert snap.instances[0].load < snap.instances[1].load, "what the round would have seen"
    assert (
        snapshot_of(batches, ["a", "b"], ASSIGNMENT, frozenset(), 121_000, 20.0, 121.0, None).warming == set()
    )


def test_the_snapshot_splits_utilization_into_fixed_and_per_tuple_parts() -> None:
    """`a` idles between 2 s batches of little input, its fixed cost: half its time, all of it fixed."""
    batches = [
        {**_batch("a", t, 2.0 + 0.0001 * n, 4.0, {0: n // 2, 1: n - n // 2}), "tuples_in": n}
        for t, n in zip((2, 6, 10, 14, 18), (0, 100, 300, 200, 400), strict=True)
    ]
    snap = snapshot_of(batches, ["a"], ASSIGNMENT, frozenset(), 18_000, 8.0, 18.0, None)
    (a,) = snap.instances
    # The batches ending in the last 8 s (at 10, 14, 18 s): 6.09 s of 12 s; 3 x 2 s of that is fixed.
    assert a.busy_fraction == pytest.approx(6.09 / 12.0)
    assert a.fixed_busy == pytest.approx(6.0 / 12.0)


def test_a_pipeline_objects_flux_fields_reach_the_policy() -> None:
    """The CRD's integer and yes/no fields arrive as the policy's int and bool parameters."""
    from controller.k8s.spec import PipelineSpec

    obj = {
        "metadata": {"name": "p", "namespace": "ns", "uid": "u"},
        "spec": {
            "kafka": {"bootstrapServers": "kafka:9092"},
            "policy": {"name": "flux", "flux": {"maxMovesPerPair": 4, "donorCost": True, "thImb": 1.5}},
        },
    }
    params = PipelineSpec.from_object(obj).policy_params()
    assert (params.max_moves_per_pair, params.donor_cost, params.th_imb) == (4, True, 1.5)


def test_a_pids_arrival_rate_is_its_tuples_over_the_event_time_they_arrived_over() -> None:
    """Pid 0 arrives at 12.5 tuples/s. `a` read it every 8 s, then handed it to `b`, whose first batch
    read the 32 s of backlog since the cutoff: the rate stays 12.5, not 400 tuples over b's 8 s batch."""
    a = [_batch("a", t, 2.0, 8.0, {0: 100}, newest_s=t) for t in (108, 116, 124)]
    b = [_batch("b", 164, 8.0, 8.0, {0: 500}, newest_s=164)]
    assert arrival_rates({"a": a}, {"a": a[1:]}) == pytest.approx({0: 12.5})
    assert arrival_rates({"a": a, "b": b}, {"a": a[-1:], "b": b}) == pytest.approx({0: 600 / 48})
    assert arrival_rates({"a": a}, {"a": a}) == pytest.approx({0: 12.5}), "measured from the first record"
    assert arrival_rates({"a": a[:1]}, {"a": a[:1]}) == {}, "one record: unknown"
    assert arrival_rates({"a": a}, {"a": []}) == {}, "not read lately: unknown"


def test_the_snapshot_carries_each_instances_demand_and_flux_ranks_by_it() -> None:
    """`a` keeps up at U 0.6; `b` reads busy 1.0 but its pids arrive twice as fast as it reads them
    (600 tuples every 6 s, 12 s a batch): demand 2, and flux sees a ratio of 3.3, not 1.7. It moves b's
    small pid (charged at the donor's cost; the large one would overload a)."""
    batches = [
        *(_batch("a", t, 4.8, 8.0, {0: 50, 1: 50}) for t in (94, 102, 110, 118)),
        *(_batch("b", t, d, d, {2: 500, 3: 100}) for t, d in ((106, 6.0), (118, 12.0))),
    ]
    snap = snapshot_of(batches, ["a", "b"], ASSIGNMENT, frozenset(), 118_000, 8.0, 118.0, None)
    stats = {i.instance: i for i in snap.instances}
    assert stats["a"].load == pytest.approx(0.6) and stats["b"].busy_fraction == 1.0
    assert stats["b"].load == pytest.approx(2.0)
    assert {p: s.tuples for p, s in snap.pids.items()} == {0: 50, 1: 50, 2: 667, 3: 133}
    params = policy_params("flux", HandoffMode.TRANSFER, donor_cost=True)
    decision = POLICIES["flux"].decide(snap, params)
    assert [(m.pid, m.source, m.target) for m in decision.moves] == [(3, "b", "a")]
    assert "U 2.000->1.667, 0.600->0.932" in decision.reason


def test_a_receivers_catch_up_batch_is_not_demand() -> None:
    """Pid 0 (12.5 tuples/s) moved from `a` to `b`, whose first batch with it read 32 s of backlog and
    took 8 s of its 8 s period. b needs 12.5 x its cost per tuple of its time, not all of it; a, left
    with pid 1, needs only pid 1's share."""
    batches = [
        *(_batch("a", t, 2.2, 8.0, {0: 100, 1: 10}, newest_s=t) for t in (108, 116, 124)),
        _batch("b", 156, 0.5, 8.0, {2: 10}, newest_s=156),
        _batch("b", 164, 8.0, 8.0, {0: 500, 2: 10}, newest_s=164),
    ]
    moved = Assignment(epoch=1, owners={0: "b", 1: "a", 2: "b", 3: "b"})
    snap = snapshot_of(batches, ["a", "b"], moved, frozenset(), 164_000, 16.0, 164.0, None)
    load = {i.instance: i.load for i in snap.instances}
    # Per tuple: a 2.2 s for 110 tuples, b 8.5 s for 520; pid 0 was read 200 times by a (its one
    # described batch, scaled to the interval) and 500 times by b.
    cost_a, cost_b = 2.2 / 110, 8.5 / 520
    pid_0 = (200 * cost_a + 500 * cost_b) / 700
    assert load["b"] == pytest.approx(12.5 * pid_0 + 1.25 * cost_b) and load["b"] < 0.25
    assert load["a"] == pytest.approx(1.25 * cost_a)
    assert snap.tuples_of(0) == 200
    quiet = [_batch("a", t, 2.0, 8.0, {0: 10, 1: 0}) for t in (8, 16)]
    snap = snapshot_of(quiet, ["a", "b"], ASSIGNMENT, frozenset(), 16_000, 8.0, 16.0, None)
    assert snap.tuples_of(1) == 0 and snap.instances[0].load > 0, "a pid that read nothing costs nothing"


def test_the_snapshot_charges_a_moved_pids_work_to_its_new_owner() -> None:
    """Pid 0 moved from `a` to `b` by parallel track: a's batches still show its tuples."""
    batches = [
        _batch("a", 10.0, 8.0, 8.0, {0: 900, 1: 100}),
        _batch("b", 10.0, 1.0, 8.0, {2: 50, 3: 50}),
    ]
    moved = Assignment(epoch=1, owners={0: "b", 1: "a", 2: "b", 3: "b"})
    snap = snapshot_of(batches, ["a", "b"], moved, frozenset({0}), 10_000, 8.0, 10.0, None)
    load = {i.instance: i.load for i in snap.instances}
    assert load["a"] < 0.2 and load["b"] > 0.9
    assert snap.tuples_of(0) == 900


def test_what_a_batch_in_flight_has_read_counts_in_the_arrival_rates() -> None:
    """`a` read pid 0 at 12.5 tuples/s until its batch ending at 116 s; then a hot set arrived, and its
    next batch, still running 18 s later, has read 2,000 of pid 0's tuples up to event time 124 s. The
    round counts them: pid 0 arrives at 2,100 tuples over the 16 s since the record before, not 12.5/s,
    and a's demand shows it, once both of its streams have been reported. A report older than a's
    latest batch record is that batch's own reading."""
    batches = [_batch("a", t, 2.0, 8.0, {0: 100, 1: 10}, newest_s=t) for t in (100, 108, 116)]

    def reading(at_s: float, pids: dict[tuple[int, int], int], newest_s: float) -> dict[str, Any]:
        body = [{"pid": p, "stream": j, "in": n, "newest_ms": newest_s * 1000} for (p, j), n in pids.items()]
        return {"kind": "reading", "instance": "a", "time_ms": at_s * 1000, "ranges": body}

    stale = reading(110, {(0, 0): 5000}, 108)
    # Pid 0's streams read by two tasks; the first task ran twice.
    retried = [reading(120, {(0, 0): 900}, 122), reading(124, {(0, 1): 800}, 124)]
    retried += [reading(125, {(0, 0): 1200, (1, 0): 10}, 124)]

    def at_134_s(readings: list[dict[str, Any]]) -> Snapshot:
        return snapshot_of(batches, ["a"], ASSIGNMENT, frozenset(), 134_000, 8.0, 134.0, None, readings, 2)

    before, partial, after = at_134_s([stale]), at_134_s([stale, retried[0]]), at_134_s([stale, *retried])
    assert before.tuples_of(0) == 100, "12.5 tuples/s over the 8 s interval"
    assert partial.tuples_of(0) == 100, "one of pid 0's two streams reported: not yet counted"
    assert after.tuples_of(0) == round(2100 / 16 * 8)
    assert after.instances[0].load > 1.0 > before.instances[0].load


def test_a_donor_whose_last_batch_read_nothing_is_charged_its_earlier_cost_per_tuple() -> None:
    """`a` released pids without reading (a batch of no input) and is now inside a long batch that has
    read a hot pid 0. Its described batch says nothing of a tuple's cost; its earlier batches do."""
    batches = [_batch("a", t, 2.0 + 0.01 * 100, 8.0, {0: 100, 1: 10}, newest_s=t) for t in (100, 108)]
    batches.append(_batch("a", 112, 2.0, 4.0, {0: 0, 1: 0}, newest_s=0))
    hot = {"pid": 0, "stream": 0, "in": 4000, "newest_ms": 124_000}
    reading = {"kind": "reading", "instance": "a", "time_ms": 125_000, "ranges": [hot]}
    snap = snapshot_of(batches, ["a"], ASSIGNMENT, frozenset(), 134_000, 8.0, 134.0, None, [reading])
    assert snap.tuples_of(0) == round(4000 / 16 * 8)
    # Fixed: its 2 s batch that read nothing, half the 4 s that batch covers. Per tuple: 250 tuples/s
    # at the 2 s its three batches took beyond their fixed cost over the tuples they read.
    assert snap.instances[0].load == pytest.approx(2.0 / 4.0 + 250 * 2.0 / 220)


def test_a_pids_rate_follows_its_newest_input_not_the_interval_before_it() -> None:
    """The hot set moved from pid 7 to pid 25 at 135 s. `a`'s batches take 19 s, so the batch ending
    in the interval read 33 s of arrivals (102-135 s, pid 7 hot throughout), and the batch in flight
    has read the 19 s since (pid 25 hot). The newest input ranks pid 25 above pid 7; measured since
    the record before the described batch, pid 7 (3,400 tuples over 52 s) would outrank pid 25 (2,400)."""
    batches = [
        _batch("a", 121, 19.0, 19.0, {7: 1300, 25: 50}, newest_s=102),
        _batch("a", 154, 19.0, 33.0, {7: 3300, 25: 100}, newest_s=135),
    ]
    hot = [{"pid": 7, "stream": 0, "in": 100, "newest_ms": 154_000}]
    hot += [{"pid": 25, "stream": 0, "in": 2300, "newest_ms": 154_000}]
    reading = {"kind": "reading", "instance": "a", "time_ms": 156_000, "ranges": hot}
    owners = Assignment(epoch=1, owners={7: "a", 25: "a"})
    snap = snapshot_of(batches, ["a"], owners, frozenset(), 160_000, 26.0, 160.0, None, [reading])
    assert snap.tuples_of(25) == round(2300 / 19 * 26)
    assert snap.tuples_of(7) == round(100 / 19 * 26)


def test_the_input_tails_rates_count_over_what_a_behind_instance_has_read() -> None:
    """`a` is 33 s behind: its newest batch read pid 7 hot and pid 25 cold, but the input's tail says
    the hot set is pid 25 now. The tail's rates count (pid 1, which the tail did not list, keeps its
    measured rate), and a's demand follows pid 25 at the cost a's batches show per tuple."""
    batches = [
        _batch("a", 121, 19.0, 19.0, {7: 1300, 25: 50, 1: 19}, newest_s=102),
        _batch("a", 154, 19.0, 33.0, {7: 3300, 25: 100, 1: 33}, newest_s=135),
    ]
    owners = Assignment(epoch=1, owners={1: "a", 7: "a", 25: "a"})

    def at_160_s(arrivals: dict[int, float] | None) -> Snapshot:
        return snapshot_of(batches, ["a"], owners, frozenset(), 160_000, 26.0, 160.0, None, arrivals=arrivals)

    records, tail = at_160_s(None), at_160_s({7: 5.0, 25: 120.0})
    assert records.tuples_of(7) > records.tuples_of(25)
    assert (tail.tuples_of(7), tail.tuples_of(25)) == (round(5.0 * 26), round(120.0 * 26))
    assert tail.tuples_of(1) == records.tuples_of(1) == 26
    fixed = records.instances[0].fixed_busy
    per_tuple = [
        (s.instances[0].load - fixed) / sum(s.tuples_of(p) for p in (1, 7, 25)) for s in (records, tail)
    ]
    assert per_tuple[0] == pytest.approx(per_tuple[1], rel=0.01), "a's demand is its pids' rates at one cost"


def _falling_behind() -> list[dict[str, Any]]:
    """`a` keeps up with pids 0 and 1 (4 s batches every 8 s), then a hot set arrives: each batch reads
    what arrived while the one before it ran, and takes longer than that (20, 27, 36 s)."""
    return [
        _batch("a", 92, 4.0, 8.0, {0: 80, 1: 80}),
        _batch("a", 100, 4.0, 8.0, {0: 80, 1: 80}),
        _batch("a", 120, 20.0, 20.0, {0: 1600, 1: 100}),
        _batch("a", 147, 27.0, 27.0, {0: 2000, 1: 135}),
        _batch("a", 183, 36.0, 36.0, {0: 2700, 1: 180}),
    ]


def test_an_instances_demand_from_its_progress_is_its_batch_time_per_second_of_input() -> None:
    behind = _falling_behind()
    # The newest two batches took 27 + 36 s for the 20 + 27 s of input their predecessors ran over.
    assert demand_from_progress(behind, {0, 1}) == pytest.approx(63 / 47)
    assert demand_from_progress(behind[:2], {0, 1}) == pytest.approx(0.5), "keeping up: its busy fraction"
    catching_up = [*behind, _batch("a", 203, 20.0, 20.0, {0: 2700, 1: 180})]
    assert demand_from_progress(catching_up, {0, 1}) == pytest.approx(56 / 63), "less work than input"
    assert demand_from_progress(behind, {0}) is None, "batches that read a pid it no longer owns"
    assert demand_from_progress(behind[:1], {0, 1}) is None, "no predecessor"
    received = [*behind[:2], _batch("a", 108, 4.0, 8.0, {0: 80, 1: 80, 2: 900})]
    owns = {0, 1, 2}
    assert demand_from_progress(received, owns) == pytest.approx(0.5), "a new pid's backlog is not demand"
    slow = [*behind[:2], _batch("a", 116, 12.0, 16.0, {0: 80, 1: 80})]
    assert demand_from_progress(slow, {0, 1}) == pytest.approx(1.0), "one slow batch is averaged"


def test_a_snapshot_takes_the_larger_of_the_modelled_and_the_progress_demand() -> None:
    """Whatever makes the cost model read `a` low (here an input tail that says pid 0 arrives at 10
    tuples/s), its batches growing from 20 s to 36 s say it needs 1.34 of its time, and flux makes it
    the donor."""
    batches = [*_falling_behind(), *(_batch("b", t, 4.0, 8.0, {2: 80, 3: 80}) for t in (164, 172, 180))]
    snap = snapshot_of(
        batches, ["a", "b"], ASSIGNMENT, frozenset(), 183_000, 16.0, 183.0, None, arrivals={0: 10.0, 1: 1.0}
    )
    load = {i.instance: i.load for i in snap.instances}
    assert load == pytest.approx({"a": 63 / 47, "b": 0.5})
    assert snap.instances[0].progress == pytest.approx(63 / 47), "the log can tell which figure decided"
    params = policy_params("flux", HandoffMode.TRANSFER, donor_cost=True)
    assert [m.source for m in POLICIES["flux"].decide(snap, params).moves] == ["a"]


def test_a_snapshot_carries_each_pids_results_for_the_memory_policy() -> None:
    """The memory policy keeps the most productive pids (results over state); a snapshot that counted
    none would leave it ordering pids by number."""
    batches = [_batch("a", t, 2.0, 8.0, {0: 100, 1: 100}) for t in (8, 16)]
    for b, results in zip(batches, (300, 500), strict=True):
        b["pids"]["0"]["results"] = results
        b["pids"]["1"]["results"] = 10
    snap = snapshot_of(batches, ["a", "b"], ASSIGNMENT, frozenset(), 16_000, 16.0, 16.0, None)
    assert {p: s.results for p, s in snap.pids.items()} == {0: 800, 1: 20}


def test_a_round_passes_the_policys_spill_gate_on_unless_it_is_a_dry_run() -> None:
    coupled = policy_params("memory", HandoffMode.TRANSFER, spill_room=0.5)
    mover = Mover()
    assert PolicyRounds.begin("memory", coupled, now_s=0.0).tick(mover, now_s=10.0) is not None
    assert mover.gates == [True], "no instance reports a budget: none has room, so instances spill"
    dry = Mover()
    assert PolicyRounds.begin("memory", coupled, now_s=0.0).tick(dry, now_s=10.0, dry_run=True) is not None
    assert dry.gates == []
    uncoupled = Mover()
    rounds = PolicyRounds.begin("flux", policy_params("flux", HandoffMode.TRANSFER), now_s=0.0)
    assert rounds.tick(uncoupled, now_s=10.0) is not None
    assert uncoupled.gates == [], "a policy that does not say leaves the gate as it is"
