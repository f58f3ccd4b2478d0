"""The scoring a data source picks whatever the run's reward is, as Search-R1's ``_select_rm_score_fn`` picks its
scorer by ``data_source`` (standard library only): multiple-choice sources by letter or option text, PhantomWiki
by answer sets (:mod:`stratarl.rewards.phantomwiki`)."""

from __future__ import annotations

from collections.abc import Sequence

from stratarl.rewards.formats import RewardFn, multiple_choice_match, multiple_choice_reward
from stratarl.rewards.phantomwiki import (
    phantomwiki_em_reward,
    phantomwiki_f1_reward,
    phantomwiki_subem_reward,
    set_covers,
    set_exact_match,
    set_f1,
)
from stratarl.rewards.qa import em_reward, exact_match, f1_reward, f1_score, sub_exact_match, subem_reward

# Rewards chosen by an example's data_source, as Search-R1's _select_rm_score_fn chooses its scorer by
# data_source: multiple-choice sources are scored by letter or option text whatever the run's reward is.
MULTIPLE_CHOICE_SOURCES = ("medqa", "medmcqa", "synthetic_mc")
SOURCE_REWARDS: dict[str, RewardFn] = dict.fromkeys(MULTIPLE_CHOICE_SOURCES, multiple_choice_reward)


# Sources whose answers are sets (PhantomWiki): each built-in reward is replaced by the same metric on sets; a
# reward of the user's own is kept.
SET_SCORED_SOURCES = ("phantomwiki",)
_SET_REWARDS: dict[RewardFn, RewardFn] = {
    em_reward: phantomwiki_em_reward,
    subem_reward: phantomwiki_subem_reward,
    f1_reward: phantomwiki_f1_reward,
}


def reward_for_source(data_source: str, default: RewardFn) -> RewardFn:
    """The reward of ``data_source`` (``SOURCE_REWARDS``; for a set-scored source the set version of a built-in
    reward), else ``default`` (the run's ``algo.reward``)."""
    if data_source in SET_SCORED_SOURCES:
        return _SET_REWARDS.get(default, default)
    return SOURCE_REWARDS.get(data_source, default)


def answer_match(data_source: str, prediction: str, golds: str | Sequence[str]) -> float:
    """1.0 if an extracted answer is right: the multiple-choice match for multiple-choice sources, set equality
    for set-scored sources (PhantomWiki), else EM."""
    if data_source in SOURCE_REWARDS:
        return multiple_choice_match(prediction, golds)
    if data_source in SET_SCORED_SOURCES:
        return set_exact_match(prediction, golds)
    return exact_match(prediction, golds)


def answer_scores(data_source: str, prediction: str | None, golds: str | Sequence[str]) -> dict[str, float]:
    """EM, SubEM and F1 of an extracted answer (all 0.0 for None), each as ``data_source`` defines it: the
    multiple-choice match three times for multiple-choice sources, the set metrics for PhantomWiki, else
    Search-R1's EM, SubEM and token F1."""
    if prediction is None:
        return {"em": 0.0, "subem": 0.0, "f1": 0.0}
    if data_source in SOURCE_REWARDS:
        match = multiple_choice_match(prediction, golds)
        return {"em": match, "subem": match, "f1": match}
    if data_source in SET_SCORED_SOURCES:
        return {
            "em": set_exact_match(prediction, golds),
            "subem": set_covers(prediction, golds),
            "f1": set_f1(prediction, golds),
        }
    return {
        "em": exact_match(prediction, golds),
        "subem": sub_exact_match(prediction, golds),
        "f1": float(f1_score(prediction, golds)),
    }
