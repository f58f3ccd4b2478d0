"""Advantage estimators: GRPO (GN), Stratified GRPO (SAN blend), GAE with observation tokens, REINFORCE without
a baseline; and two diagnostics of an update's advantages (the negative mass share, the critic's explained variance).

Shapes: B rollouts, T response tokens. Group / stratum ids are integer tensors of
arbitrary (not necessarily contiguous) values; segment statistics are computed in
one pass with ``torch.unique(return_inverse=True)`` + ``index_add_`` (no Python
loop over rollouts or groups).

Numerical conventions, decided once and shared by every estimator here:

- std estimator: ``std_ddof=1`` (Bessel's correction, Search-R1 / veRL GRPO) by default.
- ``eps`` is added to the std: ``(R - mean) / (std + eps)``, ``eps = 1e-6``.
- A segment (group or stratum cell) of one rollout gets advantage 0. veRL instead
  uses mean 0 / std 1 for a size-1 group, which turns the raw reward R into the
  advantage; we choose 0 because a lone rollout has no baseline to be compared
  with, and a raw reward is on a different scale from the normalised advantages
  next to it in the batch. With this choice ``std_ddof`` never divides by zero.
- A segment whose rewards are all equal gets advantage exactly 0 (detected by
  min == max, so float round-off in the mean cannot leak a tiny non-zero value).
"""

from __future__ import annotations

import torch
from torch import Tensor

from stratarl.algos._checks import (
    as_bool_mask,
    check_1d,
    check_2d,
    check_ids,
    float_values,
)


def _check_std_params(eps: float, std_ddof: int) -> None:
    if std_ddof not in (0, 1):
        raise ValueError(f"std_ddof must be 0 (population std) or 1 (Bessel), got {std_ddof!r}")
    if eps < 0:
        raise ValueError(f"eps must be >= 0, got {eps!r}")


def dense_ids(ids: Tensor) -> tuple[Tensor, int]:
    """Map arbitrary integer ids [B] to 0..n-1 (sorted order of the distinct ids); returns (index, n)."""
    unique, inverse = torch.unique(ids, return_inverse=True)
    return inverse, int(unique.numel())


def segment_normalize(
    values: Tensor,
    segment: Tensor,
    num_segments: int,
    *,
    eps: float,
    std_ddof: int,
    scale_by_std: bool = True,
) -> Tensor:
    """Normalise ``values`` [B] inside segments: ``(x - mean_S) / (std_S + eps)``.

    ``segment`` [B] holds dense indices in ``[0, num_segments)``. Segments of one
    element and segments whose values are all equal give exactly 0 (see module
    docstring). ``scale_by_std=False`` returns ``x - mean_S`` (Dr.GRPO,
    arXiv 2503.20783). Two-pass (mean, then centred squares) for accuracy.
    """
    zeros = values.new_zeros(num_segments)
    counts = zeros.index_add(0, segment, torch.ones_like(values))
    mean = zeros.index_add(0, segment, values) / counts.clamp(min=1)
    centered = values - mean[segment]
    seg_min = values.new_full((num_segments,), float("inf")).scatter_reduce(0, segment, values, reduce="amin")
    seg_max = values.new_full((num_segments,), float("-inf")).scatter_reduce(0, segment, values, reduce="amax")
    degenerate = (counts < 2) | (seg_min == seg_max)
    if scale_by_std:
        sq = zeros.index_add(0, segment, centered * centered)
        std = (sq / (counts - std_ddof).clamp(min=1)).sqrt()
        normalized = centered / (std[segment] + eps)
    else:
        normalized = centered
    return torch.where(degenerate[segment], torch.zeros_like(normalized), normalized)


def grpo_advantages(
    rewards: Tensor,
    group_ids: Tensor,
    *,
    eps: float = 1e-6,
    std_ddof: int = 1,
    scale_by_std: bool = True,
) -> Tensor:
    """GRPO / global-normalisation (GN) outcome advantage, one scalar per rollout.

        A_GN(τ_i) = (R_i − mean_g(R)) / (std_g(R) + ε)        g = group of τ_i (one prompt)

    Source: DeepSeekMath (arXiv 2402.03300) §4.1.2; Search-R1 / veRL ``compute_grpo_outcome_advantage``.
    ``scale_by_std=False`` gives Dr.GRPO's mean-only ``R_i − mean_g(R)`` (arXiv 2503.20783).
    Size-1 groups and all-equal groups give 0 (module docstring says why).

    Args:
        rewards: [B] float (ints accepted), finite.
        group_ids: [B] integer, any values; equal id = same prompt group.
    Returns:
        [B] advantages, dtype of ``rewards`` (float32 for integer rewards).
    """
    check_1d("rewards", rewards)
    check_ids("group_ids", group_ids, rewards.shape[0])
    _check_std_params(eps, std_ddof)
    values = float_values("rewards", rewards)
    if values.numel() == 0:
        return values.clone()
    segment, n = dense_ids(group_ids)
    return segment_normalize(values, segment, n, eps=eps, std_ddof=std_ddof, scale_by_std=scale_by_std)


