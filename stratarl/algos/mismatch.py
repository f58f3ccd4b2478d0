"""How far the behaviour policy (the sampler) is from the learner: the metrics that show an off-policy regime.

Per policy token t, with Δ_t = log π_learner(t) − log π_behav(t) (π_behav sampled the token; π_learner is the
learner's recomputed π_old):

    mismatch        mean_t |Δ_t|
    kl (k3)         mean_t (exp(Δ_t) − Δ_t − 1)   an unbiased, non-negative estimate of KL(π_behav ‖ π_learner)
                                                  from the sampler's own tokens (Schulman 2020, "k3")
    ratio           ρ_t = exp(Δ_t) = π_learner / π_behav: its p50, p99 and max over the batch's policy tokens

each also per turn index k (1-based: the k-th run of policy tokens of a rollout), since a later turn reads a
longer context and its mismatch can grow. Metric keys are namespaced ``offpolicy/`` (docs/training.md,
Off-policy training).
"""

from __future__ import annotations

import torch
from torch import Tensor

from stratarl.algos._checks import as_bool_mask, check_2d
from stratarl.algos.turns import LOG_RATIO_CLAMP, turn_ids

QUANTILES = {"p50": 0.5, "p99": 0.99}


def mismatch_metrics(
    learner_log_probs: Tensor, behaviour_log_probs: Tensor, response_mask: Tensor, *, max_turns: int = 8
) -> dict[str, Tensor]:
    """The sampler/learner mismatch of a batch [B, T] (see the module docstring), detached scalar tensors:

    ``offpolicy/mismatch``, ``offpolicy/kl_k3``, ``offpolicy/ratio_p50``, ``offpolicy/ratio_p99``,
    ``offpolicy/ratio_max``, and for each turn index k ≤ ``max_turns`` that has policy tokens
    ``offpolicy/mismatch_turn{k}`` and ``offpolicy/kl_k3_turn{k}`` (turns past ``max_turns`` count only in the
    totals). Log-ratios are clamped to ±20 before exp. Empty mask: every total is 0 (ratio quantiles 1 would
    claim a measurement; 0 says none), no per-turn key.
    """
    check_2d("learner_log_probs", learner_log_probs)
    check_2d("behaviour_log_probs", behaviour_log_probs, tuple(learner_log_probs.shape))
    check_2d("response_mask", response_mask, tuple(learner_log_probs.shape))
    if max_turns < 1:
        raise ValueError(f"max_turns must be >= 1, got {max_turns}")
    mask = as_bool_mask("response_mask", response_mask)
    with torch.no_grad():
        delta = (learner_log_probs.detach().double() - behaviour_log_probs.detach().double()).clamp(
            -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP
        )
        k3 = torch.expm1(delta) - delta
        values = delta[mask]
        zero = delta.new_zeros(())
        if values.numel() == 0:
            return {
                f"offpolicy/{k}": zero.float() for k in ("mismatch", "kl_k3", "ratio_p50", "ratio_p99", "ratio_max")
            }
        ratios = torch.exp(values)
        out = {
            "offpolicy/mismatch": values.abs().mean(),
            "offpolicy/kl_k3": k3[mask].mean(),
            "offpolicy/ratio_max": ratios.max(),
        }
        for name, q in QUANTILES.items():
            out[f"offpolicy/ratio_{name}"] = torch.quantile(ratios, q)
        turns = turn_ids(mask)
        for k in range(max_turns):
            in_turn = turns == k
            if bool(in_turn.any()):
                out[f"offpolicy/mismatch_turn{k + 1}"] = delta[in_turn].abs().mean()
                out[f"offpolicy/kl_k3_turn{k + 1}"] = k3[in_turn].mean()
        return {key: value.float() for key, value in out.items()}
