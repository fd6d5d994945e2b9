"""Live pid moves on a real broker with real Spark instances, checked by the oracle.

At least 20 random moves in the three handoff modes under continuous input, a kill -9 of the controller in the
middle of a move and of an instance (its pids are recovered by replay; it restarts empty): the results
topic must still hold exactly the oracle's join.
"""

from __future__ import annotations

from pathlib import Path

from controller.soak import SoakPlan, run_soak, soak_config
from pipeline.config import load_config


def test_random_moves_and_kills_stay_exact(kafka_bootstrap: str, topic_prefix: str, tmp_path: Path) -> None:
    plan = SoakPlan(moves=20, pids_per_round=3, kill_controller_every=3, kill_instance_every=4)
    cfg = soak_config(load_config(), topic_prefix, seconds=600)
    report, done = run_soak(cfg, kafka_bootstrap, tmp_path, plan)
    assert done["moves"] >= 20
    assert done["controller_kills"] >= 2 and done["instance_kills"] >= 1
    assert report.expected > 10_000, "the workload must produce a meaningful number of results"
    assert (report.missing, report.duplicate, report.spurious) == (0, 0, 0), report.describe()
