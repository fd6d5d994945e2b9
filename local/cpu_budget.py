"""A fixed CPU budget per local instance process: a cgroup CPU quota, the local twin of a pod's CPU limit.

On one machine the shared cores absorb any skew between instances, so without a budget a static
assignment looks balanced and no comparison of policies means anything. `budget_hook(name, cores)`
returns a function for `subprocess.Popen(preexec_fn=...)` that puts the child (and so its JVM and Python
workers) into its own cgroup with `cores` worth of CPU time per period. Works with cgroup v2 (`cpu.max`)
and v1 (`cpu.cfs_quota_us`); needs write access to the cgroup tree (root, or a delegated subtree).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable
from pathlib import Path

CGROUP_ROOT = Path("/sys/fs/cgroup")
PERIOD_US = 100_000


class CpuBudgetError(RuntimeError):
    """The cgroup for a CPU budget cannot be made; the message says why and what to do."""


def group_dir(name: str) -> tuple[Path, bool]:
    """(directory of the group, whether it is cgroup v2)."""
    if (CGROUP_ROOT / "cgroup.controllers").exists():
        return CGROUP_ROOT / "fluxjoin" / name, True
    if (CGROUP_ROOT / "cpu" / "cpu.cfs_period_us").exists():
        return CGROUP_ROOT / "cpu" / "fluxjoin" / name, False
    raise CpuBudgetError("no cgroup CPU controller found under /sys/fs/cgroup (cgroup v1 cpu or v2 needed)")


def make_group(name: str, cores: float) -> Path:
    """Create (or update) the cgroup `fluxjoin/<name>` limited to `cores` CPUs; return its directory."""
    if cores <= 0:
        raise CpuBudgetError(f"a CPU budget must be > 0 cores, got {cores}")
    group, v2 = group_dir(name)
    quota = max(1000, int(cores * PERIOD_US))
    try:
        if v2:
            parent = group.parent
            parent.mkdir(exist_ok=True)
            (CGROUP_ROOT / "cgroup.subtree_control").write_text("+cpu")
            (parent / "cgroup.subtree_control").write_text("+cpu")
            group.mkdir(exist_ok=True)
            (group / "cpu.max").write_text(f"{quota} {PERIOD_US}")
        else:
            group.mkdir(parents=True, exist_ok=True)
            (group / "cpu.cfs_period_us").write_text(str(PERIOD_US))
            (group / "cpu.cfs_quota_us").write_text(str(quota))
    except OSError as exc:
        raise CpuBudgetError(
            f"cannot set a CPU budget in {group} ({exc.strerror}); run as root or drop the CPU limit "
            "(instance.cpu_limit=null)"
        ) from None
    return group


def remove_group(name: str) -> None:
    """Remove the cgroup `fluxjoin/<name>` once its processes have exited; a group that is gone, or
    still holds a process, is left as it is."""
    group, _ = group_dir(name)
    with contextlib.suppress(OSError):
        group.rmdir()


def budget_hook(name: str, cores: float) -> Callable[[], None]:
    """A `preexec_fn` that moves the new process into a group of `cores` CPUs before it execs."""
    procs = make_group(name, cores) / "cgroup.procs"

    def enter() -> None:
        procs.write_text(str(os.getpid()))

    return enter
