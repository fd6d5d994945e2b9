"""Flux load balancing (Shah et al., ICDE 2003, section 5.3): one round of utilization-based moves.

The round, as the paper gives it:

1. Each instance j reports its utilization U_j = 1 - I_j / delta over the collection interval delta and
   the tuples N_pid each of its pids processed; T_j is the sum of N_pid over j's pids.
2. Instances are sorted by decreasing U. The most utilized is paired with the least utilized, the second
   with the second least, and so on towards the middle.
3. A pair (donor d, receiver r) fails the threshold test if U_d < mean(U), or U_d / U_r < th_imb, or
   U_r > th_util. The round stops at the first failing pair.
4. Otherwise walk the donor's pids by decreasing N_pid and move the first whose move reduces the
   imbalance, estimated with U_d' = U_d (1 - N_p / T_d) and U_r' = U_r (1 + N_p / T_r); never a move
   with U_r' > 1. At most one move per pair, so each instance sends or receives at most one pid.
5. The next collection interval lasts as long as this round's move phase; if nothing moved, delta is
   halved, never below delta_min.

Beyond the paper, `max_moves_per_pair` (default 1, the paper's rule) lets one pair move several pids in
a round: after each chosen pid the walk goes on from the pair's estimated U_d', U_r', T_d', T_r' while a
further move still reduces the estimated imbalance, until that imbalance is below th_imb; and the donor
then goes on to the next least utilized instance, from its estimates so far, for as long as it passes
the threshold test against it (docs/load-model.md, "Rounds and move phases"; "When a round stops"). Only a
donor that fails it hands that receiver to the next donor, so one overloaded instance sheds load to every idle
one in a round. The paper's rounds last milliseconds; a micro-batch engine's last two triggers or more, so one
pid per pair and round cannot follow a hot set of a dozen pids that moves (docs/load-model.md, "Which pids
move"). Also beyond it, `donor_cost` charges a moved pid to the receiver at the donor's cost per tuple: the
paper's estimate assumes every tuple costs alike on an instance, but a hot key's tuple joins many more
partners than a cold one, while fluxjoin's instances are alike (pods of one StatefulSet). And `min_move_share`
(default 0, the paper's rule) leaves a pid where it is when it processed less than that share of the tuples of
the donor's largest pid: the paper's walk moves any pid that reduces the imbalance at all, so a donor whose
load is in a few hot pids (some of them on their way to it) gives away cold pid after cold pid, each worth a
few thousandths of its time (docs/load-model.md, "Which pids move"). Last, a pair moves nothing when moving
every pid the walk could give would still leave the donor th_imb above the receiver: the gap is then in
per-batch costs or pids in flight, which no move of the round shifts, and the walk would empty the donor a
sliver at a time (docs/load-model.md, "When a round stops"). With no per-batch cost and nothing in flight this
never happens: moving every pid leaves U_d' = 0.

Where the text is not precise, this module chooses as follows:

- *Imbalance* is the pair's utilization ratio max(U) / min(U): the paper calls the ratio "(i.e.
  imbalance)" in the threshold test. A move reduces it if the estimated ratio after the move is strictly
  smaller than before. A ratio with a zero denominator is infinite (0 / 0 counts as balanced, 1).
- Threshold comparisons are strict as written ("less than", "above"): U_d equal to the mean, a ratio
  equal to th_imb and U_r equal to th_util all pass.
- A pair that passes the threshold test but has no pid whose move reduces the imbalance (all too big,
  all pushing U_r' above 1, all in flight) does not stop the round: only a threshold failure does.
  Because the pairs are sorted, the three tests are monotone along them (later donors are less utilized,
  later receivers more), so after the first failure no later pair could pass anyway.
- A pid refused because U_r' > 1 is skipped and the walk goes on: a smaller pid may still fit.
- U is `InstanceStats.load`: the instance's demand when the observer measured it (the share of its
  time its pids' arrival rates need), else its busy fraction. The two agree while an instance keeps
  up; a busy fraction stops at 1, so an instance given twice what it can process would look barely
  busier than an idle one whose fixed per-batch cost fills half its time (measured: 0.85 against
  0.65), and Flux would move one or two pids where the demand needs several (docs/load-model.md, "Which pids
  move"; "Arrival rates").
- A receiver's busy fraction, the paper's U, is held to th_util too: one above it takes nothing and
  the next least utilized instance takes its turn, without stopping the round. Demand leaves out a
  backlog and the tail of a parallel track, so an instance that has just shed pids and is still
  reading what it owes reads as half loaded while busy all the time, and a pid sent there waits
  behind that backlog (docs/load-model.md, "Thresholds and the estimate after a move").
- The estimates scale only the part of U that grows with the tuples. A micro-batch costs a fixed
  amount whatever its input (`InstanceStats.fixed_busy`, estimated by the observer, docs/load-model.md, "Busy
  fraction and fixed cost"); the paper's operator has no such cost, and charging it per tuple makes a lightly
  loaded receiver look overloaded by any hot pid. With fixed_busy = 0 the estimates are the paper's.
- T_r = 0 or U_r = 0: the paper's estimate scales the receiver's own cost per tuple, U_r / T_r, which is
  then unknown (0 / 0) or claims the pid would cost nothing. In that case the pid is assumed to cost the
  receiver what it cost the donor: U_r' = U_r + U_d N_p / T_d. A donor with T_d = 0 has nothing to move.
- Pids with N_p = 0 never move: they change no estimate, so they cannot reduce the imbalance.
- T_j sums N_pid over the pids the assignment gives to j, in-flight pids included (their tuples were
  processed there); pids in `Snapshot.moves_in_flight` are never chosen.
- Only live instances (those in `Snapshot.instances`) take part; with an odd count the middle instance
  is unpaired. Ties are broken by instance id and by pid, so the round is deterministic.
- The move phase's duration is known only after the moves finished, so a decision with moves returns
  next_interval_s = None and the caller (`controller.rounds.PolicyRounds`) starts the next interval
  when they have: as long as the phase, at least delta_min (the paper's minimum is on the collection
  phase, whatever set it). Without `phase_interval` the next round comes delta_min after this one,
  whether the moves have been released or not (docs/load-model.md, "Rounds and move phases").
  A decision without moves returns max(interval_s / 2, delta_min_s), interval_s being the delta the
  snapshot's statistics were collected over.
- Defaults: th_imb = 1.2, th_util = 0.9 as in the paper's experiments. delta_min_s = 0.25 s, the value at
  which the paper's skewed, unloaded run stopped thrashing (10 ms, its first setting, thrashed). The
  paper gives no first delta; delta_s = 1 s. Statistics here come from micro-batches, so a deployment
  should keep delta_min_s at a few trigger intervals or more.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from controller.assignment import HandoffMode, Move
from controller.policies.base import Decision, InstanceStats, Snapshot, no_change

_REFUSALS_SHOWN = 4
"""A reason names this many refused pids at most."""


@dataclass(frozen=True, slots=True, kw_only=True)
class FluxParams:
    """Thresholds of the Flux round (see the module docstring for where each default comes from)."""

    th_imb: float = 1.2
    th_util: float = 0.9
    delta_s: float = 1.0
    """The first round's collection interval; later rounds carry theirs in `Snapshot.interval_s`."""
    delta_min_s: float = 0.25
    max_moves_per_pair: int = 1
    """Pids one (donor, receiver) pair may move in a round; 1 is the paper's rule (docs/load-model.md, "Which
    pids move"). With more, a donor its receiver could not balance also pairs with the next receiver
    (docs/load-model.md, "Rounds and move phases")."""
    donor_cost: bool = False
    """Charge a moved pid to the receiver at the donor's cost per tuple, not the receiver's own (the
    paper's). Right when instances are alike and tuples are not: a hot key's tuple joins many partners
    (docs/load-model.md, "Which pids move")."""
    min_move_share: float = 0.0
    """A pid moves only if it processed at least this share of the tuples (N_pid) of the donor's largest
    pid, in flight or not; 0 is the paper's rule, any pid that reduces the imbalance. Relative, so that
    it tells hot pids from cold ones at any rate and on any machine (docs/load-model.md, "Which pids
    move")."""
    phase_interval: bool = True
    """The collection interval after a move phase lasts as long as the phase (the paper's rule: the
    statistics of a phase are the moves' as much as the load's). False: delta_min after the round,
    without waiting for the releases, for loads the moves do not distort, as fluxjoin's observer
    measures them (docs/load-model.md, "Arrival rates"; "Rounds and move phases")."""
    mode: HandoffMode = HandoffMode.TRANSFER

    def __post_init__(self) -> None:
        if self.th_imb < 1.0:
            raise ValueError(f"th_imb must be >= 1, got {self.th_imb}")
        if not 0.0 < self.th_util <= 1.0:
            raise ValueError(f"th_util must be in (0, 1], got {self.th_util}")
        if not 0.0 < self.delta_min_s <= self.delta_s:
            raise ValueError(f"need 0 < delta_min_s <= delta_s, got {self.delta_min_s}, {self.delta_s}")
        if self.max_moves_per_pair < 1:
            raise ValueError(f"max_moves_per_pair must be >= 1, got {self.max_moves_per_pair}")
        if not 0.0 <= self.min_move_share <= 1.0:
            raise ValueError(f"min_move_share must be in [0, 1], got {self.min_move_share}")


