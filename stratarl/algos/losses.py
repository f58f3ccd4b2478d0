"""Losses: aggregation modes, the clipped policy surrogate (token / turn / sequence ratios,
asymmetric and dual clip, SORL's clipping-bias part), KL estimators, entropy, clipped value loss.

Every loss is −(objective): minimising it ascends the objective. Metrics are returned as
detached tensors (no ``.item()``); empty masks give loss 0 and metrics 0, never NaN.
"""

from __future__ import annotations

from typing import Literal, NamedTuple, get_args

import torch
from torch import Tensor

from stratarl.algos._checks import as_bool_mask, check_2d, masked_mean, masked_sum
from stratarl.algos.turns import LEVELS, log_ratios, turn_ids, turn_start_mask

AggMode = Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"]
"""A loss aggregation mode (:func:`aggregate_loss`); a config's ``algo.loss_agg`` is typed with it."""
AGG_MODES: tuple[AggMode, ...] = get_args(AggMode)
KlEstimator = Literal["k1", "k2", "k3"]
"""A KL estimator (:func:`kl_penalty`)."""
KL_ESTIMATORS: tuple[KlEstimator, ...] = get_args(KlEstimator)


def aggregate_loss(
    loss_mat: Tensor, response_mask: Tensor, mode: str = "token-mean", *, norm_length: int | None = None
) -> Tensor:
    """Reduce a per-token loss [B, T] to a scalar over the policy tokens.

    - ``token-mean``: Σ_{b,t} m·ℓ / Σ m  (Search-R1 / veRL default; DAPO).
    - ``seq-mean-token-mean``: mean over rollouts with ≥ 1 policy token of (Σ_t m·ℓ / Σ_t m) (GRPO paper).
    - ``seq-mean-token-sum``: mean over *all* B rollouts of Σ_t m·ℓ.
    - ``seq-mean-token-sum-norm``: mean over all B rollouts of Σ_t m·ℓ / L, L = ``norm_length`` or T
      (Dr.GRPO, arXiv 2503.20783: a constant length instead of each rollout's own).

    Empty rows (a rollout with no policy token). ``seq-mean-token-mean`` skips them; the two
    token-sum modes count them in B, so a batch's value does not depend on which rows happen to be
    empty and the micro-batch weights of the native trainer are row counts. veRL 0.9.1's
    ``agg_loss`` divides both token-sum modes by the non-empty rows (or the global batch size it is
    given) instead: on a batch with e rows empty, veRL's value is ours × B / (B − e). The veRL
    plugin applies exactly that factor (``stratarl.integrations.verl.losses.verl_aggregation_factor``),
    so its losses equal veRL's; in the native trainer every rollout has a policy token, so the two
    conventions agree there.

    Source: veRL ``core_algos.agg_loss``. Linear in ``loss_mat`` with mask-only denominators, so
    gradients of different per-token terms add up exactly. Empty mask → 0.
    """
    check_2d("loss_mat", loss_mat)
    check_2d("response_mask", response_mask, tuple(loss_mat.shape))
    mask = as_bool_mask("response_mask", response_mask)
    if mode == "token-mean":
        return masked_mean(loss_mat, mask)
    seq_sum = masked_sum(loss_mat, mask, dim=1)
    if mode == "seq-mean-token-mean":
        tokens = mask.sum(dim=1)
        seq_mean = seq_sum / tokens.clamp(min=1).to(loss_mat.dtype)
        return masked_mean(seq_mean, tokens > 0)
    if mode == "seq-mean-token-sum":
        return seq_sum.mean() if seq_sum.numel() else seq_sum.sum()
    if mode == "seq-mean-token-sum-norm":
        length = loss_mat.shape[1] if norm_length is None else norm_length
        if length <= 0:
            raise ValueError(f"norm_length must be > 0, got {norm_length!r}")
        return (seq_sum.mean() if seq_sum.numel() else seq_sum.sum()) / length
    raise ValueError(f"unknown loss aggregation mode {mode!r}; valid modes: {', '.join(AGG_MODES)}")


def _decision_advantages(advantages: Tensor, mask: Tensor, level: str) -> Tensor:
    """Advantage whose sign decides clipping: the token's own, or the mean over its turn / rollout.

    At turn level the surrogate of turn k is Σ_{t∈k} w_k Â_t = w_k Â^k, so PPO's min(·,·) is taken
    per turn with the turn's advantage (its sign is that of the turn mean); likewise per rollout.
    """
    if level == "token":
        return advantages
    if level == "sequence":
        mean = masked_mean(advantages, mask, dim=1)
        return mean[:, None].expand_as(advantages)
    # turn level: same flat (rollout, turn) segments as turn_log_ratios.
    batch, length = mask.shape
    segment = torch.where(
        mask, torch.arange(batch, device=mask.device)[:, None] * length + turn_ids(mask), batch * length
    ).reshape(-1)
    flat = torch.where(mask, advantages, torch.zeros_like(advantages)).reshape(-1)
    sums = flat.new_zeros(batch * length + 1).index_add(0, segment, flat)
    return sums[segment].reshape(batch, length)


