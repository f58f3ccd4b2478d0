"""Stratum diagnostics and the random-strata control of Stratified GRPO.

- :func:`cross_stratum_variance`: the variance GN keeps and SAN removes, per group
  (docs/algorithms.md §1, "Variance" fact), averaged over groups.
- :func:`zero_san_fraction`: share of rollouts whose SAN advantage is exactly 0 (their
  stratum cell has one rollout or all-equal rewards), i.e. rollouts for which Stratified
  GRPO falls back to (1 − α) · A_GN.
- :func:`live_strata_group_fraction`: share of prompt groups holding at least two strata whose
  mean reward is neither ~0 nor ~1, the groups in which SAN's within-stratum contrast differs
  from GN's (an experiment's admission check for Stratified GRPO asks for it).
- :func:`shuffle_strata_within_groups`: the control arm. Same stratum sizes inside every
  group as the real strata, but which rollout lands in which stratum is random, so any gain
  of the real strata over it comes from the structure, not from splitting groups smaller.

All are pure functions of [B] tensors (no Python loop over rollouts except the seeded
permutation, which loops over groups).
"""

from __future__ import annotations

import torch
from torch import Tensor

from stratarl.algos._checks import check_1d, check_ids, float_values
from stratarl.algos.advantages import dense_ids, stratum_cells


def _segment_sum(values: Tensor, segment: Tensor, n: int) -> Tensor:
    return values.new_zeros(n).index_add(0, segment, values)


def _checked_rewards(rewards: Tensor, group_ids: Tensor, strata_ids: Tensor) -> Tensor:
    """Rewards [B] as floats, after checking that ids are [B] integer tensors."""
    check_1d("rewards", rewards)
    check_ids("group_ids", group_ids, rewards.shape[0])
    check_ids("strata_ids", strata_ids, rewards.shape[0])
    return float_values("rewards", rewards)


def cross_stratum_variance(rewards: Tensor, group_ids: Tensor, strata_ids: Tensor) -> Tensor:
    """Mean over groups of the cross-stratum variance term (a 0-dim tensor; 0 for an empty batch).

        V_g = (1/K_g) Σ_k n_k (mean_{B_k} R − mean_g R)²
            = Var_pop(R − mean_g R) − Var_pop(R − mean_{B_k} R)      (population variances)

    K_g is the group's size and n_k the size of stratum k inside it (docs/algorithms.md §1; Zhu et al.,
    arXiv 2510.06214). It is the part of GRPO's advantage variance that depends only on a rollout's
    structure; SAN removes it. Groups are weighted equally.
    """
    values = _checked_rewards(rewards, group_ids, strata_ids)
    if values.numel() == 0:
        return values.new_zeros(())
    group, n_groups = dense_ids(group_ids)
    cell, n_cells = stratum_cells(group_ids, strata_ids)
    ones = torch.ones_like(values)
    group_size = _segment_sum(ones, group, n_groups)
    group_mean = _segment_sum(values, group, n_groups) / group_size
    cell_mean = _segment_sum(values, cell, n_cells) / _segment_sum(ones, cell, n_cells)
    # Σ over rollouts of (mean_cell − mean_group)² equals Σ_k n_k (mean_k − mean)².
    per_rollout = (cell_mean[cell] - group_mean[group]) ** 2
    per_group = _segment_sum(per_rollout, group, n_groups) / group_size
    return per_group.mean()


def zero_san_fraction(rewards: Tensor, group_ids: Tensor, strata_ids: Tensor) -> Tensor:
    """Share of rollouts whose SAN advantage is exactly 0 (a 0-dim tensor; 0 for an empty batch).

    A rollout gets A_SAN = 0 when its (group, stratum) cell holds one rollout or rewards that are
    all equal (the convention of :func:`stratarl.algos.advantages.segment_normalize`).
    """
    values = _checked_rewards(rewards, group_ids, strata_ids)
    if values.numel() == 0:
        return values.new_zeros(())
    cell, n_cells = stratum_cells(group_ids, strata_ids)
    counts = _segment_sum(torch.ones_like(values), cell, n_cells)
    low = values.new_full((n_cells,), float("inf")).scatter_reduce(0, cell, values, reduce="amin")
    high = values.new_full((n_cells,), float("-inf")).scatter_reduce(0, cell, values, reduce="amax")
    degenerate = (counts < 2) | (low == high)
    return degenerate[cell].to(values.dtype).mean()


def live_strata_group_fraction(
    rewards: Tensor, group_ids: Tensor, strata_ids: Tensor, *, low: float = 0.05, high: float = 0.95
) -> Tensor:
    """Share of groups with >= 2 live strata (a 0-dim tensor; 0 for an empty batch).

        live(g) = #{k : low <= mean_{B_k ∩ g} R <= high} >= 2,   share = (1/G) Σ_g live(g)

    A stratum whose mean reward is ~0 or ~1 carries no within-stratum contrast: with one such stratum
    beside a live one, SAN's advantage is GN's up to a per-stratum offset, so Stratified GRPO can only
    move the stratum shares, not the success inside a stratum (docs/algorithms.md §1). With rewards in
    [0, 1], a one-rollout stratum is never live (its mean is its reward). Groups are weighted equally.
    """
    values = _checked_rewards(rewards, group_ids, strata_ids)
    if not 0.0 <= low <= high <= 1.0:
        raise ValueError(f"live_strata_group_fraction: need 0 <= low <= high <= 1, got low={low}, high={high}")
    if values.numel() == 0:
        return values.new_zeros(())
    group, n_groups = dense_ids(group_ids)
    cell, n_cells = stratum_cells(group_ids, strata_ids)
    ones = torch.ones_like(values)
    cell_mean = _segment_sum(values, cell, n_cells) / _segment_sum(ones, cell, n_cells)
    cell_group = torch.zeros(n_cells, dtype=torch.long).scatter(0, cell, group)
    live = ((cell_mean >= low) & (cell_mean <= high)).to(values.dtype)
    live_per_group = _segment_sum(live, cell_group, n_groups)
    return (live_per_group >= 2).to(values.dtype).mean()


def shuffle_strata_within_groups(strata_ids: Tensor, group_ids: Tensor, generator: torch.Generator) -> Tensor:
    """Random strata with the real strata's sizes: permute ``strata_ids`` among each group's rollouts.

    Every group keeps its multiset of stratum labels (so the same stratum sizes), but the
    assignment of labels to rollouts is a uniform random permutation drawn from ``generator``
    (same generator state → same result). Groups are visited in sorted id order.
    """
    check_1d("strata_ids", strata_ids)
    check_ids("strata_ids", strata_ids, strata_ids.shape[0])
    check_ids("group_ids", group_ids, strata_ids.shape[0])
    out = strata_ids.clone()
    group, n_groups = dense_ids(group_ids)
    for g in range(n_groups):
        rows = (group == g).nonzero(as_tuple=True)[0]
        perm = torch.randperm(rows.numel(), generator=generator)
        out[rows] = strata_ids[rows[perm.to(rows.device)]]
    return out
