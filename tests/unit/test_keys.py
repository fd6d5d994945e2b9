"""Key distributions: the shapes the experiments rely on, and determinism under the seed."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from generator.keys import KeySampler
from pipeline.config import EightyTwentyKeys, HotSetKeys, UniformKeys, ZipfKeys
from pipeline.partitioning import pids_of


def test_uniform_is_flat() -> None:
    count, n = 200, 400_000
    keys = KeySampler(UniformKeys(count=count), seed=1).sample(n)
    assert keys.dtype == np.int64
    assert keys.min() >= 0
    assert keys.max() < count
    freq = np.bincount(keys, minlength=count)
    expected = n / count
    chi2 = float((((freq - expected) ** 2) / expected).sum())
    df = count - 1
    assert chi2 < df + 5 * np.sqrt(2 * df)
    assert (freq > 0).all()


@pytest.mark.parametrize("s", [0.8, 1.1, 1.5])
def test_zipf_rank_frequency_follows_s(s: float) -> None:
    count, n = 10_000, 1_000_000
    keys = KeySampler(ZipfKeys(count=count, s=s), seed=3).sample(n)
    assert keys.min() >= 0
    assert keys.max() < count
    freq = np.sort(np.bincount(keys, minlength=count))[::-1]
    ranks = np.arange(1, 31)
    slope = np.polyfit(np.log(ranks), np.log(freq[:30]), 1)[0]
    assert slope == pytest.approx(-s, abs=0.08)
    # Bounded zipf: the top key's share is exactly 1 / H(count, s).
    h = float((np.arange(1, count + 1, dtype=np.float64) ** -s).sum())
    assert freq[0] / n == pytest.approx(1 / h, rel=0.03)


def test_zipf_hot_keys_are_permuted_over_pids() -> None:
    keys = KeySampler(ZipfKeys(count=10_000, s=1.2), seed=3).sample(200_000)
    top = np.argsort(np.bincount(keys, minlength=10_000))[::-1][:16]
    assert set(top.tolist()) != set(range(16))  # not simply the smallest keys
    assert len(set(pids_of(top, 64).tolist())) >= 8  # spread over many pids


def test_eighty_twenty_share() -> None:
    count, n = 1000, 500_000
    sampler = KeySampler(EightyTwentyKeys(count=count), seed=5)
    hot = sampler.hot_keys(0.0)
    assert len(hot) == count // 5
    keys = sampler.sample(n)
    share = np.isin(keys, hot).mean()
    assert share == pytest.approx(0.8, abs=0.005)
    freq = np.bincount(keys, minlength=count)
    cold = np.setdiff1d(np.arange(count), hot)
    # Each hot key gets 0.8/200 of the draws, each cold one 0.2/800: 16 times less.
    assert freq[hot].mean() / freq[cold].mean() == pytest.approx(16.0, rel=0.05)
    assert (freq[cold] > 0).all()


def test_hot_set_share_holds_and_the_set_moves_every_epoch() -> None:
    dist = HotSetKeys(count=10_000, hot_fraction=0.05, hot_share=0.8, move_every_s=30.0)
    sampler = KeySampler(dist, seed=9)
    sets = [sampler.hot_keys(e * 30.0 + 1.0) for e in range(6)]
    assert all(len(s) == 500 for s in sets)
    for before, after in itertools.pairwise(sets):
        assert len(np.intersect1d(before, after)) == 0  # moved to a different block
    # Same epoch, same set, wherever in the epoch.
    np.testing.assert_array_equal(sampler.hot_keys(30.0), sampler.hot_keys(59.999))
    for epoch, hot in enumerate(sets[:3]):
        keys = sampler.sample(100_000, epoch * 30.0 + 10.0)
        assert np.isin(keys, hot).mean() == pytest.approx(0.8, abs=0.01)
    # A small hot set lands on other pids after a move (the point of moving it).
    small = KeySampler(
        HotSetKeys(count=10_000, hot_fraction=0.0005, hot_share=0.8, move_every_s=30.0), seed=9
    )
    assert set(pids_of(small.hot_keys(0.0), 64).tolist()) != set(pids_of(small.hot_keys(30.0), 64).tolist())


def test_hot_set_follows_per_tuple_times() -> None:
    dist = HotSetKeys(count=1000, hot_fraction=0.1, hot_share=1.0, move_every_s=1.0)
    sampler = KeySampler(dist, seed=2)
    times = np.array([0.2] * 500 + [1.5] * 500)
    keys = sampler.sample(1000, times)
    assert np.isin(keys[:500], sampler.hot_keys(0.2)).all()
    assert np.isin(keys[500:], sampler.hot_keys(1.5)).all()


@pytest.mark.parametrize("share", [0.0, 1.0])
def test_hot_set_extreme_shares(share: float) -> None:
    dist = HotSetKeys(count=100, hot_fraction=0.2, hot_share=share, move_every_s=5.0)
    sampler = KeySampler(dist, seed=4)
    keys = sampler.sample(10_000, 0.0)
    assert np.isin(keys, sampler.hot_keys(0.0)).mean() == share


def test_hot_set_larger_than_half_still_moves() -> None:
    dist = HotSetKeys(count=10, hot_fraction=0.7, hot_share=0.8, move_every_s=1.0)
    sampler = KeySampler(dist, seed=4)
    assert len(sampler.hot_keys(0.0)) == 7
    assert not np.array_equal(sampler.hot_keys(0.0), sampler.hot_keys(1.0))


@pytest.mark.parametrize(
    "dist",
    [
        UniformKeys(count=1000),
        ZipfKeys(count=1000, s=1.1),
        EightyTwentyKeys(count=1000),
        HotSetKeys(count=1000, hot_fraction=0.05, hot_share=0.8, move_every_s=1.0),
    ],
    ids=lambda d: d.kind,
)
def test_deterministic_and_independent_of_chunking(
    dist: UniformKeys | ZipfKeys | EightyTwentyKeys | HotSetKeys,
) -> None:
    times = np.linspace(0.0, 5.0, 10_000)
    whole = KeySampler(dist, seed=42, stream=1).sample(10_000, times)
    again = KeySampler(dist, seed=42, stream=1).sample(10_000, times)
    np.testing.assert_array_equal(whole, again)
    chunked_sampler = KeySampler(dist, seed=42, stream=1)
    bounds = [0, 1, 77, 2000, 2001, 9000, 10_000]
    chunked = np.concatenate(
        [chunked_sampler.sample(b - a, times[a:b]) for a, b in itertools.pairwise(bounds)]
    )
    np.testing.assert_array_equal(chunked, whole)
    other_stream = KeySampler(dist, seed=42, stream=2).sample(10_000, times)
    assert not np.array_equal(other_stream, whole)


def test_streams_share_hot_keys_seeds_change_them() -> None:
    dist = HotSetKeys(count=1000, hot_fraction=0.05, hot_share=0.8, move_every_s=1.0)
    a, b = KeySampler(dist, seed=7, stream=0), KeySampler(dist, seed=7, stream=1)
    np.testing.assert_array_equal(a.hot_keys(3.0), b.hot_keys(3.0))
    assert not np.array_equal(a.hot_keys(3.0), KeySampler(dist, seed=8).hot_keys(3.0))


def test_hot_pids_put_the_share_on_the_hot_pids_and_move_them() -> None:
    from pipeline.config import HotPidsKeys
    from pipeline.partitioning import pids_of

    dist = HotPidsKeys(count=20_000, hot_fraction=0.25, hot_share=0.8, move_every_s=10.0)
    sampler = KeySampler(dist, seed=3, stream=0, partitions=16)
    early, late = sampler.hot_pids(1.0), sampler.hot_pids(11.0)
    assert len(early) == 4 and len(late) == 4
    assert not set(early) & set(late), "consecutive hot sets are disjoint when P allows"
    keys = sampler.sample(100_000, 1.0)
    pids = pids_of(keys, 16)
    on_hot = np.isin(pids, early).mean()
    assert on_hot == pytest.approx(0.8, abs=0.01)
    counts = np.bincount(pids, minlength=16)
    cold = np.setdiff1d(np.arange(16), early)
    assert counts[cold].min() > 0.5 * counts[cold].mean(), "cold pids share the rest evenly"
    assert len(np.unique(keys[pids == early[0]])) > 500, "keys spread within a hot pid"


def test_contiguous_hot_pids_are_runs_of_neighbouring_pids() -> None:
    """Under the initial layout of contiguous ranges, a run of pids loads one or two instances."""
    from pipeline.config import HotPidsKeys
    from pipeline.partitioning import pids_of

    dist = HotPidsKeys(count=20_000, hot_fraction=0.25, hot_share=0.8, move_every_s=10.0, layout="contiguous")
    sampler = KeySampler(dist, seed=3, stream=0, partitions=16)
    assert list(sampler.hot_pids(1.0)) == [0, 1, 2, 3]
    assert list(sampler.hot_pids(11.0)) == [4, 5, 6, 7]
    pids = pids_of(sampler.sample(100_000, 11.0), 16)
    assert np.isin(pids, [4, 5, 6, 7]).mean() == pytest.approx(0.8, abs=0.01)


def test_hot_pids_are_even_until_even_s_then_the_first_hot_set_begins() -> None:
    """A warm-up spreads the input over every pid; the hot sets' clock starts when it ends."""
    from pipeline.config import HotPidsKeys
    from pipeline.partitioning import pids_of

    dist = HotPidsKeys(
        count=20_000, hot_fraction=0.25, hot_share=0.8, move_every_s=10.0, layout="contiguous", even_s=30.0
    )
    sampler = KeySampler(dist, seed=3, stream=0, partitions=16)
    assert len(sampler.hot_pids(29.0)) == 0
    assert list(sampler.hot_pids(31.0)) == [0, 1, 2, 3]
    assert list(sampler.hot_pids(41.0)) == [4, 5, 6, 7]
    counts = np.bincount(pids_of(sampler.sample(160_000, 29.0), 16), minlength=16)
    assert counts.min() > 0.9 * counts.mean() and counts.max() < 1.1 * counts.mean(), "even before even_s"
    pids = pids_of(sampler.sample(100_000, 31.0), 16)
    assert np.isin(pids, [0, 1, 2, 3]).mean() == pytest.approx(0.8, abs=0.01)


def test_hot_pids_draw_the_same_keys_in_any_chunking() -> None:
    from pipeline.config import HotPidsKeys

    dist = HotPidsKeys(count=5_000, hot_fraction=0.2, hot_share=0.8, move_every_s=1.0)
    times = np.linspace(0.0, 5.0, 3000)
    whole = KeySampler(dist, seed=5, stream=1, partitions=8).sample(3000, times)
    chunked = KeySampler(dist, seed=5, stream=1, partitions=8)
    parts = [chunked.sample(1000, times[i : i + 1000]) for i in range(0, 3000, 1000)]
    np.testing.assert_array_equal(whole, np.concatenate(parts))


def test_hot_pids_refuse_a_key_space_too_small_for_the_pids() -> None:
    from pipeline.config import ConfigError, load_config

    with pytest.raises(ConfigError, match="8 x partitions"):
        load_config(None, ["partitions=64", "generator.keys={kind: hot_pids, count: 100}"])
