"""Slow, obviously-correct loop implementations used as oracles for the vectorised algos.

Written from the formulas in docs/algorithms.md with Python loops over groups / rows / tokens and
per-group torch reductions, sharing no code with stratarl.algos.
"""

from __future__ import annotations

import math
from difflib import SequenceMatcher

import torch


def grpo_loop(rewards, group_ids, *, eps=1e-6, std_ddof=1, scale_by_std=True):
    out = torch.zeros_like(rewards)
    for gid in set(group_ids.tolist()):
        idx = [i for i, g in enumerate(group_ids.tolist()) if g == gid]
        r = rewards[idx]
        if len(idx) < 2 or bool((r == r[0]).all()):
            continue  # size-1 group / all-equal rewards → 0
        centered = r - r.mean()
        out[idx] = centered / (r.std(correction=std_ddof) + eps) if scale_by_std else centered
    return out


def stratified_loop(rewards, group_ids, strata_ids, *, alpha=0.6, eps=1e-6, std_ddof=1):
    san = torch.zeros_like(rewards)
    cells = set(zip(group_ids.tolist(), strata_ids.tolist()))
    for cell in cells:
        idx = [i for i, c in enumerate(zip(group_ids.tolist(), strata_ids.tolist())) if c == cell]
        r = rewards[idx]
        if len(idx) < 2 or bool((r == r[0]).all()):
            continue
        san[idx] = (r - r.mean()) / (r.std(correction=std_ddof) + eps)
    gn = grpo_loop(rewards, group_ids, eps=eps, std_ddof=std_ddof)
    return alpha * san + (1 - alpha) * gn


def gae_loop(token_rewards, values, mask, *, gamma, lam):
    """GAE on the compressed sequence of policy tokens of each row, scattered back."""
    adv = torch.zeros_like(token_rewards)
    ret = torch.zeros_like(token_rewards)
    for b in range(token_rewards.shape[0]):
        pos = [t for t in range(token_rewards.shape[1]) if mask[b, t]]
        running = 0.0
        for j in reversed(range(len(pos))):
            t = pos[j]
            next_v = values[b, pos[j + 1]].item() if j + 1 < len(pos) else 0.0
            delta = token_rewards[b, t].item() + gamma * next_v - values[b, t].item()
            running = delta + gamma * lam * running
            adv[b, t] = running
            ret[b, t] = running + values[b, t].item()
    return adv, ret


def turn_ids_loop(mask):
    out = torch.full(mask.shape, -1, dtype=torch.long)
    for b in range(mask.shape[0]):
        turn, prev = -1, False
        for t in range(mask.shape[1]):
            cur = bool(mask[b, t])
            if cur and not prev:
                turn += 1
            if cur:
                out[b, t] = turn
            prev = cur
    return out


def ratios_loop(log_probs, old_log_probs, mask, level):
    """Ratio per token: token / geometric mean over the turn / over the rollout; 1 on masked tokens."""
    ratio = torch.ones_like(log_probs)
    ids = turn_ids_loop(mask)
    for b in range(mask.shape[0]):
        if level == "token":
            groups = [[t] for t in range(mask.shape[1]) if mask[b, t]]
        elif level == "turn":
            groups = [[t for t in range(mask.shape[1]) if ids[b, t] == k] for k in range(int(ids[b].max()) + 1)]
        else:
            groups = [[t for t in range(mask.shape[1]) if mask[b, t]]]
        for tokens in groups:
            if not tokens:
                continue
            diffs = torch.stack([log_probs[b, t] - old_log_probs[b, t] for t in tokens])
            w = torch.exp(diffs.mean())
            for t in tokens:
                ratio[b, t] = w
    return ratio


def _units_loop(mask, ids, b, level):
    """The token lists of row b's units at ``level``: each policy token, each turn, or the whole rollout."""
    if level == "token":
        return [[t] for t in range(mask.shape[1]) if mask[b, t]]
    if level == "turn":
        return [[t for t in range(mask.shape[1]) if ids[b, t] == k] for k in range(int(ids[b].max()) + 1)]
    return [[t for t in range(mask.shape[1]) if mask[b, t]]] if bool(mask[b].any()) else []


def ppo_loss_loop(log_probs, old_log_probs, advantages, mask, level, clip_low, clip_high, dual_clip=None):
    """Token-mean of −min(rA, clip(r)A) (with dual clip) computed with min/max one token at a time;
    at turn/sequence level the whole turn's surrogate w·Σ_t A_t is clipped at once (its sign decides)."""
    ratio = ratios_loop(log_probs, old_log_probs, mask, level)
    ids = turn_ids_loop(mask)
    total, count = 0.0, 0
    for b in range(mask.shape[0]):
        units = _units_loop(mask, ids, b, level)
        for tokens in units:
            r = ratio[b, tokens[0]].item()
            a_sum = sum(advantages[b, t].item() for t in tokens)
            surr = min(r * a_sum, min(max(r, 1 - clip_low), 1 + clip_high) * a_sum)
            if dual_clip is not None and a_sum < 0:
                surr = max(surr, dual_clip * a_sum)
            total += -surr
            count += len(tokens)
    return total / max(count, 1)


