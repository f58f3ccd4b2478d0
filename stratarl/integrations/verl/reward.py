"""A veRL ``compute_score`` with stratarl's Search-R1 exact-match reward (docs/compatibility.md, Reward).

veRL's built-in scorer handles only its own ``searchR1_<source>`` data sources; this one scores
any source (e.g. stratarl's synthetic benchmark). Select it with

    reward.custom_reward_function.path: <stratarl>/stratarl/integrations/verl/reward.py
    reward.custom_reward_function.name: compute_score
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from typing import Any

from stratarl.rewards import em_reward

# When set, compute_score_with_turns appends one json line per rollout it scores to this file (the data
# row's extra_info.index, score, tool_calls, num_turns): the agent loop's own counts, for checking a run
# under either veRL trainer (v1's rollout dump keeps no reward extras).
REWARD_DUMP_ENV = "STRATARL_VERL_REWARD_DUMP"


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


def compute_score_with_turns(
    data_source: str, solution_str: str, ground_truth: Any, extra_info: Any = None, **kwargs: Any
) -> dict[str, float]:
    """:func:`compute_score` plus the rollout's tool counts as veRL's agent loop recorded them.

    ``tool_calls`` = ``len(tool_rewards)`` (one entry per tool call the loop executed, failed ones
    included) and ``num_turns`` (user + assistant turns + 1): an independent count of the searches next
    to the strata the advantage estimator derives from ``response_mask``. The legacy trainer writes the
    extra keys to ``trainer.rollout_data_dir``; the v1 trainer does not, so with ``$STRATARL_VERL_REWARD_DUMP``
    set each call also appends them (with the data row's ``extra_info.index``) to that file.
    """
    info = extra_info if isinstance(extra_info, Mapping) else {}
    tool_rewards = info.get("tool_rewards")
    num_turns = info.get("num_turns")
    result = {
        "score": compute_score(data_source, solution_str, ground_truth),
        "tool_calls": float(len(tool_rewards) if tool_rewards is not None else -1),
        "num_turns": float(num_turns if num_turns is not None else -1),
    }
    if os.environ.get(REWARD_DUMP_ENV):
        index = info.get("index")
        record = {"index": None if index is None else int(index), **result}
        with open(os.environ[REWARD_DUMP_ENV], "a") as out:  # one short write per line: safe across reward workers
            out.write(json.dumps(record) + "\n")
    return result
