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
veRL's ``rollout_is`` weights never reach an estimator (they weight the actor's loss); a ``rollout_rs``
that rewrites the mask before this estimator runs is refused in one line (:mod:`.guards`).

veRL's v1 trainer (``trainer.use_v1=true``, the default since 0.9.0) calls estimators through
``verl.trainer.ppo.v1.utils.compute_advantage_for_multi_trajectories``. Two things differ from the
legacy trainer, and both are handled here:

- the batch may hold synthetic padding rows (``upsample_batch_to_divisible_size``: uid ``pad…``, reward 0,
  a one-token response). They share one uid of their own, so they form their own group, get advantage 0
  and change no real rollout's advantage (cells are (group, stratum) pairs);
- an agent loop may return several outputs per session (rows keyed ``{uid}_{session}_{index}``). veRL's
  own GRPO then scores only each session's last output and broadcasts it; any other estimator gets every
  output as a rollout of its group. Each output's mask holds only its own segment's tool rounds, so the
  stratum of the session is not in any one mask: ``stratified_grpo`` refuses such a batch in one line
  (:func:`refuse_multi_output_sessions`). veRL gives an estimator no keys, so the check reads
  ``batch_keys`` from the calling v1 function's frame (:func:`v1_batch_keys`; the hook is pinned in
  :mod:`.compat`). ``tool_agent`` returns one output per session; the legacy trainer accepts only one.

Settings come from veRL's ``algorithm`` config (a DictConfig or an ``AlgoConfig``):

    algorithm:
      adv_estimator: stratified_grpo
      norm_adv_by_std_in_grpo: true   # false: mean-only (Dr.GRPO) inside strata and groups
      stratified_grpo:                # optional; these are the defaults
        alpha: 0.6                    # 0 = GRPO, 1 = pure SAN (paper: 0.6)
        eps: 1.0e-6                   # added to the std, as veRL's GRPO
        std_ddof: 1                   # Bessel's correction, as veRL's GRPO (torch.std)
        stratum_cap: null             # counts >= cap share one stratum (older spelling: strata_cap)
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from types import FrameType
from typing import Any

import numpy as np
import torch

from stratarl.algos import broadcast_to_tokens, cap_strata, search_counts, stratified_advantages
from stratarl.algos.advantages import STRATIFIED_ALPHA, check_alpha
from stratarl.integrations.verl.guards import refuse_for_estimator

ESTIMATOR_NAME = "stratified_grpo"
CONFIG_KEY = "stratified_grpo"
# veRL 0.9.1's v1 caller of the estimator, which holds the rows' {uid}_{session}_{index} keys.
V1_CALLER_MODULE = "verl.trainer.ppo.v1.utils"
V1_CALLER = "compute_advantage_for_multi_trajectories"
# When set, every call appends one json line (uid, strata, rewards, advantages per rollout) to this
# file: what the estimator saw and gave, for checking a run against an independent count of searches.
STRATA_DUMP_ENV = "STRATARL_VERL_STRATA_DUMP"


@dataclass(frozen=True)
class StratifiedSettings:
    """Stratified GRPO parameters read from veRL's ``algorithm.stratified_grpo`` block."""

    alpha: float = STRATIFIED_ALPHA
    eps: float = 1e-6
    std_ddof: int = 1
    stratum_cap: int | None = None
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


def stratum_cap_from(block: Any, *, where: str) -> int | None:
    """The block's ``stratum_cap`` or, from an older config, ``strata_cap`` (None: no cap)."""
    cap, older = _get(block, "stratum_cap", None), _get(block, "strata_cap", None)
    if older is not None:
        if cap is not None and cap != older:
            raise ValueError(
                f"{where} sets stratum_cap={cap} and strata_cap={older}, its older spelling. Fix: keep stratum_cap only"
            )
        cap = older
    return None if cap is None else int(cap)


