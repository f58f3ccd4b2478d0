"""GiGPO: group-in-group advantages, an episode-level group and step-level groups of shared anchor states.

Source: Feng et al. 2025, "Group-in-Group Policy Optimization for LLM Agent Training" (arXiv 2505.10978),
checked against verl-agent's ``gigpo/core_gigpo.py`` (``episode_norm_reward``, ``build_step_group``,
``are_similar``, ``step_norm_reward``, ``compute_gigpo_outcome_advantage``) and its
``compute_step_discounted_returns``. Critic-free, two levels, over the G rollouts of one prompt:

    A^E(τ_i)   = (R(τ_i) − mean_j R(τ_j)) / F_norm                 episode level (paper Eq. 3; GRPO)
    R_t^(i)    = Σ_k γ^k r_{t+k}^(i) = γ^(K_i − 1 − t) · R(τ_i)   step return (Eq. 5), outcome reward at the end
    G^S(s)     = {(i, t) : s_t^(i) = s}                            step group of anchor state s (Eq. 6)
    A^S(i, t)  = (R_t^(i) − mean_{G^S(s)} R) / F_norm              step level (Eq. 7)
    A(i, t)    = A^E(τ_i) + ω · A^S(i, t)                          on every policy token of step t (Eq. 8)

F_norm is the std (``scale_by_std=True``, the default; verl-agent ``mode="mean_std_norm"``) or 1
(``scale_by_std=False``; verl-agent ``mode="mean_norm"``, its function default). The std is Bessel's
(``std_ddof=1``, as verl-agent's ``torch.std``), with ``eps`` added to it (1e-6, as verl-agent). A step
alone in its group and a step group whose returns are all equal get A^S = 0 exactly (verl-agent gives 0 too:
(x − x) / (1 + ε)); the episode level is :func:`~stratarl.algos.advantages.grpo_advantages`, so a prompt
group of one rollout gets A^E = 0 and ω = 0 reproduces GRPO bit for bit.

For a search agent a *step* is a policy turn (a maximal run of ``response_mask = 1``,
:func:`~stratarl.algos.turns.turn_ids`) and the *anchor state* of turn k is the question plus every
observation appended before it (the retrieved passages, invalid-action feedback, tool errors), in order.
Step groups are formed inside each prompt group only, so the question never needs comparing: the state key
(:func:`anchor_state`) holds the observation texts alone, and turn 0 of every rollout of a prompt shares one
anchor state. Exact matching (the paper) rarely pools later turns of a search agent; with
``similarity_threshold`` s, a state joins the first earlier step group (in rollout, then turn order) whose
first state has ``difflib.SequenceMatcher(None, state, first).ratio() >= s`` (verl-agent's
``enable_similarity``: the same greedy clustering, comparison and order). The clustering depends on the
rollouts' order when similarity is not transitive on the batch; exact matching never does.

Where stratarl differs from verl-agent (and why):

- verl-agent's batch has one row per step; its episode mean / std are taken over all step rows of a prompt
  group (``compute_mean_std_cross_steps=True``), so a rollout of K steps counts K times. Here each rollout
  counts once, as Eq. 3 and GRPO. A prompt group of one rollout: verl-agent mean 0 / std 1 (the raw
  reward), here 0 (as every estimator of stratarl.algos.advantages).
- verl-agent's anchor for its search environment is the latest observation alone (the question at reset,
  then the last ``<information>`` block); here it is the whole observation history, the state the paper
  defines (identical history). Its similarity threshold defaults to 0.95 (``similarity_thresh``); its
  search recipe (``examples/gigpo_trainer/run_search.sh``) uses 0.9 with ``mode=mean_std_norm``.
- verl-agent's recipes set ``algorithm.gamma=0.95``; its step rewards are the environment's per-step rewards
  (0 before the last step in its search environment), discounted per step. stratarl has outcome rewards
  only, so R_t = γ^(K−1−t) R. The discount is the shared knob ``algo.gamma`` (default 1.0; docs/algorithms.md,
  "GiGPO", says why): with γ < 1 equal rewards reached in fewer turns get larger returns, including in the
  turn-0 group every prompt has, i.e. γ < 1 is also a penalty on searching.

Shapes: B rollouts, T response tokens. Never NaN: empty masks and empty batches give zeros.
"""

