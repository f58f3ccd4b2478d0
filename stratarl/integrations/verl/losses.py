"""veRL policy losses ``turn_ppo`` and ``sorl``, and SORL's clipping-bias loss.

veRL calls a registered policy loss as ``fn(old_log_prob, log_prob, advantages, response_mask,
loss_agg_mode, config, rollout_is_weights) -> (loss, metrics)`` once per micro-batch, with the
actor config (clip ratios, ``global_batch_info`` for loss aggregation across micro-batches and
data-parallel ranks). The math is :func:`stratarl.algos.clipped_policy_loss`; this module only
maps veRL's config onto its arguments and rescales its (local) aggregation to veRL's global one.

- ``turn_ppo``: SORL's turn-level importance ratio ``w_k = exp(mean_{t∈k} Δ_t)`` with per-turn
  clipping (a turn is a run of ``response_mask = 1``), dual clip ``c = clip_ratio_c`` as veRL's
  ``vanilla``. Loss only; no gradient normalisation.
- ``sorl``: the same loss, run inside stratarl's SORL actor step (:mod:`.worker`), which adds the
  exact clipping-triggered normalisation ``g ← ∇J_PPO / max(‖C‖, δ)``. It refuses to run in a
  training step that is not normalised, so a missing plugin can never silently give plain PPO.

veRL's rollout correction weights (``rollout_is_weights``, from ``algorithm.rollout_correction.rollout_is``)
enter as in stratarl's own trainer (``clipped_policy_loss(..., token_weights=w)``): they multiply each
token's clipped term after the clip (decisions do not see them) and before aggregation, whose
denominators still count every policy token, as veRL's ``vanilla`` does. So SORL's C is the gradient of
the weighted clipped tokens, the step is scaled by 1/max(‖C‖, δ), and veRL's gradient-norm clipping
comes last. Settings that rewrite the turn structure first are refused in one line (:mod:`.guards`).
"""

from __future__ import annotations

from contextvars import ContextVar
from typing import Any

import torch

from stratarl.algos import clipped_policy_loss
from stratarl.integrations.verl.guards import refuse_for_turn_loss

TURN_PPO = "turn_ppo"
SORL = "sorl"
SORL_LOSS_MODES = (SORL,)
RATIO_LEVEL = "turn"

# Set by the SORL actor step (worker.py) while it runs the PPO pass of a normalised step.
SORL_STEP_ACTIVE: ContextVar[bool] = ContextVar("stratarl_sorl_step_active", default=False)

# veRL loss_agg_mode → stratarl aggregation mode with the same numerator (Σ over the local
# micro-batch); the denominators are fixed up by verl_aggregation_factor.
_STRATARL_MODE = {
    "token-mean": "token-mean",
    "token-sum": "seq-mean-token-sum",
    "seq-mean-token-sum": "seq-mean-token-sum",
    "seq-mean-token-sum-norm": "seq-mean-token-sum-norm",
    "seq-mean-token-mean": "seq-mean-token-mean",
}


def _cfg(config: Any, key: str, default: Any = None) -> Any:
    value = config.get(key, default) if hasattr(config, "get") else getattr(config, key, default)
    return default if value is None else value


def clip_settings(config: Any) -> dict[str, Any]:
    """ε_low, ε_high and the dual-clip bound c from veRL's actor config (as veRL's ``vanilla``)."""
    if config is None:
        raise ValueError("veRL passed config=None to a stratarl policy loss; it needs the actor config")
    clip = float(_cfg(config, "clip_ratio", 0.2))
    dual = _cfg(config, "clip_ratio_c", 3.0)
    return {
        "clip_low": float(_cfg(config, "clip_ratio_low", clip)),
        "clip_high": float(_cfg(config, "clip_ratio_high", clip)),
        "dual_clip": None if dual is None else float(dual),
    }


