"""stratum/cross_var and stratum/zero_san_frac against slow loops; the random-strata control."""

from __future__ import annotations

import pytest
import torch

from stratarl.algos import (
    cross_stratum_variance,
    shuffle_strata_within_groups,
    stratified_advantages,
    zero_san_fraction,
)


def _slow_cross_var(rewards, groups, strata):
    """(1/K) Σ_k n_k (mean_k − mean)² per group, then the plain mean over groups: loops only."""
    per_group = []
    for g in sorted(set(groups)):
        rows = [i for i in range(len(rewards)) if groups[i] == g]
        mean = sum(rewards[i] for i in rows) / len(rows)
        total = 0.0
        for k in sorted({strata[i] for i in rows}):
            cell = [rewards[i] for i in rows if strata[i] == k]
            total += len(cell) * (sum(cell) / len(cell) - mean) ** 2
        per_group.append(total / len(rows))
    return sum(per_group) / len(per_group)


def _slow_zero_san(rewards, groups, strata):
    zero = 0
    for i in range(len(rewards)):
        cell = [rewards[j] for j in range(len(rewards)) if groups[j] == groups[i] and strata[j] == strata[i]]
        zero += len(cell) == 1 or len(set(cell)) == 1
    return zero / len(rewards)


def _random_batch(seed: int, groups: int = 5, size: int = 6):
    g = torch.Generator().manual_seed(seed)
    rewards = torch.randint(0, 2, (groups * size,), generator=g).float()
    rewards[:size] = torch.rand(size, generator=g)  # one group with continuous rewards
    group_ids = torch.arange(groups).repeat_interleave(size) * 7 + 3  # non-contiguous ids
    strata = torch.randint(0, 3, (groups * size,), generator=g)
    return rewards, group_ids, strata


@pytest.mark.parametrize("seed", range(5))
def test_cross_var_matches_slow_loop_and_the_variance_identity(seed):
    rewards, groups, strata = _random_batch(seed)
    fast = cross_stratum_variance(rewards, groups, strata)
    slow = _slow_cross_var(rewards.tolist(), groups.tolist(), strata.tolist())
    torch.testing.assert_close(fast, torch.tensor(slow))
    # docs/algorithms.md: Var(R − mean R) − Var(R − mean_{B_k} R) = (1/K) Σ_k n_k (mean_k − mean)², per group.
    identity = []
    for g in groups.unique():
        r, s = rewards[groups == g].double(), strata[groups == g]
        within = torch.stack([r[i] - r[s == s[i]].mean() for i in range(len(r))])
        identity.append((r - r.mean()).var(unbiased=False) - within.var(unbiased=False))
    torch.testing.assert_close(fast.double(), torch.stack(identity).mean())


@pytest.mark.parametrize("seed", range(5))
def test_zero_san_frac_matches_slow_loop_and_the_advantages(seed):
    rewards, groups, strata = _random_batch(seed)
    fast = float(zero_san_fraction(rewards, groups, strata))
    assert fast == pytest.approx(_slow_zero_san(rewards.tolist(), groups.tolist(), strata.tolist()), abs=1e-7)
    # Every rollout counted has SAN advantage exactly 0 (alpha = 1 is pure SAN).
    san = stratified_advantages(rewards, groups, strata, alpha=1.0)
    assert float((san == 0).float().mean()) >= fast


def test_hand_case():
    # One group of 4: strata {0: [1, 1], 1: [0, 0]} -> mean 0.5, cells 1 and 0: (2·0.25 + 2·0.25) / 4 = 0.25.
    # Both cells are uniform, so every SAN advantage is 0.
    rewards, groups, strata = (
        torch.tensor([1.0, 1.0, 0.0, 0.0]),
        torch.zeros(4, dtype=torch.long),
        torch.tensor([0, 0, 1, 1]),
    )
    torch.testing.assert_close(cross_stratum_variance(rewards, groups, strata), torch.tensor(0.25))
    assert float(zero_san_fraction(rewards, groups, strata)) == 1.0
    # Mixing the strata removes the structural part: cells [1, 0] and [1, 0] have the group's mean.
    mixed = torch.tensor([0, 1, 0, 1])
    torch.testing.assert_close(cross_stratum_variance(rewards, groups, mixed), torch.tensor(0.0))
    assert float(zero_san_fraction(rewards, groups, mixed)) == 0.0


def test_edge_cases_are_zero_not_nan():
    empty = torch.zeros(0)
    ids = torch.zeros(0, dtype=torch.long)
    assert float(cross_stratum_variance(empty, ids, ids)) == 0.0 and float(zero_san_fraction(empty, ids, ids)) == 0.0
    one = torch.tensor([1.0])
    single = torch.zeros(1, dtype=torch.long)
    assert float(cross_stratum_variance(one, single, single)) == 0.0
    assert float(zero_san_fraction(one, single, single)) == 1.0  # a stratum of one rollout


def test_random_strata_keep_sizes_per_group_and_are_deterministic():
    _, groups, strata = _random_batch(0, groups=8, size=8)
    a = shuffle_strata_within_groups(strata, groups, torch.Generator().manual_seed(1))
    b = shuffle_strata_within_groups(strata, groups, torch.Generator().manual_seed(1))
    c = shuffle_strata_within_groups(strata, groups, torch.Generator().manual_seed(2))
    assert torch.equal(a, b)
    assert not torch.equal(a, c)
    assert not torch.equal(a, strata)
    for g in groups.unique():
        rows = groups == g
        assert sorted(a[rows].tolist()) == sorted(strata[rows].tolist())
    assert (
        a.dtype == strata.dtype and strata.tolist() == _random_batch(0, groups=8, size=8)[2].tolist()
    )  # input untouched