class PolicyLossOutput(NamedTuple):
    """What every registered policy loss returns.

    loss: scalar to minimise (−J_PPO, aggregated).
    metrics: detached scalar tensors with namespaced keys.
    clip_bias: scalar J_C whose gradient is SORL's clipping-bias vector C = ∇J_IS − ∇J_PPO
        (same aggregation as ``loss``), or None for losses that do not define it.
    """

    loss: Tensor
    metrics: dict[str, Tensor]
    clip_bias: Tensor | None


def clipped_policy_loss(
    log_probs: Tensor,
    old_log_probs: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
    *,
    level: str = "token",
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    dual_clip: float | None = None,
    agg: str = "token-mean",
    norm_length: int | None = None,
    token_weights: Tensor | None = None,
) -> PolicyLossOutput:
    """PPO clipped surrogate at token / turn / sequence level, plus SORL's clipping-bias objective.

        r_t = ratio at ``level`` (token: exp Δ_t; turn: w_k = exp mean_{t∈k} Δ_t; sequence: exp mean_t Δ_t)
        J_PPO = agg_t min(r_t A_t, clip(r_t, 1−ε_low, 1+ε_high) A_t)              (Schulman et al. 2017)
        dual clip (c > 1, A < 0):  max(J_PPO term, c · A_t)                       (Ye et al. 2020, arXiv 1912.09729)
        J_IS  = agg_t r_t A_t                     (unclipped importance-sampled surrogate)
        J_C   = agg_t 1[t clipped] · r_t A_t      so  ∇J_C = ∇J_IS − ∇J_PPO = C  (SORL, arXiv 2511.20718)

    "Clipped" means PPO's term is the constant bound, so its gradient is dropped: A > 0 and
    r > 1+ε_high, A < 0 and r < 1−ε_low, or (dual clip) A < 0 and r > c. It is written with
    explicit masks rather than min/max so that the identity ∇J_IS = ∇J_PPO + ∇J_C is exact even at
    ties. At turn / sequence level the decision is per turn / rollout, using the sign of the
    turn's / rollout's advantage (Σ_{t∈k} w_k Â_t = w_k Â^k); with a constant advantage per
    rollout (GRPO) that is every token's own sign. Observation/padding tokens have ratio 1 and are
    masked out of everything.

    Behaviour-policy correction (``token_weights`` w, e.g. from :mod:`stratarl.algos.corrections`):
    both per-token terms are multiplied by w after the clip and before aggregation,

        J_PPO = agg_t w_t · min(r_t A_t, clip(r_t) A_t),   J_C = agg_t w_t · 1[t clipped] · r_t A_t,

    so ∇J_C = ∇J_IS − ∇J_PPO still holds exactly for the weighted J_IS = agg_t w_t r_t A_t, and SORL's
    normalisation acts on the corrected gradients. Aggregation denominators are unchanged (they count
    every policy token, weight 0 or not), as veRL multiplies ``pg_losses`` by ``rollout_is_weights``
    before ``agg_loss`` (docs/algorithms.md, "Behaviour-policy corrections"). Clipping decisions and
    metrics do not see w (``loss/pg_loss`` is the weighted loss). ``None`` (the default) computes exactly
    what the loss computed before the keyword existed.

    Args:
        log_probs: [B, T] current policy log-probs (carry the graph).
        old_log_probs: [B, T] π_old log-probs, the policy the clip is centred on (detached here): the
            behaviour policy's, or the trainer's recomputation of them (then ``token_weights`` corrects
            for the behaviour policy).
        advantages: [B, T] (detached here).
        response_mask: [B, T] 1 on policy tokens.
        level: "token" | "turn" | "sequence".
        clip_low, clip_high: ε_low, ε_high ≥ 0 (asymmetric clip, DAPO's "clip-higher").
        dual_clip: c > 1 or None.
        agg: aggregation mode, see :func:`aggregate_loss`.
        token_weights: [B, T] per-token weights w ≥ 0 (detached here; ignored off the mask), or None.
    Returns:
        PolicyLossOutput(loss = −J_PPO, metrics, clip_bias = J_C). Metrics: ``loss/pg_loss``,
        ``loss/clip_frac`` (fraction of policy tokens whose ratio is clipped, any kind),
        ``loss/clip_frac_low``, ``loss/clip_frac_high``, ``loss/clip_frac_dual``,
        ``loss/clip_frac_turn`` (level "turn": fraction of turns clipped), ``loss/ratio_mean``,
        ``loss/ratio_max``, ``loss/ratio_min``, ``loss/approx_kl`` (mean of log π_old − log π_θ
        over policy tokens, the k1 estimate of KL(π_old‖π_θ)).
    """
    check_2d("advantages", advantages, tuple(log_probs.shape))
    _check_clip_args(level, clip_low, clip_high, dual_clip)
    log_ratio = log_ratios(log_probs, old_log_probs, response_mask, level)
    mask = as_bool_mask("response_mask", response_mask)
    adv = torch.where(mask, advantages.detach().to(log_ratio.dtype), torch.zeros_like(log_ratio))
    ratio = torch.exp(log_ratio)
    high, low, dual = _clipped_tokens(
        ratio, _decision_advantages(adv, mask, level), mask, clip_low, clip_high, dual_clip
    )
    clipped = high | low | dual
    # The constant PPO uses on clipped tokens (its gradient is dropped there).
    bound = torch.full_like(ratio, dual_clip if dual_clip is not None else 1.0)
    bound = torch.where(high, 1.0 + clip_high, torch.where(low, 1.0 - clip_low, bound))
    ppo_term = torch.where(clipped, bound * adv, ratio * adv)
    clipped_term = torch.where(clipped, ratio * adv, torch.zeros_like(adv))
    if token_weights is not None:
        check_2d("token_weights", token_weights, tuple(log_probs.shape))
        weights = torch.where(mask, token_weights.detach().to(ppo_term.dtype), torch.zeros_like(ppo_term))
        ppo_term, clipped_term = ppo_term * weights, clipped_term * weights
    loss = -aggregate_loss(ppo_term, mask, agg, norm_length=norm_length)
    clip_bias = aggregate_loss(clipped_term, mask, agg, norm_length=norm_length)
    with torch.no_grad():
        metrics = _policy_loss_metrics(loss, ratio, mask, high, low, dual, level)
        metrics["loss/approx_kl"] = masked_mean(-log_ratios(log_probs, old_log_probs, mask, "token"), mask)
    return PolicyLossOutput(loss, metrics, clip_bias)


