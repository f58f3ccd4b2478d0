"""Loss aggregation, the clipped surrogate (levels, asymmetric / dual clip), KL, entropy, value loss."""

from __future__ import annotations

import math

import pytest
import torch
from algos_oracles import kl_loop, ppo_loss_loop
from torch.testing import assert_close

from stratarl.algos import (
    AGG_MODES,
    aggregate_loss,
    clipped_policy_loss,
    clipped_value_loss,
    entropy_from_logits,
    importance_ratios,
    kl_penalty,
)


def random_inputs(seed, batch=5, length=12, spread=0.4):
    gen = torch.Generator().manual_seed(seed)
    mask = torch.rand(batch, length, generator=gen) < 0.7
    mask[0] = False  # an empty row
    old = -torch.rand(batch, length, generator=gen) * 3
    new = old + spread * torch.randn(batch, length, generator=gen)
    adv = torch.randn(batch, length, generator=gen)
    return new, old, adv, mask


class TestAggregateLoss:
    LOSS = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0], [7.0, 8.0, 9.0]])
    MASK = torch.tensor([[1, 1, 0], [1, 0, 0], [0, 0, 0]])

    @pytest.mark.parametrize(
        "mode, expected",
        [
            ("token-mean", (1 + 2 + 4) / 3),  # 3 policy tokens
            ("seq-mean-token-mean", (1.5 + 4) / 2),  # the empty row is not a sequence
            ("seq-mean-token-sum", (3 + 4 + 0) / 3),
            ("seq-mean-token-sum-norm", (3 + 4 + 0) / 3 / 3),  # / T = 3
        ],
    )
    def test_hand_derived(self, mode, expected):
        assert_close(aggregate_loss(self.LOSS, self.MASK, mode), torch.tensor(expected))

    def test_norm_length_and_empty_mask(self):
        normed = aggregate_loss(self.LOSS, self.MASK, "seq-mean-token-sum-norm", norm_length=7)
        assert_close(normed, torch.tensor(7 / 3 / 7))
        empty = torch.zeros(3, 3)
        for mode in AGG_MODES:
            assert torch.equal(aggregate_loss(self.LOSS, empty, mode), torch.tensor(0.0))

    def test_unknown_mode_lists_valid(self):
        with pytest.raises(ValueError, match="valid modes: token-mean, seq-mean-token-mean"):
            aggregate_loss(self.LOSS, self.MASK, "mean")


