"""Conventions the audit named, pinned: GAE against Search-R1's recursion, GAE whitening, and the
empty-row convention of the token-sum aggregations against veRL's."""

from __future__ import annotations

import torch
from torch.testing import assert_close

from stratarl.algos import (
    AdvantageBatch,
    aggregate_loss,
    gae_advantages,
    get_advantage,
    masked_whiten,
    outcome_to_token_rewards,
)

# Two rollouts: policy tokens, an observation block (mask 0), policy tokens; the second is padded.
MASK = torch.tensor([[1, 1, 0, 0, 1, 1], [1, 0, 0, 1, 0, 0]])
REWARDS = torch.tensor([1.0, -0.5])


def _search_r1_gae(token_rewards, values, gamma, lam):
    """Search-R1's compute_gae_advantage_return before whitening: the recursion over every response token
    (its eos_mask is the attention mask, so observations are steps too); padding ends the rollout, so the
    slow loop runs each row only up to its last real token."""
    B, T = token_rewards.shape
    out = torch.zeros(B, T)
    for b in range(B):
        last = int(MASK[b].nonzero().max())
        running = 0.0
        for t in range(last, -1, -1):
            next_value = float(values[b, t + 1]) if t < last else 0.0
            delta = float(token_rewards[b, t]) + gamma * next_value - float(values[b, t])
            running = delta + gamma * lam * running
            out[b, t] = running
    return out


def test_with_gamma_lambda_one_skipping_observations_matches_search_r1_on_policy_tokens():
    values = torch.tensor([[0.2, 0.1, 0.9, -0.4, 0.3, 0.5], [0.7, 0.3, -0.2, 0.1, 0.0, 0.0]])
    token_rewards = outcome_to_token_rewards(REWARDS, MASK)
    ours, _ = gae_advantages(token_rewards, values, MASK)
    theirs = _search_r1_gae(token_rewards, values, 1.0, 1.0)
    policy = MASK.bool()
    assert_close(ours[policy], theirs[policy])
    # Hand check, row 0 token 0: A = R - V(s_0) = 1 - 0.2 (the sum of deltas telescopes).
    assert_close(ours[0, 0], torch.tensor(0.8))
    # With gamma < 1 the observation tokens count as steps in Search-R1's recursion and the two differ.
    ours, _ = gae_advantages(token_rewards, values, MASK, gamma=0.9, lam=0.95)
    theirs = _search_r1_gae(token_rewards, values, 0.9, 0.95)
    assert not torch.allclose(ours[policy], theirs[policy], atol=1e-4)


def test_masked_whiten_hand_case_and_edges():
    x = torch.tensor([[1.0, 2.0, 99.0], [3.0, -7.0, 5.0]])
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    # masked entries 1, 2, 3: mean 2, unbiased var ((1)^2 + 0 + 1^2) / 2 = 1.
    expected = torch.tensor([[-1.0, 0.0, 0.0], [1.0, 0.0, 0.0]]) / (1 + 1e-8) ** 0.5
    assert_close(masked_whiten(x, mask), expected)
    assert torch.equal(masked_whiten(x, torch.zeros(2, 3)), torch.zeros(2, 3))
    one = masked_whiten(x, torch.tensor([[0, 1, 0], [0, 0, 0]]))
    assert torch.equal(one, torch.zeros(2, 3))  # one entry: centred to 0, never NaN


def test_gae_whitening_is_an_option_of_the_estimator_and_leaves_returns_alone():
    values = torch.rand(2, 6, generator=torch.Generator().manual_seed(1))
    batch = AdvantageBatch(rewards=REWARDS, group_ids=torch.tensor([0, 0]), response_mask=MASK, values=values)
    plain, plain_returns = get_advantage("gae")(batch)
    white, white_returns = get_advantage("gae")(batch, whiten=True)
    assert_close(white, masked_whiten(plain, MASK))
    assert torch.equal(white_returns, plain_returns)
    policy = MASK.bool()
    assert_close(white[policy].mean(), torch.tensor(0.0), atol=1e-6, rtol=0)
    assert_close(white[policy].var(), torch.tensor(1.0), atol=1e-5, rtol=0)
    assert not torch.allclose(white, plain)


def test_token_sum_modes_count_empty_rows_and_veRL_divides_by_the_non_empty_ones():
    loss = torch.tensor([[1.0, 2.0], [5.0, 5.0], [3.0, 0.0]])
    mask = torch.tensor([[1, 1], [0, 0], [1, 0]])
    # Σ per row: 3, 0 (empty), 3 -> ours: 6 / 3 rows = 2; veRL 0.9.1 (local counts): 6 / 2 non-empty rows = 3.
    ours = aggregate_loss(loss, mask, "seq-mean-token-sum")
    assert_close(ours, torch.tensor(2.0))
    non_empty = int(mask.any(dim=1).sum())
    assert_close(ours * mask.shape[0] / non_empty, torch.tensor(3.0))
    assert_close(aggregate_loss(loss, mask, "seq-mean-token-sum-norm", norm_length=4), torch.tensor(2.0 / 4))


def test_clip_fractions_are_disjoint_so_the_veRL_plugin_can_report_veRLs_pg_clipfrac():
    """The plugin's actor/pg_clipfrac is clip_frac_low + clip_frac_high (veRL's vanilla leaves dual-clipped
    tokens out of it): that needs the three kinds to be disjoint and to add up to clip_frac."""
    from stratarl.algos import clipped_policy_loss

    g = torch.Generator().manual_seed(3)
    log_probs = torch.randn(8, 12, generator=g)
    old = log_probs + 1.5 * torch.randn(8, 12, generator=g)  # far off-policy: every kind of clip occurs
    adv = torch.randn(8, 12, generator=g)
    mask = (torch.rand(8, 12, generator=g) > 0.2).long()
    m = clipped_policy_loss(log_probs, old, adv, mask, clip_low=0.2, clip_high=0.28, dual_clip=3.0).metrics
    assert m["loss/clip_frac_low"] > 0 and m["loss/clip_frac_high"] > 0 and m["loss/clip_frac_dual"] > 0
    assert_close(m["loss/clip_frac"], m["loss/clip_frac_low"] + m["loss/clip_frac_high"] + m["loss/clip_frac_dual"])
