"""GRPO, Stratified GRPO and GAE: hand-derived cases, loop oracles, the facts of docs/algorithms.md."""

from __future__ import annotations

import math

import pytest
import torch
from algos_oracles import gae_loop, grpo_loop, stratified_loop
from torch.testing import assert_close

from stratarl.algos import (
    broadcast_to_tokens,
    cross_stratum_bias,
    gae_advantages,
    grpo_advantages,
    outcome_to_token_rewards,
    stratified_advantages,
)


def random_batch(seed, groups=6, group_size=8, num_strata=3, binary=False):
    gen = torch.Generator().manual_seed(seed)
    size = groups * group_size
    rewards = (torch.rand(size, generator=gen) < 0.5).float() if binary else torch.randn(size, generator=gen)
    # Non-contiguous, unsorted group ids on purpose.
    group_ids = (torch.arange(groups).repeat_interleave(group_size) * 7 + 100)[torch.randperm(size, generator=gen)]
    strata_ids = torch.randint(0, num_strata, (size,), generator=gen) * 5 - 3
    return rewards, group_ids, strata_ids


class TestGrpoAdvantages:
    def test_hand_derived(self):
        # Group A: R = [1, 0, 0, 1, 1]; mean = 0.6; Bessel var = (3·0.16 + 2·0.36)/4 = 0.3, std = √0.3.
        # A = (R − 0.6)/(√0.3 + 1e-6): 0.4/0.5477 = 0.7303, −0.6/0.5477 = −1.0954.
        # Group B: R = [2, 4]; mean 3, std (ddof 1) = √2; A = ±1/√2.
        rewards = torch.tensor([1.0, 0, 0, 1, 1, 2, 4])
        groups = torch.tensor([5, 5, 5, 5, 5, -1, -1])
        s = math.sqrt(0.3) + 1e-6
        b = 2**0.5 + 1e-6
        expected = torch.tensor([0.4 / s, -0.6 / s, -0.6 / s, 0.4 / s, 0.4 / s, -1 / b, 1 / b])
        assert_close(grpo_advantages(rewards, groups), expected)

    def test_population_std_and_mean_only(self):
        # R = [0, 2]: mean 1, population std 1 → A = ±1/(1+ε); mean-only (Dr.GRPO) → ±1.
        rewards, groups = torch.tensor([0.0, 2.0]), torch.tensor([0, 0])
        assert_close(grpo_advantages(rewards, groups, std_ddof=0), torch.tensor([-1.0, 1.0]) / (1 + 1e-6))
        assert_close(grpo_advantages(rewards, groups, scale_by_std=False), torch.tensor([-1.0, 1.0]))

    @pytest.mark.parametrize("seed", [0, 1, 2])
    @pytest.mark.parametrize("binary", [False, True])
    def test_matches_loop_oracle(self, seed, binary):
        rewards, groups, _ = random_batch(seed, binary=binary)
        for ddof in (0, 1):
            assert_close(grpo_advantages(rewards, groups, std_ddof=ddof), grpo_loop(rewards, groups, std_ddof=ddof))
        assert_close(
            grpo_advantages(rewards, groups, scale_by_std=False), grpo_loop(rewards, groups, scale_by_std=False)
        )

    def test_size_one_groups_and_all_equal_give_zero(self):
        rewards = torch.tensor([0.7, 0.1, 0.1, 0.1, 3.0])
        groups = torch.tensor([0, 1, 1, 1, 2])  # two singletons, one all-equal group (0.1 is inexact in binary)
        out = grpo_advantages(rewards, groups)
        assert torch.equal(out, torch.zeros(5))

    def test_empty_batch(self):
        out = grpo_advantages(torch.zeros(0), torch.zeros(0, dtype=torch.long))
        assert out.shape == (0,)

    def test_integer_rewards_and_no_mutation(self):
        rewards = torch.tensor([1, 0, 1, 1])
        groups = torch.tensor([3, 3, 3, 3])
        before = rewards.clone()
        out = grpo_advantages(rewards, groups)
        assert out.dtype == torch.float32 and torch.equal(rewards, before)
        assert_close(out.sum(), torch.tensor(0.0))

    @pytest.mark.parametrize(
        "kwargs, message",
        [
            ({"rewards": torch.zeros(3, 1)}, "rewards must be 1-D"),
            ({"group_ids": torch.zeros(2, dtype=torch.long)}, "group_ids has length 2"),
            ({"group_ids": torch.zeros(3)}, "group_ids must be an integer tensor"),
            ({"rewards": torch.tensor([0.0, float("nan"), 1.0])}, "NaN or inf"),
            ({"std_ddof": 2}, "std_ddof must be 0"),
        ],
    )
    def test_bad_input_names_the_field(self, kwargs, message):
        args = {"rewards": torch.zeros(3), "group_ids": torch.zeros(3, dtype=torch.long)} | kwargs
        rewards, groups = args.pop("rewards"), args.pop("group_ids")
        with pytest.raises((ValueError, TypeError), match=message):
            grpo_advantages(rewards, groups, **args)