def reinforce_advantages(rewards: Tensor) -> Tensor:
    """REINFORCE without a baseline: the advantage is the outcome reward itself, ``A(τ_i) = R_i``.

    Source: Williams 1992 (the likelihood-ratio gradient ``R · ∇ log π`` with baseline b = 0). With rewards
    in [0, 1] no sampled token is ever pushed down: the ablation that separates "a baseline" from "negative
    advantages" (benchmarks/evidence/lab_offpolicy_lag.yaml, P8).

    Args:
        rewards: [B] float (ints accepted), finite.
    Returns:
        [B] advantages, a copy of ``rewards`` (float32 for integer rewards).
    """
    check_1d("rewards", rewards)
    return float_values("rewards", rewards).clone()


def positive_part(advantages: Tensor) -> Tensor:
    """``max(A, 0)``: the advantages with every negative entry set to 0 (no sampled token is pushed down).

    Used by ``grpo_positive`` (GRPO's group-normalised advantage without its negative half).
    """
    return advantages.clamp(min=0.0)


def negative_mass_share(advantages: Tensor, response_mask: Tensor) -> float:
    """The share of the advantage mass on policy tokens that pushes tokens down:

        Σ_{t: A_t < 0} |A_t|  /  Σ_t |A_t|           (policy tokens t; 0 when every A_t = 0)

    0 for REINFORCE with rewards >= 0, or for any estimator with a baseline that never exceeds the reward
    (e.g. a critic with V ≈ 0); 0.5 for a group-normalised advantage whose groups are balanced.
    """
    check_2d("response_mask", response_mask)
    check_2d("advantages", advantages, tuple(response_mask.shape))
    values = advantages[as_bool_mask("response_mask", response_mask)].double()
    total = float(values.abs().sum())
    return 0.0 if total == 0.0 else float(values.clamp(max=0.0).abs().sum()) / total


FLAT_RETURNS_VAR = 1e-8
"""Below this variance the returns count as flat (float rounding of A + V), and the explained variance is
undefined. Binary outcome rewards that vary at all have a variance over tokens of at least ~1e-3."""


def explained_variance(values: Tensor, returns: Tensor, response_mask: Tensor) -> float:
    """How much of the returns' variance the critic explains, over policy tokens:

        EV = 1 − Var(R − V) / Var(R)        (population variances; nan when Var(R) = 0)

    Source: the PPO2 baselines / veRL ``critic/vf_explained_var`` diagnostic. 1: V predicts R exactly;
    0: V is no better than the constant mean of R; < 0: worse than that constant. Undefined (nan) when the
    returns do not vary: Var(R) <= ``FLAT_RETURNS_VAR`` (returns = A + V carry float rounding, so a batch whose
    rewards are all equal has Var(R) ~ 1e-15, not 0, and the ratio would read -1e13).
    """
    check_2d("response_mask", response_mask)
    check_2d("values", values, tuple(response_mask.shape))
    check_2d("returns", returns, tuple(response_mask.shape))
    mask = as_bool_mask("response_mask", response_mask)
    r, v = returns[mask].double(), values[mask].double()
    if r.numel() == 0:
        return float("nan")
    var_r = float(r.var(unbiased=False))
    return float("nan") if var_r <= FLAT_RETURNS_VAR else 1.0 - float((r - v).var(unbiased=False)) / var_r


def stratum_cells(group_ids: Tensor, strata_ids: Tensor) -> tuple[Tensor, int]:
    """Dense index [B] of the (group, stratum) cell of each rollout, and the number of cells."""
    group, _ = dense_ids(group_ids)
    stratum, num_strata = dense_ids(strata_ids)
    return dense_ids(group * num_strata + stratum)


STRATIFIED_ALPHA = 0.6
"""The default blend α of Stratified GRPO, everywhere one is read: Zhu et al.'s setting (arXiv 2510.06214,
Qwen2.5-3B-Base runs)."""


def check_alpha(alpha: float, name: str = "alpha") -> None:
    """Raise a ValueError naming ``name`` unless the blend weight ``alpha`` lies in [0, 1]."""
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"{name} must be in [0, 1] (0 = GRPO, 1 = pure SAN), got {alpha!r}")