def verl_aggregation_factor(
    loss_agg_mode: str, response_mask: torch.Tensor, global_batch_info: dict | None
) -> tuple[str, float, int | None]:
    """(stratarl mode, factor, norm_length) with ``veRL agg_loss = factor · stratarl aggregate_loss``.

    veRL normalises each micro-batch by global counts so the gradients of all micro-batches and
    data-parallel ranks add up to the mean over the global mini-batch (``core_algos.agg_loss``):
    token-mean divides Σ by ``batch_num_tokens / dp_size``, the sequence modes by
    ``global_batch_size / dp_size``, token-sum multiplies by ``dp_size``. stratarl's
    :func:`aggregate_loss` divides the same Σ by local counts (policy tokens, rollouts, non-empty
    rollouts), so the factor is local count · dp_size / global count. With no global info
    (one micro-batch, dp = 1) veRL also uses local counts and the factor is 1.
    """
    if loss_agg_mode not in _STRATARL_MODE:
        raise ValueError(f"unknown loss_agg_mode {loss_agg_mode!r}; valid: {sorted(_STRATARL_MODE)}")
    info = dict(global_batch_info or {})
    dp_size = int(info.get("dp_size") or 1)
    mask = response_mask.bool()
    num_rollouts = mask.shape[0]
    num_tokens = int(mask.sum())
    nonempty = int(mask.any(dim=1).sum())
    if dp_size > 1 and loss_agg_mode == "token-mean" and info.get("batch_num_tokens") is None:
        raise ValueError("global_batch_info.batch_num_tokens is required when dp_size > 1 (veRL agg_loss)")
    if dp_size > 1 and loss_agg_mode.startswith("seq-") and info.get("global_batch_size") is None:
        raise ValueError("global_batch_info.global_batch_size is required when dp_size > 1 (veRL agg_loss)")
    norm_length = None
    if loss_agg_mode == "token-mean":
        total = info.get("batch_num_tokens")
        factor = 1.0 if total is None else num_tokens * dp_size / float(total)
    elif loss_agg_mode == "token-sum":
        factor = float(num_rollouts * dp_size)
    else:
        total = info.get("global_batch_size")
        denominator = nonempty if total is None else float(total)
        local = nonempty if loss_agg_mode == "seq-mean-token-mean" else num_rollouts
        factor = 0.0 if denominator == 0 else local * dp_size / float(denominator)
        if loss_agg_mode == "seq-mean-token-sum-norm":
            scale = info.get("loss_scale_factor")
            norm_length = int(scale) if scale is not None else mask.shape[-1]
    return _STRATARL_MODE[loss_agg_mode], factor, norm_length


def turn_level_loss(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str,
    config: Any,
    rollout_is_weights: torch.Tensor | None,
):
    """The turn-level clipped surrogate in veRL's aggregation: ``(loss, clip_bias, metrics)``.

    ``loss = −J_PPO`` and ``clip_bias = J_C`` (∇J_C = C = ∇J_IS − ∇J_PPO), both scaled to veRL's
    global aggregation; metrics use veRL's keys (floats) plus ``actor/turn_clipfrac``. With
    ``rollout_is_weights`` ρ [B, T] all three objectives carry ρ per token (J_IS = agg_t ρ_t r_k A_t).
    """
    policy_loss = _cfg(config, "policy_loss", None)
    refuse_for_turn_loss(
        _cfg(policy_loss, "rollout_correction", None),
        plugin=f"loss_mode={_cfg(policy_loss, 'loss_mode', TURN_PPO)}",
        where="actor_rollout_ref.actor.policy_loss.rollout_correction",
    )
    mode, factor, norm_length = verl_aggregation_factor(
        loss_agg_mode, response_mask, _cfg(config, "global_batch_info", {})
    )
    out = clipped_policy_loss(
        log_prob,
        old_log_prob,
        advantages,
        response_mask,
        level=RATIO_LEVEL,
        agg=mode,
        norm_length=norm_length,
        token_weights=rollout_is_weights,
        **clip_settings(config),
    )
    m = out.metrics
    metrics = {
        # veRL's ``vanilla`` counts the ε-clipped tokens here and the dual-clipped ones only under
        # pg_clipfrac_lower; the three kinds are disjoint, so low + high is veRL's pg_clipfrac.
        "actor/pg_clipfrac": float(m["loss/clip_frac_low"] + m["loss/clip_frac_high"]),
        "actor/ppo_kl": float(m["loss/approx_kl"]),
        "actor/pg_clipfrac_lower": float(m["loss/clip_frac_dual"]),
        "actor/turn_clipfrac": float(m["loss/clip_frac_turn"]),
        "actor/turn_ratio_mean": float(m["loss/ratio_mean"]),
        **turn_count_metrics(response_mask),
    }
    if out.clip_bias is None:  # clipped_policy_loss always returns it; the check narrows the type
        raise RuntimeError("the turn-level clipped surrogate returned no clip_bias")
    return out.loss * factor, out.clip_bias * factor, metrics


