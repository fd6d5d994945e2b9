"""Policies: pure functions from observed statistics to moves (decision 0005).

One module per policy, each behind the `Policy` protocol of `base`; `POLICIES` maps the names the
configuration uses to them. Nothing in this package performs I/O, reads a clock or draws unseeded random
numbers; the controller gathers a `Snapshot`, calls `decide`, and carries out the returned `Decision`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from controller.policies.base import (
    Decision,
    InstanceStats,
    PidStats,
    Policy,
    Snapshot,
    no_change,
    registry_of,
)
from controller.policies.flux import FluxParams, FluxPolicy
from controller.policies.memory import MemoryParams, MemoryPolicy
from controller.policies.static import StaticParams, StaticPolicy

POLICIES: Mapping[str, Policy[Any]] = registry_of(StaticPolicy(), FluxPolicy(), MemoryPolicy())
"""Every policy by its configuration name: "static", "flux", "memory"."""

__all__ = [
    "POLICIES",
    "Decision",
    "FluxParams",
    "FluxPolicy",
    "InstanceStats",
    "MemoryParams",
    "MemoryPolicy",
    "PidStats",
    "Policy",
    "Snapshot",
    "StaticParams",
    "StaticPolicy",
    "no_change",
]
