"""How collected rollouts are scored and stratified (``Scoring``), resolved once per run from their names.

The reward is a registered reward of stratarl.rewards with its parameters bound (``algo.reward``,
``algo.reward_params``), or an answer score ``package.module:function``; it sees the rollout's frozen
``Trajectory`` (``trajectory_of``) and returns its total, raw outcome and components. The overlong rule
(``algo.overlong``) acts on rollouts that ran out of budget without an answer (``is_overlong``). A reward that
cannot score a rollout raises ``RewardFault``: ``score_rollout`` returns the fault's message instead of a score.
The stratum key maps a rollout to an integer stratum (``stratum_function``).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal, Protocol

import torch

from stratarl.algos.turns import search_counts
from stratarl.infra.callables import resolve_callable
from stratarl.rewards import BoundReward, RewardFault, RewardResult, Trajectory, build_reward, text_reward
from stratarl.rollout.engine import Rollout

STRATUM_KEYS = ("num_searches", "observation_blocks", "answered", "random", "tool_calls")
"""Built-in stratum keys (``algo.stratum_key``); ``random`` is the control the trainer draws from num_searches.
``tool_calls`` counts the calls of every tool; ``tool_calls[open,search]`` those of the tools named."""
TOOL_CALLS_RE = re.compile(r"tool_calls\[\s*(\w+(?:\s*,\s*\w+)*)\s*\]")


def is_stratum_key(key: str) -> bool:
    """A built-in stratum key, ``tool_calls[name, ...]``, or ``module:function``."""
    return key in STRATUM_KEYS or TOOL_CALLS_RE.fullmatch(key) is not None or ":" in key


def named_tools(key: str) -> list[str] | None:
    """The tools a ``tool_calls[...]`` stratum key counts (None: not such a key)."""
    match = TOOL_CALLS_RE.fullmatch(key)
    return [name.strip() for name in match.group(1).split(",")] if match else None


class Question(Protocol):
    """What a rollout needs of a question (``stratarl.data.examples.Example`` is one); read-only."""

    @property
    def id(self) -> str: ...

    @property
    def question(self) -> str: ...

    @property
    def golden_answers(self) -> tuple[str, ...]: ...

    @property
    def data_source(self) -> str: ...

    @property
    def metadata(self) -> Mapping[str, Any]: ...

    @property
    def prompt(self) -> Sequence[Mapping[str, str]] | None: ...


OverlongRule = Literal["keep", "mask", "reward"]
OVERLONG_RULES: tuple[OverlongRule, ...] = ("keep", "mask", "reward")
"""What happens to a rollout that ran out of budget without an answer (``algo.overlong``): ``keep`` (trained like
any other), ``mask`` (out of the loss: the trainer zeroes its loss mask), ``reward`` (its total becomes
``algo.overlong_reward``; its raw outcome is kept)."""


@dataclass(frozen=True)
class Scoring:
    """How collected rollouts are scored and stratified: ``reward(trajectory) -> RewardResult`` (a registered
    reward with its parameters bound, stratarl.rewards), ``stratum(rollout) -> int``, and the overlong rule."""

    reward: BoundReward
    stratum: Callable[[Rollout], int]
    overlong: OverlongRule = "keep"
    overlong_reward: float = 0.0

    @classmethod
    def from_names(
        cls,
        reward: str = "em",
        stratum_key: str = "num_searches",
        stratum_cap: int | None = None,
        *,
        reward_params: Mapping[str, Any] | None = None,
        overlong: OverlongRule = "keep",
        overlong_reward: float = 0.0,
    ) -> Scoring:
        """Resolve ``algo.reward`` (with ``algo.reward_params``), ``algo.stratum_key`` and ``algo.overlong`` once.
        ``random`` collects the num_searches strata: the trainer permutes them inside each group afterwards (the
        control arm)."""
        key = "num_searches" if stratum_key == "random" else stratum_key
        return cls(
            reward_function(reward, reward_params), stratum_function(key, stratum_cap), overlong, overlong_reward
        )


def stratum_function(key: str, stratum_cap: int | None) -> Callable[[Rollout], int]:
    """Rollout -> integer stratum: number of searches (capped), tool calls (capped: every tool's, or the named
    tools' with ``tool_calls[open]``), observation blocks (capped), answered, or a user function.

    ``num_searches`` counts the calls of the ``search`` tool the engine ran (as Search-R1's retriever calls);
    ``tool_calls`` counts calls that ran (not malformed or over-budget ones). ``observation_blocks`` is the definition the
    veRL plugin must use, having only the response mask: the observation blocks between two policy turns
    (``stratarl.algos.search_counts``), which also counts invalid-action feedback and misses an observation
    after the last turn."""
    if key == "num_searches":
        return lambda r: min(r.num_searches, stratum_cap) if stratum_cap is not None else r.num_searches
    if key == "observation_blocks":

        def blocks(r) -> int:
            count = int(search_counts(torch.tensor([r.response_mask], dtype=torch.long))[0]) if r.response_mask else 0
            return min(count, stratum_cap) if stratum_cap is not None else count

        return blocks
    if key == "answered":
        return lambda r: int(r.answered)
    if key == "tool_calls" or named_tools(key) is not None:
        tools = named_tools(key)  # None: every tool

        def calls(r) -> int:
            count = r.calls_of(tools)
            return min(count, stratum_cap) if stratum_cap is not None else count

        return calls
    fn = resolve_callable(key, "algo.stratum_key", num_args=1)
    seen: dict = {}
    # Any hashable key becomes a stable small integer id.
    return lambda r: seen.setdefault(fn(r), len(seen))


def reward_function(name: str, params: Mapping[str, Any] | None = None) -> BoundReward:
    """A registered reward by name with its parameters (stratarl.rewards.build_reward), or
    ``package.module:function`` taking (response_text, golds) -> float (no parameters)."""
    if ":" not in name:
        return build_reward(name, params)
    if params:
        raise ValueError(f"algo.reward={name!r} takes (response_text, golds) and no algo.reward_params")
    return text_reward(resolve_callable(name, "algo.reward", num_args=2))


def is_overlong(rollout: Rollout) -> bool:
    """The rollout ran out of budget without an answer: the total token budget (``truncated``) or the turn budget
    (``hit_max_turns``: a search or no valid action in its last turn). A rollout that ended with EOS stopped on
    its own and is not overlong."""
    return rollout.end_reason in ("max_length", "max_turns")


def trajectory_of(rollout: Rollout, example: Question) -> Trajectory:
    """The frozen view of ``rollout`` a reward sees (stratarl.rewards.Trajectory)."""
    return Trajectory(
        response_text=rollout.response_text,
        question=example.question,
        answer=rollout.answer if rollout.answered else None,
        actions=tuple((turn.action.kind, turn.action.content) for turn in rollout.turns),
        tool_calls=rollout.calls_of(None),
        invalid_actions=rollout.invalid_actions,
        truncated=is_overlong(rollout),
        golds=tuple(example.golden_answers),
        data_source=example.data_source,
    )


def score_rollout(scoring: Scoring, rollout: Rollout, example: Question) -> tuple[RewardResult, str]:
    """(the reward's result, "") of one rollout, with the overlong rule applied; (zeros, the fault's message) when
    the reward raised ``RewardFault``: the rollout is then kept out of the update, never trained on with 0."""
    try:
        result = scoring.reward(trajectory_of(rollout, example))
    except RewardFault as fault:
        return RewardResult(0.0, 0.0, {}), str(fault) or type(fault).__name__
    if scoring.overlong == "reward" and is_overlong(rollout):
        result = RewardResult(scoring.overlong_reward, result.outcome, {"overlong": scoring.overlong_reward})
    return result, ""