def turn_count_metrics(response_mask: torch.Tensor) -> dict[str, float]:
    """How many turns the turn-level ratio ran over: ``actor/turns_per_row`` (mean over rows with any
    policy token) and ``actor/multi_turn_frac`` (fraction of those rows with more than one turn)."""
    mask = response_mask.bool()
    starts = mask & ~torch.nn.functional.pad(mask[:, :-1], (1, 0), value=False)
    turns = starts.sum(dim=-1)[mask.any(dim=-1)].float()
    if turns.numel() == 0:
        return {"actor/turns_per_row": 0.0, "actor/multi_turn_frac": 0.0}
    return {"actor/turns_per_row": float(turns.mean()), "actor/multi_turn_frac": float((turns > 1).float().mean())}


def compute_turn_ppo_loss(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str = "token-mean",
    config: Any = None,
    rollout_is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, Any]]:
    """veRL loss ``turn_ppo``: PPO with SORL's turn-level ratio and per-turn clipping.

        w_k = exp( (1/|y^k|) Σ_{t∈k} (log π_θ − log π_old)_t )                (SORL, arXiv 2511.20718)
        loss = −agg_t ρ_t · [ w_k Â_t  or the clipped bound · Â_t when turn k is clipped ]

    ρ_t = ``rollout_is_weights`` (veRL's TIS / IcePop weights for π_old / π_rollout), or 1 when None.

    Shapes: all tensors [B, T]. Returns (scalar loss, metrics).
    """
    loss, _, metrics = turn_level_loss(
        old_log_prob, log_prob, advantages, response_mask, loss_agg_mode, config, rollout_is_weights
    )
    return loss, metrics


def compute_sorl_loss(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str = "token-mean",
    config: Any = None,
    rollout_is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, Any]]:
    """veRL loss ``sorl``: ``turn_ppo``'s loss, for use inside the SORL actor step.

    The gradient normalisation ``g ← ∇J_PPO / max(‖C‖, δ)`` is applied by
    :class:`stratarl.integrations.verl.worker.SORLTrainingWorker` around the whole mini-batch;
    called with gradients enabled outside that step this raises instead of silently training
    plain turn-level PPO.
    """
    if torch.is_grad_enabled() and not SORL_STEP_ACTIVE.get():
        raise RuntimeError(
            "policy loss 'sorl' ran in a training step without SORL's clipping-triggered normalisation. "
            "Load the plugin in every Ray worker: VERL_USE_EXTERNAL_MODULES=stratarl.integrations.verl "
            "(it installs SORLTrainingWorker as ActorRolloutRefWorker.actor_worker_cls), or use "
            "loss_mode=turn_ppo for turn-level PPO without the normalisation."
        )
    return compute_turn_ppo_loss(
        old_log_prob, log_prob, advantages, response_mask, loss_agg_mode, config, rollout_is_weights
    )
