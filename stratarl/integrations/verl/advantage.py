"""veRL advantage estimator ``stratified_grpo``: Stratified GRPO on veRL's batch layout.

veRL calls a registered estimator as ``fn(token_level_rewards, response_mask, index, config=...)``
with no per-sample metadata (docs/compatibility.md), so the stratum key is recovered from the mask:
the number of tool observations of a rollout is the number of runs of 0s between two runs of 1s
(:func:`stratarl.algos.search_counts`). That is the native trainer's ``algo.stratum_key:
observation_blocks``, not its default ``num_searches`` (retriever calls run): the two differ on a
rollout with invalid-action feedback (an observation block without a search) or one cut right after
a search result (a trailing observation the mask cannot tell from padding). In veRL 0.9.1's
``tool_agent`` loop a block is exactly one tool round: a tool response that does not fit is dropped
whole, never appended cut (docs/verl.md, "What a stratum is inside veRL"; pinned by
tests/verl/test_verl_tool_agent_mask.py). Groups are veRL's ``uid`` (a fresh uuid per prompt),
never ``extra_info.index``. The math is :func:`stratarl.algos.stratified_advantages`.

Settings come from veRL's ``algorithm`` config (a DictConfig or an ``AlgoConfig``):

    algorithm:
      adv_estimator: stratified_grpo
      norm_adv_by_std_in_grpo: true   # false: mean-only (Dr.GRPO) inside strata and groups
      stratified_grpo:                # optional; these are the defaults
        alpha: 0.6                    # 0 = GRPO, 1 = pure SAN (paper: 0.6)
        eps: 1.0e-6                   # added to the std, as veRL's GRPO
        std_ddof: 1                   # Bessel's correction, as veRL's GRPO (torch.std)
        strata_cap: null              # counts >= cap share one stratum
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from stratarl.algos import broadcast_to_tokens, cap_strata, search_counts, stratified_advantages
from stratarl.integrations.verl.guards import refuse_mask_rewrites

ESTIMATOR_NAME = "stratified_grpo"
CONFIG_KEY = "stratified_grpo"
# When set, every call appends one json line (uid, strata, rewards, advantages per rollout) to this
# file: what the estimator saw and gave, for checking a run against an independent count of searches.
DUMP_ENV = "STRATARL_VERL_STRATA_DUMP"


@dataclass(frozen=True)
class StratifiedSettings:
    """Stratified GRPO parameters read from veRL's ``algorithm.stratified_grpo`` block."""

    alpha: float = 0.6
    eps: float = 1e-6
    std_ddof: int = 1
    strata_cap: int | None = None
    scale_by_std: bool = True


def _get(config: Any, key: str, default: Any) -> Any:
    """``config[key]`` for a DictConfig, dict, veRL BaseConfig or plain object; default if absent."""
    if config is None:
        return default
    if isinstance(config, Mapping) or hasattr(config, "get"):
        value = config.get(key, default)
    else:
        value = getattr(config, key, default)
    return default if value is None and default is not None else value


def stratified_settings(config: Any, *, epsilon: float = 1e-6, norm_adv_by_std: bool = True) -> StratifiedSettings:
    """Settings from veRL's algorithm config; unknown keys in the block are an error (typos)."""
    block = _get(config, CONFIG_KEY, None) or {}
    allowed = {"alpha", "eps", "std_ddof", "strata_cap"}
    keys = {k for k in block.keys() if not str(k).startswith("_")} if hasattr(block, "keys") else set()
    unknown = sorted(keys - allowed)
    if unknown:
        raise ValueError(
            f"algorithm.{CONFIG_KEY} has unknown key(s) {unknown}; valid keys: {sorted(allowed)}"
        )
    cap = _get(block, "strata_cap", None)
    settings = StratifiedSettings(
        alpha=float(_get(block, "alpha", 0.6)),
        eps=float(_get(block, "eps", epsilon)),
        std_ddof=int(_get(block, "std_ddof", 1)),
        strata_cap=None if cap is None else int(cap),
        scale_by_std=bool(_get(config, "norm_adv_by_std_in_grpo", norm_adv_by_std)),
    )
    if not 0.0 <= settings.alpha <= 1.0:
        raise ValueError(
            f"algorithm.{CONFIG_KEY}.alpha must be in [0, 1] (0 = GRPO, 1 = pure SAN), got {settings.alpha}"
        )
    return settings


