"""Random moves and faults against a running local pipeline, then the oracle's verdict.

Shared by the integration test (`tests/integration/test_moves.py`, about 20 moves) and
`fluxjoin bench soak` (100+ moves): rounds of `fluxjoin move` requests in the three handoff modes in turn
under continuous input, and every few rounds a fault:
- the controller killed with SIGKILL as soon as a move has started (a new controller must finish it);
- an instance killed with SIGKILL (the controller recovers its pids by replay; it restarts empty);
- an instance frozen with SIGSTOP past the heartbeat timeout, then let go with SIGCONT: a zombie, whose
  pids were recovered elsewhere meanwhile; it must stop with the eviction status (3) without committing
  anything, and restarts empty;
- a second controller started while the first runs: the newer one fences the older, which stops;
- the control topic truncated below its newest snapshot (what retention does to old segments).

`Watch` and the conditions it waits for on the control log (`moved`, `acquired_by`, `evicted`,
`rejoined`) also serve the integration tests of faults.
"""

from __future__ import annotations

import itertools
import os
import random
import signal
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from controller.moves.kafka_mover import request_moves
from controller.runner import instance_names
from local.processes import LocalPipeline, wait_drained
from pipeline.config import Config
from pipeline.control import FENCED_EXIT_STATUS, ControlLog
from pipeline.control_view import ControlView, SnapshotMsg
from pipeline.kafka_client import kafka_config
from pipeline.oracle import VerifyReport, verify_pipeline
from pipeline.protocol import Mode
from pipeline.protocol_codec import decode


@dataclass(frozen=True)
class SoakPlan:
    moves: int = 20
    pids_per_round: int = 2
    kill_controller_every: int = 5  # rounds; 0: never
    kill_instance_every: int = 8
    freeze_instance_every: int = 0  # rounds; 0: never
    second_controller_every: int = 0
    truncate_control_every: int = 0
    heartbeat_timeout_s: float = 6.0
    seed: int = 7
    modes: tuple[Mode, ...] = (Mode.TRANSFER, Mode.REPLAY, Mode.PARALLEL_TRACK)  # one per round, in turn


def soak_config(base: Config, pipeline: str, seconds: float) -> Config:
    """A small 2-way pipeline (P = 8, 3 instances) with input for at most `seconds` (the soak ends the
    input once its moves are done; a parallel track ends only while input flows)."""
    return base.with_overrides(
        pipeline=pipeline,
        streams=["A", "B"],
        partitions=8,
        instances=3,
        window_ms=3000,
        allowed_lateness_ms=1000,
        **{
            "generator.mode": "real_time",
            "generator.duration_s": seconds,
            "generator.max_tuples": None,
            "generator.rate": {"kind": "constant", "rate": 800},
            "generator.keys": {"kind": "uniform", "count": 3000},
            "generator.tuples_per_message": 32,
            "instance.trigger_ms": 200,
            "instance.max_rows_per_batch": 20000,
            "instance.spark_master": "local[1]",
            "instance.shuffle_partitions": 1,
        },
    )


class Watch:
    """Waits on the control log for a condition, failing fast when a pipeline process has crashed."""

    def __init__(self, pipeline: LocalPipeline) -> None:
        self.pipeline = pipeline
        self.log = ControlLog(pipeline.bootstrap, pipeline.cfg.control_topic)
        self.controller = "controller"
        """The name of the newest controller process (whose log a timeout shows)."""
        self.superseded: set[str] = set()
        """Older controllers, which stop with `FENCED_EXIT_STATUS` once the newest has fenced them."""

    def until(self, ok: Callable[[ControlView], bool], timeout_s: float, what: str) -> ControlView:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                view: ControlView | None = self.log.catch_up()
            except TimeoutError:
                # A transaction open on the control log holds its readers back (read committed) until
                # it ends, after a long broker outage until the broker aborts it: waited for up to the
                # deadline.
                view = None
            if view is not None and ok(view):
                return view
            crashed = {
                n: c
                for n, c in self.pipeline.failed().items()
                if n != "generator" and not (n in self.superseded and c == FENCED_EXIT_STATUS)
            }
            if crashed:
                name = next(iter(crashed))
                raise RuntimeError(f"{name} exited with {crashed[name]}:\n{self.pipeline.log_tail(name, 40)}")
            if time.monotonic() > deadline:
                tail = self.pipeline.log_tail(self.controller, 30)
                raise TimeoutError(f"timed out waiting for {what}; controller log:\n{tail}")
            time.sleep(0.3)


