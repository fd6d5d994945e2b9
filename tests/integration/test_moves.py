"""Live pid moves on a real broker with real Spark instances, checked by the oracle.

At least 20 random moves in the three handoff modes under continuous input, a kill -9 of the controller in the
middle of a move and of an instance (its pids are recovered by replay; it restarts empty), an instance
frozen past the heartbeat timeout and let go (a zombie), a second controller started beside the first,
and the control log truncated below its newest snapshot: the results topic must still hold exactly the
oracle's join. And three rare cases on purpose: the sender of a
parallel track killed while it still holds old tuples, the sender of a replay killed before the batch
that releases the pid committed, and a pid moved back to the old side of its track before that side saw
the track end.
"""

from __future__ import annotations

import itertools
import os
import signal
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from bench.soak import SoakPlan, Watch, acquired_by, evicted, rejoined, run_soak, soak_config
from controller.moves.kafka_mover import request_moves
from local.processes import LocalPipeline, committed_offsets, wait_drained
from pipeline.commits import read_logged_offsets
from pipeline.config import Config, load_config
from pipeline.control import ControlLog
from pipeline.control_view import ControlView
from pipeline.instance import instance_dir
from pipeline.oracle import verify_pipeline
from pipeline.protocol import Mode, track_key

INSTANCES = ["instance-0", "instance-1", "instance-2"]


def test_random_moves_kills_zombies_two_controllers_and_a_truncated_log_stay_exact(
    kafka_bootstrap: str, topic_prefix: str, tmp_path: Path
) -> None:
    plan = SoakPlan(
        moves=20,
        pids_per_round=3,
        kill_controller_every=3,
        kill_instance_every=4,
        freeze_instance_every=5,
        second_controller_every=2,
        truncate_control_every=3,
    )
    cfg = soak_config(load_config(), topic_prefix, seconds=600)
    report, done = run_soak(cfg, kafka_bootstrap, tmp_path, plan)
    assert done["moves"] >= 20
    assert done["controller_kills"] >= 2 and done["instance_kills"] >= 1
    assert done["zombies"] >= 1 and done["second_controllers"] >= 1 and done["control_truncations"] >= 2
    assert report.expected > 10_000, "the workload must produce a meaningful number of results"
    assert (report.missing, report.duplicate, report.spurious) == (0, 0, 0), report.describe()


def _pid_3_flowing(pipeline: LocalPipeline, watch: Watch, heartbeat_timeout_s: float) -> str:
    """Start a static controller, the instances and the input; pid 3's owner, once it has committed
    200 of pid 3's messages."""
    pipeline.start_controller(policy="static", heartbeat_timeout_s=heartbeat_timeout_s)
    for name in INSTANCES:
        pipeline.start_instance(name)
    pipeline.wait_running(INSTANCES)
    pipeline.start_generator()
    start = watch.until(lambda v: bool(v.assignment and v.assignment.epoch == 0), 60, "epoch 0")
    assert start.assignment is not None
    cfg, bootstrap = pipeline.cfg, pipeline.bootstrap
    watch.until(lambda v: committed_offsets(cfg, bootstrap).get(("A", 3), 0) >= 200, 120, "input")
    return start.assignment.owners[3]


def test_a_parallel_track_sender_killed_in_the_overlap_is_resumed_exactly(
    kafka_bootstrap: str, topic_prefix: str, tmp_path: Path
) -> None:
    """The sender is frozen as soon as it has released the pid (W = 20 s: it still holds old tuples for
    that long), then killed. A third instance must rebuild its window from the log, re-read silently
    what the sender had committed, and emit every later result with an old tuple."""
    cfg = soak_config(load_config(), topic_prefix, seconds=300).with_overrides(window_ms=20_000)
    with _scenario(cfg, kafka_bootstrap, tmp_path) as (pipeline, watch):
        sender = _pid_3_flowing(pipeline, watch, heartbeat_timeout_s=6.0)
        receiver = next(name for name in INSTANCES if name != sender)

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
        over = watch.until(_no_track(3), 180, "the track")
        assert over.track_done[track_key(move, "old")].instance == holder, "ended where resumed"


def _frozen_before_its_release_committed(
    pipeline: LocalPipeline, log: ControlLog, sender: str, move: str
) -> bool:
    """Freeze the sender as soon as its replay's `Released` is announced (its release batch planned); true
    if that batch had not committed by then (its committed `Released` is not in the log 2 s later)."""
    deadline = time.monotonic() + 120
    while move not in log.catch_up().released:
        assert time.monotonic() < deadline, f"no release of {move}"
        time.sleep(0.01)
    os.killpg(pipeline.procs[sender].pid, signal.SIGSTOP)
    time.sleep(2)
    released = log.catch_up().released.get(move)
    return released is not None and released.announced