def kl_loop(log_probs, ref_log_probs, mask, kind):
    out = torch.zeros_like(log_probs)
    for b in range(mask.shape[0]):
        for t in range(mask.shape[1]):
            if not mask[b, t]:
                continue
            d = ref_log_probs[b, t].item() - log_probs[b, t].item()
            out[b, t] = {"k1": -d, "k2": 0.5 * d * d, "k3": math.exp(d) - d - 1}[kind]
    return out


def correction_loop(kind, old_log_probs, behaviour_log_probs, mask, cap, level="token"):
    """Behaviour-correction weights one unit (token / turn / rollout) at a time with math.exp and min:
    ρ = mean over the unit of clamp(log π_old − log π_behav, ±20), r = exp ρ;
    tis: min(r, C) (truncated if r > C); mis: 1 if 1/C ≤ r ≤ C else 0 (masked otherwise);
    decoupled (token units): r if C is None or r ≤ C else 0 (masked otherwise).
    Returns (weights [B, T] float64, {metric: float}) with the metrics averaged over policy tokens."""
    weights = torch.zeros(mask.shape, dtype=torch.float64)
    ids = turn_ids_loop(mask)
    n_tokens = n_truncated = n_masked = 0
    for b in range(mask.shape[0]):
        units = _units_loop(mask, ids, b, level)
        for tokens in units:
            diffs = [
                min(max(old_log_probs[b, t].item() - behaviour_log_probs[b, t].item(), -20.0), 20.0) for t in tokens
            ]
            r = math.exp(sum(diffs) / len(diffs))
            truncated = masked = False
            if kind == "tis":
                w, truncated = min(r, cap), r > cap
            elif kind == "mis":
                masked = not (1.0 / cap <= r <= cap)
                w = 0.0 if masked else 1.0
            else:
                masked = cap is not None and r > cap
                w = 0.0 if masked else r
            for t in tokens:
                weights[b, t] = w
            n_tokens += len(tokens)
            n_truncated += len(tokens) * truncated
            n_masked += len(tokens) * masked
    total = float(weights.sum())
    denominator = max(n_tokens, 1)
    metrics = {
        "offpolicy/is_weight_mean": total / denominator,
        "offpolicy/truncated_frac": n_truncated / denominator,
        "offpolicy/masked_frac": n_masked / denominator,
    }
    return weights, metrics


def policy_runs_loop(mask_row):
    """The policy turns of one row: lists of token positions, one per maximal run of mask 1."""
    runs, prev = [], False
    for t, value in enumerate(mask_row.tolist()):
        if value and not prev:
            runs.append([])
        if value:
            runs[-1].append(t)
        prev = bool(value)
    return runs


def gigpo_loop(
    rewards,
    group_ids,
    mask,
    step_states,
    *,
    gamma=1.0,
    step_weight=1.0,
    eps=1e-6,
    std_ddof=1,
    scale_by_std=True,
    similarity_threshold=None,
):
    """GiGPO one step at a time, in float64 (arXiv 2505.10978 Eq. 3-8, verl-agent's grouping):
    A^E from grpo_loop; step (b, k) of a K-turn rollout has return gamma**(K-1-k) * R_b; inside each prompt
    group the steps, taken rollout by rollout and turn by turn, join the first cluster whose first state is
    equal (or difflib ratio >= threshold), else open one; A^S = (x - mean) / (std + eps) per cluster, 0 for a
    cluster of one or of equal returns; every token of step (b, k) gets A^E_b + step_weight * A^S."""
    episode = grpo_loop(rewards.double(), group_ids, eps=eps, std_ddof=std_ddof, scale_by_std=scale_by_std)
    steps = []  # (row, turn index, tokens, group, state, return)
    for b in range(mask.shape[0]):
        runs = policy_runs_loop(mask[b])
        assert len(runs) == len(step_states[b])
        for k, tokens in enumerate(runs):
            steps.append(
                (b, k, tokens, int(group_ids[b]), step_states[b][k], gamma ** (len(runs) - 1 - k) * float(rewards[b]))
            )
    cluster = {}
    for gid in {s[3] for s in steps}:
        firsts = []
        for b, k, _, group, state, _ in steps:
            if group != gid:
                continue
            for j, first in enumerate(firsts):
                if (
                    state == first
                    if similarity_threshold is None
                    else SequenceMatcher(None, state, first).ratio() >= similarity_threshold
                ):
                    cluster[b, k] = (gid, j)
                    break
            else:
                firsts.append(state)
                cluster[b, k] = (gid, len(firsts) - 1)
    step_adv = {}
    for key in set(cluster.values()):
        members = [s for s in steps if cluster[s[0], s[1]] == key]
        values = torch.tensor([s[5] for s in members], dtype=torch.float64)
        for s, v in zip(members, values.tolist()):
            if len(members) < 2 or bool((values == values[0]).all()):
                step_adv[s[0], s[1]] = 0.0
            elif scale_by_std:
                step_adv[s[0], s[1]] = (v - values.mean().item()) / (values.std(correction=std_ddof).item() + eps)
            else:
                step_adv[s[0], s[1]] = v - values.mean().item()
    out = torch.zeros(mask.shape, dtype=torch.float64)
    for b, k, tokens, *_ in steps:
        for t in tokens:
            out[b, t] = episode[b].item() + step_weight * step_adv[b, k]
    groups = {}
    for (b, k), key in cluster.items():
        groups.setdefault(key, []).append((b, k))
    return out, list(groups.values())