def _moving(pids: list[int], target: str) -> Callable[[ControlView], bool]:
    """Every pid's move has started (it is in transit) or is already over."""
    return lambda v: (
        v.assignment is not None
        and all(p in v.assignment.moving or v.assignment.owners.get(p) == target for p in pids)
    )


def moved(pids: list[int], target: str) -> Callable[[ControlView], bool]:
    """Every pid is owned by `target`, which has acquired it (its handoff is dropped): a state of the
    assignment, which holds whichever controller took the move over and whatever move ids it used."""
    return lambda v: (
        v.assignment is not None
        and all(v.assignment.owners.get(p) == target and p not in v.assignment.handoffs for p in pids)
    )


def acquired_by(instance: str, pid: int) -> Callable[[ControlView], bool]:
    return lambda v: any(a.instance == instance and a.pid == pid for a in v.acquired.values())


def evicted(name: str) -> Callable[[ControlView], bool]:
    return lambda v: v.assignment is not None and any(e.startswith(f"{name}@") for e in v.assignment.evicted)


def rejoined(name: str) -> Callable[[ControlView], bool]:
    return lambda v: v.assignment is not None and not evicted(name)(v)


def run_soak(
    cfg: Config, bootstrap: str, work: Path, plan: SoakPlan, say: Callable[[str], None] = print
) -> tuple[VerifyReport, dict[str, Any]]:
    """Run the plan on a fresh pipeline; returns the oracle's report and counts of what was done."""
    rng = random.Random(plan.seed)
    say(f"soak: seed {plan.seed}, pipeline {cfg.pipeline}, {plan.moves} moves")
    pipeline = LocalPipeline(cfg, bootstrap, work)
    watch = Watch(pipeline)
    names = instance_names(cfg.instances)
    done = dict.fromkeys(
        ("moves", "rounds", "controller_kills", "instance_kills", "zombies", "second_controllers"), 0
    )
    done["control_truncations"] = 0
    modes = plan.modes
    controllers = itertools.count(1)

    def start_controller() -> None:
        watch.controller = f"controller-{next(controllers)}"
        pipeline.start_controller(
            policy="static", heartbeat_timeout_s=plan.heartbeat_timeout_s, name=watch.controller
        )

    def every(n: int, round_no: int) -> bool:
        return n > 0 and round_no % n == 0

    try:
        start_controller()
        for name in names:
            pipeline.start_instance(name)
        watch.until(lambda v: v.assignment is not None, 60, "epoch 0")
        pipeline.start_generator()
        while done["moves"] < plan.moves:
            view = watch.log.catch_up()
            assert view.assignment is not None
            a = view.assignment
            owners = a.owners
            target = rng.choice(names)
            idle = sorted(p for p in owners if p not in a.handoffs and p not in a.tracks)
            chosen = rng.sample(idle, min(plan.pids_per_round, len(idle)))
            pids = [p for p in chosen if owners[p] != target]
            if not pids:
                if not idle and pipeline.procs["generator"].poll() is not None:
                    raise RuntimeError(
                        f"the input ended after {done['moves']} moves; every pid is in a parallel track,"
                        " which ends only with input: give the soak more input seconds"
                    )
                time.sleep(0.2)  # every pid busy or already on the target: try again shortly
                continue
            # Only a round that requests moves counts: the faults then come every N such rounds, as planned.
            done["rounds"] += 1
            round_no = done["rounds"]
            mode = modes[round_no % len(modes)]
            request_moves(cfg, bootstrap, pids, target, mode)
            if every(plan.kill_controller_every, round_no):
                watch.until(_moving(pids, target), 60, "the move to start")
                pipeline.kill(watch.controller, signal.SIGKILL)
                start_controller()
                done["controller_kills"] += 1
            elif every(plan.second_controller_every, round_no):
                watch.until(_moving(pids, target), 60, "the move to start")
                older = watch.controller
                start_controller()  # the newer fences the older, which stops at its next publish
                watch.superseded.add(older)
                done["second_controllers"] += 1
            watch.until(moved(pids, target), 180, f"moves {pids} -> {target} ({mode.value})")
            done["moves"] += len(pids)
            say(f"soak: round {round_no}: pids {pids} -> {target} ({mode.value}); {done['moves']} moves done")
            if every(plan.kill_instance_every, round_no):
                victim = rng.choice(names)
                pipeline.kill(victim, signal.SIGKILL)
                done["instance_kills"] += 1
                watch.until(evicted(victim), 90, f"the recovery of {victim}")
                pipeline.start_instance(victim)
                watch.until(rejoined(victim), 120, f"{victim} rejoining")
                say(f"soak: {victim} killed, its pids recovered, rejoined empty")
            elif every(plan.freeze_instance_every, round_no):
                victim = rng.choice(names)
                _zombie(pipeline, watch, victim)
                done["zombies"] += 1
                say(f"soak: {victim} frozen past the timeout and let go: stopped as evicted, rejoined empty")
            if every(plan.truncate_control_every, round_no):
                kept = truncate_control_log(cfg, bootstrap)
                done["control_truncations"] += 1
                say(f"soak: control log truncated below offset {kept} (its newest snapshot)")
        done["controllers_fenced"] = _retire(pipeline, watch.superseded)
        say("soak: moves done; ending the input, waiting for the pipeline to drain")
        pipeline.end_input()
        wait_drained(pipeline, timeout_s=600)
    finally:
        watch.log.close()
        pipeline.stop()
    say("soak: verifying against the oracle")
    return verify_pipeline(pipeline.cfg, bootstrap), done