class TestClippedPolicyLoss:
    def test_hand_derived_token_level(self):
        # ε = 0.2. Token ratios r = [1.5, 0.5, 1.1, 0.7], A = [+1, +1, −2, −1]:
        #   t0: A>0, r>1.2 → clipped, term 1.2·1 = 1.2
        #   t1: A>0, r<0.8 → min(0.5, 0.8) = 0.5, not clipped
        #   t2: A<0, r in range → 1.1·(−2) = −2.2
        #   t3: A<0, r<0.8 → min(−0.7, −0.8) = −0.8, clipped
        # loss = −(1.2 + 0.5 − 2.2 − 0.8)/4 = 0.325; clip_frac = 2/4; J_C = (1.5·1 + 0.7·(−1))/4 = 0.2.
        old = torch.zeros(1, 4)
        new = torch.log(torch.tensor([[1.5, 0.5, 1.1, 0.7]]))
        adv = torch.tensor([[1.0, 1.0, -2.0, -1.0]])
        out = clipped_policy_loss(new, old, adv, torch.ones(1, 4))
        assert_close(out.loss, torch.tensor(0.325))
        assert_close(out.clip_bias, torch.tensor(0.2))
        assert_close(out.metrics["loss/clip_frac"], torch.tensor(0.5))
        assert_close(out.metrics["loss/clip_frac_high"], torch.tensor(0.25))
        assert_close(out.metrics["loss/clip_frac_low"], torch.tensor(0.25))
        assert_close(out.metrics["loss/ratio_mean"], torch.tensor(0.95))

    def test_asymmetric_and_dual_clip(self):
        # ε_low = 0.2, ε_high = 0.28 (clip-higher), dual clip c = 3.
        # r = [1.25, 4.0, 2.0], A = [+1, −1, −1]:
        #   t0: 1.25 < 1.28 → unclipped, 1.25
        #   t1: A<0, r = 4 > c → dual clip: max(min(−4, −0.8·…), 3·(−1)) = −3, clipped (dual)
        #   t2: A<0, r = 2 ≤ c → −2, unclipped (standard PPO does not bound A<0, r>1)
        # loss = −(1.25 − 3 − 2)/3 = 1.25.
        new = torch.log(torch.tensor([[1.25, 4.0, 2.0]]))
        adv = torch.tensor([[1.0, -1.0, -1.0]])
        out = clipped_policy_loss(new, torch.zeros(1, 3), adv, torch.ones(1, 3), clip_high=0.28, dual_clip=3.0)
        assert_close(out.loss, torch.tensor(1.25))
        assert_close(out.metrics["loss/clip_frac_dual"], torch.tensor(1 / 3))
        assert_close(out.clip_bias, torch.tensor(-4.0 / 3))
        no_dual = clipped_policy_loss(new, torch.zeros(1, 3), adv, torch.ones(1, 3), clip_high=0.28)
        assert_close(no_dual.loss, torch.tensor((-1.25 + 4 + 2) / 3))

    @pytest.mark.parametrize("level", ["token", "turn", "sequence"])
    @pytest.mark.parametrize("seed", range(3))
    def test_matches_loop_oracle(self, level, seed):
        new, old, adv, mask = random_inputs(seed)
        for clip_low, clip_high, dual in ((0.2, 0.2, None), (0.1, 0.3, 2.0)):
            out = clipped_policy_loss(
                new, old, adv, mask, level=level, clip_low=clip_low, clip_high=clip_high, dual_clip=dual
            )
            expected = ppo_loss_loop(new, old, adv, mask, level, clip_low, clip_high, dual)
            assert_close(out.loss, torch.tensor(expected, dtype=out.loss.dtype))

    @pytest.mark.parametrize("level", ["token", "turn", "sequence"])
    @pytest.mark.parametrize("agg", AGG_MODES)
    def test_clip_bias_gradient_identity(self, level, agg):
        # ∇J_IS = ∇J_PPO + ∇J_C with J_IS = agg(r·A), checked by autograd w.r.t. the log-probs.
        new, old, adv, mask = random_inputs(11, spread=0.6)
        # Sequence ratios average many tokens; shift whole rows so some of them are clipped.
        new = (new + torch.tensor([0.0, 0.5, -0.5, 0.0, 0.4])[:, None]).requires_grad_(True)
        out = clipped_policy_loss(new, old, adv, mask, level=level, dual_clip=2.5, agg=agg)
        assert 0 < out.metrics["loss/clip_frac"] < 1  # some clipped, some not: the case is not vacuous
        j_is = aggregate_loss(importance_ratios(new, old, mask, level=level) * adv, mask, agg)
        (g_is,) = torch.autograd.grad(j_is, new)
        (g_ppo,) = torch.autograd.grad(-out.loss, new, retain_graph=True)
        (g_c,) = torch.autograd.grad(out.clip_bias, new)
        assert_close(g_is, g_ppo + g_c)

    def test_turn_level_clipping_is_per_turn(self):
        mask = torch.tensor([[1, 1, 1, 0, 1, 1]])
        new, old = torch.tensor([[0.5, -0.1, 0.3, 0.0, 0.0, 0.01]]), torch.zeros(1, 6)
        adv = torch.ones(1, 6)
        out = clipped_policy_loss(new, old, adv, mask, level="turn")
        # turn 0: w = exp(0.7/3) = 1.263 > 1.2 → clipped (3 tokens); turn 1: w = exp(0.005) → not clipped
        assert_close(out.metrics["loss/clip_frac"], torch.tensor(3 / 5))
        assert_close(out.metrics["loss/clip_frac_turn"], torch.tensor(1 / 2))

    def test_theta_equals_old(self):
        new, _, adv, mask = random_inputs(2)
        out = clipped_policy_loss(new, new.clone(), adv, mask, level="turn")
        assert out.metrics["loss/clip_frac"] == 0
        assert_close(out.metrics["loss/ratio_mean"], torch.tensor(1.0))
        assert out.clip_bias == 0

    def test_empty_mask_gives_zero_and_finite_grad(self):
        new = torch.randn(3, 4, requires_grad=True)
        out = clipped_policy_loss(new, torch.randn(3, 4), torch.randn(3, 4), torch.zeros(3, 4), level="turn")
        assert out.loss == 0 and out.clip_bias == 0
        assert all(bool(torch.isfinite(v)) and v == 0 for k, v in out.metrics.items() if k != "loss/pg_loss")
        out.loss.backward()
        assert torch.equal(new.grad, torch.zeros(3, 4))

    @pytest.mark.parametrize("shape", [(0, 4), (3, 0)])
    @pytest.mark.parametrize("level", ["token", "turn", "sequence"])
    def test_zero_sized_batches(self, shape, level):
        new = torch.zeros(shape, requires_grad=True)
        out = clipped_policy_loss(new, torch.zeros(shape), torch.zeros(shape), torch.zeros(shape), level=level)
        assert out.loss == 0 and all(v == 0 for v in out.metrics.values())
        out.loss.backward()

    def test_bad_params(self):
        new, old, adv, mask = random_inputs(0)
        with pytest.raises(ValueError, match="dual_clip must be > 1"):
            clipped_policy_loss(new, old, adv, mask, dual_clip=0.9)
        with pytest.raises(ValueError, match="advantages has shape"):
            clipped_policy_loss(new, old, adv[:, :3], mask)