from __future__ import annotations

import functools
from collections import Counter
from collections.abc import Sequence
from difflib import SequenceMatcher

import torch
from torch import Tensor

from stratarl.algos._checks import as_bool_mask, check_1d, check_2d, check_ids, float_values
from stratarl.algos.advantages import dense_ids, grpo_advantages, segment_normalize
from stratarl.algos.turns import num_turns, turn_ids, turn_start_mask

STATE_SEPARATOR = "\x1e"
"""Opens each observation in a state key (ASCII record separator), so histories of different lengths differ."""


def anchor_state(observations: Sequence[str]) -> str:
    """The anchor-state key of a turn: the texts of the observations before it, each opened by
    :data:`STATE_SEPARATOR` (turn 0: ``""``). The question is left out: step groups never leave a prompt group."""
    return "".join(STATE_SEPARATOR + text for text in observations)


def _check_gamma(gamma: float) -> None:
    if not 0.0 <= gamma <= 1.0:
        raise ValueError(f"gamma must be in [0, 1], got {gamma!r}")


def step_returns(rewards: Tensor, response_mask: Tensor, *, gamma: float = 1.0) -> Tensor:
    """Discounted return of each step, on its policy tokens [B, T]: ``γ^(K − 1 − t) · R`` on turn t of a
    K-turn rollout, 0 off the mask (the outcome reward is the last step's reward; earlier steps' are 0).

    Args:
        rewards: [B] outcome rewards, finite.
        response_mask: [B, T] 1 on policy tokens.
    """
    check_2d("response_mask", response_mask)
    check_1d("rewards", rewards, response_mask.shape[0])
    _check_gamma(gamma)
    mask = as_bool_mask("response_mask", response_mask)
    values = float_values("rewards", rewards)
    remaining = (num_turns(mask)[:, None] - 1 - turn_ids(mask)).clamp(min=0).to(values.dtype)
    discount = torch.full_like(remaining, gamma).pow(remaining)
    return torch.where(mask, values[:, None] * discount, values.new_zeros(()))


def _cluster(states: Sequence[str], threshold: float | None) -> list[int]:
    """Cluster index of each state of one prompt group: equal keys, or verl-agent's greedy similarity
    clustering (join the first cluster whose first state is similar enough, else open one)."""
    firsts: list[str] = []
    seen: dict[str, int] = {}  # an identical state makes the same comparisons, so it joins the same cluster
    out = []
    for state in states:
        if state not in seen:
            seen[state] = len(firsts)
            if threshold is not None:
                for index, first in enumerate(firsts):
                    matcher = SequenceMatcher(None, state, first)
                    # real_quick_ratio >= quick_ratio >= ratio: the cheap bounds skip only hopeless pairs.
                    if (
                        matcher.real_quick_ratio() >= threshold
                        and matcher.quick_ratio() >= threshold
                        and matcher.ratio() >= threshold
                    ):
                        seen[state] = index
                        break
            if seen[state] == len(firsts):
                firsts.append(state)
        out.append(seen[state])
    return out


@functools.lru_cache(maxsize=4)
def _groups(
    states: tuple[tuple[str, ...], ...], groups: tuple[int, ...], threshold: float | None
) -> tuple[tuple[int, ...], ...]:
    members: dict[int, list[tuple[int, int]]] = {}
    for b, (group, turns) in enumerate(zip(groups, states)):
        members.setdefault(group, []).extend((b, k) for k in range(len(turns)))
    ids = [[0] * len(turns) for turns in states]
    offset = 0
    for group in sorted(members):
        steps = members[group]
        clusters = _cluster([states[b][k] for b, k in steps], threshold)
        for (b, k), cluster in zip(steps, clusters):
            ids[b][k] = offset + cluster
        offset += max(clusters, default=-1) + 1
    return tuple(tuple(row) for row in ids)