def imbalance(u_a: float, u_b: float) -> float:
    """Utilization ratio of two instances, larger over smaller (inf against an idle one, 1 if both idle)."""
    high, low = max(u_a, u_b), min(u_a, u_b)
    if low > 0.0:
        return high / low
    return math.inf if high > 0.0 else 1.0


def estimate_after_move(
    u_d: float,
    t_d: int,
    u_r: float,
    t_r: int,
    n_p: int,
    f_d: float = 0.0,
    f_r: float = 0.0,
    donor_cost: bool = False,
) -> tuple[float, float]:
    """(U_d', U_r') if a pid that processed n_p tuples moves from the donor to the receiver.

    The paper's U_d (1 - N_p / T_d) and U_r (1 + N_p / T_r), applied to the part of each U that scales
    with the tuples: f_d and f_r are the parts a micro-batch costs whatever its input, which stay put
    (f_d + (U_d - f_d) (1 - N_p / T_d) and f_r + (U_r - f_r) (1 + N_p / T_r)). Charged per tuple, a
    lightly loaded receiver's fixed cost would make any hot pid look like an overload. With f = 0 this
    is the paper's estimate. When the receiver's cost per tuple is unknown (T_r = 0 or U_r = f_r) the
    pid is charged at the donor's, U_r + (U_d - f_d) N_p / T_d; with `donor_cost` it always is.
    """
    if t_d <= 0 or not 0 <= n_p <= t_d:
        raise ValueError(f"need 0 <= n_p <= t_d and t_d > 0, got n_p={n_p}, t_d={t_d}")
    u_d_after = f_d + (u_d - f_d) * (1.0 - n_p / t_d)
    receiver_cost_known = t_r > 0 and u_r > f_r
    if receiver_cost_known and not donor_cost:
        return u_d_after, f_r + (u_r - f_r) * (1.0 + n_p / t_r)
    return u_d_after, u_r + (u_d - f_d) * n_p / t_d


