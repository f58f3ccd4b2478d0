"""Time stratarl's vectorised GRPO / Stratified GRPO advantages against a per-group Python loop.

The baseline is the formula written the way peers write it (veRL / Search-R1
``compute_grpo_outcome_advantage``): gather each group's scores into a dict of lists in a loop
over rollouts, take torch.mean / torch.std per group, then normalise in a second loop. Both
implementations are checked to agree before timing. Target: ≥ 20× at B = 8,192.

    python benchmarks/bench_advantages.py [--sizes 512 2048 8192 32768 65536] [--group-size 5] [--repeats 5]
"""

from __future__ import annotations

import argparse
import time
from collections import defaultdict

import torch

from stratarl.algos import grpo_advantages, stratified_advantages


def grpo_loop_baseline(rewards: torch.Tensor, group_ids: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """Per-group loop in the style of veRL's compute_grpo_outcome_advantage (size-1 / all-equal → 0)."""
    scores = rewards.clone()
    id2score: dict[int, list[torch.Tensor]] = defaultdict(list)
    index = group_ids.tolist()
    for i in range(len(index)):
        id2score[index[i]].append(scores[i])
    id2mean, id2std = {}, {}
    for key, values in id2score.items():
        stacked = torch.stack(values)
        id2mean[key] = torch.mean(stacked)
        # size-1 and all-equal groups give advantage 0 (stratarl's convention): std = inf makes it 0
        degenerate = len(values) < 2 or bool((stacked == stacked[0]).all())
        id2std[key] = torch.tensor(float("inf")) if degenerate else torch.std(stacked)
    for i in range(len(index)):
        scores[i] = (scores[i] - id2mean[index[i]]) / (id2std[index[i]] + eps)
    return scores


def stratified_loop_baseline(
    rewards: torch.Tensor, group_ids: torch.Tensor, strata_ids: torch.Tensor, alpha: float = 0.6, eps: float = 1e-6
) -> torch.Tensor:
    """SAN by the same per-cell loop over (group, stratum) keys, blended with the loop GRPO."""
    cells = [g * 1_000_003 + s for g, s in zip(group_ids.tolist(), strata_ids.tolist())]
    san = grpo_loop_baseline(rewards, torch.tensor(cells), eps)
    gn = grpo_loop_baseline(rewards, group_ids, eps)
    return alpha * san + (1 - alpha) * gn


def make_batch(size: int, group_size: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    groups = torch.arange(size // group_size).repeat_interleave(group_size)
    groups = groups[torch.randperm(groups.numel(), generator=gen)] * 3 + 11  # arbitrary, unsorted ids
    rewards = (torch.rand(groups.numel(), generator=gen) < 0.4).float()
    strata = torch.randint(0, 4, (groups.numel(),), generator=gen)  # search counts 0..3
    return rewards, groups, strata


def best_time(fn, repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", type=int, nargs="+", default=[512, 2048, 8192, 32768, 65536])
    parser.add_argument("--group-size", type=int, default=5, help="rollouts per prompt (Search-R1: 5)")
    parser.add_argument("--repeats", type=int, default=5, help="best of this many runs (loop: at most 2 above 8k)")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads (default 1)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    print(f"group size {args.group_size}, {args.threads} thread(s), best of {args.repeats}; times in ms")
    print(f"{'B':>7} {'method':>11} {'loop':>10} {'stratarl':>10} {'speed-up':>9}")
    for size in args.sizes:
        rewards, groups, strata = make_batch(size, args.group_size)
        torch.testing.assert_close(grpo_advantages(rewards, groups), grpo_loop_baseline(rewards, groups))
        torch.testing.assert_close(
            stratified_advantages(rewards, groups, strata), stratified_loop_baseline(rewards, groups, strata)
        )
        loop_repeats = args.repeats if size <= 8192 else min(args.repeats, 2)
        cases = [
            ("grpo", lambda: grpo_loop_baseline(rewards, groups), lambda: grpo_advantages(rewards, groups)),
            (
                "stratified",
                lambda: stratified_loop_baseline(rewards, groups, strata),
                lambda: stratified_advantages(rewards, groups, strata),
            ),
        ]
        for name, loop_fn, fast_fn in cases:
            fast_fn()  # warm-up
            t_loop = best_time(loop_fn, loop_repeats)
            t_fast = best_time(fast_fn, args.repeats)
            print(f"{size:>7} {name:>11} {t_loop * 1e3:>10.2f} {t_fast * 1e3:>10.3f} {t_loop / t_fast:>8.0f}x")


if __name__ == "__main__":
    main()