def step_groups(
    step_states: Sequence[Sequence[str]],
    group_ids: Tensor | Sequence[int],
    *,
    similarity_threshold: float | None = None,
) -> tuple[tuple[int, ...], ...]:
    """Anchor-state group of every step: ``out[b][k]`` is the step group id (0..n−1, unique over the batch) of
    turn k of rollout b. Steps pool only inside one prompt group (equal ``group_ids``); inside it, equal state
    keys (``similarity_threshold`` None, the paper's exact match), or verl-agent's greedy clustering by
    ``difflib.SequenceMatcher`` ratio >= the threshold (in (0, 1]), over the steps in rollout, then turn order.

    Args:
        step_states: per rollout, the anchor-state key of each of its turns (e.g. :func:`anchor_state`).
        group_ids: [B] prompt-group ids (any integers).
    """
    groups = tuple(int(g) for g in (group_ids.tolist() if isinstance(group_ids, Tensor) else group_ids))
    if len(groups) != len(step_states):
        raise ValueError(f"step_states has {len(step_states)} rollouts, group_ids {len(groups)}")
    if similarity_threshold is not None and not 0.0 < similarity_threshold <= 1.0:
        raise ValueError(f"similarity_threshold must be in (0, 1] or None (exact match), got {similarity_threshold!r}")
    states = tuple(tuple(str(s) for s in turns) for turns in step_states)
    return _groups(states, groups, None if similarity_threshold is None else float(similarity_threshold))


def token_step_ids(step_ids: Sequence[Sequence[int]], response_mask: Tensor) -> Tensor:
    """Per-turn ids → [B, T] int64: turn k's id on its policy tokens, −1 off the mask. Rollout b must have
    exactly one id per turn (run of ``response_mask = 1``); a mismatch raises, naming the rollout."""
    check_2d("response_mask", response_mask)
    if len(step_ids) != response_mask.shape[0]:
        raise ValueError(f"{len(step_ids)} rollouts of step ids for a mask of B={response_mask.shape[0]}")
    mask = as_bool_mask("response_mask", response_mask)
    counts = num_turns(mask).tolist()
    for b, (ids, count) in enumerate(zip(step_ids, counts)):
        if len(ids) != count:
            raise ValueError(f"rollout {b} has {count} policy turns in its response mask but {len(ids)} step states")
    width = max((len(ids) for ids in step_ids), default=0)
    table = torch.full((len(step_ids), max(width, 1)), -1, dtype=torch.long)
    for b, ids in enumerate(step_ids):
        table[b, : len(ids)] = torch.tensor(list(ids), dtype=torch.long)
    table = table.to(mask.device)
    turn = turn_ids(mask)
    return torch.where(mask, table.gather(1, turn.clamp(min=0)), torch.full_like(turn, -1))


def step_group_sizes(step_ids: Sequence[Sequence[int]]) -> list[int]:
    """Number of steps in each step group (one entry per distinct id)."""
    return list(Counter(i for ids in step_ids for i in ids).values())


def step_advantages(
    rewards: Tensor,
    group_ids: Tensor,
    response_mask: Tensor,
    step_state_ids: Tensor,
    *,
    gamma: float = 1.0,
    eps: float = 1e-6,
    std_ddof: int = 1,
    scale_by_std: bool = True,
) -> Tensor:
    """The step level A^S on policy tokens [B, T] (0 off the mask): each turn's return
    (:func:`step_returns`) normalised inside its step group, the turns of one prompt group that share an
    anchor-state id. Size-1 and all-equal step groups give 0 (``segment_normalize``).

    Args:
        rewards: [B] outcome rewards; group_ids: [B] integer prompt-group ids.
        response_mask: [B, T]; step_state_ids: [B, T] integer anchor-state id of each policy token (>= 0 and
            constant over a turn; ignored off the mask). Equal ids in different prompt groups never pool.
    """
    check_2d("response_mask", response_mask)
    check_1d("rewards", rewards, response_mask.shape[0])
    check_ids("group_ids", group_ids, response_mask.shape[0])
    check_2d("step_state_ids", step_state_ids, tuple(response_mask.shape))
    if step_state_ids.dtype.is_floating_point or step_state_ids.dtype == torch.bool:
        raise TypeError(f"step_state_ids must be an integer tensor, got dtype {step_state_ids.dtype}")
    mask = as_bool_mask("response_mask", response_mask)
    returns = step_returns(rewards, mask, gamma=gamma)
    starts = turn_start_mask(mask)
    rows, cols = starts.nonzero(as_tuple=True)  # one entry per turn, row-major
    if rows.numel() == 0:
        return torch.zeros_like(returns)
    states = step_state_ids[rows, cols]
    entry = (torch.cumsum(starts.flatten().long(), 0) - 1).view_as(starts)  # each token's turn entry
    if bool((states < 0).any()) or not torch.equal(step_state_ids[mask], states[entry[mask]]):
        raise ValueError("step_state_ids must be >= 0 on policy tokens and constant over each turn")
    group, _ = dense_ids(group_ids.to(mask.device))
    cell, n_cells = _pairs(group[rows], states)
    normalised = segment_normalize(
        returns[rows, cols], cell, n_cells, eps=eps, std_ddof=std_ddof, scale_by_std=scale_by_std
    )
    out = torch.zeros_like(returns)
    out[mask] = normalised[entry[mask]]
    return out


