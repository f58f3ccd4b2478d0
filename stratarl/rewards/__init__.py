"""Answer normalisation and rewards (pure functions, standard library only).

A reward is any callable ``(response_text: str, golds: Sequence[str]) -> float``.
"""

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


def get_reward(name: str) -> RewardFn:
    """The built-in reward called ``name``; unknown names list the valid ones."""
    try:
        return REWARDS[name]
    except KeyError:
        raise ValueError(f"unknown reward {name!r}; valid: {sorted(REWARDS)}") from None


__all__ = [
    "REWARDS",
    "RewardFn",
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
    "sub_exact_match",
    "subem_reward",
]
