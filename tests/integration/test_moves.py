"""Live pid moves on a real broker with real Spark instances, checked by the oracle.

At least 20 random moves in the three handoff modes under continuous input, a kill -9 of the controller in the
middle of a move and of an instance (its pids are recovered by replay; it restarts empty): the results
topic must still hold exactly the oracle's join. And the rarest recovery on purpose: the sender of a
parallel track killed while it still holds old tuples.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path

from controller.local import LocalPipeline, committed_offsets, wait_drained
from controller.moves import request_moves
from controller.soak import SoakPlan, Watch, acquired_by, evicted, rejoined, run_soak, soak_config
from pipeline.config import load_config
from pipeline.oracle import verify_pipeline
from pipeline.protocol import Mode, track_key

INSTANCES = ["instance-0", "instance-1", "instance-2"]


def test_random_moves_and_kills_stay_exact(kafka_bootstrap: str, topic_prefix: str, tmp_path: Path) -> None:
    plan = SoakPlan(moves=20, pids_per_round=3, kill_controller_every=3, kill_instance_every=4)
    cfg = soak_config(load_config(), topic_prefix, seconds=600)
    report, done = run_soak(cfg, kafka_bootstrap, tmp_path, plan)
    assert done["moves"] >= 20
    assert done["controller_kills"] >= 2 and done["instance_kills"] >= 1
    assert report.expected > 10_000, "the workload must produce a meaningful number of results"
    assert (report.missing, report.duplicate, report.spurious) == (0, 0, 0), report.describe()


def test_a_parallel_track_sender_killed_in_the_overlap_is_resumed_exactly(
    kafka_bootstrap: str, topic_prefix: str, tmp_path: Path
) -> None:
    """The sender is frozen as soon as it has released the pid (W = 20 s: it still holds old tuples for
    that long), then killed. A third instance must rebuild its window from the log, re-read silently
    what the sender had committed, and emit every later result with an old tuple."""
    cfg = soak_config(load_config(), topic_prefix, seconds=300).with_overrides(window_ms=20_000)
    pipeline = LocalPipeline(cfg, kafka_bootstrap, tmp_path)
    watch = Watch(pipeline)
    try:
        pipeline.start_controller(policy="static", heartbeat_timeout_s=6.0)
        for name in INSTANCES:
            pipeline.start_instance(name)
        pipeline.wait_running(INSTANCES)
        pipeline.start_generator()
        start = watch.until(lambda v: bool(v.assignment and v.assignment.epoch == 0), 60, "epoch 0")
        assert start.assignment is not None
        sender = start.assignment.owners[3]
        receiver = next(name for name in INSTANCES if name != sender)
        watch.until(lambda v: committed_offsets(cfg, kafka_bootstrap).get(("A", 3), 0) >= 200, 120, "input")

        move = request_moves(cfg, kafka_bootstrap, [3], receiver, Mode.PARALLEL_TRACK).move_id(3)
        released = watch.until(lambda v: move in v.released, 120, "the sender's release")
        os.killpg(pipeline.procs[sender].pid, signal.SIGSTOP)
        assert not released.track_ended(move, "old"), "the sender's overlap ended before it was frozen"
        pipeline.kill(sender, signal.SIGKILL)

        recovered = watch.until(evicted(sender), 90, f"the recovery of {sender}")
        assert recovered.assignment is not None
        holder = recovered.assignment.tracks[3].source
        assert holder not in (sender, receiver), recovered.assignment
        watch.until(acquired_by(holder, 3), 120, f"{holder} resuming the old side")
        pipeline.start_instance(sender)
        watch.until(rejoined(sender), 120, f"{sender} rejoining")
        over = watch.until(lambda v: 3 not in (v.assignment.tracks if v.assignment else {}), 180, "the track")
        assert over.track_done[track_key(move, "old")].instance == holder, "ended where resumed"
        pipeline.end_input()
        wait_drained(pipeline, timeout_s=300)
    finally:
        watch.log.close()
        pipeline.stop()
    report = verify_pipeline(pipeline.cfg, kafka_bootstrap)
    assert report.expected > 10_000, "the workload must produce a meaningful number of results"
    assert (report.missing, report.duplicate, report.spurious) == (0, 0, 0), report.describe()