def _pairs(first: Tensor, second: Tensor) -> tuple[Tensor, int]:
    """Dense index of each (first, second) pair and the number of distinct pairs."""
    unique, inverse = torch.unique(torch.stack([first, second.to(first.dtype)], dim=1), dim=0, return_inverse=True)
    return inverse, int(unique.shape[0])


def gigpo_advantages(
    rewards: Tensor,
    group_ids: Tensor,
    response_mask: Tensor,
    step_state_ids: Tensor,
    *,
    gamma: float = 1.0,
    step_weight: float = 1.0,
    eps: float = 1e-6,
    std_ddof: int = 1,
    scale_by_std: bool = True,
) -> Tensor:
    """GiGPO token advantages [B, T]: ``A^E(τ_b) + ω · A^S(b, turn of t)`` on policy tokens, 0 elsewhere
    (formulas and source in the module docstring). ``step_weight`` ω = 0 gives GRPO's
    ``broadcast_to_tokens(grpo_advantages(...))`` bit for bit; A^E and A^S share ``eps``, ``std_ddof`` and
    ``scale_by_std``.

    Args:
        rewards: [B] outcome rewards, finite; group_ids: [B] integer prompt-group ids (any values).
        response_mask: [B, T] 1 on policy tokens.
        step_state_ids: [B, T] anchor-state id per policy token (:func:`token_step_ids`), −1 off the mask.
    Returns:
        [B, T] advantages (float; the dtype of ``rewards``, float32 for integer rewards).
    """
    check_2d("response_mask", response_mask)
    check_1d("rewards", rewards, response_mask.shape[0])
    episode = grpo_advantages(rewards, group_ids, eps=eps, std_ddof=std_ddof, scale_by_std=scale_by_std)
    step = step_advantages(
        rewards,
        group_ids,
        response_mask,
        step_state_ids,
        gamma=gamma,
        eps=eps,
        std_ddof=std_ddof,
        scale_by_std=scale_by_std,
    )
    mask = as_bool_mask("response_mask", response_mask)
    return torch.where(mask, episode[:, None] + step_weight * step, step.new_zeros(()))


def step_group_metrics(step_ids: Sequence[Sequence[int]], prefix: str = "gigpo") -> dict[str, float]:
    """How much the step level can act: ``step_group_size_mean`` (steps per step group, verl-agent's "avg size
    of step-level group"), ``step_group_size_max``, ``singleton_step_frac`` (steps alone in their group:
    A^S = 0), ``later_singleton_step_frac`` (the same over the turns after the first: turn 0's group is always
    the whole prompt group), ``step_groups``, and ``step_group_size_frac/{1,2,3,4+}`` (the share of step groups
    of each size). All 0 on an empty batch."""
    sizes = step_group_sizes(step_ids)
    size_of = Counter(i for ids in step_ids for i in ids)
    steps = [size_of[i] for ids in step_ids for i in ids]
    later = [size_of[i] for ids in step_ids for i in ids[1:]]
    by_size = Counter(min(size, 4) for size in sizes)
    out = {
        f"{prefix}/step_group_size_mean": sum(sizes) / max(1, len(sizes)),
        f"{prefix}/step_group_size_max": float(max(sizes, default=0)),
        f"{prefix}/singleton_step_frac": sum(size == 1 for size in steps) / max(1, len(steps)),
        f"{prefix}/later_singleton_step_frac": sum(size == 1 for size in later) / max(1, len(later)),
        f"{prefix}/step_groups": float(len(sizes)),
    }
    for k in range(1, 5):
        out[f"{prefix}/step_group_size_frac/{k}{'+' if k == 4 else ''}"] = by_size.get(k, 0) / max(1, len(sizes))
    return out
