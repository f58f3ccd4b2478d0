"""GiGPO (arXiv 2505.10978): hand-derived cases, the loop oracle, invariances, the edges, the registered estimator."""

from __future__ import annotations

import math

import pytest
import torch
from algos_oracles import gigpo_loop, grpo_loop, policy_runs_loop
from torch.testing import assert_close

from stratarl.algos import AdvantageBatch, broadcast_to_tokens, get_advantage, grpo_advantages
from stratarl.algos.gigpo import (
    STATE_SEPARATOR,
    anchor_state,
    gigpo_advantages,
    step_advantages,
    step_group_metrics,
    step_groups,
    step_returns,
    token_step_ids,
)
from stratarl.algos.registry import advantage_info, keyword_params

S = STATE_SEPARATOR
# One prompt, four rollouts (turns = runs of 1s):
#   r0  1 1 0 1 0   2 turns, R = 1, states ("", A)
#   r1  1 0 1 1 1   2 turns, R = 0, states ("", A)
#   r2  1 1 1 0 0   1 turn,  R = 1, states ("",)
#   r3  1 0 1 0 1   3 turns, R = 1, states ("", B, B C)
MASK = torch.tensor([[1, 1, 0, 1, 0], [1, 0, 1, 1, 1], [1, 1, 1, 0, 0], [1, 0, 1, 0, 1]])
REWARDS = torch.tensor([1.0, 0.0, 1.0, 1.0])
GROUPS = torch.tensor([7, 7, 7, 7])
STATES = (("", S + "A"), ("", S + "A"), ("",), ("", S + "B", S + "B" + S + "C"))


def _ids(states=STATES, groups=GROUPS, mask=MASK, threshold=None):
    return token_step_ids(step_groups(states, groups, similarity_threshold=threshold), mask)


def _batch(**kwargs):
    fields = {"rewards": REWARDS, "group_ids": GROUPS, "response_mask": MASK, "step_states": STATES}
    fields.update(kwargs)
    return AdvantageBatch(**fields)


def test_hand_derived():
    # Episode: R = [1, 0, 1, 1], mean 0.75, Bessel var (3·0.0625 + 0.5625)/3 = 0.25, std 0.5:
    #   A^E = [0.25, −0.75, 0.25, 0.25] / (0.5 + ε) ≈ [0.5, −1.5, 0.5, 0.5].
    # Step returns, γ = 0.5: r0 (0.5, 1), r1 (0, 0), r2 (1,), r3 (0.25, 0.5, 1).
    # Turn-0 group {0.5, 0, 1, 0.25}: mean 0.4375, deviations (0.0625, −0.4375, 0.5625, −0.1875),
    #   Bessel var 0.546875 / 3, std s0 = 0.42696.
    # Group A {1, 0} (r0 and r1 after the same observation): mean 0.5, std √0.5 → ±0.5 / √0.5 = ±0.7071.
    # B and B C are alone: A^S = 0.  A = A^E + ω·A^S with ω = 2 on every token of the turn.
    e, s0, sa = 1e-6, math.sqrt(0.546875 / 3) + 1e-6, math.sqrt(0.5) + 1e-6
    ae = [0.25 / (0.5 + e), -0.75 / (0.5 + e), 0.25 / (0.5 + e), 0.25 / (0.5 + e)]
    w = 2.0
    expected = torch.tensor(
        [
            [ae[0] + w * 0.0625 / s0] * 2 + [0.0, ae[0] + w * 0.5 / sa, 0.0],
            [ae[1] - w * 0.4375 / s0, 0.0] + [ae[1] - w * 0.5 / sa] * 3,
            [ae[2] + w * 0.5625 / s0] * 3 + [0.0, 0.0],
            [ae[3] - w * 0.1875 / s0, 0.0, ae[3], 0.0, ae[3]],
        ]
    )
    out = gigpo_advantages(REWARDS, GROUPS, MASK, _ids(), gamma=0.5, step_weight=w)
    assert_close(out, expected)


