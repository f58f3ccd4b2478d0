"""Turn structure from the mask and importance ratios at three levels."""

from __future__ import annotations

import pytest
import torch
from algos_oracles import ratios_loop, turn_ids_loop
from torch.testing import assert_close

from stratarl.algos import (
    cap_strata,
    importance_ratios,
    num_turns,
    search_counts,
    turn_ids,
    turn_start_mask,
)

MASK = torch.tensor(
    [
        [1, 1, 0, 0, 1, 0, 1, 1],  # 3 turns, 2 observations
        [1, 1, 1, 1, 1, 0, 0, 0],  # 1 turn + padding, 0 observations
        [0, 0, 0, 0, 0, 0, 0, 0],  # empty
        [0, 1, 0, 1, 1, 1, 1, 1],  # starts with a 0-run: not an observation between two turns
    ]
)


def random_mask(seed, batch=6, length=20):
    gen = torch.Generator().manual_seed(seed)
    mask = torch.rand(batch, length, generator=gen) < 0.6
    mask[0] = False
    mask[1] = True
    return mask


def test_turn_ids_hand_case():
    expected = torch.tensor(
        [
            [0, 0, -1, -1, 1, -1, 2, 2],
            [0, 0, 0, 0, 0, -1, -1, -1],
            [-1] * 8,
            [-1, 0, -1, 1, 1, 1, 1, 1],
        ]
    )
    assert torch.equal(turn_ids(MASK), expected)
    assert torch.equal(turn_ids(MASK.bool()), expected)
    assert torch.equal(num_turns(MASK), torch.tensor([3, 1, 0, 2]))
    assert torch.equal(turn_start_mask(MASK).sum(dim=1), num_turns(MASK))


@pytest.mark.parametrize("seed", range(3))
def test_turn_ids_matches_loop(seed):
    mask = random_mask(seed)
    assert torch.equal(turn_ids(mask.float()), turn_ids_loop(mask))


def test_search_counts_from_mask():
    assert torch.equal(search_counts(MASK), torch.tensor([2, 0, 0, 1]))
    # A trailing observation (cut right after a search result) counts only with valid_mask.
    mask = torch.tensor([[1, 1, 0, 0, 1, 0, 0, 0]])
    valid = torch.tensor([[1, 1, 1, 1, 1, 1, 1, 0]])
    assert torch.equal(search_counts(mask), torch.tensor([1]))
    assert torch.equal(search_counts(mask, valid), torch.tensor([2]))
    assert torch.equal(cap_strata(torch.tensor([0, 1, 4, 7]), 2), torch.tensor([0, 1, 2, 2]))
    assert torch.equal(cap_strata(torch.tensor([0, 5]), None), torch.tensor([0, 5]))


def test_mask_with_other_values_is_rejected():
    with pytest.raises(ValueError, match="only 0 and 1"):
        turn_ids(torch.tensor([[1, 2, 0]]))
    with pytest.raises(ValueError, match="must be 2-D"):
        turn_ids(torch.tensor([1, 0]))


class TestImportanceRatios:
    def test_hand_derived_turn_ratio(self):
        # Row mask 1 1 0 1: turn 0 = tokens 0,1 with Δ = log 2, log 8 → w_0 = exp((log 2 + log 8)/2) = √16 = 4.
        # turn 1 = token 3 with Δ = log 0.5 → w_1 = 0.5. Sequence: exp((log 2 + log 8 + log 0.5)/3) = 8^(1/3) = 2.
        mask = torch.tensor([[1, 1, 0, 1]])
        old = torch.zeros(1, 4)
        new = torch.log(torch.tensor([[2.0, 8.0, 123.0, 0.5]]))
        assert_close(importance_ratios(new, old, mask, level="token"), torch.tensor([[2.0, 8.0, 1.0, 0.5]]))
        assert_close(importance_ratios(new, old, mask, level="turn"), torch.tensor([[4.0, 4.0, 1.0, 0.5]]))
        assert_close(importance_ratios(new, old, mask, level="sequence"), torch.tensor([[2.0, 2.0, 1.0, 2.0]]))

    @pytest.mark.parametrize("level", ["token", "turn", "sequence"])
    @pytest.mark.parametrize("seed", range(2))
    def test_matches_loop_oracle(self, level, seed):
        mask = random_mask(seed)
        gen = torch.Generator().manual_seed(100 + seed)
        new, old = torch.randn(*mask.shape, generator=gen), torch.randn(*mask.shape, generator=gen)
        assert_close(importance_ratios(new, old, mask, level=level), ratios_loop(new, old, mask, level))

    def test_turn_ratio_between_min_and_max_token_ratio(self):
        mask = random_mask(5)
        gen = torch.Generator().manual_seed(5)
        new, old = torch.randn(*mask.shape, generator=gen), torch.randn(*mask.shape, generator=gen)
        tok = importance_ratios(new, old, mask, level="token")
        turn = importance_ratios(new, old, mask, level="turn")
        ids = turn_ids(mask)
        for b in range(mask.shape[0]):
            for k in range(int(ids[b].max()) + 1):
                members = ids[b] == k
                w = turn[b][members]
                assert bool((w >= tok[b][members].min() * (1 - 1e-6)).all())
                assert bool((w <= tok[b][members].max() * (1 + 1e-6)).all())

    def test_theta_equals_old_gives_ones(self):
        mask = random_mask(7)
        lp = torch.randn(*mask.shape)
        for level in ("token", "turn", "sequence"):
            assert torch.equal(importance_ratios(lp, lp.clone(), mask, level=level), torch.ones_like(lp))

    def test_gradient_of_turn_ratio_is_shared_across_the_turn(self):
        # d w_k / d logp_t = w_k / |y^k| for every t in turn k, and 0 for masked tokens.
        mask = torch.tensor([[1, 1, 1, 0, 1]])
        new = torch.tensor([[0.1, -0.3, 0.5, 2.0, 0.2]], requires_grad=True)
        w = importance_ratios(new, torch.zeros(1, 5), mask, level="turn")
        w[0, 0].backward()
        w0 = torch.exp(torch.tensor(0.3 / 3))
        assert_close(new.grad, torch.tensor([[w0 / 3, w0 / 3, w0 / 3, 0.0, 0.0]]))

    def test_unknown_level_and_garbage_on_masked_tokens(self):
        mask = torch.tensor([[1, 0]])
        new = torch.tensor([[0.0, float("-inf")]])
        old = torch.tensor([[0.0, float("-inf")]])  # -inf − -inf = NaN on a masked token must not leak
        for level in ("token", "turn", "sequence"):
            assert torch.equal(importance_ratios(new, old, mask, level=level), torch.ones(1, 2))
        with pytest.raises(ValueError, match="valid levels: token, turn, sequence"):
            importance_ratios(new, old, mask, level="episode")
