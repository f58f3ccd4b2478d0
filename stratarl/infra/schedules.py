"""Learning-rate schedules: linear warm-up, then constant or cosine to 10% of the base lr (RL and SFT share them)."""

from __future__ import annotations

import math
from collections.abc import Callable


def lr_multiplier(step: int, warmup_steps: int, decay_steps: int, schedule: str) -> float:
    """Multiplier of the base lr at optimizer step ``step`` (0-based): linear warm-up
    ((step + 1) / warmup_steps), then ``constant`` (1) or ``cosine`` from 1 to 0.1,
    0.1 + 0.9 * (1 + cos(pi * p)) / 2 with p = (step - warmup_steps) / decay_steps capped at 1."""
    if warmup_steps and step < warmup_steps:
        return (step + 1) / warmup_steps
    if schedule == "cosine":
        progress = min(1.0, (step - warmup_steps) / max(1, decay_steps))
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress))
    return 1.0


def lr_lambda(warmup_steps: int, total_steps: int, schedule: str) -> Callable[[int], float]:
    """Multiplier of the base lr at optimizer step s: linear warm-up, then constant or cosine to 10%
    (reached after the last of ``total_steps``)."""
    return lambda step: lr_multiplier(step, warmup_steps, total_steps - warmup_steps, schedule)


def sft_lr_factor(step: int, total_steps: int, warmup_steps: int, schedule: str) -> float:
    """The warm start's multiplier at optimizer step ``step`` (0-based): as ``lr_multiplier``, with the cosine
    reaching 10% of the lr at the last step (step total_steps - 1)."""
    if schedule not in ("constant", "cosine"):
        raise ValueError(f"unknown SFT lr schedule {schedule!r}; use constant or cosine")
    return lr_multiplier(step, warmup_steps, total_steps - 1 - warmup_steps, schedule)