def test_a_replay_receiver_takes_the_pid_while_its_sender_is_frozen_before_the_release_committed(
    kafka_bootstrap: str, topic_prefix: str, tmp_path: Path
) -> None:
    """A replay's cutoff is where the sender's release batch begins, so its receiver starts as soon as
    that batch is planned and never waits for it (decision 0037). The sender is frozen right after it
    announced the release, before that batch commits: the receiver must acquire the pid all the same,
    and once the sender is killed and evicted, the output must be exact. (The freeze can come too late,
    after the batch committed: then the pid moves back and the other side is tried.)"""
    cfg = soak_config(load_config(), topic_prefix, seconds=300)
    with _scenario(cfg, kafka_bootstrap, tmp_path) as (pipeline, watch):
        sender = _pid_3_flowing(pipeline, watch, heartbeat_timeout_s=6.0)
        receiver = next(name for name in INSTANCES if name != sender)
        for _ in range(5):
            move = request_moves(cfg, kafka_bootstrap, [3], receiver, Mode.REPLAY).move_id(3)
            if _frozen_before_its_release_committed(pipeline, watch.log, sender, move):
                break
            os.killpg(pipeline.procs[sender].pid, signal.SIGCONT)
            watch.until(_acquired(move), 120, f"{receiver} acquiring pid 3")
            sender, receiver = receiver, sender
        else:
            raise AssertionError("no release batch was frozen before it committed, in 5 tries")
        taken = watch.until(_acquired(move), 120, f"{receiver} acquiring pid 3 from a frozen sender")
        assert taken.acquired[move].instance == receiver
        assert taken.released[move].announced, "the sender's release batch committed while frozen"
        pipeline.kill(sender, signal.SIGKILL)
        watch.until(evicted(sender), 90, f"the eviction of {sender}")
        pipeline.start_instance(sender)
        watch.until(rejoined(sender), 120, f"{sender} rejoining")


@contextmanager
def _scenario(cfg: Config, bootstrap: str, work: Path) -> Iterator[tuple[LocalPipeline, Watch]]:
    """A pipeline and a watch on its control log for the body; then the input ends, the pipeline
    drains, stops, and its output must be exact."""
    pipeline = LocalPipeline(cfg, bootstrap, work)
    watch = Watch(pipeline)
    try:
        yield pipeline, watch
        pipeline.end_input()
        wait_drained(pipeline, timeout_s=300)
    finally:
        watch.log.close()
        pipeline.stop()
    report = verify_pipeline(pipeline.cfg, pipeline.bootstrap)
    assert report.expected > 10_000, "the workload must produce a meaningful number of results"
    assert (report.missing, report.duplicate, report.spurious) == (0, 0, 0), report.describe()


def _acquired(move: str) -> Callable[[ControlView], bool]:
    return lambda v: move in v.acquired


def _no_track(pid: int) -> Callable[[ControlView], bool]:
    return lambda v: v.assignment is not None and pid not in v.assignment.tracks


def _tracked_from(side: str, pid: int) -> Callable[[ControlView], bool]:
    return lambda v: v.assignment is not None and getattr(v.assignment.tracks.get(pid), "source", "") == side


def _old_side_done(move: str) -> Callable[[ControlView], bool]:
    return lambda v: v.track_ended(move, "old")


def _handed_over(move: str, pid: int) -> Callable[[ControlView], bool]:
    return lambda v: move in v.released and v.assignment is not None and pid in v.assignment.handoffs


def _returned_while_old(home: Path, pid: int) -> bool:
    """Whether a batch of the instance began with `pid` tracked as an old side and acquired it (the source
    offsets in Spark's offset log)."""
    checkpoint = home / "checkpoint"
    batches = sorted(int(f.name) for f in (checkpoint / "offsets").iterdir() if f.name.isdigit())
    ends = [read_logged_offsets(checkpoint, b) for b in batches]
    return any(
        before.get("tracking", {}).get(str(pid), {}).get("role") == "old"
        and str(pid) in after.get("acquired", {})
        for before, after in itertools.pairwise(ends)
    )


def test_a_pid_moved_back_before_its_old_side_saw_the_track_end_stays_exact(
    kafka_bootstrap: str, topic_prefix: str, tmp_path: Path
) -> None:
    """Pid 3's old side is frozen once its old tuples expire; meanwhile the track ends and pid 3 moves
    back to it. It wakes to an assignment that owns pid 3 with a handoff, the epochs between unseen,
    as a loaded instance does after one long batch. It must acquire pid 3 afresh; kept as an old side
    it would emit none of pid 3's later results. The controller is frozen from the track's start until
    the side is: otherwise the side can see the track end between its report and its freeze (CI saw
    that three times in a row)."""
    cfg = soak_config(load_config(), topic_prefix, seconds=300)
    with _scenario(cfg, kafka_bootstrap, tmp_path) as (pipeline, watch):
        side = _pid_3_flowing(pipeline, watch, heartbeat_timeout_s=60.0)
        other = next(name for name in INSTANCES if name != side)
        controller = pipeline.procs["controller"].pid

        out = request_moves(cfg, kafka_bootstrap, [3], other, Mode.PARALLEL_TRACK).move_id(3)
        watch.until(_tracked_from(side, 3), 120, f"pid 3's track from {side}")
        os.killpg(controller, signal.SIGSTOP)
        try:
            watch.until(_old_side_done(out), 120, f"{side}'s old tuples expiring")
            os.killpg(pipeline.procs[side].pid, signal.SIGSTOP)
        finally:
            os.killpg(controller, signal.SIGCONT)
        try:
            watch.until(_no_track(3), 60, "the track")
            back = request_moves(cfg, kafka_bootstrap, [3], side, Mode.PARALLEL_TRACK).move_id(3)
            watch.until(_handed_over(back, 3), 60, f"pid 3 handed back to {side}")
        finally:
            os.killpg(pipeline.procs[side].pid, signal.SIGCONT)
        watch.until(acquired_by(side, 3), 120, f"{side} acquiring pid 3 back")
        assert _returned_while_old(instance_dir(pipeline.cfg, side), 3), f"{side} saw the track end"
        watch.until(_no_track(3), 120, "the last track")
