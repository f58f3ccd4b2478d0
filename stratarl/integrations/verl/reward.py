"""A veRL ``compute_score`` with stratarl's Search-R1 exact-match reward (COMPATIBILITY.md, Reward).

veRL's built-in scorer handles only its own ``searchR1_<source>`` data sources; this one scores
any source (e.g. stratarl's synthetic benchmark). Select it with

    reward.custom_reward_function.path: <stratarl>/stratarl/integrations/verl/reward.py
    reward.custom_reward_function.name: compute_score
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from stratarl.rewards import em_reward


def gold_answers(ground_truth: Any) -> list[str]:
    """Gold answers from veRL's ``reward_model.ground_truth`` ({"target": [...]}, a list or a string)."""
    if isinstance(ground_truth, Mapping):
        if "target" not in ground_truth:
            raise ValueError(f"reward_model.ground_truth has no 'target' key: {dict(ground_truth)!r}")
        ground_truth = ground_truth["target"]
    if isinstance(ground_truth, str):
        return [ground_truth]
    if isinstance(ground_truth, Sequence) or hasattr(ground_truth, "tolist"):
        values = ground_truth.tolist() if hasattr(ground_truth, "tolist") else list(ground_truth)
        return [str(v) for v in values]
    raise ValueError(f"reward_model.ground_truth must be a list of answers, got {type(ground_truth).__name__}")


def compute_score(
    data_source: str, solution_str: str, ground_truth: Any, extra_info: Any = None, **kwargs: Any
) -> float:
    """EM of the last ``<answer>`` in the response against the gold answers; no answer → 0."""
    return float(em_reward(solution_str, gold_answers(ground_truth)))
