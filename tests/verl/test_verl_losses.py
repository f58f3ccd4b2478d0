"""Policy losses `turn_ppo` / `sorl` through veRL's registry: values and gradients vs stratarl and veRL."""

from __future__ import annotations

import pytest

# "verl.trainer…", not "verl": in the main venv this folder itself is importable as a namespace package "verl".
pytest.importorskip("verl.trainer.ppo.core_algos", reason="needs veRL (make test-verl runs these in .venv-verl)")

import torch
from verl.trainer.ppo import core_algos
from verl.workers.config import FSDPActorConfig

import stratarl.integrations.verl  # noqa: F401  (registers the losses)
from stratarl.algos import clipped_policy_loss
from stratarl.integrations.verl.config import SORLPolicyLossConfig
from stratarl.integrations.verl.losses import verl_aggregation_factor

VERL_AGG_MODES = ["token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-sum-norm", "seq-mean-token-mean"]


def actor_config(loss_mode: str = "turn_ppo", **overrides) -> FSDPActorConfig:
    fields = {
        "strategy": "fsdp",
        "ppo_mini_batch_size": 4,
        "ppo_micro_batch_size_per_gpu": 2,
        "rollout_n": 1,
        "clip_ratio": 0.2,
        "clip_ratio_low": 0.2,
        "clip_ratio_high": 0.28,
    }
    fields.update(overrides)
    return FSDPActorConfig(policy_loss=SORLPolicyLossConfig(loss_mode=loss_mode), **fields)


def multi_token_turns_mask() -> torch.Tensor:
    # Turns of 1–4 tokens separated by observations; row 3 is empty (all padding).
    return torch.tensor(
        [
            [1, 1, 1, 0, 0, 1, 1, 0, 1, 1, 1, 1],
            [1, 0, 0, 0, 1, 1, 1, 1, 0, 0, 0, 0],
            [1, 1, 1, 1, 1, 1, 0, 0, 1, 0, 0, 0],
            [0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0],
            [1, 1, 0, 1, 1, 0, 1, 1, 0, 1, 1, 0],
        ],
        dtype=torch.bool,
    )


def one_token_turns_mask() -> torch.Tensor:
    # Every turn is a single token (1 0 1 0 …): the turn ratio equals the token ratio.
    mask = torch.zeros(5, 12, dtype=torch.bool)
    mask[:, ::2] = True
    mask[4, 6:] = False
    return mask