def _check_clip_args(level: str, clip_low: float, clip_high: float, dual_clip: float | None) -> None:
    if level not in LEVELS:
        raise ValueError(f"unknown ratio level {level!r}; valid levels: {', '.join(LEVELS)}")
    if clip_low < 0 or clip_high < 0 or clip_low >= 1:
        raise ValueError(f"need 0 <= clip_low < 1 and clip_high >= 0, got clip_low={clip_low}, clip_high={clip_high}")
    if dual_clip is not None and dual_clip <= 1.0:
        raise ValueError(f"dual_clip must be > 1 (typically 3) or None, got {dual_clip!r}")


def _clipped_tokens(
    ratio: Tensor, decision: Tensor, mask: Tensor, clip_low: float, clip_high: float, dual_clip: float | None
) -> tuple[Tensor, Tensor, Tensor]:
    """Boolean [B, T] masks of the tokens PPO clips: (high: A > 0 and r > 1+ε_high, low: A < 0 and r < 1−ε_low,
    dual: A < 0 and r > c), A being the decision advantage of the token's unit (token, turn or rollout)."""
    high = mask & (decision > 0) & (ratio > 1.0 + clip_high)
    low = mask & (decision < 0) & (ratio < 1.0 - clip_low)
    dual = mask & (decision < 0) & (ratio > dual_clip) if dual_clip is not None else torch.zeros_like(mask)
    return high, low, dual


def _policy_loss_metrics(
    loss: Tensor, ratio: Tensor, mask: Tensor, high: Tensor, low: Tensor, dual: Tensor, level: str
) -> dict[str, Tensor]:
    """The policy loss's metrics (but ``loss/approx_kl``); see :func:`clipped_policy_loss`."""
    clipped = high | low | dual
    metrics = {
        "loss/pg_loss": loss.detach(),
        "loss/clip_frac": masked_mean(clipped.to(ratio.dtype), mask),
        "loss/clip_frac_low": masked_mean(low.to(ratio.dtype), mask),
        "loss/clip_frac_high": masked_mean(high.to(ratio.dtype), mask),
        "loss/clip_frac_dual": masked_mean(dual.to(ratio.dtype), mask),
        "loss/ratio_mean": masked_mean(ratio, mask),
        "loss/ratio_max": _masked_extreme(ratio, mask, largest=True),
        "loss/ratio_min": _masked_extreme(ratio, mask, largest=False),
    }
    if level == "turn":
        # One entry per turn: its first token (every token of a turn shares the decision).
        metrics["loss/clip_frac_turn"] = masked_mean(clipped.to(ratio.dtype), turn_start_mask(mask))
    return metrics