def test_step_returns_hand_case():
    # γ^(K−1−t)·R per turn: r0 (0.5, 1), r1 zeros, r2 (1,), r3 (0.25, 0.5, 1); 0 on observations.
    expected = torch.tensor([[0.5, 0.5, 0, 1, 0], [0, 0, 0, 0, 0], [1, 1, 1, 0, 0], [0.25, 0, 0.5, 0, 1]])
    assert_close(step_returns(REWARDS, MASK, gamma=0.5), expected)
    assert torch.equal(step_returns(REWARDS, MASK, gamma=1.0), REWARDS[:, None] * MASK)
    last_turn_only = torch.tensor([[0, 0, 0, 1, 0], [0, 0, 0, 0, 0], [1, 1, 1, 0, 0], [0, 0, 0, 0, 1.0]])
    assert torch.equal(step_returns(REWARDS, MASK, gamma=0.0), last_turn_only)  # 0^0 = 1 on the last turn


def random_case(seed, groups=4, group_size=5, max_turns=4, T=14, alphabet="abc", near=False):
    """Rollouts of ``groups`` prompts with 0..max_turns turns; observation texts drawn from a tiny alphabet so
    states repeat. ``near``: texts are long near-duplicates, so similarity pools what exact matching splits."""
    gen = torch.Generator().manual_seed(seed)
    B = groups * group_size
    mask = torch.zeros(B, T, dtype=torch.long)
    states = []
    for b in range(B):
        turns = int(torch.randint(0, max_turns + 1, (1,), generator=gen))
        t, history, row = 0, [], []
        for _ in range(turns):
            length = int(torch.randint(1, 3, (1,), generator=gen))
            if t + length > T:
                break
            mask[b, t : t + length] = 1
            row.append(anchor_state(history))
            t += length + 1  # one observation token after every turn
            letter = alphabet[int(torch.randint(0, len(alphabet), (1,), generator=gen))]
            text = ("x" * 60 + letter + str(int(torch.randint(0, 2, (1,), generator=gen)))) if near else letter
            history.append(text)
        states.append(tuple(row))
    rewards = torch.randn(B, generator=gen)
    group_ids = (torch.arange(groups).repeat_interleave(group_size) * 3 - 5)[torch.randperm(B, generator=gen)]
    return rewards, group_ids, mask, tuple(states)


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
@pytest.mark.parametrize("gamma, weight, scale, ddof", [(1.0, 1.0, True, 1), (0.9, 0.5, True, 0), (0.7, 1.0, False, 1)])
def test_matches_loop_oracle(seed, gamma, weight, scale, ddof):
    rewards, groups, mask, states = random_case(seed)
    ids = _ids(states, groups, mask)
    out = gigpo_advantages(
        rewards, groups, mask, ids, gamma=gamma, step_weight=weight, scale_by_std=scale, std_ddof=ddof
    )
    expected, clusters = gigpo_loop(
        rewards, groups, mask, states, gamma=gamma, step_weight=weight, scale_by_std=scale, std_ddof=ddof
    )
    assert_close(out.double(), expected, rtol=1e-5, atol=1e-5)
    assert sorted(step_group_metrics_sizes(states, groups)) == sorted(len(c) for c in clusters)
    assert any(len(c) > 1 for c in clusters) and any(len(c) == 1 for c in clusters)  # both kinds occur


def step_group_metrics_sizes(states, groups, threshold=None):
    ids = step_groups(states, groups, similarity_threshold=threshold)
    return [sum(i == g for row in ids for i in row) for g in sorted({i for row in ids for i in row})]


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("threshold", [0.9, 0.99])
def test_similarity_mode_matches_loop_oracle(seed, threshold):
    rewards, groups, mask, states = random_case(seed, near=True)
    ids = _ids(states, groups, mask, threshold)
    expected, clusters = gigpo_loop(rewards, groups, mask, states, gamma=0.9, similarity_threshold=threshold)
    assert_close(gigpo_advantages(rewards, groups, mask, ids, gamma=0.9).double(), expected, rtol=1e-5, atol=1e-5)
    assert sorted(step_group_metrics_sizes(states, groups, threshold)) == sorted(len(c) for c in clusters)
    exact = step_group_metrics_sizes(states, groups)
    if threshold == 0.9:  # the texts differ in 2 of ~62 characters: ratio ≈ 0.97, so 0.9 pools what exact splits
        assert len(clusters) < len(exact)


