"""`fluxjoin status`: the assignment of record, moves in flight and per-instance load, as text."""

from __future__ import annotations

import time

from controller.moves import Observer
from controller.rounds import busy_fraction, described_by
from pipeline.config import Config
from pipeline.control import ControlLog


def pid_ranges(pids: list[int]) -> str:
    """[0, 1, 2, 5, 7, 8] -> '0-2,5,7-8'."""
    out: list[str] = []
    for p in sorted(pids):
        if out and int(out[-1].split("-")[-1]) == p - 1:
            out[-1] = f"{out[-1].split('-')[0]}-{p}"
        else:
            out.append(str(p))
    return ",".join(out)


def describe_status(cfg: Config, bootstrap: str, listen_s: float = 3.0) -> str:
    view = ControlLog(bootstrap, cfg.control_topic).catch_up()
    a = view.assignment
    if a is None:
        return f"pipeline {cfg.pipeline}: no assignment yet (no controller has run)"
    observer = Observer(cfg, bootstrap, heartbeat_timeout_s=10.0, clock=time.monotonic)
    deadline = time.monotonic() + listen_s
    while time.monotonic() < deadline:
        observer.poll(wait_s=0.2)
    observer.poll()
    live = observer.liveness().live
    now_ms = time.time() * 1000
    lines = [f"pipeline {cfg.pipeline}: epoch {a.epoch}, {len(a.owners)}/{cfg.partitions} pids owned"]
    names = sorted(set(a.owners.values()) | set(live))
    lines.append(
        f"{'instance':<14}{'alive':<7}{'pids':>5}  {'busy':>5}  {'tuples/s':>9}  {'state MB':>8}  ranges"
    )
    for name in names:
        pids = [p for p, o in a.owners.items() if o == name]
        history = [b for b in observer.batches if b["instance"] == name]
        recent = [b for b in history if b["time_ms"] >= now_ms - 10_000]
        busy = busy_fraction(described_by(history, now_ms - 10_000))
        rate = sum(b["tuples_in"] for b in recent) / 10
        state = sum(s["state_bytes"] for s in recent[-1]["pids"].values()) / 1e6 if recent else 0.0
        alive = "yes" if name in live else "no"
        load = f"{busy:>5.2f}  {rate:>9,.0f}  {state:>8.1f}"
        lines.append(f"{name:<14}{alive:<7}{len(pids):>5}  {load}  {pid_ranges(pids)}")
    for p, m in sorted(a.moving.items()):
        lines.append(f"in flight: pid {p} {m.source} -> {m.target} ({m.mode.value}), waiting for the release")
    for p, h in sorted(a.handoffs.items()):
        lines.append(f"in flight: pid {p} -> {a.owners.get(p)} ({h.mode.value}), waiting for the install")
    if a.evicted:
        lines.append(f"evicted (restart empty on return): {', '.join(a.evicted)}")
    observer.close()
    return "\n".join(lines)