class TestKlEntropyValue:
    @pytest.mark.parametrize("kind", ["k1", "k2", "k3"])
    def test_kl_matches_loop(self, kind):
        new, ref, _, mask = random_inputs(4)
        assert_close(kl_penalty(new, ref, mask, kind), kl_loop(new, ref, mask, kind))

    def test_kl_hand_case_and_properties(self):
        # Δ = log π_ref − log π = log 2: k1 = −log 2, k2 = ½ log² 2, k3 = 2 − log 2 − 1.
        new, ref = torch.tensor([[0.0]]), torch.tensor([[math.log(2)]])
        one = torch.ones(1, 1)
        assert_close(kl_penalty(new, ref, one, "k1"), torch.tensor([[-math.log(2)]]))
        assert_close(kl_penalty(new, ref, one, "k2"), torch.tensor([[0.5 * math.log(2) ** 2]]))
        assert_close(kl_penalty(new, ref, one, "k3"), torch.tensor([[1 - math.log(2)]]))
        x, r, _, mask = random_inputs(5, spread=2.0)
        assert bool((kl_penalty(x, r, mask, "k3") >= 0).all())
        assert torch.equal(kl_penalty(x, x.clone(), mask, "k3"), torch.zeros_like(x))
        with pytest.raises(ValueError, match="valid estimators: k1, k2, k3"):
            kl_penalty(x, r, mask, "k4")

    def test_entropy_matches_torch_distributions(self):
        logits = torch.randn(2, 3, 11, generator=torch.Generator().manual_seed(0))
        expected = torch.distributions.Categorical(logits=logits).entropy()
        assert_close(entropy_from_logits(logits), expected)
        # Uniform over V: H = log V.
        assert_close(entropy_from_logits(torch.zeros(1, 1, 11)), torch.tensor([[math.log(11)]]))

    def test_clipped_value_loss_hand_case(self):
        # clip 0.2. Token 0: V_old 0, V 1, R 1 → unclipped (V−R)² = 0; V_clip = 0.2 → (0.2−1)² = 0.64 (max).
        # Token 1: V_old 0, V 0.1, R 0.5 → 0.16 vs V_clip = 0.1 → 0.16: equal, not "clipped more".
        # loss = ½ · (0.64 + 0.16)/2 = 0.2.
        values = torch.tensor([[1.0, 0.1]])
        loss, metrics = clipped_value_loss(values, torch.zeros(1, 2), torch.tensor([[1.0, 0.5]]), torch.ones(1, 2))
        assert_close(loss, torch.tensor(0.2))
        assert_close(metrics["critic/vf_clip_frac"], torch.tensor(0.5))
        returns, mask = torch.tensor([[1.0, 0.5]]), torch.ones(1, 2)
        unclipped, _ = clipped_value_loss(values, torch.zeros(1, 2), returns, mask, clip=None)
        assert_close(unclipped, torch.tensor(0.5 * 0.16 / 2))
