"""The assignment of record: which instance owns each pid, under which epoch, and the moves that change it.

Pure value objects (no I/O, no clock): policies read an `Assignment` and return `Move`s; the protocol layer
turns a move into control messages, and only once it has completed does the controller apply it with
`Assignment.with_moves`, which yields the next epoch. Every assignment is validated before it is acted on
(`Assignment.validate`), so a policy or a persistence bug shows up as a list of `AssignmentError`s rather
than as a pid that two instances process, or none.

This module must not know how a move is carried out (that is `handoff/`) or why it was chosen (that is
`policies/`).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from enum import Enum
from types import MappingProxyType

from pipeline.partitioning import contiguous_ranges
from pipeline.protocol import Mode

HandoffMode = Mode
"""How a moved pid's window reaches its new owner (the protocol's `Mode`)."""


class AssignmentError(Enum):
    """What can be wrong with an ownership map; the order of the members is the order of reporting."""

    MISSING_PID = "missing_pid"
    """A pid in 0..P-1 has no owner: its tuples would be read by nobody."""
    DOUBLE_OWNED_PID = "double_owned_pid"
    """A pid has two owners: its results would be produced twice."""
    UNKNOWN_PID = "unknown_pid"
    """A pid outside 0..P-1: the map was built for another partition count."""
    DEAD_OWNER = "dead_owner"
    """An owner is not among the live instances: its pids are stalled until reassigned."""


@dataclass(frozen=True, slots=True)
class Violation:
    """One concrete problem found by validation, for logs and error messages."""

    error: AssignmentError
    pid: int
    instance: str | None


@dataclass(frozen=True, slots=True)
class Move:
    """Move one pid from its current owner to another instance, by the given handoff mode."""

    pid: int
    source: str
    target: str
    mode: HandoffMode = HandoffMode.TRANSFER

    def __post_init__(self) -> None:
        if self.pid < 0:
            raise ValueError(f"pid must be >= 0, got {self.pid}")
        if self.source == self.target:
            raise ValueError(f"move of pid {self.pid} has the same source and target {self.source!r}")


@dataclass(frozen=True, slots=True)
class FinishedMove:
    """A move that left the moves in flight: the epoch that ended it, and the pid's owner under that
    epoch (its target when it completed, another instance when it was abandoned because its source died)."""

    move: Move
    epoch: int
    owner: str | None

    @property
    def completed(self) -> bool:
        return self.owner == self.move.target


def find_violations(
    claims: Mapping[str, Iterable[int]], partitions: int, live_instances: Iterable[str]
) -> list[Violation]:
    """Check an ownership map given as instance -> pids, the shape in which instances report what they own.

    This is the general check: unlike `Assignment.owners` (pid -> instance), this shape can hold a pid
    claimed by two instances, which is exactly what a stale owner that was not fenced looks like.
    Violations come out sorted by (error, pid, instance) so that reports are reproducible.
    """
    if partitions <= 0:
        raise ValueError(f"partitions must be > 0, got {partitions}")
    live = frozenset(live_instances)
    holders: dict[int, list[str]] = {}
    for instance in sorted(claims):
        for pid in claims[instance]:
            holders.setdefault(pid, []).append(instance)
    found: list[Violation] = []
    for pid in range(partitions):
        if pid not in holders:
            found.append(Violation(AssignmentError.MISSING_PID, pid, None))
    for pid, owners in holders.items():
        if not 0 <= pid < partitions:
            found.extend(Violation(AssignmentError.UNKNOWN_PID, pid, owner) for owner in owners)
        if len(owners) > 1:
            found.extend(Violation(AssignmentError.DOUBLE_OWNED_PID, pid, owner) for owner in owners)
        found.extend(
            Violation(AssignmentError.DEAD_OWNER, pid, owner) for owner in owners if owner not in live
        )
    order = list(AssignmentError)
    found.sort(key=lambda v: (order.index(v.error), v.pid, v.instance or ""))
    return found


def validate_claims(
    claims: Mapping[str, Iterable[int]], partitions: int, live_instances: Iterable[str]
) -> list[AssignmentError]:
    """The distinct kinds of error in an instance -> pids map, in `AssignmentError` order; empty if valid."""
    kinds = {v.error for v in find_violations(claims, partitions, live_instances)}
    return [error for error in AssignmentError if error in kinds]


@dataclass(frozen=True, slots=True)
class Assignment:
    """pid -> owning instance id, under an epoch that increases with every applied change.

    `owners` is copied into a read-only mapping sorted by pid, so an assignment cannot change after it
    was validated and iterating it is deterministic.
    """

    epoch: int
    owners: Mapping[int, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.epoch < 0:
            raise ValueError(f"epoch must be >= 0, got {self.epoch}")
        frozen = MappingProxyType({pid: self.owners[pid] for pid in sorted(self.owners)})
        object.__setattr__(self, "owners", frozen)

    def __hash__(self) -> int:
        return hash((self.epoch, tuple(self.owners.items())))

    @property
    def instances(self) -> tuple[str, ...]:
        """Instances that own at least one pid, sorted by id."""
        return tuple(sorted(set(self.owners.values())))

    def pids_of(self, instance: str) -> tuple[int, ...]:
        """The pids `instance` owns, ascending; empty for an instance that owns none."""
        return tuple(pid for pid, owner in self.owners.items() if owner == instance)

    def by_instance(self) -> dict[str, tuple[int, ...]]:
        """instance -> its pids (ascending), instances sorted by id."""
        grouped: dict[str, list[int]] = {}
        for pid, owner in self.owners.items():
            grouped.setdefault(owner, []).append(pid)
        return {instance: tuple(grouped[instance]) for instance in sorted(grouped)}

    def violations(self, partitions: int, instances: Iterable[str]) -> list[Violation]:
        """Every concrete problem (see `find_violations`)."""
        return find_violations(self.by_instance(), partitions, instances)

    def validate(self, partitions: int, instances: Iterable[str]) -> list[AssignmentError]:
        """Distinct kinds of error against P partitions and the live instances; empty means valid.

        A pid -> instance map cannot hold a pid twice, so DOUBLE_OWNED_PID never comes from here; it is
        reported by `validate_claims`, which checks what instances say they own.
        """
        return validate_claims(self.by_instance(), partitions, instances)

    def with_moves(self, moves: Iterable[Move]) -> Assignment:
        """The assignment after `moves` completed, at the next epoch.

        Refuses (ValueError) a move whose source is not the current owner (it was decided on a stale
        assignment) and two moves of one pid (the second would undo or race the first). No moves at all
        return this assignment unchanged: a new epoch would fence every instance for nothing.
        """
        batch = tuple(moves)
        if not batch:
            return self
        owners = dict(self.owners)
        seen: set[int] = set()
        for move in batch:
            if move.pid in seen:
                raise ValueError(f"pid {move.pid} is moved twice in one batch")
            seen.add(move.pid)
            current = owners.get(move.pid)
            if current != move.source:
                raise ValueError(
                    f"move of pid {move.pid} from {move.source!r}, but its owner is {current!r} "
                    f"at epoch {self.epoch}"
                )
            owners[move.pid] = move.target
        return Assignment(self.epoch + 1, owners)


def initial_assignment(partitions: int, instance_ids: Sequence[str]) -> Assignment:
    """Epoch 0: instance i (in the given order) owns the i-th contiguous range of pids.

    Contiguous ranges keep the initial layout readable (instance-0 owns the lowest pids) and are the
    static baseline every adaptive policy is compared with. The given order is kept rather than sorted,
    because sorting ids as strings would put "i-10" before "i-2".
    """
    if not instance_ids:
        raise ValueError("at least one instance is needed")
    if len(set(instance_ids)) != len(instance_ids):
        raise ValueError(f"instance ids must be distinct: {list(instance_ids)}")
    if partitions < len(instance_ids):
        raise ValueError(
            f"{partitions} partitions cannot give a pid to each of {len(instance_ids)} instances"
        )
    owners = {
        pid: instance
        for instance, pids in zip(instance_ids, contiguous_ranges(partitions, len(instance_ids)), strict=True)
        for pid in pids
    }
    return Assignment(0, owners)
