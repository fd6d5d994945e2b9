"""`fluxjoin status`: the assignment of record, moves in flight and per-instance load, as text or JSON."""

from __future__ import annotations

import time
from typing import Any

from controller.observation.estimates import busy_fraction, described_by
from controller.observation.observer import Observer
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


def pipeline_status(cfg: Config, bootstrap: str, listen_s: float = 3.0) -> dict[str, Any]:
    """Where the pipeline stands: the assignment of record, and per instance whether it heartbeats, its
    pids, and from its batches of the last 10 s its busy fraction, tuples per second, state and lag (Kafka
    messages behind the end of its pids' partitions at its newest batch: 0 once it has drained)."""
    view = ControlLog(bootstrap, cfg.control_topic).catch_up()
    a = view.assignment
    if a is None:
        return {"pipeline": cfg.pipeline, "epoch": None, "instances": [], "moves": [], "evicted": []}
    observer = Observer(cfg, bootstrap, heartbeat_timeout_s=10.0, clock=time.monotonic)
    try:
        deadline = time.monotonic() + listen_s
        while time.monotonic() < deadline:
            observer.poll(wait_s=0.2)
        observer.poll()
        live = observer.liveness().live
        batches = list(observer.batches)
    finally:
        observer.close()
    now_ms = time.time() * 1000
    instances = []
    for name in sorted(set(a.owners.values()) | set(live)):
        history = [b for b in batches if b["instance"] == name]
        recent = [b for b in history if b["time_ms"] >= now_ms - 10_000]
        instances.append(
            {
                "instance": name,
                "alive": name in live,
                "pids": sorted(p for p, o in a.owners.items() if o == name),
                "busy": round(busy_fraction(described_by(history, now_ms - 10_000)), 3),
                "tuples_per_s": sum(b["tuples_in"] for b in recent) / 10,
                "state_bytes": history[-1].get("state_bytes", 0) if history else 0,
                "state_budget_bytes": history[-1].get("state_budget_bytes", 0) if history else 0,
                "lag": sum(history[-1].get("lag", {}).values()) if history else None,
            }
        )
    moves = [
        {"pid": p, "from": m.source, "to": m.target, "mode": m.mode.value, "waiting_for": "release"}
        for p, m in sorted(a.moving.items())
    ] + [
        {"pid": p, "from": None, "to": a.owners.get(p), "mode": h.mode.value, "waiting_for": "install"}
        for p, h in sorted(a.handoffs.items())
    ]
    return {
        "pipeline": cfg.pipeline,
        "epoch": a.epoch,
        "pids_owned": len(a.owners),
        "partitions": cfg.partitions,
        "instances": instances,
        "moves": moves,
        "evicted": list(a.evicted),
    }


def describe_status(status: dict[str, Any]) -> str:
    """`pipeline_status` as the text `fluxjoin status` prints."""
    if status["epoch"] is None:
        return f"pipeline {status['pipeline']}: no assignment yet (no controller has run)"
    lines = [
        f"pipeline {status['pipeline']}: epoch {status['epoch']}, "
        f"{status['pids_owned']}/{status['partitions']} pids owned",
        f"{'instance':<14}{'alive':<7}{'pids':>5}  {'busy':>5}  {'tuples/s':>9}  {'state MB':>8}  "
        f"{'lag':>7}  ranges",
    ]
    for i in status["instances"]:
        lag = "-" if i["lag"] is None else f"{i['lag']:,}"
        state = f"{i['state_bytes'] / 1e6:.1f}/{i['state_budget_bytes'] / 1e6:.0f}"
        load = f"{i['busy']:>5.2f}  {i['tuples_per_s']:>9,.0f}  {state:>15}  {lag:>7}"
        alive = "yes" if i["alive"] else "no"
        lines.append(f"{i['instance']:<14}{alive:<7}{len(i['pids']):>5}  {load}  {pid_ranges(i['pids'])}")
    for m in status["moves"]:
        if m["waiting_for"] == "release":
            lines.append(
                f"in flight: pid {m['pid']} {m['from']} -> {m['to']} ({m['mode']}), waiting for the release"
            )
        else:
            lines.append(f"in flight: pid {m['pid']} -> {m['to']} ({m['mode']}), waiting for the install")
    if status["evicted"]:
        lines.append(f"evicted (restart empty on return): {', '.join(status['evicted'])}")
    return "\n".join(lines)
