"""Turn structure from the response mask, and importance ratios at token / turn / sequence level.

A turn is a maximal run of policy tokens (``response_mask = 1``); each run of 0s
between two turns is one tool observation (docs/compatibility.md, "veRL extension
points"). Everything here is derived from the mask alone, so it also works inside
veRL hooks that see no per-sample metadata.
"""

from __future__ import annotations

import torch
from torch import Tensor

from stratarl.algos._checks import as_bool_mask, check_2d, masked_mean

LEVELS = ("token", "turn", "sequence")
# Log-ratios are clamped before exp (as veRL does) so one wild token cannot overflow to inf.
LOG_RATIO_CLAMP = 20.0


def _starts(mask: Tensor) -> Tensor:
    """True on the first token of every run of True values along T (bool mask in)."""
    previous = torch.nn.functional.pad(mask, (1, 0), value=False)[:, :-1]
    return mask & ~previous


def turn_ids(response_mask: Tensor) -> Tensor:
    """Index of the policy turn each token belongs to [B, T] (int64), −1 on observation/padding.

    Turns are the maximal runs of ``response_mask = 1`` numbered 0, 1, … from the left.
    Example: mask ``1 1 0 0 1 0`` → ``0 0 −1 −1 1 −1``.
    """
    check_2d("response_mask", response_mask)
    mask = as_bool_mask("response_mask", response_mask)
    ids = torch.cumsum(_starts(mask).long(), dim=1) - 1
    return torch.where(mask, ids, torch.full_like(ids, -1))


def turn_start_mask(response_mask: Tensor) -> Tensor:
    """True on the first token of every policy turn [B, T] (bool)."""
    check_2d("response_mask", response_mask)
    return _starts(as_bool_mask("response_mask", response_mask))


def num_turns(response_mask: Tensor) -> Tensor:
    """Number of policy turns (runs of 1s) per rollout [B] (int64)."""
    check_2d("response_mask", response_mask)
    return _starts(as_bool_mask("response_mask", response_mask)).sum(dim=1)


def search_counts(response_mask: Tensor, valid_mask: Tensor | None = None) -> Tensor:
    """Number of tool observations per rollout [B] (int64), from the masks alone.

    Without ``valid_mask``: the runs of 0s that lie between two runs of 1s, i.e.
    ``max(num_turns − 1, 0)`` for a response that starts with a policy token. An observation
    at the very end (the rollout was cut right after a search result) is indistinguishable
    from padding there; pass ``valid_mask`` [B, T] (1 on real tokens, 0 on padding) to count it:
    an observation is then a run of valid non-policy tokens that follows a policy token.
    """
    check_2d("response_mask", response_mask)
    mask = as_bool_mask("response_mask", response_mask)
    if valid_mask is None:
        starts = _starts(mask)
        seen_policy_before = (torch.cumsum(mask.long(), dim=1) - mask.long()) > 0
        return (starts & seen_policy_before).sum(dim=1)
    check_2d("valid_mask", valid_mask, tuple(mask.shape))
    valid = as_bool_mask("valid_mask", valid_mask)
    observation = valid & ~mask
    after_policy = (torch.cumsum(mask.long(), dim=1)) > 0
    return (_starts(observation) & after_policy).sum(dim=1)


def cap_strata(counts: Tensor, stratum_cap: int | None) -> Tensor:
    """Stratum key with a cap: counts ≥ ``stratum_cap`` share one stratum (``None`` = no cap)."""
    if stratum_cap is None:
        return counts
    if stratum_cap < 0:
        raise ValueError(f"stratum_cap must be >= 0 or None, got {stratum_cap!r}")
    return counts.clamp(max=stratum_cap)


def _check_log_probs(log_probs: Tensor, old_log_probs: Tensor, response_mask: Tensor) -> Tensor:
    check_2d("log_probs", log_probs)
    check_2d("old_log_probs", old_log_probs, tuple(log_probs.shape))
    check_2d("response_mask", response_mask, tuple(log_probs.shape))
    return as_bool_mask("response_mask", response_mask)


