"""Key distributions: which join key each generated tuple carries.

Pure: no I/O, no clock reads; all randomness is seeded.

The *structure* of a distribution (which keys are hot, the zipf rank order, where the hot set goes in
each epoch) depends on the seed alone, so every stream of a pipeline shares the same hot keys — skew in
a join only matters if the streams agree on it. The *draws* come from a per-stream random stream.

Each tuple consumes exactly one uniform double from that stream, and a double draw does not depend on
how many are drawn per call, so drawing keys chunk by chunk gives the same keys as drawing them at
once: the generator's output does not depend on how it slices time.

Hot keys are chosen through a seeded permutation of [0, count) rather than being the smallest key
values, so they are spread over pids instead of depending on how the pid hash treats small integers.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

from pipeline.config import EightyTwentyKeys, HotPidsKeys, HotSetKeys, UniformKeys, ZipfKeys
from pipeline.partitioning import pids_of

KeyDistribution = UniformKeys | ZipfKeys | EightyTwentyKeys | HotSetKeys | HotPidsKeys
I64 = npt.NDArray[np.int64]

# spawn_key purposes under a pipeline seed: structure is shared by all streams, draws are per stream.
_STRUCTURE = 0x6B657973  # "keys"
_DRAWS = 1


def _seed_sequence(seed: int, *spawn_key: int) -> np.random.SeedSequence:
    """A SeedSequence for (seed, *spawn_key); seeds may be any Python int, negative included."""
    return np.random.SeedSequence(seed % 2**64, spawn_key=spawn_key)


def stream_rng(seed: int, stream: int, purpose: int) -> np.random.Generator:
    """The random stream of one purpose (arrivals, keys, ...) of stream number `stream`."""
    return np.random.default_rng(_seed_sequence(seed, stream, purpose))


class KeySampler:
    """Draws keys in [0, count) for one stream; see the module docstring for what is shared."""

    def __init__(self, dist: KeyDistribution, seed: int, stream: int = 0, partitions: int = 64) -> None:
        self.dist = dist
        self.count = dist.count
        self._rng = stream_rng(seed, stream, _DRAWS)
        structure = np.random.default_rng(_seed_sequence(seed, _STRUCTURE))
        self._perm: I64 = np.empty(0, dtype=np.int64)
        self._cdf: npt.NDArray[np.float64] = np.empty(0, dtype=np.float64)
        self._hot_n = 0
        self._offset0 = 0
        self._step = 0
        self._keys_by_pid: I64 = np.empty(0, dtype=np.int64)
        self._pid_sizes: I64 = np.empty(0, dtype=np.int64)
        self._pid_starts: I64 = np.empty(0, dtype=np.int64)
        if isinstance(dist, UniformKeys):
            return
        if isinstance(dist, HotPidsKeys):
            self._init_hot_pids(dist, structure, partitions)
            return
        self._perm = structure.permutation(self.count).astype(np.int64)
        if isinstance(dist, ZipfKeys):
            weights = np.arange(1, self.count + 1, dtype=np.float64) ** -dist.s
            cdf = np.cumsum(weights)
            cdf /= cdf[-1]
            cdf[-1] = 1.0
            self._cdf = cdf
        elif isinstance(dist, EightyTwentyKeys):
            self._hot_n = self.count // 5
        else:
            self._hot_n = min(max(1, round(dist.hot_fraction * self.count)), self.count - 1)
            self._offset0 = int(structure.integers(self.count))
            # Consecutive hot sets are disjoint when the key space allows it (a step of at least hot_n
            # both ways round the permuted circle); otherwise they are as far apart as possible.
            if self.count >= 2 * self._hot_n:
                self._step = int(structure.integers(self._hot_n, self.count - self._hot_n + 1))
            else:
                self._step = max(1, self.count // 2)

    def _init_hot_pids(self, dist: HotPidsKeys, structure: np.random.Generator, partitions: int) -> None:
        """Keys grouped by pid, and the pids in the layout's order: epoch e's hot set is the next hot_n
        of that order, round the circle, so consecutive hot sets are disjoint when P allows it."""
        all_keys = np.arange(self.count, dtype=np.int64)
        pids = pids_of(all_keys, partitions)
        order = np.argsort(pids, kind="stable")
        self._keys_by_pid = all_keys[order]
        sizes = np.bincount(pids, minlength=partitions)
        if (sizes == 0).any():
            raise ValueError(
                f"hot_pids needs keys in every pid: count {self.count} is too small for P={partitions}"
            )
        self._pid_sizes = sizes.astype(np.int64)
        self._pid_starts = np.concatenate(([0], np.cumsum(sizes)[:-1])).astype(np.int64)
        order = np.arange(partitions) if dist.layout == "contiguous" else structure.permutation(partitions)
        self._perm = order.astype(np.int64)
        self._hot_n = min(max(1, round(dist.hot_fraction * partitions)), partitions - 1)

    def _sample_hot_pids(self, u: npt.NDArray[np.float64], t_s: npt.NDArray[np.float64]) -> I64:
        """One uniform per tuple picks hot or cold, the pid within that set and the key within the pid;
        before `even_s`, the pid among all of them."""
        assert isinstance(self.dist, HotPidsKeys)
        share, p, hot_n = self.dist.hot_share, len(self._perm), self._hot_n
        even = t_s < self.dist.even_s
        hot = (u < share) & ~even
        with np.errstate(divide="ignore", invalid="ignore"):
            skewed = np.where(hot, u / share * hot_n, (u - share) / (1 - share) * (p - hot_n))
            x = np.where(even, u * p, skewed)
        slot = np.minimum(x.astype(np.int64), np.where(even, p - 1, np.where(hot, hot_n - 1, p - hot_n - 1)))
        frac = np.clip(x - slot, 0.0, np.nextafter(1.0, 0.0))
        position = np.where(hot | even, slot, hot_n + slot)
        epochs = self._epochs(t_s)
        pid = self._perm[(position + epochs * hot_n) % p]
        index = self._pid_starts[pid] + (frac * self._pid_sizes[pid]).astype(np.int64)
        return self._keys_by_pid[index]

    def _epochs(self, t_s: npt.NDArray[np.float64]) -> I64:
        assert isinstance(self.dist, HotPidsKeys)
        skewed_s = np.maximum(t_s - self.dist.even_s, 0.0)
        return np.floor(skewed_s / self.dist.move_every_s).astype(np.int64)

    def hot_pids(self, t_s: float) -> I64:
        """The pids hot at `t_s` (hot_pids only; none before `even_s`)."""
        if not isinstance(self.dist, HotPidsKeys) or t_s < self.dist.even_s:
            return np.empty(0, dtype=np.int64)
        epoch = int(self._epochs(np.array([t_s], dtype=np.float64))[0])
        return np.sort(self._perm[(np.arange(self._hot_n) + epoch * self._hot_n) % len(self._perm)])

    def sample(self, n: int, t_s: float | npt.NDArray[np.float64] = 0.0) -> I64:
        """`n` keys; `t_s` (seconds since start, a scalar or one time per key) matters for hot_set only."""
        u = self._rng.random(n)
        dist = self.dist
        if isinstance(dist, UniformKeys):
            return np.minimum((u * self.count).astype(np.int64), self.count - 1)
        if isinstance(dist, ZipfKeys):
            ranks = np.minimum(np.searchsorted(self._cdf, u, side="right"), self.count - 1)
            return self._perm[ranks]
        if isinstance(dist, EightyTwentyKeys):
            return self._perm[self._split(u, 0.8, self._hot_n)]
        if isinstance(dist, HotPidsKeys):
            return self._sample_hot_pids(u, np.broadcast_to(np.asarray(t_s, dtype=np.float64), (n,)))
        offsets = self._offsets(np.broadcast_to(np.asarray(t_s, dtype=np.float64), (n,)))
        return self._perm[(self._split(u, dist.hot_share, self._hot_n) + offsets) % self.count]

    def _split(self, u: npt.NDArray[np.float64], share: float, hot_n: int) -> I64:
        """Positions in the permuted order: u < share maps uniformly onto [0, hot_n), the rest onto
        [hot_n, count). One uniform does both the choice and the draw."""
        cold_n = self.count - hot_n
        hot = u < share
        with np.errstate(divide="ignore", invalid="ignore"):
            hot_pos = np.minimum((u / share * hot_n).astype(np.int64), hot_n - 1) if share > 0 else 0
            cold_pos = (
                hot_n + np.minimum(((u - share) / (1 - share) * cold_n).astype(np.int64), cold_n - 1)
                if share < 1
                else 0
            )
        return np.asarray(np.where(hot, hot_pos, cold_pos), dtype=np.int64)

    def _offsets(self, t_s: npt.NDArray[np.float64]) -> I64:
        assert isinstance(self.dist, HotSetKeys)
        epochs = np.floor(np.maximum(t_s, 0.0) / self.dist.move_every_s).astype(np.int64)
        return (self._offset0 + epochs % self.count * self._step) % self.count

    def hot_keys(self, t_s: float) -> I64:
        """The keys hot at `t_s` (hot_set), the fixed hot fifth (eighty_twenty); empty otherwise."""
        if isinstance(self.dist, HotSetKeys):
            offset = int(self._offsets(np.array([t_s]))[0])
            return np.sort(self._perm[(offset + np.arange(self._hot_n)) % self.count])
        if isinstance(self.dist, EightyTwentyKeys):
            return np.sort(self._perm[: self._hot_n])
        return np.empty(0, dtype=np.int64)
