"""Dynamic sampling's pure parts (DAPO, arXiv 2503.14476, section 3.2): which prompt groups carry a signal,
how many prompts a refill draws, and the batch of the kept groups.

A group whose rollouts all earn the same raw outcome (the answer score before shaping: ``CollectedBatch.outcomes``)
gets a group-relative advantage of 0 on every rollout: it costs an update and teaches nothing. The filter reads
the raw outcome, never the shaped reward: a format floor, an invalid-action penalty or a tool-call cost can
differ inside a group whose answers are all equally wrong, and training on those differences alone teaches the
shaping, not the task. The refill loop itself is in stratarl.trainer.step (``_collect_informative``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import replace

from stratarl.rollout.collect import CollectedBatch, constant_outcome_groups, select_rollouts


def informative_groups(batch: CollectedBatch) -> list[int]:
    """The group ids of ``batch`` whose raw outcome varies, in order of first appearance."""
    constant = constant_outcome_groups(batch.group_ids, batch.outcomes)
    return [g for g in dict.fromkeys(batch.group_ids) if g not in constant]


def keep_groups(batch: CollectedBatch, groups: Sequence[int], first_id: int = 0) -> CollectedBatch:
    """The rollouts of ``groups`` (in batch order), their group ids renumbered ``first_id``, ``first_id + 1``, ...
    in the order of ``groups``."""
    new_id = {g: first_id + i for i, g in enumerate(groups)}
    kept = select_rollouts(batch, [i for i, g in enumerate(batch.group_ids) if g in new_id])
    return replace(kept, group_ids=[new_id[g] for g in kept.group_ids])


def concat_batches(batches: Sequence[CollectedBatch]) -> CollectedBatch:
    """One batch of ``batches`` in order (their group ids must already be distinct; times add up; the run's tools
    are the first batch's)."""

    def join(name: str) -> list:
        return [value for batch in batches for value in getattr(batch, name)]

    return replace(
        batches[0],
        rollouts=join("rollouts"),
        examples=join("examples"),
        group_ids=join("group_ids"),
        rewards=join("rewards"),
        em=join("em"),
        strata=join("strata"),
        generation_s=sum(batch.generation_s for batch in batches),
        retrieval_s=sum(batch.retrieval_s for batch in batches),
        outcomes=join("outcomes"),
        components=join("components"),
        reward_faults=join("reward_faults"),
        overlong=join("overlong"),
    )


def refill_size(missing: int, kept: int, seen: int, limit: int) -> int:
    """Prompts the next collection draws: the ``missing`` groups divided by the share of groups kept so far
    (``kept`` of ``seen``), rounded up, at most ``limit`` (a full batch); ``limit`` when none was kept yet."""
    if missing <= 0:
        return 0
    if kept == 0 or seen == 0:
        return limit
    return min(limit, max(missing, math.ceil(missing * seen / kept)))


def dynsample_metrics(attempts: int, seen: int, dropped: int, kept: int, target: int, drawn: int) -> dict[str, float]:
    """``dynsample/``: the collections the step made, the share of the groups it saw that were dropped (and both
    counts, so a run's share is the sum of ``groups_dropped`` over the sum of ``groups_seen``), the groups it
    kept, the prompts it drew, and ``short`` 1 when the attempts ran out before ``target`` groups were kept."""
    return {
        "dynsample/attempts": float(attempts),
        "dynsample/filtered_share": dropped / seen if seen else 0.0,
        "dynsample/groups_seen": float(seen),
        "dynsample/groups_dropped": float(dropped),
        "dynsample/kept_groups": float(kept),
        "dynsample/prompts_drawn": float(drawn),
        "dynsample/short": float(kept < target),
    }