def token_log_ratios(log_probs: Tensor, old_log_probs: Tensor, response_mask: Tensor) -> Tensor:
    """``clamp(log π_θ − log π_old, ±20)`` on policy tokens, 0 elsewhere [B, T] (differentiable in log_probs)."""
    mask = _check_log_probs(log_probs, old_log_probs, response_mask)
    diff = (log_probs - old_log_probs.detach()).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    return torch.where(mask, diff, torch.zeros_like(diff))


def turn_log_ratios(log_probs: Tensor, old_log_probs: Tensor, response_mask: Tensor) -> Tensor:
    """Each policy token gets the mean log-ratio of its turn [B, T]; 0 on observation/padding.

        log w_k = (1/|y^k|) Σ_{t ∈ turn k} (log π_θ − log π_old)_t

    Source: SORL (Li et al., arXiv 2511.20718), turn-level importance sampling. Vectorised with a
    flat (rollout, turn) segment index and ``index_add`` (gradients flow to every token of the turn).
    """
    mask = _check_log_probs(log_probs, old_log_probs, response_mask)
    token = token_log_ratios(log_probs, old_log_probs, mask)
    batch, length = mask.shape
    if token.numel() == 0:
        return token
    turns = turn_ids(mask)
    # (rollout, turn) → flat segment; observation tokens go to a spare segment that is never read.
    segment = torch.where(
        mask, torch.arange(batch, device=mask.device)[:, None] * length + turns, batch * length
    ).reshape(-1)
    n_segments = batch * length + 1
    sums = token.new_zeros(n_segments).index_add(0, segment, token.reshape(-1))
    counts = token.new_zeros(n_segments).index_add(0, segment, mask.reshape(-1).to(token.dtype))
    turn_mean = (sums / counts.clamp(min=1))[segment].reshape(batch, length)
    return torch.where(mask, turn_mean, torch.zeros_like(turn_mean))


def sequence_log_ratios(log_probs: Tensor, old_log_probs: Tensor, response_mask: Tensor) -> Tensor:
    """Each policy token gets the mean log-ratio over its rollout's policy tokens [B, T] (GSPO-like).

        log s_i = (1/|y_i|) Σ_{t: mask=1} (log π_θ − log π_old)_t

    Source: GSPO (Zheng et al., arXiv 2507.18071), sequence-level length-normalised ratio.
    """
    mask = _check_log_probs(log_probs, old_log_probs, response_mask)
    token = token_log_ratios(log_probs, old_log_probs, mask)
    mean = masked_mean(token, mask, dim=1)
    return torch.where(mask, mean[:, None].expand_as(token), torch.zeros_like(token))


def log_ratios(log_probs: Tensor, old_log_probs: Tensor, response_mask: Tensor, level: str) -> Tensor:
    """Log importance ratio at ``level`` ∈ {"token", "turn", "sequence"}, broadcast to tokens [B, T]."""
    if level == "token":
        return token_log_ratios(log_probs, old_log_probs, response_mask)
    if level == "turn":
        return turn_log_ratios(log_probs, old_log_probs, response_mask)
    if level == "sequence":
        return sequence_log_ratios(log_probs, old_log_probs, response_mask)
    raise ValueError(f"unknown ratio level {level!r}; valid levels: {', '.join(LEVELS)}")


def importance_ratios(
    log_probs: Tensor, old_log_probs: Tensor, response_mask: Tensor, *, level: str = "token"
) -> Tensor:
    """Importance ratio π_θ/π_old at ``level``, broadcast to tokens [B, T]; exactly 1 on masked tokens.

    token: ``exp(Δ_t)``; turn: ``w_k = exp(mean_{t∈k} Δ_t)`` (SORL, arXiv 2511.20718);
    sequence: ``exp(mean_t Δ_t)`` (GSPO, arXiv 2507.18071); Δ = log π_θ − log π_old.
    A geometric mean, so w_k lies between the turn's smallest and largest token ratio.
    """
    return torch.exp(log_ratios(log_probs, old_log_probs, response_mask, level))