def _masked_extreme(x: Tensor, mask: Tensor, *, largest: bool) -> Tensor:
    """Max / min of ``x`` over ``mask``, 0 for an empty mask (no host sync, no boolean indexing)."""
    if x.numel() == 0:
        return x.new_zeros(())
    fill = float("-inf") if largest else float("inf")
    picked = torch.where(mask, x, torch.full_like(x, fill))
    extreme = picked.amax() if largest else picked.amin()
    return torch.where(mask.any(), extreme, torch.zeros_like(extreme))


def kl_penalty(log_probs: Tensor, ref_log_probs: Tensor, response_mask: Tensor, kind: str = "k3") -> Tensor:
    """Per-token estimate of KL(π_θ ‖ π_ref) from samples of π_θ [B, T]; 0 on masked tokens.

    With Δ = log π_ref − log π_θ (clamped to ±20):
        k1 = −Δ                         unbiased, high variance
        k2 = ½ Δ²                       biased, low variance
        k3 = exp(Δ) − Δ − 1 ≥ 0         unbiased, low variance ("low_var_kl"; clamped to ≤ 10 as veRL does)
    Source: J. Schulman, "Approximating KL divergence" (2020); veRL ``kl_penalty``; GRPO uses k3.
    """
    check_2d("log_probs", log_probs)
    check_2d("ref_log_probs", ref_log_probs, tuple(log_probs.shape))
    check_2d("response_mask", response_mask, tuple(log_probs.shape))
    mask = as_bool_mask("response_mask", response_mask)
    delta = (ref_log_probs.detach() - log_probs).clamp(-20.0, 20.0)
    delta = torch.where(mask, delta, torch.zeros_like(delta))
    if kind == "k1":
        return -delta
    if kind == "k2":
        return 0.5 * delta * delta
    if kind in ("k3", "low_var_kl"):
        return (torch.exp(delta) - delta - 1.0).clamp(max=10.0)
    raise ValueError(f"unknown KL estimator {kind!r}; valid estimators: {', '.join(KL_ESTIMATORS)}")


def entropy_from_logits(logits: Tensor) -> Tensor:
    """Entropy of the softmax distribution at each position: logits [B, T, V] → [B, T].

    H = logsumexp(z) − Σ_v softmax(z)_v z_v
    """
    if logits.dim() != 3:
        raise ValueError(f"logits must be 3-D [B, T, V], got shape {tuple(logits.shape)}")
    log_norm = torch.logsumexp(logits, dim=-1)
    return log_norm - (torch.softmax(logits, dim=-1) * logits).sum(dim=-1)


def clipped_value_loss(
    values: Tensor,
    old_values: Tensor,
    returns: Tensor,
    response_mask: Tensor,
    *,
    clip: float | None = 0.2,
    agg: str = "token-mean",
    norm_length: int | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Critic loss with value clipping: ½ · agg max((V − R)², (V_clip − R)²).

        V_clip = V_old + clip(V − V_old, −ε_v, ε_v)
    Source: PPO2 baselines / veRL ``compute_value_loss``. ``clip=None`` gives ½ (V − R)².
    Returns (loss, metrics) with ``critic/vf_loss``, ``critic/vf_clip_frac``, ``critic/vpred_mean``.
    """
    check_2d("values", values)
    for name, x in (("old_values", old_values), ("returns", returns), ("response_mask", response_mask)):
        check_2d(name, x, tuple(values.shape))
    mask = as_bool_mask("response_mask", response_mask)
    returns = returns.detach()
    unclipped = (values - returns) ** 2
    if clip is None:
        per_token = unclipped
        clipped_more = torch.zeros_like(mask)
    else:
        old = old_values.detach()
        v_clipped = old + (values - old).clamp(-clip, clip)
        clipped_sq = (v_clipped - returns) ** 2
        per_token = torch.maximum(unclipped, clipped_sq)
        clipped_more = clipped_sq > unclipped
    loss = 0.5 * aggregate_loss(per_token, mask, agg, norm_length=norm_length)
    with torch.no_grad():
        metrics = {
            "critic/vf_loss": loss.detach(),
            "critic/vf_clip_frac": masked_mean(clipped_more.to(values.dtype), mask),
            "critic/vpred_mean": masked_mean(values.detach(), mask),
        }
    return loss, metrics
