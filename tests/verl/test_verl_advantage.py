"""The `stratified_grpo` estimator through veRL's own advantage dispatch on a DataProto batch."""

from __future__ import annotations

import uuid

import pytest

# "verl.trainer…", not "verl": in the main venv this folder itself is importable as a namespace package "verl".
pytest.importorskip("verl.trainer.ppo.core_algos", reason="needs veRL (make test-verl runs these in .venv-verl)")

import numpy as np
import torch
from omegaconf import OmegaConf
from verl import DataProto
from verl.trainer.ppo.ray_trainer import compute_advantage

import stratarl.integrations.verl  # noqa: F401  (registers the estimator)
from stratarl.algos import stratified_advantages
from stratarl.integrations.verl.config import StratifiedAlgoConfig, StratifiedGRPOConfig

T = 12


def mask_with_searches(num_searches: int, *, trailing_pad: int = 2) -> list[int]:
    """A response with `num_searches` observation blocks: (policy 2, obs 1) × k, policy 2, padding."""
    row = [1, 1, 0] * num_searches + [1, 1]
    row += [0] * trailing_pad
    return (row + [0] * T)[:T]


def make_batch(rewards, searches, uids) -> DataProto:
    mask = torch.tensor([mask_with_searches(k) for k in searches], dtype=torch.float32)
    scores = torch.zeros_like(mask)
    last = mask.cumsum(dim=1).argmax(dim=1)  # reward on the last policy token, as veRL's reward manager
    scores[torch.arange(len(rewards)), last] = torch.tensor(rewards, dtype=torch.float32)
    return DataProto.from_dict(
        tensors={"token_level_rewards": scores, "response_mask": mask},
        non_tensors={"uid": np.array(uids, dtype=object)},
    )


def algorithm_config(estimator: str = "stratified_grpo", **block):
    return OmegaConf.create({"adv_estimator": estimator, "norm_adv_by_std_in_grpo": True, "stratified_grpo": block})


@pytest.fixture()
def rollouts():
    # Two prompts × 5 rollouts, interleaved rows; uids are veRL-style uuids.
    uid_a, uid_b = str(uuid.uuid4()), str(uuid.uuid4())
    rewards = [1.0, 0.0, 1.0, 1.0, 0.0, 0.0, 1.0, 0.0, 1.0, 1.0]
    searches = [0, 2, 1, 0, 1, 1, 2, 0, 2, 2]
    uids = [uid_a, uid_b] * 5
    return rewards, searches, uids


def test_dispatch_matches_stratarl_stratified_advantages(rollouts):
    rewards, searches, uids = rollouts
    batch = make_batch(rewards, searches, uids)
    out = compute_advantage(batch, adv_estimator="stratified_grpo", config=algorithm_config(alpha=0.6))
    group_ids = torch.tensor([0 if u == uids[0] else 1 for u in uids])
    expected = stratified_advantages(
        torch.tensor(rewards), group_ids, torch.tensor(searches), alpha=0.6, eps=1e-6, std_ddof=1
    )
    mask = batch.batch["response_mask"]
    torch.testing.assert_close(out.batch["advantages"], expected[:, None] * mask)
    torch.testing.assert_close(out.batch["returns"], out.batch["advantages"])
    # Broadcast: constant on policy tokens, 0 on observations and padding.
    assert bool((out.batch["advantages"][mask == 0] == 0).all())


def test_alpha_zero_matches_verl_builtin_grpo(rollouts):
    rewards, searches, uids = rollouts
    ours = compute_advantage(
        make_batch(rewards, searches, uids), adv_estimator="stratified_grpo", config=algorithm_config(alpha=0.0)
    )
    verl_grpo = compute_advantage(
        make_batch(rewards, searches, uids), adv_estimator="grpo", config=algorithm_config("grpo")
    )
    torch.testing.assert_close(ours.batch["advantages"], verl_grpo.batch["advantages"])


def test_alpha_one_is_pure_san_with_strata_from_the_mask():
    # One group: searches [0, 0, 2, 2] with rewards [1, 0, 1, 1].
    # Stratum 0: rewards {1, 0}: mean 0.5, std (Bessel) = sqrt(0.5) → ±0.5/0.7071 = ±0.7071.
    # Stratum 2: rewards {1, 1}: all equal → 0.
    batch = make_batch([1.0, 0.0, 1.0, 1.0], [0, 0, 2, 2], ["g"] * 4)
    out = compute_advantage(batch, adv_estimator="stratified_grpo", config=algorithm_config(alpha=1.0))
    per_rollout = out.batch["advantages"][:, 0]
    half_over_std = 0.5 / (0.5**0.5 + 1e-6)
    torch.testing.assert_close(per_rollout, torch.tensor([half_over_std, -half_over_std, 0.0, 0.0]))


def test_groups_come_from_uid_not_row_order():
    # Same rewards in two groups; permuting rows (with their uids) permutes the advantages.
    rewards = [1.0, 0.0, 1.0, 0.0, 0.0, 1.0]
    searches = [0, 1, 1, 0, 1, 1]
    uids = ["a", "a", "a", "b", "b", "b"]
    perm = [3, 0, 5, 1, 4, 2]
    out = compute_advantage(
        make_batch(rewards, searches, uids), adv_estimator="stratified_grpo", config=algorithm_config()
    )
    out_perm = compute_advantage(
        make_batch([rewards[i] for i in perm], [searches[i] for i in perm], [uids[i] for i in perm]),
        adv_estimator="stratified_grpo",
        config=algorithm_config(),
    )
    torch.testing.assert_close(out_perm.batch["advantages"][:, 0], out.batch["advantages"][perm, 0])


