"""The pid function: which mini-partition a key belongs to.

Defined once, here; the generator, the instances and the verifier all import it, so a key can never
land in two partitions. Keys are 64-bit integers; the hash is the splitmix64 finalizer, which is stable
across processes, platforms and Python versions (unlike `hash()`), and vectorizes in numpy.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)


def stable_hash(keys: npt.ArrayLike) -> npt.NDArray[np.uint64]:
    """splitmix64 finalizer of each key (as unsigned 64-bit), element-wise."""
    z = np.asarray(keys, dtype=np.int64).astype(np.uint64, copy=True)
    with np.errstate(over="ignore"):
        z ^= z >> np.uint64(30)
        z *= _M1
        z ^= z >> np.uint64(27)
        z *= _M2
        z ^= z >> np.uint64(31)
    return z


def pids_of(keys: npt.ArrayLike, partitions: int) -> npt.NDArray[np.int32]:
    """pid = stable_hash(key) mod P, for an array of keys."""
    return (stable_hash(keys) % np.uint64(partitions)).astype(np.int32)


def pid_of(key: int, partitions: int) -> int:
    """pid of a single key (the same function as `pids_of`)."""
    return int(pids_of(np.array([key], dtype=np.int64), partitions)[0])


def contiguous_ranges(partitions: int, instances: int) -> list[range]:
    """Split pids 0..P-1 into `instances` contiguous ranges whose sizes differ by at most one."""
    base, extra = divmod(partitions, instances)
    ranges, start = [], 0
    for i in range(instances):
        size = base + (1 if i < extra else 0)
        ranges.append(range(start, start + size))
        start += size
    return ranges
