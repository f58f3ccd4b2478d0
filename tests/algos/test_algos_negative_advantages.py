"""REINFORCE without a baseline, GRPO's positive half, and the two diagnostics of what an update pushes (the
negative mass share, the critic's explained variance): hand-derived cases and the registry wiring."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
from torch.testing import assert_close

from stratarl.algos import (
    AdvantageBatch,
    explained_variance,
    get_advantage,
    grpo_advantages,
    negative_mass_share,
    positive_part,
    reinforce_advantages,
)
from stratarl.algos.registry import advantage_info
from stratarl.trainer.config import load_config
from stratarl.trainer.config.resolve import bound_advantage
from stratarl.trainer.step import advantage_diagnostics

MASK = torch.tensor([[1, 1, 0, 1], [1, 0, 0, 0], [1, 1, 1, 0], [0, 1, 1, 1]])


def _batch(rewards, groups):
    return AdvantageBatch(rewards=torch.tensor(rewards), group_ids=torch.tensor(groups), response_mask=MASK)


def test_reinforce_is_the_reward_itself():
    rewards = torch.tensor([1.0, 0.0, 0.5, 1.0])
    out = reinforce_advantages(rewards)
    assert_close(out, rewards)
    assert out.data_ptr() != rewards.data_ptr()  # a copy, never the caller's tensor
    assert reinforce_advantages(torch.tensor([1, 0])).dtype == torch.float32


def test_reinforce_estimator_broadcasts_r_on_policy_tokens_only():
    adv, ret = get_advantage("reinforce")(_batch([1.0, 0.0, 1.0, 0.25], [0, 0, 1, 1]))
    want = torch.tensor([[1.0, 1, 0, 1], [0, 0, 0, 0], [1, 1, 1, 0], [0, 0.25, 0.25, 0.25]])
    assert_close(adv, want)
    assert_close(ret, want)
    assert not advantage_info("reinforce").group_relative  # no group: a group of one rollout keeps A = R


def test_positive_part_zeroes_only_the_negative_entries():
    assert_close(positive_part(torch.tensor([-1.5, 0.0, 0.2, -0.0, 3.0])), torch.tensor([0.0, 0, 0.2, 0, 3.0]))


def test_grpo_positive_hand_derived():
    # Group 0: R = [1, 0]: mean 0.5, std (ddof 1) = 1/sqrt(2): A_GN = ±0.7071 -> [0.7071, 0].
    # Group 1: R = [1, 1]: flat -> 0, 0.
    adv, _ = get_advantage("grpo_positive")(_batch([1.0, 0.0, 1.0, 1.0], [0, 0, 1, 1]))
    a = 0.5 / (math.sqrt(0.5) + 1e-6)
    assert_close(adv[0], torch.tensor([a, a, 0.0, a]))
    assert_close(adv[1:], torch.zeros(3, 4))
    # Against GRPO on random groups: equal where GRPO's advantage is >= 0, 0 elsewhere.
    gen = torch.Generator().manual_seed(0)
    rewards = (torch.rand(32, generator=gen) < 0.5).float()
    groups = torch.arange(8).repeat_interleave(4)
    mask = torch.ones(32, 3)
    gn = grpo_advantages(rewards, groups)
    pos, _ = get_advantage("grpo_positive")(AdvantageBatch(rewards=rewards, group_ids=groups, response_mask=mask))
    assert bool((gn < 0).any())
    assert_close(pos[:, 0], torch.where(gn > 0, gn, torch.zeros_like(gn)))
    assert advantage_info("grpo_positive").group_relative


@pytest.mark.parametrize(
    ("advantages", "want"),
    [
        # |A| mass over policy tokens: rows [2, 2, -, 2], [-1], [0.5, 0.5, 0.5], [-, -3, -3, -3]:
        # negative 1 + 9 = 10 of 6 + 1 + 1.5 + 9 = 17.5.
        ([[2.0, 2, 99, 2], [-1, 99, 99, 99], [0.5, 0.5, 0.5, 99], [-99, -3, -3, -3]], 10 / 17.5),
        ([[1.0, 1, -5, 1], [0, -7, 0, 0], [1, 1, 1, 0], [0, 0, 0, 0]], 0.0),  # negatives only off the mask
        ([[0.0] * 4] * 4, 0.0),  # no mass at all
    ],
)
def test_negative_mass_share_hand_derived(advantages, want):
    assert negative_mass_share(torch.tensor(advantages), MASK) == pytest.approx(want)


def test_negative_mass_share_of_balanced_grpo_groups_is_one_half():
    adv, _ = get_advantage("grpo")(_batch([1.0, 0.0, 0.0, 1.0], [0, 0, 1, 1]))
    # Every row has advantage ±a; the positive rows hold 3 + 3 policy tokens, the negative ones 1 + 3.
    assert negative_mass_share(adv, MASK) == pytest.approx(4 / 10)


def test_explained_variance_hand_derived():
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]])
    returns = torch.tensor([[1.0, 1.0, 9.0], [0.0, 0.0, 1.0]])  # on the mask: [1, 1, 0, 0, 1], var 0.24
    # A perfect critic explains all of it.
    assert explained_variance(returns, returns, mask) == pytest.approx(1.0)
    # V = the returns' mean (0.6) everywhere: nothing explained.
    assert explained_variance(torch.full((2, 3), 0.6), returns, mask) == pytest.approx(0.0, abs=1e-12)
    # V = 0 (a critic that has not learned): Var(R - 0) = Var(R) -> 0; a constant offset does not count.
    assert explained_variance(torch.zeros(2, 3), returns, mask) == pytest.approx(0.0, abs=1e-12)
    # V = [0, 0, -, 1, 1, 0]: residual on the mask [1, 1, -1, -1, 1], mean 0.2, var 1 - 0.04 = 0.96 -> 1 - 4 = -3.
    values = torch.tensor([[0.0, 0.0, 5.0], [1.0, 1.0, 0.0]])
    assert explained_variance(values, returns, mask) == pytest.approx(1 - 0.96 / 0.24)
    assert math.isnan(explained_variance(torch.zeros(2, 3), torch.ones(2, 3), mask))  # returns do not vary
    # Returns that are flat up to float rounding (A + V in float32) are flat: no -1e13 readings.
    rounded = torch.tensor([[1e-9, 0.0, 0.0], [0.0, -1e-9, 0.0]])
    assert math.isnan(explained_variance(torch.full((2, 3), 0.3), rounded, mask))


def test_step_logs_the_diagnostics_of_the_advantages_it_trains_on():
    returns = torch.tensor([[1.0, 1, 0, 1], [0, 0, 0, 0], [1, 1, 1, 0], [0, 0, 0, 0]])
    adv = returns - 0.5 * MASK
    batch = SimpleNamespace(advantages=adv, response_mask=MASK, old_values=None, returns=returns)
    out = advantage_diagnostics(batch)
    assert out == {"advantage/negative_mass_share": pytest.approx(4 / 10)}  # no critic: no critic/ key
    with_critic = advantage_diagnostics(SimpleNamespace(**{**vars(batch), "old_values": returns * MASK}))
    assert with_critic["critic/explained_variance"] == pytest.approx(1.0)
    flat = SimpleNamespace(**{**vars(batch), "old_values": torch.zeros(4, 4), "returns": torch.ones(4, 4)})
    assert "critic/explained_variance" not in advantage_diagnostics(flat)  # undefined when the returns are flat


@pytest.mark.parametrize(
    ("name", "rewards", "want_first"), [("reinforce", [1.0, 0.0], 1.0), ("grpo_positive", [0.0, 1.0], 0.0)]
)
def test_the_config_selects_the_estimator(name, rewards, want_first):
    spec = load_config(None, ["algo.name=grpo", f"algo.advantage={name}"]).algorithm
    assert spec.advantage == name
    adv, _ = bound_advantage(spec)(
        AdvantageBatch(rewards=torch.tensor(rewards), group_ids=torch.tensor([0, 0]), response_mask=torch.ones(2, 1))
    )
    assert float(adv[0, 0]) == pytest.approx(want_first)
    assert float(adv.min()) >= 0.0  # neither estimator pushes a token down with rewards in [0, 1]