@pytest.mark.parametrize("spelling", ["stratum_cap", "strata_cap"])  # strata_cap: the older spelling still loads
def test_stratum_cap_merges_high_counts(spelling):
    rewards, searches = [1.0, 0.0, 1.0, 0.0], [2, 3, 2, 3]
    capped = compute_advantage(
        make_batch(rewards, searches, ["g"] * 4),
        adv_estimator="stratified_grpo",
        config=algorithm_config(alpha=1.0, **{spelling: 2}),
    )
    one_stratum = compute_advantage(
        make_batch(rewards, [2, 2, 2, 2], ["g"] * 4),
        adv_estimator="stratified_grpo",
        config=algorithm_config(alpha=1.0),
    )
    # The masks differ (2 vs 3 observations), so compare the per-rollout scalar (first token).
    torch.testing.assert_close(capped.batch["advantages"][:, 0], one_stratum.batch["advantages"][:, 0])
    uncapped = compute_advantage(
        make_batch(rewards, searches, ["g"] * 4), adv_estimator="stratified_grpo", config=algorithm_config(alpha=1.0)
    )
    # Without the cap each stratum's rewards are all equal → pure SAN is 0 everywhere.
    torch.testing.assert_close(uncapped.batch["advantages"], torch.zeros(4, T))


def test_older_cap_spelling_in_the_dataclass():
    assert StratifiedGRPOConfig(strata_cap=2).stratum_cap == 2
    assert StratifiedGRPOConfig(stratum_cap=3).stratum_cap == 3
    with pytest.raises(ValueError, match="keep stratum_cap only"):
        StratifiedGRPOConfig(stratum_cap=3, strata_cap=2)
    with pytest.raises(ValueError, match="stratum_cap must be >= 0"):
        StratifiedGRPOConfig(strata_cap=-1)


def test_dataclass_config_and_mean_only_mode(rollouts):
    rewards, searches, uids = rollouts
    config = StratifiedAlgoConfig(
        adv_estimator="stratified_grpo",
        norm_adv_by_std_in_grpo=False,
        stratified_grpo=StratifiedGRPOConfig(alpha=0.3),
    )
    out = compute_advantage(
        make_batch(rewards, searches, uids),
        adv_estimator="stratified_grpo",
        norm_adv_by_std_in_grpo=False,
        config=config,
    )
    group_ids = torch.tensor([0 if u == uids[0] else 1 for u in uids])
    expected = stratified_advantages(
        torch.tensor(rewards), group_ids, torch.tensor(searches), alpha=0.3, scale_by_std=False
    )
    torch.testing.assert_close(out.batch["advantages"][:, 0], expected)


def test_defaults_without_a_config_block(rollouts):
    rewards, searches, uids = rollouts
    out = compute_advantage(
        make_batch(rewards, searches, uids),
        adv_estimator="stratified_grpo",
        config=OmegaConf.create({"adv_estimator": "stratified_grpo"}),
    )
    group_ids = torch.tensor([0 if u == uids[0] else 1 for u in uids])
    expected = stratified_advantages(torch.tensor(rewards), group_ids, torch.tensor(searches), alpha=0.6)
    torch.testing.assert_close(out.batch["advantages"][:, 0], expected)


def test_bad_settings_are_named():
    batch = make_batch([1.0, 0.0], [0, 1], ["g", "g"])
    with pytest.raises(ValueError, match="unknown key.*alpah"):
        compute_advantage(batch, adv_estimator="stratified_grpo", config=algorithm_config(alpah=0.5))
    with pytest.raises(ValueError, match="alpha must be in"):
        compute_advantage(batch, adv_estimator="stratified_grpo", config=algorithm_config(alpha=1.5))
    with pytest.raises(ValueError, match="alpha must be in"):
        StratifiedGRPOConfig(alpha=-0.1)


def test_missing_uid_is_a_clear_error():
    mask = torch.ones(2, 4)
    batch = DataProto.from_dict(tensors={"token_level_rewards": torch.zeros(2, 4), "response_mask": mask})
    with pytest.raises(ValueError, match="uid"):
        compute_advantage(batch, adv_estimator="stratified_grpo", config=algorithm_config())


def test_all_equal_rewards_and_singletons_give_zero_not_nan():
    batch = make_batch([1.0, 1.0, 0.5], [0, 1, 2], ["g", "g", "lonely"])
    out = compute_advantage(batch, adv_estimator="stratified_grpo", config=algorithm_config())
    assert bool(torch.isfinite(out.batch["advantages"]).all())
    torch.testing.assert_close(out.batch["advantages"], torch.zeros_like(out.batch["advantages"]))


def test_rejection_sampling_that_rewrites_the_mask_is_refused():
    """rollout_rs zeroes rejected tokens in response_mask before the estimator: phantom strata."""
    from verl.trainer.config.algorithm import RolloutCorrectionConfig

    batch = make_batch([1.0, 0.0], [0, 1], ["g", "g"])
    config = algorithm_config()
    config.rollout_correction = {"rollout_rs": "token_k1", "bypass_mode": False}
    with pytest.raises(ValueError, match=r"rollout_rs='token_k1'.*rollout_correction.rollout_rs=null"):
        compute_advantage(batch, adv_estimator="stratified_grpo", config=config)
    config.rollout_correction = {"rollout_rs": None, "bypass_mode": False}
    compute_advantage(batch, adv_estimator="stratified_grpo", config=config)  # null: fine
    with pytest.raises(ValueError, match="rollout_rs"):
        StratifiedAlgoConfig(
            adv_estimator="stratified_grpo", rollout_correction=RolloutCorrectionConfig(rollout_rs="seq_mean_k1")
        )
    StratifiedAlgoConfig(adv_estimator="grpo", rollout_correction=RolloutCorrectionConfig(rollout_rs="seq_mean_k1"))
