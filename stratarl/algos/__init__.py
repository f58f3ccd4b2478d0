"""The algorithm core: pure tensor functions for GRPO, Stratified GRPO, GiGPO, GAE, PPO / SORL losses and
behaviour-policy corrections (TIS, MIS, decoupled PPO).

Shapes use fixed letters: B rollouts, T response tokens. Masks are bool or {0,1} float [B, T]
(1 = policy token, 0 = observation / padding). Empty masks give 0, never NaN. Every function
takes explicit scalars, checks shapes at entry, never mutates its arguments, and documents its
formula and source. See docs/ARCHITECTURE.md and docs/algorithms.md.
"""

from __future__ import annotations

from stratarl.algos.advantages import (
    STRATIFIED_ALPHA,
    broadcast_to_tokens,
    check_alpha,
    cross_stratum_bias,
    explained_variance,
    gae_advantages,
    grpo_advantages,
    masked_whiten,
    negative_mass_share,
    outcome_to_token_rewards,
    positive_part,
    reinforce_advantages,
    stratified_advantages,
)
from stratarl.algos.corrections import (
    CORRECTION_METRICS,
    CorrectionOutput,
    decoupled_weights,
    mis_weights,
    tis_weights,
)
from stratarl.algos.gigpo import anchor_state, gigpo_advantages, step_groups, step_returns, token_step_ids
from stratarl.algos.losses import (
    AGG_MODES,
    KL_ESTIMATORS,
    PolicyLossOutput,
    aggregate_loss,
    clipped_policy_loss,
    clipped_value_loss,
    entropy_from_logits,
    kl_penalty,
)
from stratarl.algos.params import Param
from stratarl.algos.registry import (
    AdvantageBatch,
    GradNormalizer,
    advantage_names,
    behaviour_correction_names,
    get_advantage,
    get_behaviour_correction,
    get_grad_normalizer,
    get_policy_loss,
    grad_normalizer_names,
    policy_loss_names,
    register_advantage,
    register_behaviour_correction,
    register_grad_normalizer,
    register_policy_loss,
)
from stratarl.algos.sorl import DELTA_RULES, ClipBiasNormalizer, sorl_scale
from stratarl.algos.strata import (
    cross_stratum_variance,
    live_strata_group_fraction,
    shuffle_strata_within_groups,
    zero_san_fraction,
)
from stratarl.algos.turns import (
    LEVELS,
    cap_strata,
    importance_ratios,
    log_ratios,
    num_turns,
    search_counts,
    sequence_log_ratios,
    token_log_ratios,
    turn_ids,
    turn_log_ratios,
    turn_start_mask,
)

__all__ = [
    "AGG_MODES",
    "CORRECTION_METRICS",
    "DELTA_RULES",
    "KL_ESTIMATORS",
    "LEVELS",
    "STRATIFIED_ALPHA",
    "AdvantageBatch",
    "ClipBiasNormalizer",
    "CorrectionOutput",
    "GradNormalizer",
    "Param",
    "PolicyLossOutput",
    "advantage_names",
    "aggregate_loss",
    "anchor_state",
    "behaviour_correction_names",
    "broadcast_to_tokens",
    "cap_strata",
    "check_alpha",
    "clipped_policy_loss",
    "clipped_value_loss",
    "cross_stratum_bias",
    "cross_stratum_variance",
    "decoupled_weights",
    "entropy_from_logits",
    "explained_variance",
    "gae_advantages",
    "get_advantage",
    "get_behaviour_correction",
    "get_grad_normalizer",
    "get_policy_loss",
    "gigpo_advantages",
    "grad_normalizer_names",
    "grpo_advantages",
    "importance_ratios",
    "kl_penalty",
    "live_strata_group_fraction",
    "log_ratios",
    "masked_whiten",
    "mis_weights",
    "negative_mass_share",
    "num_turns",
    "outcome_to_token_rewards",
    "policy_loss_names",
    "positive_part",
    "register_advantage",
    "register_behaviour_correction",
    "register_grad_normalizer",
    "register_policy_loss",
    "reinforce_advantages",
    "search_counts",
    "sequence_log_ratios",
    "shuffle_strata_within_groups",
    "sorl_scale",
    "step_groups",
    "step_returns",
    "stratified_advantages",
    "tis_weights",
    "token_log_ratios",
    "token_step_ids",
    "turn_ids",
    "turn_log_ratios",
    "turn_start_mask",
    "zero_san_fraction",
]
