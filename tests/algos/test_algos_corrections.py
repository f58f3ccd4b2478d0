"""Behaviour-policy corrections (TIS, MIS, decoupled PPO), their registry, and ``token_weights`` in the loss."""

from __future__ import annotations

import math

import pytest
import torch
from algos_oracles import correction_loop
from torch.testing import assert_close

from stratarl.algos import (
    AGG_MODES,
    CORRECTION_METRICS,
    CorrectionOutput,
    aggregate_loss,
    behaviour_correction_names,
    clipped_policy_loss,
    decoupled_weights,
    get_behaviour_correction,
    get_policy_loss,
    importance_ratios,
    mis_weights,
    register_behaviour_correction,
    tis_weights,
)
from stratarl.algos.registry import keyword_params

KINDS = {"tis": tis_weights, "mis": mis_weights, "decoupled": decoupled_weights}
# (kind, level) pairs: decoupled PPO is token-level only.
CASES = [(k, lv) for k in ("tis", "mis") for lv in ("token", "turn", "sequence")] + [("decoupled", "token")]


def call(kind, old, behav, mask, level="token", **kw):
    if kind == "decoupled":
        return decoupled_weights(old, behav, mask, **kw)
    return KINDS[kind](old, behav, mask, level=level, **kw)


def random_inputs(seed, batch=6, length=14, spread=0.6, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    mask = torch.rand(batch, length, generator=gen) < 0.7
    mask[0] = False  # a rollout with no policy token
    old = (-torch.rand(batch, length, generator=gen) * 3).to(dtype)
    behav = old + (spread * torch.randn(batch, length, generator=gen)).to(dtype)
    return old, behav, mask


def from_ratios(ratios, dtype=torch.float64):
    """(old, behav) with log π_old = log r exactly (math.log) and log π_behav = 0, so ρ = log r bit for bit."""
    old = torch.tensor([[math.log(r) for r in row] for row in ratios], dtype=dtype)
    return old, torch.zeros_like(old)


def metrics_of(out):
    return {k: float(v) for k, v in out.metrics.items()}


class TestHandDerived:
    MASK = torch.tensor([[1, 1, 0, 1, 1]])
    # Token ratios π_old/π_behav; the observation (index 2) holds a wild value that must be ignored.
    RATIOS = [[2.0, 8.0, 1e6, 0.25, 0.4]]

    def test_tis_three_levels(self):
        old, behav = from_ratios(self.RATIOS)
        # token, C = 2: min(r, 2) = [2, 2, ·, 0.25, 0.4]; 8 > 2 truncated (2.0 sits at the cap: not truncated).
        out = tis_weights(old, behav, self.MASK)
        assert_close(out.weights, torch.tensor([[2.0, 2.0, 0.0, 0.25, 0.4]], dtype=torch.float64))
        assert metrics_of(out) == pytest.approx(
            {CORRECTION_METRICS[0]: 4.65 / 4, CORRECTION_METRICS[1]: 1 / 4, CORRECTION_METRICS[2]: 0.0}
        )
        # turn: turn 0 geometric mean √(2·8) = 4 → 2 (both tokens truncated); turn 1 √(0.25·0.4) = √0.1.
        out = tis_weights(old, behav, self.MASK, level="turn")
        g1 = math.sqrt(0.1)
        assert_close(out.weights, torch.tensor([[2.0, 2.0, 0.0, g1, g1]], dtype=torch.float64))
        assert metrics_of(out)[CORRECTION_METRICS[1]] == pytest.approx(2 / 4)
        # sequence: (2·8·0.25·0.4)^(1/4) = 1.6^(1/4) ≈ 1.1247 < 2 on all four tokens, none truncated.
        out = tis_weights(old, behav, self.MASK, level="sequence")
        s = 1.6**0.25
        assert_close(out.weights, torch.tensor([[s, s, 0.0, s, s]], dtype=torch.float64))
        assert metrics_of(out) == pytest.approx(
            {CORRECTION_METRICS[0]: s, CORRECTION_METRICS[1]: 0.0, CORRECTION_METRICS[2]: 0.0}
        )

    def test_mis_three_levels(self):
        old, behav = from_ratios(self.RATIOS)
        # token, C = 2: keep r ∈ [0.5, 2]: [2 ✓ (bound), 8 ✗, ·, 0.25 ✗, 0.4 ✗] → [1, 0, 0, 0, 0]; 3 of 4 masked.
        out = mis_weights(old, behav, self.MASK)
        assert torch.equal(out.weights, torch.tensor([[1.0, 0.0, 0.0, 0.0, 0.0]], dtype=torch.float64))
        assert metrics_of(out) == pytest.approx(
            {CORRECTION_METRICS[0]: 1 / 4, CORRECTION_METRICS[1]: 0.0, CORRECTION_METRICS[2]: 3 / 4}
        )
        # turn: turn 0 (geo mean 4) dropped, turn 1 (√0.1 ≈ 0.316 < 0.5) dropped; with C = 4 turn 0 is kept whole
        # (though its token 8 alone would be dropped) and turn 1 (0.316 ≥ 0.25) too.
        out = mis_weights(old, behav, self.MASK, level="turn")
        assert torch.equal(out.weights, torch.zeros(1, 5, dtype=torch.float64))
        out = mis_weights(old, behav, self.MASK, level="turn", cap=4.0)
        assert torch.equal(out.weights, torch.tensor([[1.0, 1.0, 0.0, 1.0, 1.0]], dtype=torch.float64))
        # sequence: 1.6^(1/4) ≈ 1.12 ∈ [0.5, 2] → every policy token kept.
        out = mis_weights(old, behav, self.MASK, level="sequence")
        assert torch.equal(out.weights, self.MASK.to(torch.float64))

    def test_decoupled(self):
        # Ratios [0.1, 1, 4, 6, 30 (observation)], C = 5: 6 > 5 → 0, the rest keep the raw ratio (no lower bound).
        old, behav = from_ratios([[0.1, 1.0, 4.0, 6.0, 30.0]])
        mask = torch.tensor([[1, 1, 1, 1, 0]])
        out = decoupled_weights(old, behav, mask)
        assert_close(out.weights, torch.tensor([[0.1, 1.0, 4.0, 0.0, 0.0]], dtype=torch.float64))
        assert metrics_of(out) == pytest.approx(
            {CORRECTION_METRICS[0]: 5.1 / 4, CORRECTION_METRICS[1]: 0.0, CORRECTION_METRICS[2]: 1 / 4}
        )
        uncapped = decoupled_weights(old, behav, mask, cap=None)
        assert_close(uncapped.weights, torch.tensor([[0.1, 1.0, 4.0, 6.0, 0.0]], dtype=torch.float64))
        assert metrics_of(uncapped)[CORRECTION_METRICS[2]] == 0.0


class TestAgainstLoopOracle:
    @pytest.mark.parametrize("kind, level", CASES)
    @pytest.mark.parametrize("seed", range(3))
    @pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
    def test_matches_loop(self, kind, level, seed, dtype):
        old, behav, mask = random_inputs(seed, dtype=dtype)
        for cap in (1.3, 2.0, 5.0):
            out = call(kind, old, behav, mask, level, cap=cap)
            weights, metrics = correction_loop(kind, old, behav, mask, cap, level)
            assert out.weights.dtype == dtype
            assert_close(out.weights, weights.to(dtype))
            for key in CORRECTION_METRICS:
                assert_close(out.metrics[key], torch.tensor(metrics[key], dtype=dtype))

    def test_decoupled_without_cap_matches_loop_and_uncapped_tis(self):
        old, behav, mask = random_inputs(7, spread=1.5, dtype=torch.float64)
        out = decoupled_weights(old, behav, mask, cap=None)
        weights, _ = correction_loop("decoupled", old, behav, mask, None)
        assert_close(out.weights, weights)
        assert torch.equal(out.weights, tis_weights(old, behav, mask, cap=math.inf).weights)


class TestInvariances:
    @pytest.mark.parametrize("kind, level", CASES)
    def test_depends_only_on_old_minus_behaviour(self, kind, level):
        old, behav, mask = random_inputs(1, dtype=torch.float64)
        shift = torch.randn(old.shape, generator=torch.Generator().manual_seed(5), dtype=torch.float64) * 4
        out, shifted = call(kind, old, behav, mask, level), call(kind, old + shift, behav + shift, mask, level)
        assert_close(shifted.weights, out.weights)
        assert metrics_of(shifted) == pytest.approx(metrics_of(out))

    @pytest.mark.parametrize("kind, level", CASES)
    def test_permuting_rows_permutes_weights(self, kind, level):
        old, behav, mask = random_inputs(2)
        perm = torch.tensor([3, 0, 5, 1, 4, 2])
        out, permuted = call(kind, old, behav, mask, level), call(kind, old[perm], behav[perm], mask[perm], level)
        assert_close(permuted.weights, out.weights[perm])
        assert_close(permuted.metrics["offpolicy/is_weight_mean"], out.metrics["offpolicy/is_weight_mean"])

    @pytest.mark.parametrize("kind, level", CASES)
    def test_identical_policies_give_weight_one(self, kind, level):
        old, _, mask = random_inputs(3)
        out = call(kind, old, old.clone(), mask, level)
        assert torch.equal(out.weights, mask.float())
        assert metrics_of(out) == {CORRECTION_METRICS[0]: 1.0, CORRECTION_METRICS[1]: 0.0, CORRECTION_METRICS[2]: 0.0}

    @pytest.mark.parametrize("kind, level", CASES)
    def test_observation_values_are_ignored_and_inputs_untouched(self, kind, level):
        old, behav, mask = random_inputs(4)
        wild_old, wild_behav = old.clone(), behav.clone()
        wild_old[~mask], wild_behav[~mask] = float("nan"), float("-inf")
        before = (wild_old.clone(), wild_behav.clone(), mask.clone())
        out, wild = call(kind, old, behav, mask, level), call(kind, wild_old, wild_behav, mask, level)
        assert torch.equal(wild.weights, out.weights) and bool((wild.weights[~mask] == 0).all())
        assert metrics_of(wild) == metrics_of(out)
        for kept, now in zip(before, (wild_old, wild_behav, mask)):  # never mutated
            assert_close(now, kept, rtol=0, atol=0, equal_nan=True)

    @pytest.mark.parametrize("kind, level", CASES)
    def test_weights_are_detached_and_bounded(self, kind, level):
        old, behav, mask = random_inputs(6, spread=1.5)
        old.requires_grad_(True)
        out = call(kind, old, behav, mask, level, cap=3.0)
        assert not out.weights.requires_grad and all(not v.requires_grad for v in out.metrics.values())
        assert set(out.metrics) == set(CORRECTION_METRICS) and all(v.dim() == 0 for v in out.metrics.values())
        assert bool((out.weights >= 0).all()) and bool((out.weights <= 3.0 * (1 + 1e-6)).all())
        if kind == "mis":
            assert bool(((out.weights == 0) | (out.weights == 1)).all())


class TestEdgeCases:
    @pytest.mark.parametrize("kind, level", CASES)
    def test_empty_mask_gives_zero_weights_and_metrics(self, kind, level):
        old, behav, _ = random_inputs(0)
        out = call(kind, old, behav, torch.zeros_like(old), level)
        assert torch.equal(out.weights, torch.zeros_like(old))
        assert all(bool(torch.isfinite(v)) and v == 0 for v in out.metrics.values())

    @pytest.mark.parametrize("shape", [(0, 4), (3, 0)])
    @pytest.mark.parametrize("kind, level", CASES)
    def test_zero_sized_batches(self, shape, kind, level):
        out = call(kind, torch.zeros(shape), torch.zeros(shape), torch.zeros(shape), level)
        assert out.weights.shape == shape and all(v == 0 for v in out.metrics.values())

    def test_rollout_without_policy_tokens_counts_nothing(self):
        # Row 1 has no policy token: its weights are 0 and the metrics average over row 0's two tokens only.
        old, behav = from_ratios([[3.0, 1.0], [9.0, 9.0]])
        mask = torch.tensor([[1, 1], [0, 0]])
        for level in ("token", "turn", "sequence"):
            out = tis_weights(old, behav, mask, level=level)
            assert torch.equal(out.weights[1], torch.zeros(2, dtype=torch.float64))
        out = tis_weights(old, behav, mask)
        assert metrics_of(out) == pytest.approx(
            {CORRECTION_METRICS[0]: 1.5, CORRECTION_METRICS[1]: 0.5, CORRECTION_METRICS[2]: 0.0}
        )

    def test_huge_ratios_are_clamped_not_inf(self):
        # ρ = ±1000 is clamped to ±20 before exp: exp(20) ≈ 4.85e8, exp(−20) ≈ 2.06e−9, both finite.
        old = torch.tensor([[1000.0, -1000.0, 0.0]])
        behav, mask = torch.zeros(1, 3), torch.ones(1, 3)
        tis = tis_weights(old, behav, mask)
        assert_close(tis.weights, torch.tensor([[2.0, math.exp(-20), 1.0]]))
        assert torch.equal(mis_weights(old, behav, mask).weights, torch.tensor([[0.0, 0.0, 1.0]]))
        assert_close(
            decoupled_weights(old, behav, mask, cap=None).weights, torch.tensor([[math.exp(20), math.exp(-20), 1.0]])
        )
        assert torch.equal(decoupled_weights(old, behav, mask).weights[0, 0], torch.tensor(0.0))
        for level in ("turn", "sequence"):  # mean of clamped token log-ratios: (20 − 20 + 0)/3 = 0 → weight 1
            assert torch.equal(tis_weights(old, behav, mask, level=level).weights, torch.ones(1, 3))

    def test_cap_boundaries_are_inclusive_and_exact(self):
        # ρ = ±log C exactly (ratios C and 1/C), and the next float above log C.
        cap = 2.0
        at, above = math.log(cap), math.nextafter(math.log(cap), math.inf)
        old = torch.tensor([[at, -at, above]], dtype=torch.float64)
        behav, mask = torch.zeros_like(old), torch.ones(1, 3)
        tis = tis_weights(old, behav, mask, cap=cap)
        assert tis.weights[0, 0] == cap and tis.weights[0, 2] == cap
        assert metrics_of(tis)[CORRECTION_METRICS[1]] == pytest.approx(1 / 3)  # only the one above the cap
        mis = mis_weights(old, behav, mask, cap=cap)
        assert torch.equal(mis.weights, torch.tensor([[1.0, 1.0, 0.0]], dtype=torch.float64))
        dec = decoupled_weights(old, behav, mask, cap=cap)  # AReaL keeps weight <= cap
        assert dec.weights[0, 0] > 0 and dec.weights[0, 2] == 0

    def test_dtypes(self):
        old, behav, mask = random_inputs(8)
        assert tis_weights(old.bfloat16(), behav.bfloat16(), mask).weights.dtype == torch.float32
        assert tis_weights(old, behav.double(), mask).weights.dtype == torch.float64
        assert tis_weights(old, behav, mask.float()).weights.dtype == torch.float32

    def test_bad_arguments(self):
        old, behav, mask = random_inputs(0)
        for bad in (1.0, 0.5, -3.0, float("nan"), True, "2"):
            with pytest.raises(ValueError, match="cap must be a number > 1"):
                tis_weights(old, behav, mask, cap=bad)
            with pytest.raises(ValueError, match="cap must be a number > 1 or None"):
                decoupled_weights(old, behav, mask, cap=bad)
        with pytest.raises(ValueError, match="cap must be a number > 1, got None"):
            mis_weights(old, behav, mask, cap=None)
        with pytest.raises(ValueError, match="unknown correction level 'step'; valid levels: token, turn, sequence"):
            tis_weights(old, behav, mask, level="step")
        with pytest.raises(ValueError, match="behaviour_log_probs has shape"):
            mis_weights(old, behav[:, :3], mask)
        with pytest.raises(ValueError, match="response_mask must contain only 0 and 1"):
            decoupled_weights(old, behav, mask.long() * 2)


class TestTokenWeightsInLoss:
    @staticmethod
    def loss_inputs(seed, spread=0.6):
        gen = torch.Generator().manual_seed(seed)
        old, behav, mask = random_inputs(seed, spread=spread)
        new = old + spread * torch.randn(old.shape, generator=gen)
        new = (new + torch.tensor([0.0, 0.5, -0.5, 0.0, 0.4, -0.3])[:, None]).requires_grad_(True)
        adv = torch.randn(old.shape, generator=gen)
        return new, old, behav, adv, mask

    def test_hand_derived(self):
        # The token-level case of test_algos_losses (ε = 0.2): r = [1.5, 0.5, 1.1, 0.7], A = [+1, +1, −2, −1],
        # PPO terms [1.2, 0.5, −2.2, −0.8]. Weights w = [0.5, 2, 1, 0]: weighted terms [0.6, 1.0, −2.2, 0];
        # loss = −(0.6 + 1.0 − 2.2 + 0)/4 = 0.15 (still / 4 tokens); J_C = (0.5·1.5·1 + 0·0.7·(−1))/4 = 0.1875.
        new = torch.log(torch.tensor([[1.5, 0.5, 1.1, 0.7]]))
        adv = torch.tensor([[1.0, 1.0, -2.0, -1.0]])
        weights = torch.tensor([[0.5, 2.0, 1.0, 0.0]])
        out = clipped_policy_loss(new, torch.zeros(1, 4), adv, torch.ones(1, 4), token_weights=weights)
        assert_close(out.loss, torch.tensor(0.15))
        assert_close(out.clip_bias, torch.tensor(0.1875))
        assert_close(out.metrics["loss/clip_frac"], torch.tensor(0.5))  # clipping decisions do not see w
        assert_close(out.metrics["loss/pg_loss"], torch.tensor(0.15))

    @pytest.mark.parametrize("level", ["token", "turn", "sequence"])
    @pytest.mark.parametrize("agg", AGG_MODES)
    def test_unit_weights_are_bit_identical_to_none(self, level, agg):
        new, old, _, adv, mask = self.loss_inputs(1)
        plain = clipped_policy_loss(new, old, adv, mask, level=level, agg=agg, dual_clip=3.0)
        ones = clipped_policy_loss(
            new, old, adv, mask, level=level, agg=agg, dual_clip=3.0, token_weights=torch.ones_like(old)
        )
        assert torch.equal(plain.loss, ones.loss) and torch.equal(plain.clip_bias, ones.clip_bias)
        assert plain.metrics.keys() == ones.metrics.keys()
        assert all(torch.equal(plain.metrics[k], ones.metrics[k]) for k in plain.metrics)
        grads = [torch.autograd.grad(o.loss + o.clip_bias, new)[0] for o in (plain, ones)]
        assert torch.equal(grads[0], grads[1])

    @pytest.mark.parametrize("level", ["token", "turn", "sequence"])
    @pytest.mark.parametrize("agg", AGG_MODES)
    def test_clip_bias_identity_with_weights(self, level, agg):
        # ∇J_C = ∇J_IS − ∇J_PPO of the weighted surrogate, J_IS = agg(w · r · A), by autograd.
        new, old, behav, adv, mask = self.loss_inputs(11)
        weights = tis_weights(old, behav, mask, cap=1.5, level=level).weights
        weights[:, ::4] = 0.0  # and some tokens removed outright
        out = clipped_policy_loss(new, old, adv, mask, level=level, dual_clip=2.5, agg=agg, token_weights=weights)
        assert 0 < out.metrics["loss/clip_frac"] < 1
        plain = clipped_policy_loss(new, old, adv, mask, level=level, dual_clip=2.5, agg=agg)
        assert not torch.equal(out.loss, plain.loss)
        j_is = aggregate_loss(weights * importance_ratios(new, old, mask, level=level) * adv, mask, agg)
        (g_is,) = torch.autograd.grad(j_is, new)
        (g_ppo,) = torch.autograd.grad(-out.loss, new, retain_graph=True)
        (g_c,) = torch.autograd.grad(out.clip_bias, new)
        assert_close(g_c, g_is - g_ppo)

    def test_zero_weight_removes_a_tokens_gradient_and_keeps_the_denominator(self):
        new, old, _, adv, mask = self.loss_inputs(3)
        weights = torch.ones_like(old)
        b, t = mask.nonzero()[5].tolist()
        weights[b, t] = 0.0
        out = clipped_policy_loss(new, old, adv, mask, token_weights=weights)
        plain = clipped_policy_loss(new, old, adv, mask)
        (g_w,) = torch.autograd.grad(out.loss + out.clip_bias, new)
        (g_plain,) = torch.autograd.grad(plain.loss + plain.clip_bias, new)
        assert g_w[b, t] == 0 and g_plain[b, t] != 0
        keep = torch.ones_like(mask)
        keep[b, t] = False
        assert torch.equal(g_w[keep], g_plain[keep])  # other tokens: same gradient, same denominator
        n = int(mask.sum())
        term = (-plain.loss * n).detach() - (-out.loss * n).detach()  # the removed token's PPO term
        r = math.exp(float(new[b, t].detach() - old[b, t]))
        assert_close(term, torch.tensor(min(r * float(adv[b, t]), min(max(r, 0.8), 1.2) * float(adv[b, t]))))

    def test_weights_are_detached_and_ignored_off_the_mask(self):
        new, old, _, adv, mask = self.loss_inputs(4)
        weights = torch.rand(old.shape, generator=torch.Generator().manual_seed(0))
        weights[~mask] = float("nan")
        weights.requires_grad_(True)
        out = clipped_policy_loss(new, old, adv, mask, level="turn", token_weights=weights)
        (out.loss + out.clip_bias).backward()
        assert bool(torch.isfinite(out.loss)) and bool(torch.isfinite(new.grad).all()) and weights.grad is None
        with pytest.raises(ValueError, match="token_weights has shape"):
            clipped_policy_loss(new, old, adv, mask, token_weights=weights[:, :3])


class TestRegistry:
    def test_builtins_match_direct_calls(self):
        assert {"tis", "mis", "decoupled"} <= set(behaviour_correction_names())
        old, behav, mask = random_inputs(9)
        for name, fn in KINDS.items():
            assert get_behaviour_correction(name) is fn
        out = get_behaviour_correction("tis")(old, behav, mask, cap=3.0, level="turn")
        assert isinstance(out, CorrectionOutput)
        assert torch.equal(out.weights, tis_weights(old, behav, mask, cap=3.0, level="turn").weights)
        assert keyword_params(get_behaviour_correction("tis")) == {"cap": 2.0, "level": "token"}
        assert keyword_params(get_behaviour_correction("mis")) == {"cap": 2.0, "level": "token"}
        assert keyword_params(get_behaviour_correction("decoupled")) == {"cap": 5.0}

    def test_unknown_name_lists_the_valid_ones(self):
        with pytest.raises(KeyError, match="unknown behaviour correction 'icepop'; registered: decoupled, mis, tis"):
            get_behaviour_correction("icepop")

    def test_user_registered_correction_is_found_by_name(self):
        @register_behaviour_correction("zz-test-halve")
        def halve(old_log_probs, behaviour_log_probs, response_mask, *, factor: float = 0.5):
            weights = response_mask.float() * factor
            zero = torch.zeros(())
            return CorrectionOutput(weights, dict.fromkeys(CORRECTION_METRICS, zero))

        assert "zz-test-halve" in behaviour_correction_names()
        old, behav, mask = random_inputs(0)
        assert torch.equal(get_behaviour_correction("zz-test-halve")(old, behav, mask).weights, mask.float() * 0.5)
        assert keyword_params(halve) == {"factor": 0.5}
        with pytest.raises(ValueError, match="already registered"):
            register_behaviour_correction("tis")(halve)

    def test_correction_feeds_the_registered_loss(self):
        new, old, behav, adv, mask = TestTokenWeightsInLoss.loss_inputs(5)
        weights = get_behaviour_correction("decoupled")(old, behav, mask, cap=1.5).weights
        out = get_policy_loss("ppo")(new, old, adv, mask, token_weights=weights)
        assert torch.equal(out.loss, clipped_policy_loss(new, old, adv, mask, token_weights=weights).loss)
