"""The built-in rewards of the registry: em, subem, f1, multiple_choice and their format-gated variants
(em_format, subem_format, f1_format), each with two optional shaping terms (standard library only).

    total = answer score [gated by the format]  -  invalid_action_penalty x invalid actions
                                                -  tool_call_cost x tool calls

The answer score is the one the name says, except for a data source that scores answers its own way
(stratarl.rewards.sources.reward_for_source): a multiple-choice source (medqa, medmcqa, synthetic_mc) by letter or
option text, PhantomWiki by answer sets, as Search-R1 picks its scorer by data_source.
The format gate is ``make_format_reward`` (our reading of Search-R1's ``qa_em_format``): a valid tag sequence
earns ``format_score`` even with a wrong answer, an invalid one loses it from a right answer. With both shaping
terms at 0 (their defaults) each reward is exactly its answer score, the reward of earlier releases.

Components (``reward/<name>_mean``): ``answer`` (the raw outcome), ``format`` (what the gate adds or takes),
``invalid_penalty`` and ``tool_cost`` (each only when its parameter is not 0); they add up to the total.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from stratarl.rewards.formats import make_format_reward, multiple_choice_reward
from stratarl.rewards.qa import em_reward, f1_reward, subem_reward
from stratarl.rewards.registry import (
    BoundReward,
    RewardResult,
    Trajectory,
    as_result,
    at_least,
    in_range,
    register_reward,
)
from stratarl.rewards.sources import reward_for_source

TextReward = Callable[[str, Sequence[str]], float]

SHAPING_CHECKS = {"invalid_action_penalty": at_least(0.0), "tool_call_cost": at_least(0.0)}
FORMAT_CHECKS = {**SHAPING_CHECKS, "format_score": in_range(0.0, 1.0, high_open=True)}


def shaped(
    trajectory: Trajectory,
    answer: float,
    gated: float | None = None,
    *,
    invalid_action_penalty: float = 0.0,
    tool_call_cost: float = 0.0,
) -> RewardResult:
    """The total and components of an answer score ``answer`` (the raw outcome), optionally gated by the format
    (``gated``: the gated score), minus the invalid-action penalty and the tool-call cost."""
    total = answer if gated is None else gated
    components = {"answer": answer}
    if gated is not None:
        components["format"] = gated - answer
    if invalid_action_penalty:
        components["invalid_penalty"] = -invalid_action_penalty * trajectory.invalid_actions
        total += components["invalid_penalty"]
    if tool_call_cost:
        components["tool_cost"] = -tool_call_cost * trajectory.tool_calls
        total += components["tool_cost"]
    return RewardResult(total=total, outcome=answer, components=components)


def _answer_reward(name: str, scorer: TextReward) -> None:
    @register_reward(name, checks=SHAPING_CHECKS)
    def reward(
        trajectory: Trajectory, *, invalid_action_penalty: float = 0.0, tool_call_cost: float = 0.0
    ) -> RewardResult:
        answer = reward_for_source(trajectory.data_source, scorer)(trajectory.response_text, trajectory.golds)
        return shaped(trajectory, answer, invalid_action_penalty=invalid_action_penalty, tool_call_cost=tool_call_cost)

    reward.__doc__ = f"{name}: the answer's score; minus the shaping terms (module docstring)."


def _format_reward(name: str, scorer: TextReward) -> None:
    @register_reward(f"{name}_format", checks=FORMAT_CHECKS)
    def reward(
        trajectory: Trajectory,
        *,
        format_score: float = 0.2,
        invalid_action_penalty: float = 0.0,
        tool_call_cost: float = 0.0,
    ) -> RewardResult:
        base = reward_for_source(trajectory.data_source, scorer)
        answer = base(trajectory.response_text, trajectory.golds)
        gated = make_format_reward(base, format_score)(trajectory.response_text, trajectory.golds)
        return shaped(
            trajectory, answer, gated, invalid_action_penalty=invalid_action_penalty, tool_call_cost=tool_call_cost
        )

    reward.__doc__ = f"{name}_format: {name} gated by the format (make_format_reward); minus the shaping terms."


ANSWER_SCORERS: dict[str, TextReward] = {
    "em": em_reward,
    "subem": subem_reward,
    "f1": f1_reward,
    "multiple_choice": multiple_choice_reward,
}
"""The built-in answer scores, ``(response_text, golds) -> float``."""

for _name, _scorer in ANSWER_SCORERS.items():
    _answer_reward(_name, _scorer)
for _name in ("em", "subem", "f1"):
    _format_reward(_name, ANSWER_SCORERS[_name])


def text_reward(scorer: TextReward) -> BoundReward:
    """An answer score ``(response_text, golds) -> float`` (``algo.reward: package.module:function``) as a bound
    reward: a multiple-choice data source keeps its own score (``SOURCE_REWARDS``), as in earlier releases; the
    total, the outcome and the one component ``answer`` are the score."""

    def reward(trajectory: Trajectory) -> RewardResult:
        answer = float(reward_for_source(trajectory.data_source, scorer)(trajectory.response_text, trajectory.golds))
        return as_result(RewardResult(answer, answer, {"answer": answer}), getattr(scorer, "__name__", "reward"))

    return reward