def test_similarity_clusters_greedily_in_rollout_order():
    # a ~ b and b ~ c but not a ~ c: b joins a's cluster; c is compared with a (its cluster's first state) only.
    a, b, c = "x" * 18 + "aa", "x" * 18 + "ab", "x" * 18 + "bb"
    groups = torch.tensor([0, 0, 0])
    ratio = lambda p, q: __import__("difflib").SequenceMatcher(None, p, q).ratio()  # noqa: E731
    assert ratio(b, a) >= 0.95 and ratio(c, b) >= 0.95 and ratio(c, a) < 0.95
    assert step_groups([[a], [b], [c]], groups, similarity_threshold=0.95) == ((0,), (0,), (1,))
    assert step_groups([[b], [a], [c]], groups, similarity_threshold=0.95) == ((0,), (0,), (0,))  # order matters
    assert step_groups([[a], [b], [c]], groups) == ((0,), (1,), (2,))  # exact matching never pools these


def test_step_weight_zero_is_grpo_bit_for_bit():
    rewards, groups, mask, states = random_case(5)
    ids = _ids(states, groups, mask)
    grpo = broadcast_to_tokens(grpo_advantages(rewards, groups), mask)
    for gamma in (1.0, 0.8):
        assert torch.equal(gigpo_advantages(rewards, groups, mask, ids, gamma=gamma, step_weight=0.0), grpo)
    batch = AdvantageBatch(rewards=rewards, group_ids=groups, response_mask=mask, step_states=states)
    assert torch.equal(get_advantage("gigpo")(batch, step_weight=0.0)[0], get_advantage("grpo")(batch)[0])


def test_with_gamma_one_and_no_shared_later_state_the_first_turn_doubles_grpo():
    # γ = 1: every return is R, so the turn-0 group (the whole prompt group) normalises exactly GRPO's values:
    # A^S = A^E on turn 0; later states all distinct → A^S = 0 there. Hence A = 2·A^E on turn 0, A^E after.
    states = (("", S + "p"), ("", S + "q"), ("",), ("", S + "r", S + "r" + S + "s"))
    out = gigpo_advantages(REWARDS, GROUPS, MASK, _ids(states))
    episode = grpo_advantages(REWARDS, GROUPS)
    first = torch.tensor([[1, 1, 0, 0, 0], [1, 0, 0, 0, 0], [1, 1, 1, 0, 0], [1, 0, 0, 0, 0]]).bool()
    assert torch.equal(out, torch.where(first, 2 * episode[:, None], episode[:, None] * MASK))


def test_gamma_below_one_prefers_fewer_turns_at_equal_reward():
    # All R = 1: A^E = 0. γ = 0.5: turn-0 returns r0 0.5, r1 0.5, r2 1 (one turn), r3 0.25 — the one-turn
    # rollout gets the largest step advantage, the three-turn one the smallest: a penalty on searching.
    out = gigpo_advantages(torch.ones(4), GROUPS, MASK, _ids(), gamma=0.5)
    first = [out[0, 0], out[1, 0], out[2, 0], out[3, 0]]
    assert first[2] > first[0] == first[1] > first[3]
    assert out[0, 3] == 0 and out[1, 2] == 0  # group A: equal returns (1, 1) → exactly 0
    assert torch.equal(gigpo_advantages(torch.ones(4), GROUPS, MASK, _ids(), gamma=1.0), torch.zeros(4, 5))


