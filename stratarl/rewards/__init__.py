"""Answer normalisation and rewards (pure functions, standard library only).

A reward is any callable ``(response_text: str, golds: Sequence[str]) -> float``.
"""

from collections.abc import Sequence

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

REWARDS: dict[str, RewardFn] = {
    "em": em_reward,
    "subem": subem_reward,
    "f1": f1_reward,
    "multiple_choice": multiple_choice_reward,
}


# Rewards chosen by an example's data_source, as Search-R1's _select_rm_score_fn chooses its scorer by
# data_source: multiple-choice sources are scored by letter or option text whatever the run's reward is.
MULTIPLE_CHOICE_SOURCES = ("medqa", "medmcqa", "synthetic_mc")
SOURCE_REWARDS: dict[str, RewardFn] = dict.fromkeys(MULTIPLE_CHOICE_SOURCES, multiple_choice_reward)


def reward_for_source(data_source: str, default: RewardFn) -> RewardFn:
    """The reward of ``data_source`` (``SOURCE_REWARDS``), else ``default`` (the run's ``algo.reward``)."""
    return SOURCE_REWARDS.get(data_source, default)


def answer_match(data_source: str, prediction: str, golds: str | Sequence[str]) -> float:
    """1.0 if an extracted answer is right: the multiple-choice match for multiple-choice sources, else EM."""
    if data_source in SOURCE_REWARDS:
        return multiple_choice_match(prediction, golds)
    return exact_match(prediction, golds)


def get_reward(name: str) -> RewardFn:
    """The built-in reward called ``name``; unknown names list the valid ones."""
    try:
        return REWARDS[name]
    except KeyError:
        raise ValueError(f"unknown reward {name!r}; valid: {sorted(REWARDS)}") from None


__all__ = [
    "MULTIPLE_CHOICE_SOURCES",
    "REWARDS",
    "SOURCE_REWARDS",
    "RewardFn",
    "answer_match",
    "em_reward",
    "exact_match",
    "extract_answer",
    "extract_choice_letter",
    "f1_reward",
    "f1_score",
    "get_reward",
    "is_valid_format",
    "make_format_reward",
    "multiple_choice_match",
    "multiple_choice_reward",
    "normalize_answer",
    "reward_for_source",
    "sub_exact_match",
    "subem_reward",
]