class TestStratifiedAdvantages:
    def test_hand_derived(self):
        # One group R = [1, 0, 1, 0, 1], strata (search counts) [0, 0, 1, 1, 1].
        # GN: mean 0.6, std √0.3 → 0.4/√0.3 = 0.7303, −0.6/√0.3 = −1.0954.
        # SAN stratum 0: R = [1, 0], mean 0.5, std 1/√2 → ±0.7071.
        # SAN stratum 1: R = [1, 0, 1], mean 2/3, std (ddof 1) = √(1/3)
        #   → (1/3)/0.5774 = 0.5774, (−2/3)/0.5774 = −1.1547.
        rewards = torch.tensor([1.0, 0, 1, 0, 1])
        groups = torch.zeros(5, dtype=torch.long)
        strata = torch.tensor([0, 0, 1, 1, 1])
        gn = torch.tensor([0.4, -0.6, 0.4, -0.6, 0.4]) / (math.sqrt(0.3) + 1e-6)
        s0, s1 = math.sqrt(0.5) + 1e-6, math.sqrt(1 / 3) + 1e-6
        san = torch.tensor([0.5 / s0, -0.5 / s0, (1 / 3) / s1, (-2 / 3) / s1, (1 / 3) / s1])
        assert_close(stratified_advantages(rewards, groups, strata, alpha=0.6), 0.6 * san + 0.4 * gn)
        assert_close(stratified_advantages(rewards, groups, strata, alpha=1.0), san)

    @pytest.mark.parametrize("seed", [0, 1, 2])
    @pytest.mark.parametrize("binary", [False, True])
    def test_matches_loop_oracle(self, seed, binary):
        rewards, groups, strata = random_batch(seed, binary=binary)
        for alpha in (0.0, 0.3, 0.6, 1.0):
            assert_close(
                stratified_advantages(rewards, groups, strata, alpha=alpha),
                stratified_loop(rewards, groups, strata, alpha=alpha),
            )

    @pytest.mark.parametrize("seed", range(4))
    def test_alpha_zero_is_grpo_bit_for_bit(self, seed):
        rewards, groups, strata = random_batch(seed, binary=seed % 2 == 0)
        for ddof in (0, 1):
            for scale in (True, False):
                kw = {"std_ddof": ddof, "scale_by_std": scale}
                assert torch.equal(
                    stratified_advantages(rewards, groups, strata, alpha=0.0, **kw),
                    grpo_advantages(rewards, groups, **kw),
                )

    @pytest.mark.parametrize("seed", range(5))
    def test_decomposition_and_variance_identity(self, seed):
        gen = torch.Generator().manual_seed(seed)
        k = 12
        rewards = torch.randn(k, generator=gen, dtype=torch.float64)
        strata = torch.randint(0, 4, (k,), generator=gen)
        groups = torch.zeros(k, dtype=torch.long)
        bias = cross_stratum_bias(rewards, groups, strata)
        centered_global = rewards - rewards.mean()
        centered_stratum = torch.empty_like(rewards)
        for s in strata.unique():
            members = strata == s
            centered_stratum[members] = rewards[members] - rewards[members].mean()
            # bias is constant inside a stratum
            assert_close(bias[members], bias[members][0].expand(int(members.sum())))
        # Decomposition: (R − mean R) − (R − mean_Bk R) = mean_Bk R − mean R.
        assert_close(centered_global - centered_stratum, bias)
        # Variance: Var(R − mean R) − Var(R − mean_Bk R) = (1/K) Σ_k n_k (mean_Bk R − mean R)² ≥ 0.
        lhs = centered_global.var(correction=0) - centered_stratum.var(correction=0)
        rhs = torch.stack([(strata == s).sum() * bias[strata == s][0] ** 2 for s in strata.unique()]).sum() / k
        assert_close(lhs, rhs)
        assert lhs >= 0

    @pytest.mark.parametrize("seed", range(3))
    def test_san_mean_zero_and_unit_variance_within_stratum(self, seed):
        rewards, groups, strata = random_batch(seed, groups=4, group_size=16)
        san = stratified_advantages(rewards, groups, strata, alpha=1.0, eps=0.0, std_ddof=0)
        for g in groups.unique():
            in_group = groups == g
            assert_close(san[in_group].mean(), torch.tensor(0.0), atol=1e-6, rtol=0)
            for s in strata.unique():
                cell = in_group & (strata == s)
                if cell.sum() >= 2:
                    assert_close(san[cell].mean(), torch.tensor(0.0), atol=1e-6, rtol=0)
                    assert_close(san[cell].var(correction=0), torch.tensor(1.0))

    def test_affine_invariance_with_eps_zero(self):
        # float64 so that a·R + b itself is not rounded away (0.1·R + 7 loses ~3 digits in float32).
        rewards, groups, strata = random_batch(3)
        rewards = rewards.double()
        base = stratified_advantages(rewards, groups, strata, eps=0.0)
        for a, b in ((2.5, -1.0), (0.1, 7.0)):
            assert_close(stratified_advantages(a * rewards + b, groups, strata, eps=0.0), base)
            assert_close(grpo_advantages(a * rewards + b, groups, eps=0.0), grpo_advantages(rewards, groups, eps=0.0))

    def test_one_stratum_equals_gn_for_every_alpha(self):
        rewards, groups, _ = random_batch(4)
        gn = grpo_advantages(rewards, groups)
        for alpha in (0.0, 0.4, 1.0):
            out = stratified_advantages(rewards, groups, torch.full_like(groups, 2), alpha=alpha)
            assert_close(out, gn)

    def test_degenerate_strata_get_zero_san(self):
        # Group R = [1, 1, 0, 1], strata [0, 0, 1, 2]: stratum 0 all equal, strata 1 and 2 singletons → SAN ≡ 0,
        # so α = 1 gives all zeros and α = 0.6 gives 0.4 · GN.
        rewards = torch.tensor([1.0, 1, 0, 1])
        groups = torch.zeros(4, dtype=torch.long)
        strata = torch.tensor([0, 0, 1, 2])
        assert torch.equal(stratified_advantages(rewards, groups, strata, alpha=1.0), torch.zeros(4))
        assert_close(stratified_advantages(rewards, groups, strata), 0.4 * grpo_advantages(rewards, groups))

    def test_strata_do_not_cross_groups(self):
        # Same stratum id in two groups are two different cells.
        rewards = torch.tensor([0.0, 1.0, 5.0, 9.0])
        groups = torch.tensor([0, 0, 1, 1])
        strata = torch.tensor([3, 3, 3, 3])
        assert_close(stratified_advantages(rewards, groups, strata, alpha=1.0), grpo_advantages(rewards, groups))

    def test_bad_alpha_and_strata(self):
        r, g = torch.zeros(2), torch.zeros(2, dtype=torch.long)
        with pytest.raises(ValueError, match="alpha must be in"):
            stratified_advantages(r, g, g, alpha=1.5)
        with pytest.raises(ValueError, match="strata_ids has length 3"):
            stratified_advantages(r, g, torch.zeros(3, dtype=torch.long))