def stratified_advantages(
    rewards: Tensor,
    group_ids: Tensor,
    strata_ids: Tensor,
    *,
    alpha: float = STRATIFIED_ALPHA,
    eps: float = 1e-6,
    std_ddof: int = 1,
    scale_by_std: bool = True,
) -> Tensor:
    """Stratified GRPO advantage: α · A_SAN + (1 − α) · A_GN.

        A_SAN(τ_i) = (R_i − mean_{B_k}(R)) / (std_{B_k}(R) + ε),   B_k = rollouts of τ_i's group in stratum k
        A(τ_i)     = α · A_SAN(τ_i) + (1 − α) · A_GN(τ_i)

    Source: Zhu et al., "Stratified GRPO", arXiv 2510.06214 (SAN eq. and the blend; α = 0.6 in
    their Qwen2.5-3B-Base runs). Strata are formed inside each prompt group: a cell is a
    (group id, stratum id) pair. A_GN is computed by :func:`grpo_advantages` with the same
    ``eps`` / ``std_ddof`` / ``scale_by_std``, so α = 0 reproduces GRPO bit for bit
    (``0 · SAN + 1 · GN == GN`` exactly in IEEE arithmetic). A cell of one rollout or
    with all-equal rewards gets SAN 0 (that rollout then keeps (1 − α) · A_GN).

    Args:
        rewards: [B] float, finite.
        group_ids: [B] integer prompt-group ids (any values).
        strata_ids: [B] integer structural keys, e.g. number of search calls (any values).
        alpha: blend weight in [0, 1]; 0 → GRPO, 1 → pure SAN.
    Returns:
        [B] advantages.
    """
    check_1d("rewards", rewards)
    check_ids("group_ids", group_ids, rewards.shape[0])
    check_ids("strata_ids", strata_ids, rewards.shape[0])
    check_alpha(alpha)
    gn = grpo_advantages(rewards, group_ids, eps=eps, std_ddof=std_ddof, scale_by_std=scale_by_std)
    if gn.numel() == 0:
        return gn
    values = float_values("rewards", rewards)
    cell, n_cells = stratum_cells(group_ids, strata_ids)
    san = segment_normalize(values, cell, n_cells, eps=eps, std_ddof=std_ddof, scale_by_std=scale_by_std)
    return alpha * san + (1.0 - alpha) * gn


def cross_stratum_bias(rewards: Tensor, group_ids: Tensor, strata_ids: Tensor) -> Tensor:
    """The structural offset GRPO adds to each rollout: ``mean_{B_k}(R) − mean_g(R)`` [B].

    Decomposition (arXiv 2510.06214): ``(R_i − mean R) − (R_i − mean_{B_k} R) = mean_{B_k} R − mean R``,
    constant inside a stratum. Unnormalised (before dividing by any std).
    """
    check_1d("rewards", rewards)
    check_ids("group_ids", group_ids, rewards.shape[0])
    check_ids("strata_ids", strata_ids, rewards.shape[0])
    values = float_values("rewards", rewards)
    if values.numel() == 0:
        return values.clone()

    def segment_mean(segment: Tensor, n: int) -> Tensor:
        zeros = values.new_zeros(n)
        counts = zeros.index_add(0, segment, torch.ones_like(values))
        return (zeros.index_add(0, segment, values) / counts)[segment]

    group, n_groups = dense_ids(group_ids)
    cell, n_cells = stratum_cells(group_ids, strata_ids)
    return segment_mean(cell, n_cells) - segment_mean(group, n_groups)


def broadcast_to_tokens(advantages: Tensor, response_mask: Tensor) -> Tensor:
    """Outcome advantage [B] → token advantage [B, T]: A on policy tokens, 0 elsewhere."""
    check_2d("response_mask", response_mask)
    check_1d("advantages", advantages, response_mask.shape[0])
    mask = as_bool_mask("response_mask", response_mask)
    return torch.where(mask, advantages[:, None], advantages.new_zeros(()))


def outcome_to_token_rewards(rewards: Tensor, response_mask: Tensor) -> Tensor:
    """Place each rollout's scalar reward on its last policy token (the Search-R1 / veRL convention).

    Rows with no policy token get no reward (all zeros); they carry no gradient anyway.
    """
    check_2d("response_mask", response_mask)
    check_1d("rewards", rewards, response_mask.shape[0])
    mask = as_bool_mask("response_mask", response_mask)
    values = float_values("rewards", rewards)
    positions = torch.arange(mask.shape[1], device=mask.device).expand_as(mask)
    last = torch.where(mask, positions, torch.full_like(positions, -1)).amax(dim=1)
    is_last = (positions == last[:, None]) & mask
    return torch.where(is_last, values[:, None], values.new_zeros(()))


