"""The per-instance CPU budget on the machine's real cgroup tree (the tests run as root)."""

from __future__ import annotations

import subprocess
import uuid

from local.cpu_budget import budget_hook, group_dir, make_group, remove_group


def test_a_budgeted_process_runs_in_its_own_group_which_stop_removes() -> None:
    name = f"test-{uuid.uuid4().hex[:8]}"
    group, v2 = group_dir(name)
    proc = subprocess.Popen(["sleep", "30"], preexec_fn=budget_hook(name, 0.25))
    try:
        assert str(proc.pid) in (group / "cgroup.procs").read_text().split()
        quota = (group / "cpu.max").read_text().split()[0] if v2 else (group / "cpu.cfs_quota_us").read_text()
        assert int(quota) == 25_000, "0.25 cores of each 100 ms period"
        remove_group(name)
        assert group.exists(), "a group that still holds a process is left in place"
    finally:
        proc.kill()
        proc.wait()
    remove_group(name)
    assert not group.exists()


def test_a_running_process_gets_a_new_quota_in_its_group() -> None:
    """What `LocalPipeline.set_cpu_limit` does to slow an instance while it runs."""
    name = f"test-{uuid.uuid4().hex[:8]}"
    group, v2 = group_dir(name)
    proc = subprocess.Popen(["sleep", "30"], preexec_fn=budget_hook(name, 0.5))
    try:
        make_group(name, 0.1)
        assert str(proc.pid) in (group / "cgroup.procs").read_text().split(), "still in its group"
        quota = (group / "cpu.max").read_text().split()[0] if v2 else (group / "cpu.cfs_quota_us").read_text()
        assert int(quota) == 10_000, "0.1 cores of each 100 ms period"
    finally:
        proc.kill()
        proc.wait()
    remove_group(name)