def group_ids_from_index(index: Any, batch_size: int) -> torch.Tensor:
    """veRL's per-row group labels (uid strings, ints, …) → dense int64 ids [B]."""
    labels = np.asarray(index, dtype=object)
    if labels.shape != (batch_size,):
        raise ValueError(
            f"index (veRL's uid per rollout) has shape {labels.shape}, expected ({batch_size},); "
            "veRL passes data.non_tensor_batch['uid'] here"
        )
    _, inverse = np.unique(labels.astype(str), return_inverse=True)
    return torch.as_tensor(inverse.reshape(-1), dtype=torch.long)


def compute_stratified_grpo_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: np.ndarray | None = None,
    epsilon: float = 1e-6,
    norm_adv_by_std_in_grpo: bool = True,
    config: Any = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Stratified GRPO advantage for veRL, broadcast to policy tokens.

        R_i = Σ_t token_level_rewards[i, t]                      (outcome reward, as veRL's GRPO)
        k_i = number of tool observations of rollout i (from response_mask)
        A_i = α · A_SAN(i) + (1 − α) · A_GN(i)                   (Zhu et al., arXiv 2510.06214)

    Shapes: token_level_rewards, response_mask [B, T]; index [B] (veRL's ``uid``).
    Returns ``(advantages, returns)``, both ``A_i · response_mask`` [B, T] (veRL's GRPO convention).
    A trailing observation (rollout cut right after a search result) is indistinguishable from
    padding in ``response_mask`` and is not counted.
    """
    if token_level_rewards.dim() != 2 or tuple(token_level_rewards.shape) != tuple(response_mask.shape):
        raise ValueError(
            f"token_level_rewards {tuple(token_level_rewards.shape)} and response_mask "
            f"{tuple(response_mask.shape)} must both be [B, T]"
        )
    if index is None:
        raise ValueError(
            f"advantage estimator {ESTIMATOR_NAME!r} needs index (veRL's uid per rollout) to form prompt groups; "
            "make sure the batch has non_tensor_batch['uid']"
        )
    refuse_mask_rewrites(_get(config, "rollout_correction", None), plugin=ESTIMATOR_NAME, where="algorithm.rollout_correction")
    settings = stratified_settings(config, epsilon=epsilon, norm_adv_by_std=norm_adv_by_std_in_grpo)
    with torch.no_grad():
        rewards = token_level_rewards.sum(dim=-1)
        group_ids = group_ids_from_index(index, rewards.shape[0]).to(rewards.device)
        strata = cap_strata(search_counts(response_mask), settings.strata_cap)
        per_rollout = stratified_advantages(
            rewards,
            group_ids,
            strata,
            alpha=settings.alpha,
            eps=settings.eps,
            std_ddof=settings.std_ddof,
            scale_by_std=settings.scale_by_std,
        )
        advantages = broadcast_to_tokens(per_rollout, response_mask).to(token_level_rewards.dtype)
    if os.environ.get(DUMP_ENV):
        dump_strata(os.environ[DUMP_ENV], index, strata, rewards, per_rollout)
    return advantages, advantages.clone()


def dump_strata(path: str, index: Any, strata: torch.Tensor, rewards: torch.Tensor, advantages: torch.Tensor) -> None:
    """Append one json line: the batch's uids, strata, rewards and per-rollout advantages, in batch order."""
    record = {
        "uid": [str(u) for u in np.asarray(index, dtype=object).reshape(-1)],
        "strata": strata.tolist(),
        "rewards": rewards.tolist(),
        "advantages": advantages.tolist(),
    }
    with open(path, "a") as out:
        out.write(json.dumps(record) + "\n")