def stratified_settings(config: Any, *, epsilon: float = 1e-6, norm_adv_by_std: bool = True) -> StratifiedSettings:
    """Settings from veRL's algorithm config; unknown keys in the block are an error (typos)."""
    block = _get(config, CONFIG_KEY, None) or {}
    allowed = {"alpha", "eps", "std_ddof", "stratum_cap"}
    keys = {k for k in block.keys() if not str(k).startswith("_")} if hasattr(block, "keys") else set()  # noqa: SIM118  DictConfig
    unknown = sorted(keys - allowed - {"strata_cap"})
    if unknown:
        raise ValueError(f"algorithm.{CONFIG_KEY} has unknown key(s) {unknown}; valid keys: {sorted(allowed)}")
    settings = StratifiedSettings(
        alpha=float(_get(block, "alpha", STRATIFIED_ALPHA)),
        eps=float(_get(block, "eps", epsilon)),
        std_ddof=int(_get(block, "std_ddof", 1)),
        stratum_cap=stratum_cap_from(block, where=f"algorithm.{CONFIG_KEY}"),
        scale_by_std=bool(_get(config, "norm_adv_by_std_in_grpo", norm_adv_by_std)),
    )
    check_alpha(settings.alpha, f"algorithm.{CONFIG_KEY}.alpha")
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


def v1_batch_keys(max_depth: int = 8) -> list[str] | None:
    """The ``batch_keys`` of veRL's v1 ``compute_advantage_for_multi_trajectories`` when it is the caller.

    None under the legacy trainer (or any other caller). Looks at most ``max_depth`` frames up.
    """
    frame: FrameType | None = sys._getframe(1)
    for _ in range(max_depth):
        frame = frame.f_back if frame is not None else None
        if frame is None:
            return None
        if frame.f_code.co_name == V1_CALLER and frame.f_globals.get("__name__") == V1_CALLER_MODULE:
            keys = frame.f_locals.get("batch_keys")
            return None if keys is None else [str(key) for key in keys]
    return None


def multi_output_sessions(keys: Sequence[str]) -> dict[str, int]:
    """Sessions (``{uid}_{session}``) with more than one row, and their row counts, from v1's row keys."""
    counts: dict[str, int] = {}
    for key in keys:
        fields = str(key).rsplit("_", 2)
        session = "_".join(fields[:2]) if len(fields) == 3 else str(key)
        counts[session] = counts.get(session, 0) + 1
    return {session: n for session, n in counts.items() if n > 1}


def refuse_multi_output_sessions(keys: Sequence[str] | None) -> None:
    """Raise one line when an agent loop returned several outputs for one session (v1 trainer only)."""
    if not keys:
        return
    several = multi_output_sessions(keys)
    if several:
        session, rows = next(iter(several.items()))
        raise ValueError(
            f"{ESTIMATOR_NAME} cannot compose with an agent loop that returns several outputs per session "
            f"(veRL's v1 trainer, trainer.use_v1=true: {len(several)} session(s), e.g. {session!r} with {rows} rows): "
            "each output's response_mask holds only its own segment's tool rounds, so no row carries the session's "
            "stratum, and every output would count as a rollout of its group; fix: an agent loop that returns one "
            "output per session (actor_rollout_ref.rollout.agent.default_agent_loop=tool_agent, or the rows' "
            "agent_name), or algorithm.adv_estimator=grpo (veRL scores each session's last output)"
        )


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
    refuse_for_estimator(_get(config, "rollout_correction", None), where="algorithm.rollout_correction")
    keys = v1_batch_keys()
    refuse_multi_output_sessions(keys)
    settings = stratified_settings(config, epsilon=epsilon, norm_adv_by_std=norm_adv_by_std_in_grpo)
    with torch.no_grad():
        rewards = token_level_rewards.sum(dim=-1)
        group_ids = group_ids_from_index(index, rewards.shape[0]).to(rewards.device)
        strata = cap_strata(search_counts(response_mask), settings.stratum_cap)
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
    if os.environ.get(STRATA_DUMP_ENV):
        dump_strata(os.environ[STRATA_DUMP_ENV], index, strata, rewards, per_rollout, keys=keys)
    return advantages, advantages.clone()


def dump_strata(
    path: str,
    index: Any,
    strata: torch.Tensor,
    rewards: torch.Tensor,
    advantages: torch.Tensor,
    keys: Sequence[str] | None = None,
) -> None:
    """Append one json line: the batch's uids, strata, rewards and per-rollout advantages, in batch order.

    ``keys``: v1's row keys ``{uid}_{session}_{index}`` when the v1 trainer called (else the line has none).
    """
    record = {
        "uid": [str(u) for u in np.asarray(index, dtype=object).reshape(-1)],
        "strata": strata.tolist(),
        "rewards": rewards.tolist(),
        "advantages": advantages.tolist(),
    }
    if keys is not None:
        record["keys"] = list(keys)
    with open(path, "a") as out:
        out.write(json.dumps(record) + "\n")