def test_singletons_all_equal_and_empty_give_zero_never_nan():
    ids = _ids()
    # All rewards 0: every return is 0 for any γ → all zeros.
    assert torch.equal(gigpo_advantages(torch.zeros(4), GROUPS, MASK, ids, gamma=0.7), torch.zeros(4, 5))
    # Every rollout its own prompt group: A^E = 0 and every step group is a singleton.
    alone = torch.arange(4)
    assert torch.equal(gigpo_advantages(REWARDS, alone, MASK, _ids(groups=alone), gamma=0.7), torch.zeros(4, 5))
    # A row without policy tokens, and an empty batch.
    mask = MASK.clone()
    mask[1] = 0
    states = (STATES[0], (), STATES[2], STATES[3])
    out = gigpo_advantages(REWARDS, GROUPS, mask, _ids(states, mask=mask), gamma=0.5)
    assert torch.isfinite(out).all() and torch.equal(out[1], torch.zeros(5))
    empty = gigpo_advantages(
        torch.zeros(0), torch.zeros(0, dtype=torch.long), torch.zeros(0, 3), torch.zeros(0, 3, dtype=torch.long)
    )
    assert empty.shape == (0, 3)
    assert torch.equal(step_advantages(REWARDS, GROUPS, torch.zeros(4, 5), torch.full((4, 5), -1)), torch.zeros(4, 5))


def test_permuting_rollouts_within_and_across_groups_permutes_the_advantages():
    rewards, groups, mask, states = random_case(7, groups=3)
    base = gigpo_advantages(rewards, groups, mask, _ids(states, groups, mask), gamma=0.9)
    perm = torch.randperm(len(rewards), generator=torch.Generator().manual_seed(1))
    p_states = tuple(states[i] for i in perm.tolist())
    out = gigpo_advantages(rewards[perm], groups[perm], mask[perm], _ids(p_states, groups[perm], mask[perm]), gamma=0.9)
    assert_close(out, base[perm])
    relabelled = groups * 11 + 40  # group ids are labels only
    assert_close(gigpo_advantages(rewards, relabelled, mask, _ids(states, relabelled, mask), gamma=0.9), base)


def test_equal_states_in_different_prompt_groups_never_pool():
    groups = torch.tensor([0, 0, 1, 1])
    together = gigpo_advantages(REWARDS, groups, MASK, _ids(groups=groups), gamma=0.5)
    for g in (0, 1):
        rows = (groups == g).nonzero().flatten()
        sub_states = tuple(STATES[i] for i in rows.tolist())
        alone = gigpo_advantages(
            REWARDS[rows], groups[rows], MASK[rows], _ids(sub_states, groups[rows], MASK[rows]), gamma=0.5
        )
        assert torch.equal(together[rows], alone)
    same = torch.where(MASK.bool(), 0, -1)  # one id for every turn of both prompts
    separate = torch.where(MASK.bool(), groups[:, None].expand_as(MASK), -1)  # ids that differ per prompt
    assert torch.equal(
        step_advantages(REWARDS, groups, MASK, same, gamma=0.5),
        step_advantages(REWARDS, groups, MASK, separate, gamma=0.5),
    )


@pytest.mark.parametrize("scale", [2.5, 0.1])
def test_scaling_rewards_leaves_the_normalised_advantages_unchanged(scale):
    rewards, groups, mask, states = random_case(11)
    ids = _ids(states, groups, mask)
    for gamma in (1.0, 0.8):
        base = gigpo_advantages(rewards, groups, mask, ids, gamma=gamma, eps=0.0)
        assert_close(
            gigpo_advantages(rewards * scale, groups, mask, ids, gamma=gamma, eps=0.0), base, rtol=1e-4, atol=1e-4
        )


def test_shifting_rewards_is_invariant_only_without_discount():
    # R → R + b: with γ = 1 every return shifts by b inside a prompt group (invariant); with γ < 1 the return
    # of turn t shifts by γ^(K−1−t)·b, which differs between rollouts of different lengths (not invariant).
    rewards, groups, mask, states = random_case(12)
    ids = _ids(states, groups, mask)
    base = gigpo_advantages(rewards, groups, mask, ids, eps=0.0)
    assert_close(gigpo_advantages(rewards + 3.0, groups, mask, ids, eps=0.0), base, rtol=1e-4, atol=1e-4)
    discounted = gigpo_advantages(rewards, groups, mask, ids, gamma=0.8, eps=0.0)
    assert not torch.allclose(
        gigpo_advantages(rewards + 3.0, groups, mask, ids, gamma=0.8, eps=0.0), discounted, atol=1e-3
    )