def inputs(mask: torch.Tensor, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    old = -torch.rand(mask.shape, generator=gen) * 3
    # Large perturbations so that turns clip high, low and (dual) beyond c = 3.
    log_prob = (old + torch.randn(mask.shape, generator=gen) * 0.8).requires_grad_(True)
    adv = torch.randn(mask.shape[0], 1, generator=gen).expand(mask.shape).contiguous()
    adv = adv + 0.3 * torch.randn(mask.shape, generator=gen)  # token-varying advantages (GAE-like)
    return old, log_prob, adv


def value_and_grad(fn, log_prob):
    loss = fn(log_prob)
    (grad,) = torch.autograd.grad(loss, log_prob)
    return loss.detach(), grad


def test_turn_ppo_matches_stratarl_clipped_policy_loss():
    mask = multi_token_turns_mask()
    old, log_prob, adv = inputs(mask)
    config = actor_config()
    turn_ppo = core_algos.get_policy_loss_fn("turn_ppo")

    ours, ours_grad = value_and_grad(lambda lp: turn_ppo(old, lp, adv, mask, "token-mean", config)[0], log_prob)
    ref, ref_grad = value_and_grad(
        lambda lp: (
            clipped_policy_loss(
                lp, old, adv, mask, level="turn", clip_low=0.2, clip_high=0.28, dual_clip=3.0, agg="token-mean"
            ).loss
        ),
        log_prob,
    )
    torch.testing.assert_close(ours, ref)
    torch.testing.assert_close(ours_grad, ref_grad)
    assert ours_grad.abs().sum() > 0
    _, metrics = turn_ppo(old, log_prob, adv, mask, "token-mean", config)
    assert 0.0 < metrics["actor/pg_clipfrac"] < 1.0
    assert set(metrics) >= {"actor/pg_clipfrac", "actor/ppo_kl", "actor/pg_clipfrac_lower", "actor/turn_clipfrac"}


@pytest.mark.parametrize("mode", VERL_AGG_MODES)
@pytest.mark.parametrize("global_info", [False, True])
def test_one_token_turns_equal_verl_vanilla_in_every_aggregation(mode, global_info):
    """With one-token turns, turn-level PPO is token-level PPO: veRL's own `vanilla` loss is the oracle,
    including veRL's aggregation over micro-batches and data-parallel ranks (global_batch_info)."""
    mask = one_token_turns_mask()
    old, log_prob, adv = inputs(mask, seed=1)
    config = actor_config()
    if global_info:
        # This micro-batch is part of a global mini-batch of 3× the tokens / rollouts on 2 ranks.
        config.global_batch_info.update(
            dp_size=2, batch_num_tokens=int(mask.sum()) * 3, global_batch_size=mask.shape[0] * 3, loss_scale_factor=7
        )
    ours_fn = core_algos.get_policy_loss_fn("turn_ppo")
    verl_fn = core_algos.get_policy_loss_fn("vanilla")
    ours, ours_grad = value_and_grad(lambda lp: ours_fn(old, lp, adv, mask, mode, config)[0], log_prob)
    ref, ref_grad = value_and_grad(lambda lp: verl_fn(old, lp, adv, mask, mode, config)[0], log_prob)
    torch.testing.assert_close(ours, ref)
    torch.testing.assert_close(ours_grad, ref_grad)


def test_aggregation_factor_hand_cases():
    # 2 rollouts, one empty: 3 policy tokens locally.
    mask = torch.tensor([[1, 1, 0, 1], [0, 0, 0, 0]], dtype=torch.bool)
    # token-mean: local Σ/3 → global Σ/12·dp(2): factor 3·2/12 = 0.5.
    assert verl_aggregation_factor("token-mean", mask, {"dp_size": 2, "batch_num_tokens": 12})[1] == 0.5
    # seq-mean-token-mean: local mean over 1 non-empty rollout → Σ/8·2: factor 1·2/8 = 0.25.
    assert verl_aggregation_factor("seq-mean-token-mean", mask, {"dp_size": 2, "global_batch_size": 8})[1] == 0.25
    # seq-mean-token-sum: local Σ/2 (all rollouts) → Σ/8·2: factor 2·2/8 = 0.5.
    assert verl_aggregation_factor("seq-mean-token-sum", mask, {"dp_size": 2, "global_batch_size": 8})[1] == 0.5
    # token-sum: stratarl seq-mean-token-sum is Σ/2 → Σ·dp: factor 2·2 = 4.
    mode, factor, _ = verl_aggregation_factor("token-sum", mask, {"dp_size": 2})
    assert (mode, factor) == ("seq-mean-token-sum", 4.0)
    # No global info: veRL uses local counts; factor 1 (seq modes count non-empty rollouts).
    assert verl_aggregation_factor("token-mean", mask, {})[1] == 1.0
    assert verl_aggregation_factor("seq-mean-token-mean", mask, None)[1] == 1.0
    with pytest.raises(ValueError, match="batch_num_tokens is required"):
        verl_aggregation_factor("token-mean", mask, {"dp_size": 2})
    with pytest.raises(ValueError, match="unknown loss_agg_mode"):
        verl_aggregation_factor("token-avg", mask, {})


def test_at_old_policy_turn_ppo_is_minus_mean_advantage():
    # θ = θ_old: every ratio is 1, nothing clips, loss = −token-mean(A), grad = −A/N on policy tokens.
    mask = multi_token_turns_mask()
    old, _, adv = inputs(mask)
    log_prob = old.clone().requires_grad_(True)
    loss, grad = value_and_grad(
        lambda lp: core_algos.get_policy_loss_fn("turn_ppo")(old, lp, adv, mask, "token-mean", actor_config())[0],
        log_prob,
    )
    n = mask.sum()
    torch.testing.assert_close(loss, -(adv * mask).sum() / n)
    # d/dlogπ_t of w_k Â^k/N: each token of turn k gets Â^k / (|y^k| N) (chain rule through the mean).
    from stratarl.algos import turn_ids

    ids = turn_ids(mask)
    expected = torch.zeros_like(adv)
    for b in range(mask.shape[0]):
        for k in range(int(ids[b].max()) + 1 if mask[b].any() else 0):
            turn = ids[b] == k
            expected[b, turn] = -(adv[b, turn].sum() / turn.sum()) / n
    torch.testing.assert_close(grad, expected)


def test_empty_mask_gives_zero_not_nan():
    mask = torch.zeros(2, 5, dtype=torch.bool)
    old, log_prob, adv = inputs(mask)
    loss, metrics = core_algos.get_policy_loss_fn("turn_ppo")(old, log_prob, adv, mask, "token-mean", actor_config())
    assert float(loss.detach()) == 0.0
    assert all(value == value for value in metrics.values())  # no NaN


def test_unit_rollout_correction_weights_change_nothing():
    # veRL's weights multiply the clipped per-token terms (test_verl_rollout_correction.py); w = 1 changes nothing.
    mask = multi_token_turns_mask()
    old, log_prob, adv = inputs(mask)
    turn_ppo = core_algos.get_policy_loss_fn("turn_ppo")
    ones = torch.ones_like(old)
    weighted, _ = turn_ppo(old, log_prob, adv, mask, "token-mean", actor_config(), rollout_is_weights=ones)
    plain, _ = turn_ppo(old, log_prob, adv, mask, "token-mean", actor_config())
    torch.testing.assert_close(weighted, plain)


def test_sorl_loss_refuses_to_train_without_the_normalisation():
    mask = multi_token_turns_mask()
    old, log_prob, adv = inputs(mask)
    sorl = core_algos.get_policy_loss_fn("sorl")
    with pytest.raises(RuntimeError, match="VERL_USE_EXTERNAL_MODULES=stratarl.integrations.verl"):
        sorl(old, log_prob, adv, mask, "token-mean", actor_config("sorl"))
    with torch.no_grad():  # evaluation (no gradient) is fine and equals turn_ppo
        value, _ = sorl(old, log_prob, adv, mask, "token-mean", actor_config("sorl"))
        expected, _ = core_algos.get_policy_loss_fn("turn_ppo")(old, log_prob, adv, mask, "token-mean", actor_config())
    torch.testing.assert_close(value, expected)


def test_options_that_split_turns_or_replace_the_loss_are_refused():
    from verl.trainer.config.algorithm import RolloutCorrectionConfig

    for settings, name in [({"rollout_rs": "token_k1"}, "rollout_rs"), ({"bypass_mode": True}, "bypass_mode")]:
        with pytest.raises(ValueError, match=f"loss_mode=sorl cannot compose with .*{name}.*; fix: "):
            SORLPolicyLossConfig(loss_mode="sorl", rollout_correction=RolloutCorrectionConfig(**settings))
    SORLPolicyLossConfig(loss_mode="vanilla", rollout_correction=RolloutCorrectionConfig(rollout_rs="token_k1"))
    SORLPolicyLossConfig(loss_mode="sorl", rollout_correction=RolloutCorrectionConfig(rollout_rs="seq_mean_k1"))
    # At run time too (a config built without the dataclass check).
    mask = multi_token_turns_mask()
    old, log_prob, adv = inputs(mask)
    config = actor_config()
    object.__setattr__(config.policy_loss, "rollout_correction", RolloutCorrectionConfig(rollout_rs="token_k1"))
    with pytest.raises(ValueError, match="rollout_rs"):
        core_algos.get_policy_loss_fn("turn_ppo")(old, log_prob, adv, mask, "token-mean", config)


def test_turn_count_metrics():
    from stratarl.integrations.verl.losses import turn_count_metrics

    m = turn_count_metrics(multi_token_turns_mask())  # turns per row: 3, 2, 2, (empty), 4
    assert m == {"actor/turns_per_row": pytest.approx(11 / 4), "actor/multi_turn_frac": 1.0}
    assert turn_count_metrics(torch.tensor([[1, 1, 0, 0]]))["actor/multi_turn_frac"] == 0.0
