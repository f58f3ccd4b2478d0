"""Admission check of a warm start: do its rollouts show the regime an experiment was designed for?

An experiment's YAML may hold ``admission: {steps: 1, prompts: 64, bounds: {metric: [low, high], ...}}``.
Before the sweep, run.py trains the baseline arm of each task for ``steps`` RL steps from the warm start with
``prompts`` prompts per step; the rollouts of step 1 are sampled from the warm start itself (no update has
happened yet). Their metrics (the trainer's metrics.jsonl row of step 1) must lie inside ``bounds``, else the
sweep does not start: a regime that the warm start does not show would make the arms' comparison answer
another question. Standard library only.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

# Readable names of the trainer's step metrics an admission bound may use (or any metrics.jsonl key itself).
ALIASES = {
    "two_search_share": "rollout/search_calls_frac/2",
    "success_given_2": "stratum/2/reward_mean",
    "no_search_share": "rollout/search_calls_frac/0",
    "success_given_0": "stratum/0/reward_mean",
    "reward": "reward/mean",
}


def first_step_row(run_dir: Path) -> dict:
    """The metrics.jsonl row of RL step 1 (its rollouts come from the warm start); {} when there is none."""
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        return {}
    for line in path.read_text().splitlines():
        row = json.loads(line)
        if row.get("step") == 1 and "reward/mean" in row:
            return row
    return {}


def check(row: dict, bounds: dict) -> list[str]:
    """One line per bound that ``row`` violates (a missing metric counts as a violation); [] when admitted."""
    failures = []
    for name, (low, high) in bounds.items():
        key = ALIASES.get(name, name)
        value = row.get(key)
        if value is None or not math.isfinite(float(value)):
            failures.append(f"{name} ({key}) is missing from the warm start's first step")
        elif not low <= float(value) <= high:
            failures.append(f"{name} ({key}) = {float(value):.3f}, outside [{low}, {high}]")
    return failures


def validate(admission: dict, where: str) -> None:
    """A clear error for a malformed ``admission`` section (unknown shape or low > high)."""
    bounds = admission.get("bounds")
    if not isinstance(bounds, dict) or not bounds:
        raise ValueError(
            f"{where}: admission.bounds must map metric names to [low, high]. "
            f"Fix: e.g. bounds: {{two_search_share: [0.6, 1.0]}}"
        )
    for name, pair in bounds.items():
        if not (isinstance(pair, list) and len(pair) == 2 and pair[0] <= pair[1]):
            raise ValueError(f"{where}: admission.bounds.{name} = {pair!r}. Fix: use [low, high] with low <= high")
    for key in ("steps", "prompts"):
        if int(admission.get(key, 1)) < 1:
            raise ValueError(f"{where}: admission.{key} = {admission[key]!r}. Fix: use an integer >= 1")
