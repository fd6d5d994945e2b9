"""Random moves and kills against a running local pipeline, then the oracle's verdict.

Shared by the integration test (`tests/integration/test_moves.py`, about 20 moves) and
`fluxjoin bench soak` (100+ moves): rounds of `fluxjoin move` requests in the three handoff modes in turn
under continuous input; in some rounds the controller is killed with SIGKILL as soon as the move has started
(a new controller must finish it), in others an instance is killed with SIGKILL (the controller recovers
its pids by replay; the instance restarts empty).
"""

from __future__ import annotations

import random
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from controller.local import LocalPipeline, wait_drained
from controller.moves import request_moves
from controller.runner import instance_names
from pipeline.config import Config
from pipeline.control import ControlLog
from pipeline.oracle import VerifyReport, verify_pipeline
from pipeline.protocol import ControlView, Mode


@dataclass(frozen=True)
class SoakPlan:
    moves: int = 20
    pids_per_round: int = 2
    kill_controller_every: int = 5  # rounds; 0: never
    kill_instance_every: int = 8
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

    def until(self, ok: Callable[[ControlView], bool], timeout_s: float, what: str) -> ControlView:
        deadline = time.monotonic() + timeout_s
        while True:
            view = self.log.catch_up()
            if ok(view):
                return view
            crashed = {n: c for n, c in self.pipeline.failed().items() if n != "generator"}
            if crashed:
                name = next(iter(crashed))
                raise RuntimeError(f"{name} exited with {crashed[name]}:\n{self.pipeline.log_tail(name, 40)}")
            if time.monotonic() > deadline:
                tail = self.pipeline.log_tail("controller", 30)
                raise TimeoutError(f"timed out waiting for {what}; controller log:\n{tail}")
            time.sleep(0.3)


def _started(move_ids: set[str]) -> Callable[[ControlView], bool]:
    return lambda v: move_ids <= v.started


def _acquired(move_ids: set[str]) -> Callable[[ControlView], bool]:
    return lambda v: move_ids <= set(v.acquired)


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
    done = {"moves": 0, "controller_kills": 0, "instance_kills": 0, "rounds": 0}
    modes = plan.modes

    def start_controller() -> None:
        pipeline.start_controller(policy="static", heartbeat_timeout_s=plan.heartbeat_timeout_s)

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
            # Only a round that requests moves counts: the kills then come every N such rounds, as planned.
            done["rounds"] += 1
            round_no = done["rounds"]
            mode = modes[round_no % len(modes)]
            request = request_moves(cfg, bootstrap, pids, target, mode)
            if plan.kill_controller_every and round_no % plan.kill_controller_every == 0:
                first = request.move_id(pids[0])
                watch.until(_started({first}), 60, "the move to start")
                pipeline.kill("controller", signal.SIGKILL)
                start_controller()
                done["controller_kills"] += 1
            ids = {request.move_id(p) for p in pids}
            watch.until(_acquired(ids), 180, f"moves {pids} -> {target} ({mode.value})")
            done["moves"] += len(pids)
            say(f"soak: round {round_no}: pids {pids} -> {target} ({mode.value}); {done['moves']} moves done")
            if plan.kill_instance_every and round_no % plan.kill_instance_every == 0:
                victim = rng.choice(names)
                pipeline.kill(victim, signal.SIGKILL)
                done["instance_kills"] += 1

                watch.until(evicted(victim), 90, f"the recovery of {victim}")
                pipeline.start_instance(victim)
                watch.until(rejoined(victim), 120, f"{victim} rejoining")
                say(f"soak: {victim} killed, its pids recovered, rejoined empty")
        say("soak: moves done; ending the input, waiting for the pipeline to drain")
        pipeline.end_input()
        wait_drained(pipeline, timeout_s=600)
    finally:
        watch.log.close()
        pipeline.stop()
    say("soak: verifying against the oracle")
    return verify_pipeline(pipeline.cfg, bootstrap), done