class TestGae:
    def test_hand_derived_with_observation_tokens(self):
        # Row: mask 1 1 0 0 1 0(pad). Policy tokens at t = 0, 1, 4; reward 1 on t = 4.
        # V = [0.5, 0.2, 9, 9, 0.4, 9] (9 on masked tokens must be ignored). γ = 0.9, λ = 0.8.
        # t=4: δ = 1 + 0.9·0 − 0.4 = 0.6;            A = 0.6
        # t=1: δ = 0 + 0.9·0.4 − 0.2 = 0.16;         A = 0.16 + 0.72·0.6 = 0.592
        # t=0: δ = 0 + 0.9·0.2 − 0.5 = −0.32;        A = −0.32 + 0.72·0.592 = 0.10624
        # returns = A + V on policy tokens: 0.60624, 0.792, 1.0.
        mask = torch.tensor([[1, 1, 0, 0, 1, 0]])
        rewards = torch.tensor([[0.0, 0, 0, 0, 1, 0]])
        values = torch.tensor([[0.5, 0.2, 9, 9, 0.4, 9]])
        adv, ret = gae_advantages(rewards, values, mask, gamma=0.9, lam=0.8)
        assert_close(adv, torch.tensor([[0.10624, 0.592, 0, 0, 0.6, 0]]))
        assert_close(ret, torch.tensor([[0.60624, 0.792, 0, 0, 1.0, 0]]))

    def test_gamma_lambda_one_is_reward_to_go_minus_value(self):
        # With γ = λ = 1 and reward only at the end: A_t = R − V_t (telescoping), returns = R.
        mask = torch.tensor([[1, 0, 1, 1, 0]])
        values = torch.tensor([[0.3, 5.0, -0.2, 0.7, 5.0]])
        rewards = outcome_to_token_rewards(torch.tensor([2.0]), mask)
        assert torch.equal(rewards, torch.tensor([[0.0, 0, 0, 2, 0]]))
        adv, ret = gae_advantages(rewards, values, mask)
        assert_close(adv, torch.tensor([[1.7, 0, 2.2, 1.3, 0]]))
        assert_close(ret, torch.tensor([[2.0, 0, 2.0, 2.0, 0]]))

    @pytest.mark.parametrize("seed", range(3))
    def test_matches_loop_oracle(self, seed):
        gen = torch.Generator().manual_seed(seed)
        mask = torch.rand(5, 17, generator=gen) < 0.7
        mask[2] = False  # an empty row
        rewards = torch.where(mask, torch.randn(5, 17, generator=gen), torch.zeros(()))
        values = torch.randn(5, 17, generator=gen)
        adv, ret = gae_advantages(rewards, values, mask.float(), gamma=0.95, lam=0.7)
        ref_adv, ref_ret = gae_loop(rewards, values, mask, gamma=0.95, lam=0.7)
        assert_close(adv, ref_adv)
        assert_close(ret, ref_ret)
        assert torch.equal(adv[2], torch.zeros(17))

    def test_reward_on_observation_token_raises(self):
        with pytest.raises(ValueError, match="observation/padding tokens"):
            gae_advantages(torch.tensor([[0.0, 1.0]]), torch.zeros(1, 2), torch.tensor([[1, 0]]))

    def test_values_are_detached(self):
        values = torch.zeros(1, 3, requires_grad=True)
        adv, ret = gae_advantages(torch.tensor([[0.0, 0, 1]]), values, torch.ones(1, 3))
        assert not adv.requires_grad and not ret.requires_grad


def test_broadcast_to_tokens():
    mask = torch.tensor([[1, 0, 1], [0, 0, 0]])
    out = broadcast_to_tokens(torch.tensor([2.0, -1.0]), mask)
    assert torch.equal(out, torch.tensor([[2.0, 0, 2.0], [0, 0, 0]]))