def test_random_strata_break_the_link_between_structure_and_reward():
    # Reward is fully determined by the stratum (searched -> right): the real strata carry all the variance,
    # random ones of the same sizes carry much less on average.
    groups = torch.arange(200).repeat_interleave(8)
    strata = torch.tensor([0, 0, 0, 0, 1, 1, 1, 1]).repeat(200)
    rewards = strata.float()
    real = float(cross_stratum_variance(rewards, groups, strata))
    shuffled = shuffle_strata_within_groups(strata, groups, torch.Generator().manual_seed(0))
    assert real == pytest.approx(0.25)
    assert float(cross_stratum_variance(rewards, groups, shuffled)) < 0.1


def test_random_strata_check_inputs():
    with pytest.raises(ValueError, match="group_ids"):
        shuffle_strata_within_groups(torch.tensor([0, 1]), torch.tensor([0]), torch.Generator())
    with pytest.raises(TypeError, match="integer"):
        shuffle_strata_within_groups(torch.tensor([0.0, 1.0]), torch.tensor([0, 0]), torch.Generator())


# ---- live_strata_group_fraction: the Paper A admission metric (stratum/live_groups_frac) ----

from stratarl.algos import live_strata_group_fraction  # noqa: E402


def _slow_live_groups(rewards, groups, strata, low=0.05, high=0.95):
    """Loops only: per group, count strata whose mean reward is in [low, high]; share of groups with >= 2."""
    live_groups = 0
    for g in sorted(set(groups)):
        rows = [i for i in range(len(rewards)) if groups[i] == g]
        live = 0
        for k in sorted({strata[i] for i in rows}):
            cell = [rewards[i] for i in rows if strata[i] == k]
            live += low <= sum(cell) / len(cell) <= high
        live_groups += live >= 2
    return live_groups / len(set(groups))


def test_live_groups_hand_derived():
    # group 0: stratum 1 mean 0.5, stratum 2 mean 0.5 -> live; group 1: stratum 1 all 0, stratum 2 mean 0.5 -> not;
    # group 2: one stratum, mean 0.5 -> not (one live stratum only); group 3: two one-rollout strata (0, 1) -> not.
    rewards = torch.tensor([1.0, 0.0, 1.0, 0.0, 0.0, 0.0, 1.0, 0.0, 1.0, 0.0, 1.0, 0.0, 0.0, 1.0])
    groups = torch.tensor([0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3])
    strata = torch.tensor([1, 1, 2, 2, 1, 1, 2, 2, 2, 2, 2, 2, 1, 2])
    assert float(live_strata_group_fraction(rewards, groups, strata)) == pytest.approx(0.25)
    # the bounds are inclusive and adjustable: with low = 0 the all-0 stratum of group 1 is live too
    assert float(live_strata_group_fraction(rewards, groups, strata, low=0.0)) == pytest.approx(0.5)


@pytest.mark.parametrize("seed", range(5))
def test_live_groups_matches_slow_loop(seed):
    rewards, groups, strata = _random_batch(seed, groups=7, size=8)
    fast = float(live_strata_group_fraction(rewards, groups, strata))
    assert fast == pytest.approx(_slow_live_groups(rewards.tolist(), groups.tolist(), strata.tolist()))
    assert float(live_strata_group_fraction(rewards, groups, strata, low=0.2, high=0.7)) == pytest.approx(
        _slow_live_groups(rewards.tolist(), groups.tolist(), strata.tolist(), 0.2, 0.7)
    )


@pytest.mark.parametrize("seed", range(3))
def test_live_groups_invariances(seed):
    rewards, groups, strata = _random_batch(seed, groups=6, size=8)
    value = float(live_strata_group_fraction(rewards, groups, strata))
    perm = torch.randperm(rewards.numel(), generator=torch.Generator().manual_seed(seed))
    # order of rollouts, the ids' labels, and the reward flip r -> 1 - r (symmetric bounds) leave it unchanged
    assert float(live_strata_group_fraction(rewards[perm], groups[perm], strata[perm])) == pytest.approx(value)
    assert float(live_strata_group_fraction(rewards, groups * 11 + 5, strata + 40)) == pytest.approx(value)
    assert float(live_strata_group_fraction(1 - rewards, groups, strata)) == pytest.approx(value)
    # one stratum per group: never two live strata
    assert float(live_strata_group_fraction(rewards, groups, torch.zeros_like(strata))) == 0.0


def test_live_groups_edge_cases():
    empty, ids = torch.zeros(0), torch.zeros(0, dtype=torch.long)
    assert float(live_strata_group_fraction(empty, ids, ids)) == 0.0
    with pytest.raises(ValueError, match="low <= high"):
        live_strata_group_fraction(
            torch.ones(2), torch.zeros(2, dtype=torch.long), torch.zeros(2, dtype=torch.long), low=0.9, high=0.1
        )
    with pytest.raises(ValueError):
        live_strata_group_fraction(torch.ones(3), torch.zeros(2, dtype=torch.long), torch.zeros(3, dtype=torch.long))
