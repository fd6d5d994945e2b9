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
from controller.policies.flux_memory import FluxMemoryParams, FluxMemoryPolicy
from controller.policies.hybrid import HybridPolicy
from controller.policies.memory import MemoryParams, MemoryPolicy
from controller.policies.static import StaticParams, StaticPolicy

POLICIES: Mapping[str, Policy[Any]] = registry_of(
    StaticPolicy(), FluxPolicy(), MemoryPolicy(), FluxMemoryPolicy(), HybridPolicy()
)
"""Every policy by its configuration name: "static", "flux" (load), "memory" (Liu and Rundensteiner's
state balancing), "flux-memory" (Flux's memory-constrained round), "hybrid" (Flux's hybrid)."""

__all__ = [
    "POLICIES",
    "Decision",
    "FluxMemoryParams",
    "FluxMemoryPolicy",
    "FluxParams",
    "FluxPolicy",
    "HybridPolicy",
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
