"""SORL clipping-triggered normalisation on a tiny policy: C = ∇J_IS − ∇J_PPO, SO step = PPO step, …"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch.testing import assert_close

from stratarl.algos import ClipBiasNormalizer, aggregate_loss, clipped_policy_loss, importance_ratios

VOCAB, BATCH, LENGTH = 11, 6, 9


class TinyPolicy(nn.Module):
    """A 2-layer MLP over the previous token: log π(y_t | y_{t−1})."""

    def __init__(self, seed: int = 0):
        super().__init__()
        torch.manual_seed(seed)
        self.embed = nn.Embedding(VOCAB, 16)
        self.hidden = nn.Linear(16, 16)
        self.head = nn.Linear(16, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        previous = torch.nn.functional.pad(tokens, (1, 0))[:, :-1]
        logits = self.head(torch.tanh(self.hidden(self.embed(previous))))
        return torch.log_softmax(logits, dim=-1).gather(-1, tokens[..., None]).squeeze(-1)


def toy_batch(seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, VOCAB, (BATCH, LENGTH), generator=gen)
    # Two or three turns per rollout separated by observation tokens, then padding.
    mask = torch.tensor([[1, 1, 1, 0, 0, 1, 1, 0, 0]] * 3 + [[1, 1, 0, 1, 1, 0, 1, 1, 1]] * 3)
    # GRPO-style: one advantage per rollout, broadcast over its tokens.
    adv = torch.randn(BATCH, 1, generator=gen).expand(BATCH, LENGTH).clone()
    return tokens, mask, adv


def perturbed(model: nn.Module, scale: float, seed: int = 1) -> nn.Module:
    other = copy.deepcopy(model)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in other.parameters():
            p.add_(scale * torch.randn(p.shape, generator=gen))
    return other


def grads(loss, params):
    return torch.autograd.grad(loss, params, retain_graph=True, allow_unused=True)


def flat(tensors):
    return torch.cat([t.reshape(-1) for t in tensors])


@pytest.mark.parametrize("level", ["token", "turn"])
def test_clip_bias_equals_is_minus_ppo_gradient(level):
    policy = TinyPolicy()
    old_policy = perturbed(policy, 0.3)  # off-policy enough that some tokens/turns are clipped
    tokens, mask, adv = toy_batch()
    old = old_policy(tokens).detach()
    params = list(policy.parameters())

    new = policy(tokens)
    out = clipped_policy_loss(new, old, adv, mask, level=level)
    assert 0 < out.metrics["loss/clip_frac"] < 1
    j_is = aggregate_loss(importance_ratios(new, old, mask, level=level) * adv, mask, "token-mean")
    c_expected = flat(grads(j_is, params)) - flat(grads(-out.loss, params))

    normalizer = ClipBiasNormalizer(params)
    normalizer.backward(out.loss, out.clip_bias)
    assert_close(flat(normalizer.c_buffers), c_expected)
    assert float(normalizer.c_norm()) > 0


def test_theta_equals_old_gives_zero_c_and_unit_scale():
    policy = TinyPolicy()
    tokens, mask, adv = toy_batch()
    new = policy(tokens)
    out = clipped_policy_loss(new, new.detach(), adv, mask, level="turn")
    assert_close(importance_ratios(new, new.detach(), mask, level="turn"), torch.ones(BATCH, LENGTH))
    normalizer = ClipBiasNormalizer(policy.parameters())
    normalizer.backward(out.loss, out.clip_bias)
    metrics = normalizer.apply()
    assert metrics["sorl/c_norm"] == 0 and metrics["sorl/scale"] == 1


@pytest.mark.parametrize("level", ["token", "turn"])
def test_so_step_equals_ppo_step_when_nothing_is_clipped(level):
    base = TinyPolicy()
    old_policy = perturbed(base, 0.002)  # slightly off-policy, nothing clipped
    tokens, mask, adv = toy_batch()
    old = old_policy(tokens).detach()
    ppo, so = copy.deepcopy(base), copy.deepcopy(base)
    opt_ppo = torch.optim.Adam(ppo.parameters(), lr=1e-4)
    opt_so = torch.optim.Adam(so.parameters(), lr=1e-4)
    normalizer = ClipBiasNormalizer(so.parameters(), delta=1.0)
    for _ in range(2):
        out_ppo = clipped_policy_loss(ppo(tokens), old, adv, mask, level=level)
        out_ppo.loss.backward()
        opt_ppo.step()
        opt_ppo.zero_grad()

        out_so = clipped_policy_loss(so(tokens), old, adv, mask, level=level)
        assert out_so.metrics["loss/clip_frac"] == 0
        normalizer.backward(out_so.loss, out_so.clip_bias)
        metrics = normalizer.apply()
        assert metrics["sorl/scale"] == 1
        opt_so.step()
        opt_so.zero_grad()
    for p_ppo, p_so in zip(ppo.parameters(), so.parameters()):
        assert torch.equal(p_ppo, p_so)


def test_scaled_gradient_is_ppo_gradient_over_c_norm():
    policy = TinyPolicy()
    tokens, mask, adv = toy_batch()
    old = perturbed(policy, 0.5)(tokens).detach()
    out = clipped_policy_loss(policy(tokens), old, adv, mask, level="turn")
    ppo_grad = flat(grads(out.loss, list(policy.parameters())))
    delta = 1e-3  # small δ so that the normalisation is active
    normalizer = ClipBiasNormalizer(policy.parameters(), delta=delta)
    normalizer.backward(out.loss, out.clip_bias)
    metrics = normalizer.apply()
    c_norm = metrics["sorl/c_norm"]
    assert c_norm > delta
    assert_close(metrics["sorl/scale"], 1 / c_norm)
    scaled = flat([p.grad for p in policy.parameters()])
    assert_close(scaled, ppo_grad / c_norm)
    assert_close(metrics["sorl/pg_grad_norm"], ppo_grad.norm())
    assert scaled.norm() <= ppo_grad.norm() / delta
    assert float(normalizer.c_norm()) == 0  # reset after apply


def test_gradient_accumulation_matches_full_batch():
    # seq-mean-token-sum over equal-size micro-batches: the full-batch loss is the mean of the halves,
    # so weights 1/2 must reproduce the full-batch gradient and C.
    policy = TinyPolicy()
    tokens, mask, adv = toy_batch()
    old = perturbed(policy, 0.3)(tokens).detach()
    agg = "seq-mean-token-sum"

    full = copy.deepcopy(policy)
    n_full = ClipBiasNormalizer(full.parameters(), delta=1e-3)
    out = clipped_policy_loss(full(tokens), old, adv, mask, level="turn", agg=agg)
    n_full.backward(out.loss, out.clip_bias)
    c_full = flat(n_full.c_buffers).clone()
    m_full = n_full.apply()

    micro = copy.deepcopy(policy)
    n_micro = ClipBiasNormalizer(micro.parameters(), delta=1e-3)
    for rows in (slice(0, 3), slice(3, 6)):
        out = clipped_policy_loss(micro(tokens[rows]), old[rows], adv[rows], mask[rows], level="turn", agg=agg)
        n_micro.backward(0.5 * out.loss, 0.5 * out.clip_bias)
    assert_close(flat(n_micro.c_buffers), c_full)
    m_micro = n_micro.apply()
    assert_close(m_micro["sorl/c_norm"], m_full["sorl/c_norm"])
    assert_close(flat([p.grad for p in micro.parameters()]), flat([p.grad for p in full.parameters()]))


def test_only_trainable_parameters_are_tracked_and_skip_flag():
    policy = TinyPolicy()
    policy.embed.weight.requires_grad_(False)  # like a frozen base under LoRA
    tokens, mask, adv = toy_batch()
    old = perturbed(policy, 0.3)(tokens).detach()
    normalizer = ClipBiasNormalizer(policy.parameters())
    assert len(normalizer.parameters) == 4
    out = clipped_policy_loss(policy(tokens), old, adv, mask)
    normalizer.backward(out.loss, out.clip_bias, skip_clip_bias=True)
    assert float(normalizer.c_norm()) == 0 and policy.embed.weight.grad is None


def test_bad_arguments():
    with pytest.raises(ValueError, match="delta must be > 0"):
        ClipBiasNormalizer(TinyPolicy().parameters(), delta=0)
    frozen = TinyPolicy().requires_grad_(False)
    with pytest.raises(ValueError, match="no trainable parameters"):
        ClipBiasNormalizer(frozen.parameters())