def interval_without_moves(interval_s: float, params: FluxParams) -> float:
    """The next collection interval after a round that moved nothing: half of it, at least delta_min."""
    return max(interval_s / 2.0, params.delta_min_s)


def threshold_failure(u_d: float, u_r: float, mean_u: float, params: FluxParams) -> str:
    """Why a pair with these utilizations fails the paper's threshold test, or "" if it passes."""
    if u_d < mean_u:
        return f"U_d {u_d:.3f} < mean U {mean_u:.3f}"
    ratio = imbalance(u_d, u_r)
    if ratio < params.th_imb:
        return f"U_d/U_r {ratio:.3f} < th_imb {params.th_imb}"
    if u_r > params.th_util:
        return f"U_r {u_r:.3f} > th_util {params.th_util}"
    return ""


@dataclass(frozen=True, slots=True)
class _Walk:
    """A pair's walk over the donor's pids: what it chose, why, and the donor's estimates after it."""

    moves: list[Move]
    note: str
    u_d: float
    t_d: int
    spent: bool
    """The donor has nothing left to give, nothing worth a move (`min_move_share`), or nothing whose
    move could close its gap: it gives no further receiver anything this round."""


class FluxPolicy:
    """The Flux load-balancing round; see the module docstring."""

    name = "flux"

    def default_params(self) -> FluxParams:
        return FluxParams()

    def decide(self, snapshot: Snapshot, params: FluxParams) -> Decision:
        """One round: at most max_moves_per_pair moves per (donor, receiver) pair, stopping at the first
        failing pair. With several moves per pair, a donor goes on to the next least utilized instance,
        from its estimates after the moves chosen so far, until it fails the threshold test against
        one; that receiver is then the next donor's."""
        calm = interval_without_moves(snapshot.interval_s, params)
        ranked = sorted(snapshot.instances, key=lambda s: (-s.load, s.instance))
        if len(ranked) < 2:
            return no_change("flux: fewer than two live instances", calm)
        mean_u = sum(s.load for s in ranked) / len(ranked)
        moves: list[Move] = []
        notes: list[str] = []
        d, r = 0, len(ranked) - 1
        u_d, t_d = ranked[0].load, snapshot.tuples_on(ranked[0].instance)
        going_on = False  # the donor has been paired this round and goes on from its estimates
        balanced = False
        while d < r:
            donor, receiver = ranked[d], ranked[r]
            if receiver.busy_fraction > params.th_util:  # the paper's U_r test on the paper's U
                busy = receiver.busy_fraction
                notes.append(f"{receiver.instance} takes nothing: busy {busy:.3f} > th_util")
                r -= 1
                continue
            pair = f"{donor.instance}->{receiver.instance}"
            failure = threshold_failure(u_d, receiver.load, mean_u, params)
            if failure and going_on:  # the donor is done; the next one is tested against this receiver
                notes.append(f"{donor.instance} done at {pair}: {failure}")
                d += 1
                u_d, t_d, going_on = ranked[d].load, snapshot.tuples_on(ranked[d].instance), False
                continue
            if failure:
                # The first pair, the most and the least utilized instance, within th_imb of each other:
                # balanced by the policy's own test (a first pair whose receiver is too busy is not).
                balanced = not notes and imbalance(u_d, receiver.load) < params.th_imb
                notes.append(f"stopped at {pair}: {failure}")
                break
            walk = self._pick(snapshot, donor, receiver, params, u_d, t_d, {m.pid for m in moves})
            notes.append(f"{pair}: {walk.note}")
            moves.extend(walk.moves)
            r -= 1
            if walk.spent or params.max_moves_per_pair == 1:
                d += 1
                u_d, t_d, going_on = ranked[d].load, snapshot.tuples_on(ranked[d].instance), False
            else:
                u_d, t_d, going_on = walk.u_d, walk.t_d, True
        reason = "flux: " + "; ".join(notes)
        if not moves:
            return no_change(reason, calm, balanced)
        return Decision(tuple(moves), reason, None)

    def _pick(
        self,
        snapshot: Snapshot,
        donor: InstanceStats,
        receiver: InstanceStats,
        params: FluxParams,
        u_d: float,
        t_d: int,
        taken: set[int],
    ) -> _Walk:
        """The donor's pids to move, walked by N_pid descending (then pid) from the donor's estimated
        U_d and T_d: each one whose move reduces the pair's estimated imbalance, up to
        max_moves_per_pair, the estimates carried from move to move. `taken` are the pids chosen for
        earlier receivers this round (already out of T_d)."""
        t_r, u_r = snapshot.tuples_on(receiver.instance), receiver.load
        if t_d == 0:
            return _Walk([], "donor processed no tuples", u_d, t_d, spent=True)
        by_tuples = sorted(
            snapshot.assignment.pids_of(donor.instance), key=lambda p: (-snapshot.tuples_of(p), p)
        )
        smallest_move = max(params.min_move_share * snapshot.tuples_of(by_tuples[0]), 1)
        refused = [
            f"pid {p} in flight"
            for p in by_tuples
            if p in snapshot.moves_in_flight and snapshot.tuples_of(p) >= smallest_move
        ]
        candidates = [  # by N_pid descending, so the pids worth a move come first
            p
            for p in by_tuples
            if snapshot.tuples_of(p) > 0 and p not in snapshot.moves_in_flight and p not in taken
        ]
        movable = [p for p in candidates if snapshot.tuples_of(p) >= smallest_move]
        if movable:
            n_movable = sum(snapshot.tuples_of(p) for p in movable)
            u_d_all, u_r_all = estimate_after_move(
                u_d, t_d, u_r, t_r, n_movable, donor.fixed_busy, receiver.fixed_busy, params.donor_cost
            )
            if u_d_all > u_r_all and imbalance(u_d_all, u_r_all) >= params.th_imb:
                note = (
                    f"moving all {len(movable)} pids it could give leaves U {u_d:.3f}->{u_d_all:.3f}, "
                    f"{u_r:.3f}->{u_r_all:.3f}: the gap is in per-batch costs and pids in flight"
                )
                return _Walk([], note, u_d, t_d, spent=True)
        chosen: list[str] = []
        moves: list[Move] = []
        spent = False
        too_small = ""
        for pid in movable:
            if len(moves) == params.max_moves_per_pair:
                break
            n_p = snapshot.tuples_of(pid)
            u_d_after, u_r_after = estimate_after_move(
                u_d, t_d, u_r, t_r, n_p, donor.fixed_busy, receiver.fixed_busy, params.donor_cost
            )
            if u_r_after > 1.0:
                refused.append(f"pid {pid} U_r' {u_r_after:.3f} > 1")
                continue
            before, after = imbalance(u_d, u_r), imbalance(u_d_after, u_r_after)
            if after >= before:
                refused.append(f"pid {pid} imbalance {before:.3f}->{after:.3f}")
                continue
            moves.append(Move(pid, donor.instance, receiver.instance, params.mode))
            chosen.append(f"pid {pid} (U {u_d:.3f}->{u_d_after:.3f}, {u_r:.3f}->{u_r_after:.3f})")
            u_d, u_r, t_d, t_r = u_d_after, u_r_after, t_d - n_p, t_r + n_p
            if t_d == 0:
                spent = True
                break
            if after < params.th_imb:  # balanced by the policy's own test: the next receiver's turn
                break
        else:
            if len(movable) < len(candidates):  # every pid worth a move was walked; the rest stay
                kept = candidates[len(movable)]
                too_small = f"; kept pid {kept} and smaller: N_pid {snapshot.tuples_of(kept)}"
                too_small += f" < {smallest_move:.0f} (min_move_share)"
                spent = True
        if not moves:
            note = f"no pid reduces the imbalance ({_listing(refused) or 'no candidate pids'}){too_small}"
            return _Walk([], note, u_d, t_d, spent=spent or t_d == 0)
        passed = f"; passed over {_listing(refused)}" if refused else ""
        return _Walk(moves, f"move {', '.join(chosen)}{passed}{too_small}", u_d, t_d, spent)


def _listing(refusals: list[str]) -> str:
    """The first few refusals, and how many more; a donor may own a hundred pids."""
    shown = refusals[:_REFUSALS_SHOWN]
    if len(refusals) > len(shown):
        shown.append(f"{len(refusals) - len(shown)} more")
    return ", ".join(shown)
