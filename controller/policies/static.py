"""The non-adaptive baseline: the initial assignment stays, whatever the statistics say.

It sits behind the same `Policy` interface as the adaptive policies so that every experiment can compare
against it with nothing else changed (the papers' "static" curves).
"""

from __future__ import annotations

from dataclasses import dataclass

from controller.policies.base import Decision, Snapshot, no_change


@dataclass(frozen=True, slots=True, kw_only=True)
class StaticParams:
    """The static policy has nothing to tune; the type exists so every policy takes params alike."""


class StaticPolicy:
    """Never moves a pid."""

    name = "static"

    def default_params(self) -> StaticParams:
        return StaticParams()

    def decide(self, snapshot: Snapshot, params: StaticParams) -> Decision:
        """No change, at the snapshot's interval (the statistics are still worth collecting for reports)."""
        return no_change("static policy: assignment is fixed", snapshot.interval_s)
