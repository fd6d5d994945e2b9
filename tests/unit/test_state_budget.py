"""What an instance's windows hold and may hold: the sink's running total over the pids it keeps, the
configured budget, and a budget set while it runs through the control log."""

from __future__ import annotations

import pytest

from pipeline.batch_metrics import held_after
from pipeline.config import Config, spark_bytes
from pipeline.control_view import ControlView, Fold, SnapshotMsg, fold
from pipeline.protocol import BudgetMsg, ProtocolError, SpillGateMsg
from pipeline.protocol_codec import decode, encode


def test_an_idle_pid_keeps_its_size_and_a_pid_moved_away_leaves_the_total() -> None:
    held = held_after({}, {"1": {"state_bytes": 500}, "2": {"state_bytes": 300}}, {"1", "2", "3"})
    assert held == {1: 500, 2: 300}
    held = held_after(held, {"2": {"state_bytes": 700}}, {"1", "2"})
    assert held == {1: 500, 2: 700}, "pid 1 read nothing and holds its window still"
    held = held_after(held, {"2": {"state_bytes": 0}}, {"2"})
    assert held == {}, "pid 1 moved away, pid 2's window emptied"


@pytest.mark.parametrize(
    ("size", "expected"), [("1g", 1 << 30), ("1536m", 1536 << 20), ("2048k", 2 << 20), ("1000", 1000)]
)
def test_spark_sizes_read_as_bytes(size: str, expected: int) -> None:
    assert spark_bytes(size) == expected


def test_the_default_budget_is_a_quarter_of_the_heap_and_a_configured_one_wins() -> None:
    assert Config().instance.state_budget() == (1 << 30) // 4
    assert Config.model_validate({"instance": {"state_budget_bytes": 5000}}).instance.state_budget() == 5000
    with pytest.raises(ValueError):
        Config.model_validate({"instance": {"driver_memory": "lots"}})


def test_the_newest_budget_per_instance_wins_and_zero_returns_to_the_configured() -> None:
    view = fold(
        [
            BudgetMsg(instance="i-0", state_budget_bytes=100),
            BudgetMsg(instance="i-1", state_budget_bytes=200),
            BudgetMsg(instance="i-0", state_budget_bytes=50),
            BudgetMsg(instance="i-1", state_budget_bytes=0),
        ]
    )
    assert view.budgets == {"i-0": 50}


def test_budgets_survive_the_wire_and_a_snapshot() -> None:
    msg = BudgetMsg(instance="i-0", state_budget_bytes=123)
    assert decode(encode(msg)) == msg
    view = fold([msg]).pruned()
    snap = decode(encode(SnapshotMsg(view=view, read_to=1)))
    assert isinstance(snap, SnapshotMsg) and snap.view.budgets == {"i-0": 123}
    late = Fold(complete=False)  # a reader whose log begins after the budget was set
    late.add(snap)
    assert late.view().budgets == {"i-0": 123}
    assert ControlView().budgets == {}


def test_a_negative_budget_is_refused() -> None:
    with pytest.raises(ValueError, match="budget"):
        BudgetMsg(instance="i-0", state_budget_bytes=-1)


def test_the_newest_spill_gate_wins_and_survives_the_wire_and_a_snapshot() -> None:
    """Never said, instances spill at their threshold; the controller's newest word holds, also for a
    reader whose log begins after it (a snapshot carries it)."""
    assert ControlView().spill is None
    closed = SpillGateMsg(spill=False)
    assert decode(encode(closed)) == closed
    assert fold([SpillGateMsg(spill=True), closed]).spill is False
    assert fold([closed, SpillGateMsg(spill=True)]).spill is True
    snap = decode(encode(SnapshotMsg(view=fold([closed]).pruned(), read_to=1)))
    assert isinstance(snap, SnapshotMsg) and snap.view.spill is False
    late = Fold(complete=False)
    late.add(snap)
    assert late.view().spill is False
    assert fold([closed]).merge(ControlView()).spill is False, "a view that never heard keeps the word"


def test_a_spill_gate_that_is_not_a_boolean_is_refused() -> None:
    raw = encode(SpillGateMsg(spill=False)).replace(b"false", b'"false"')
    with pytest.raises(ProtocolError, match="true or false"):
        decode(raw)
