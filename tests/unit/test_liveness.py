"""Who the controller counts as live or dead, and how a pod restart changes that (decision 0051)."""

from __future__ import annotations

from typing import Any

from controller.k8s.status import restarting_instances
from controller.observation.liveness import judge_liveness

TIMEOUT_S, PROGRESS_TIMEOUT_S = 10.0, 120.0


def _judge(now: float, heard: dict[str, float], **kwargs: Any) -> tuple[frozenset[str], frozenset[str]]:
    given: dict[str, Any] = {
        "started": 0.0,
        "expected": (),
        "stalled_s": {},
        "timeout_s": TIMEOUT_S,
        "progress_timeout_s": PROGRESS_TIMEOUT_S,
        "restarting": (),
        "restart_grace_s": 300.0,
    }
    return judge_liveness(now, heard=heard, **(given | kwargs))


def test_an_instance_silent_past_the_timeout_is_dead_unless_its_pod_is_restarting() -> None:
    heard = {"a": 100.0, "b": 100.0, "c": 100.0}
    assert _judge(105.0, heard) == ({"a", "b", "c"}, set())
    assert _judge(111.0, heard) == (set(), {"a", "b", "c"})
    # b's pod is being replaced: neither live nor dead for the grace, then dead.
    assert _judge(111.0, heard, restarting={"b"}) == (set(), {"a", "c"})
    assert _judge(399.0, heard, restarting={"b"}) == (set(), {"a", "c"})
    assert _judge(401.0, heard, restarting={"b"}) == (set(), {"a", "b", "c"})


def test_a_grace_shorter_than_the_timeout_never_shortens_it() -> None:
    assert _judge(109.0, {"a": 100.0}, restarting={"a"}, restart_grace_s=0.0) == ({"a"}, set())
    assert _judge(111.0, {"a": 100.0}, restarting={"a"}, restart_grace_s=0.0) == (set(), {"a"})


def test_a_stalled_query_is_dead_even_while_its_pod_restarts() -> None:
    assert _judge(105.0, {"a": 100.0}, stalled_s={"a": 121.0}, restarting={"a"}) == (set(), {"a"})


def test_an_expected_instance_never_heard_from_is_silent_since_the_controller_started() -> None:
    assert _judge(5.0, {}, expected={"a"}) == (set(), set()), "the controller has just started"
    assert _judge(11.0, {}, expected={"a"}) == (set(), {"a"})
    assert _judge(11.0, {}, expected={"a"}, restarting={"a"}) == (set(), set())
    assert _judge(301.0, {}, expected={"a"}, restarting={"a"}) == (set(), {"a"})


def _pod(name: str, ready: bool, terminating: bool = False) -> dict[str, Any]:
    meta: dict[str, Any] = {"name": name} | (
        {"deletionTimestamp": "2026-01-01T00:00:00Z"} if terminating else {}
    )
    return {"metadata": meta, "status": {"conditions": [{"type": "Ready", "status": str(ready)}]}}


def test_a_pod_missing_terminating_or_not_ready_is_restarting() -> None:
    pods = [_pod("x-0", True), _pod("x-1", False), _pod("x-2", True, terminating=True), _pod("y-0", False)]
    assert restarting_instances(pods, ["x-0", "x-1", "x-2", "x-3"]) == {"x-1", "x-2", "x-3"}
    assert restarting_instances([{"metadata": {"name": "x-0"}, "status": {}}], ["x-0"]) == {"x-0"}