def _retire(pipeline: LocalPipeline, superseded: set[str]) -> int:
    """Stop the controllers a newer one superseded; how many had already stopped as fenced (the others
    have not tried to publish since: they would be fenced at their next publication)."""
    fenced = 0
    for name in sorted(superseded):
        proc = pipeline.procs.get(name)
        fenced += proc is not None and proc.poll() == FENCED_EXIT_STATUS
        pipeline.kill(name, signal.SIGTERM)
    superseded.clear()
    return fenced


def truncate_control_log(cfg: Config, bootstrap: str) -> int:
    """Delete the control log's records below its newest snapshot's `read_to` (the most that retention
    may take without losing state, see `pipeline.control`); the new log start."""
    from confluent_kafka import TopicPartition
    from confluent_kafka.admin import AdminClient

    from pipeline.topics import read_topic

    snapshots = [decode(value) for _, _, value in read_topic(bootstrap, cfg.control_topic)]
    read_to = max(m.read_to for m in snapshots if isinstance(m, SnapshotMsg))
    admin = AdminClient(kafka_config(bootstrap))
    for done in admin.delete_records([TopicPartition(cfg.control_topic, 0, read_to)]).values():
        done.result()
    return read_to


def _zombie(pipeline: LocalPipeline, watch: Watch, victim: str) -> None:
    """Freeze `victim` (its whole process group: the JVM too) until it is evicted, let it go, and wait
    for it to stop with the eviction status; then start it again (it rejoins empty)."""
    proc = pipeline.procs[victim]
    os.killpg(proc.pid, signal.SIGSTOP)
    try:
        watch.until(evicted(victim), 90, f"the eviction of the frozen {victim}")
    finally:
        os.killpg(proc.pid, signal.SIGCONT)
    try:
        status = proc.wait(120)
    except subprocess.TimeoutExpired:
        raise RuntimeError(f"{victim}, evicted while frozen, still runs 120 s after it was let go") from None
    if status != FENCED_EXIT_STATUS:
        tail = pipeline.log_tail(victim, 40)
        raise RuntimeError(f"{victim} exited with {status} after its eviction:\n{tail}")
    pipeline.kill(victim)  # forget the exited process
    pipeline.start_instance(victim)
    watch.until(rejoined(victim), 120, f"{victim} rejoining")