def test_inputs_are_checked_and_never_mutated():
    ids = _ids()
    before = (REWARDS.clone(), MASK.clone(), ids.clone())
    gigpo_advantages(REWARDS, GROUPS, MASK, ids, gamma=0.5)
    assert all(torch.equal(x, y) for x, y in zip(before, (REWARDS, MASK, ids)))
    varying = ids.clone()
    varying[0, 1] = varying[0, 0] + 1  # two ids inside r0's first turn
    with pytest.raises(ValueError, match="constant over each turn"):
        gigpo_advantages(REWARDS, GROUPS, MASK, varying)
    with pytest.raises(ValueError, match=">= 0 on policy tokens"):
        gigpo_advantages(REWARDS, GROUPS, MASK, torch.where(MASK.bool(), -1, -1))
    with pytest.raises(TypeError, match="integer"):
        gigpo_advantages(REWARDS, GROUPS, MASK, ids.float())
    with pytest.raises(ValueError, match="gamma"):
        gigpo_advantages(REWARDS, GROUPS, MASK, ids, gamma=1.5)
    with pytest.raises(ValueError, match="rollout 2 has 1 policy turns in its response mask but 2 step states"):
        token_step_ids([[0, 1], [0, 1], [0, 3], [0, 1, 2]], MASK)
    with pytest.raises(ValueError, match="similarity_threshold"):
        step_groups(STATES, GROUPS, similarity_threshold=0.0)


def test_anchor_state_and_step_groups():
    assert anchor_state([]) == "" and anchor_state([""]) != anchor_state([])  # an empty observation still counts
    assert anchor_state(["a", "b"]) != anchor_state(["ab"])
    # Turn 0 of every rollout of a prompt shares one state; A (r0, r1) pools; B, B C are alone.
    assert step_groups(STATES, GROUPS) == ((0, 1), (0, 1), (0,), (0, 2, 3))
    assert torch.equal(
        _ids(), torch.tensor([[0, 0, -1, 1, -1], [0, -1, 1, 1, 1], [0, 0, 0, -1, -1], [0, -1, 2, -1, 3]])
    )


def test_registered_estimator_its_parameters_and_metrics():
    assert keyword_params(get_advantage("gigpo")) == {
        "gamma": 1.0,
        "step_weight": 1.0,
        "eps": 1e-6,
        "std_ddof": 1,
        "scale_by_std": True,
        "similarity_threshold": None,
    }
    info = advantage_info("gigpo")
    assert info.group_relative and info.needs_step_states and not info.needs_values and info.metrics is not None
    adv, ret = get_advantage("gigpo")(_batch(), gamma=0.5, step_weight=2.0)
    assert adv is ret and torch.equal(adv, gigpo_advantages(REWARDS, GROUPS, MASK, _ids(), gamma=0.5, step_weight=2.0))
    with pytest.raises(ValueError, match="needs AdvantageBatch.step_states"):
        get_advantage("gigpo")(_batch(step_states=None))
    # Groups: turn 0 (4 steps), A (2), B (1), B C (1): mean size 2, 2 of 8 steps alone, 2 of 4 later steps alone.
    metrics = info.metrics(_batch(), gamma=0.5, similarity_threshold=None)
    assert metrics == {
        "gigpo/step_group_size_mean": 2.0,
        "gigpo/step_group_size_max": 4.0,
        "gigpo/singleton_step_frac": 0.25,
        "gigpo/later_singleton_step_frac": 0.5,
        "gigpo/step_groups": 4.0,
        "gigpo/step_group_size_frac/1": 0.5,
        "gigpo/step_group_size_frac/2": 0.25,
        "gigpo/step_group_size_frac/3": 0.0,
        "gigpo/step_group_size_frac/4+": 0.25,
    }
    assert step_group_metrics(())["gigpo/singleton_step_frac"] == 0.0  # empty batch: zeros


def test_oracle_turns_agree_with_the_mask_runs():
    assert [len(policy_runs_loop(row)) for row in MASK] == [2, 2, 1, 3]
    assert torch.equal(grpo_loop(REWARDS, GROUPS), grpo_advantages(REWARDS, GROUPS))