def gae_advantages(
    token_rewards: Tensor,
    values: Tensor,
    response_mask: Tensor,
    *,
    gamma: float = 1.0,
    lam: float = 1.0,
    whiten: bool = False,
) -> tuple[Tensor, Tensor]:
    """Generalised advantage estimation over policy tokens only, skipping observation tokens.

        δ_t = r_t + γ · V(s_{next(t)}) − V(s_t)          next(t) = next policy token after t (V = 0 past the end)
        A_t = δ_t + γλ · A_{next(t)}          R_t = A_t + V(s_t)

    Source: Schulman et al. 2015 (arXiv 1506.02438). Skipping observation tokens is stratarl's
    choice: tokens the policy did not write are not MDP steps, so the recursion jumps over them
    and γ is applied once per policy token. Search-R1 (arXiv 2503.09516; ``compute_advantage`` in
    its ``verl/trainer/ppo/ray_trainer.py``) runs the recursion over every response token,
    observations included (it passes the attention mask), and masks observations only out of the
    actor loss ("state masking"). With its defaults γ = λ = 1 the two agree on every policy token
    (both telescope to A_t = Σ_{k≥t} r_k − V(s_t), observation rewards being 0); they differ when
    γ < 1 or λ < 1. Defaults γ = λ = 1 (Search-R1's PPO). Observation and padding tokens get
    advantage 0 and return 0. Vectorised over B; one reverse pass over T.

    ``whiten=True`` standardises the advantages over the batch's policy tokens, as veRL and
    Search-R1 do (``masked_whiten``: (A − mean) / sqrt(var + 1e-8), unbiased var; Search-R1 takes
    the statistics over the attention mask, observations included); the returns stay unwhitened.
    Off by default in the native trainer (``algo.advantage_params.whiten: true`` turns it on).

    Args:
        token_rewards: [B, T]; non-zero only on policy tokens (a reward on a masked token
            would be silently dropped, so it raises instead).
        values: [B, T] critic values V(s_t) (detached by this function).
        response_mask: [B, T] 1 on policy tokens.
    Returns:
        (advantages [B, T], returns [B, T]), both detached.
    """
    check_2d("token_rewards", token_rewards)
    check_2d("values", values, tuple(token_rewards.shape))
    check_2d("response_mask", response_mask, tuple(token_rewards.shape))
    if not 0.0 <= gamma <= 1.0 or not 0.0 <= lam <= 1.0:
        raise ValueError(f"gamma and lam must be in [0, 1], got gamma={gamma!r}, lam={lam!r}")
    mask = as_bool_mask("response_mask", response_mask)
    rewards = float_values("token_rewards", token_rewards.detach())
    if bool((rewards[~mask] != 0).any()):
        raise ValueError(
            "token_rewards has non-zero entries on observation/padding tokens (response_mask = 0); "
            "put rewards on policy tokens, e.g. with outcome_to_token_rewards(rewards, response_mask)"
        )
    values = values.detach().to(rewards.dtype)
    batch, length = rewards.shape
    advantages = torch.zeros_like(rewards)
    next_value = rewards.new_zeros(batch)
    next_advantage = rewards.new_zeros(batch)
    for t in range(length - 1, -1, -1):
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        advantage_t = delta + gamma * lam * next_advantage
        on_policy = mask[:, t]
        advantages[:, t] = torch.where(on_policy, advantage_t, torch.zeros_like(advantage_t))
        # Observation tokens leave the carried state untouched: the recursion skips them.
        next_value = torch.where(on_policy, values[:, t], next_value)
        next_advantage = torch.where(on_policy, advantage_t, next_advantage)
    returns = torch.where(mask, advantages + values, torch.zeros_like(advantages))
    if whiten:
        advantages = masked_whiten(advantages, mask)
    return advantages, returns


def masked_whiten(x: Tensor, mask: Tensor, *, eps: float = 1e-8) -> Tensor:
    """``(x − mean) / sqrt(var + eps)`` over the entries where ``mask`` is true, 0 elsewhere [B, T].

    mean and the unbiased variance (n − 1) are taken over the masked entries (veRL
    ``torch_functional.masked_whiten``); one masked entry gives variance 0, an empty mask all zeros.
    """
    check_2d("x", x)
    mask = as_bool_mask("mask", mask)
    check_2d("mask", mask, tuple(x.shape))
    count = mask.sum()
    if int(count) == 0:
        return torch.zeros_like(x)
    picked = torch.where(mask, x, torch.zeros_like(x))
    mean = picked.sum() / count
    centred = torch.where(mask, x - mean, torch.zeros_like(x))
    var = (centred * centred).sum() / (count - 1).clamp(min=1)
    return torch.where(mask, centred * torch.rsqrt(var + eps), torch.zeros_like(x))
