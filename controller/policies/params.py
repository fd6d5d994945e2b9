"""A policy's parameters from what a command line or a Pipeline resource gives: its defaults, the values
set, and the handoff mode its moves use.

Apart from the policies themselves, which take their parameters as typed dataclasses: this is the one
place where loosely typed settings (a command line's floats) become those types.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from controller.assignment import HandoffMode
from controller.policies import POLICIES


def policy_params(name: str, mode: HandoffMode, **overrides: Any) -> Any:
    """The policy's default parameters with `overrides` and the handoff mode its moves should use.

    A command line passes every value as a float: 0 or 1 for a yes/no parameter becomes a bool, a whole
    number for an integer parameter an int; any other value for either is refused, not truncated."""
    params = POLICIES[name].default_params()
    if hasattr(params, "mode"):
        overrides["mode"] = mode
    for key, value in overrides.items():
        if not isinstance(value, float):
            continue
        if isinstance(getattr(params, key, None), bool):
            if value not in (0.0, 1.0):
                raise ValueError(f"{key} is yes (1) or no (0), got {value}")
            overrides[key] = value == 1.0
        elif isinstance(getattr(params, key, None), int):
            if not value.is_integer():
                raise ValueError(f"{key} must be a whole number, got {value}")
            overrides[key] = int(value)
    return replace(params, **overrides)
