"""Answer normalisation and rewards (pure functions, standard library only).

Two kinds of reward:

- an answer score, ``(response_text: str, golds: Sequence[str]) -> float`` (em, subem, f1, multiple_choice:
  ``REWARDS`` / ``get_reward``; also what ``algo.reward: package.module:function`` names);
- a registered reward (``register_reward``, ``build_reward``), a function of the rollout's ``Trajectory`` that
  returns its total, raw outcome and components: what ``algo.reward`` / ``algo.reward_params`` name
  (stratarl.rewards.registry; the built-in ones in stratarl.rewards.builtin and stratarl.rewards.judge).

Some data sources score answers their own way whatever the run's reward is (multiple choice by letter;
PhantomWiki by answer sets, :mod:`stratarl.rewards.phantomwiki`): ``reward_for_source`` and ``answer_scores``
(stratarl.rewards.sources) pick that scoring by ``data_source``, as Search-R1's ``_select_rm_score_fn`` picks
its scorer.
"""

from stratarl.rewards import judge as _judge  # noqa: F401  registers the judge reward
from stratarl.rewards.builtin import ANSWER_SCORERS, shaped, text_reward
from stratarl.rewards.formats import (
    RewardFn,
    extract_choice_letter,
    is_valid_format,
    make_format_reward,
    multiple_choice_match,
    multiple_choice_reward,
)
from stratarl.rewards.qa import (
    em_reward,
    exact_match,
    extract_answer,
    f1_reward,
    f1_score,
    normalize_answer,
    sub_exact_match,
    subem_reward,
)
from stratarl.rewards.registry import (
    BoundReward,
    RewardFault,
    RewardParamError,
    RewardResult,
    Trajectory,
    as_result,
    at_least,
    build_reward,
    check_reward_params,
    in_range,
    register_reward,
    reward_names,
)
from stratarl.rewards.sources import (
    MULTIPLE_CHOICE_SOURCES,
    SET_SCORED_SOURCES,
    SOURCE_REWARDS,
    answer_match,
    answer_scores,
    reward_for_source,
)

REWARDS: dict[str, RewardFn] = dict(ANSWER_SCORERS)
"""The answer scores by name (what ``get_reward`` returns)."""


def get_reward(name: str) -> RewardFn:
    """The built-in reward called ``name``; unknown names list the valid ones."""
    try:
        return REWARDS[name]
    except KeyError:
        raise ValueError(f"unknown reward {name!r}; valid: {sorted(REWARDS)}") from None


__all__ = [
    "MULTIPLE_CHOICE_SOURCES",
    "REWARDS",
    "SET_SCORED_SOURCES",
    "SOURCE_REWARDS",
    "BoundReward",
    "RewardFault",
    "RewardFn",
    "RewardParamError",
    "RewardResult",
    "Trajectory",
    "answer_match",
    "answer_scores",
    "as_result",
    "at_least",
    "build_reward",
    "check_reward_params",
    "em_reward",
    "exact_match",
    "extract_answer",
    "extract_choice_letter",
    "f1_reward",
    "f1_score",
    "get_reward",
    "in_range",
    "is_valid_format",
    "make_format_reward",
    "multiple_choice_match",
    "multiple_choice_reward",
    "normalize_answer",
    "register_reward",
    "reward_for_source",
    "reward_names",
    "shaped",
    "sub_exact_match",
    "subem_reward",
    "text_reward",
]
