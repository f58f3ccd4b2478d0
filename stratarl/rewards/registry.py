"""The reward registry: a reward is one decorated function of a rollout's trajectory (standard library only).

    @register_reward("my_reward", checks={"weight": at_least(0.0)})
    def my_reward(trajectory: Trajectory, *, weight: float = 1.0) -> RewardResult | float: ...

``algo.reward`` names the reward and ``algo.reward_params`` holds its keyword arguments. Every parameter is
keyword-only; one with a default is optional, one without is required. The parameters are typed by their
annotations (``float``, ``int``, ``str``, ``bool``; an ``int`` is a valid ``float``) and range-checked by the
registration's ``checks`` when the config loads (:func:`check_reward_params`), never first when the reward is
called. A reward returns a :class:`RewardResult` (its total, the raw outcome and named components), or a plain
float (then the total, the outcome and its one component, named after the reward, are that float).

The raw outcome is the answer's score before any shaping (format, penalties, costs): dynamic sampling reads it,
never the total. A reward that cannot score a rollout (an unreachable judge) raises :class:`RewardFault`: the
trainer keeps that rollout out of the update, as it keeps a rollout with a failed search (docs/training.md).
"""

from __future__ import annotations

import inspect
import math
import typing
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from stratarl.registry import Registry


@dataclass(frozen=True)
class Trajectory:
    """What a reward sees of one rollout (a frozen view; the trainer builds it from the engine's ``Rollout``).

    response_text: everything after the prompt (policy turns and observations), as decoded.
    question: the question asked.
    answer: the extracted final answer, or None when the rollout never answered.
    actions: each policy turn's action as (kind, content): kind is ``search``, ``answer`` or ``invalid``.
    tool_calls: the tool calls the engine ran (searches).
    invalid_actions: turns whose action could not be parsed (each got the invalid-action feedback).
    truncated: the rollout ended on a budget (rollout.max_total_tokens, or the turn budget) without an answer.
    golds: the gold answers.
    data_source: the example's data source (multiple-choice sources are scored by letter or option text).
    """

    response_text: str
    question: str = ""
    answer: str | None = None
    actions: tuple[tuple[str, str], ...] = ()
    tool_calls: int = 0
    invalid_actions: int = 0
    truncated: bool = False
    golds: tuple[str, ...] = ()
    data_source: str = ""


@dataclass(frozen=True)
class RewardResult:
    """A reward's value for one rollout: ``total`` (what the advantage reads), ``outcome`` (the raw answer score
    before shaping: what dynamic sampling reads) and ``components`` (named terms, logged as
    ``reward/<name>_mean``; the built-in rewards' components add up to the total)."""

    total: float
    outcome: float
    components: Mapping[str, float] = field(default_factory=dict)


class RewardFault(RuntimeError):
    """A reward could not score a rollout (a judge that timed out, refused, or replied nonsense): the rollout is
    kept out of the update, never trained on with a made-up score."""


class RewardParamError(ValueError):
    """A reward parameter is missing, unknown, mistyped or out of range: ``key``, ``value``, ``why``, ``fix``
    (the config names it ``algo.reward_params.<key>``)."""

    def __init__(self, key: str, value: Any, why: str, fix: str) -> None:
        super().__init__(f"reward parameter {key!r} = {value!r}: {why}. Fix: {fix}")
        self.key, self.value, self.why, self.fix = key, value, why, fix


Check = tuple[Callable[[Any], bool], str]
"""A range check: (predicate on the value, the rule in words, e.g. ``must lie in [0, 1)``)."""
RewardFn = Callable[..., "RewardResult | float"]
"""A registered reward: ``fn(trajectory, **params) -> RewardResult | float``."""
BoundReward = Callable[[Trajectory], RewardResult]
"""A reward with its parameters bound (:func:`build_reward`): what the trainer calls."""
_TYPES = (float, int, str, bool)
_TYPE_WORDS = {float: "a number", int: "an integer", str: "a string", bool: "true or false"}


def at_least(low: float) -> Check:
    """The check ``value >= low`` (finite)."""
    return (lambda v: math.isfinite(v) and v >= low, f"must be >= {low:g} and finite")


def in_range(low: float, high: float, *, high_open: bool = False) -> Check:
    """The check ``low <= value <= high`` (``< high`` with ``high_open``)."""
    bracket = ")" if high_open else "]"
    return (
        lambda v: low <= v < high if high_open else low <= v <= high,
        f"must lie in [{low:g}, {high:g}{bracket}",
    )


@dataclass(frozen=True)
class RewardEntry:
    """A registered reward: its function and the range checks of its parameters."""

    fn: RewardFn
    checks: Mapping[str, Check]


_REWARDS: Registry[RewardEntry] = Registry(
    "reward",
    listed_as="registered",
    how_to_add="(a reward of your own: register_reward in a module loaded with --import, or `package.module:function`)",
    unknown_error=ValueError,
    source=lambda entry: entry.fn,
)


def register_reward(name: str, *, checks: Mapping[str, Check] | None = None) -> Callable[[RewardFn], RewardFn]:
    """Decorator: register ``fn(trajectory: Trajectory, **params) -> RewardResult | float`` as ``name``.
    ``checks``: parameter -> :data:`Check` (e.g. ``{"cost": at_least(0.0)}``), run when the config loads."""
    _REWARDS.check_name(name)

    def decorator(fn: RewardFn) -> RewardFn:
        params = reward_params(fn)
        unknown = sorted(set(checks or {}) - set(params))
        if unknown:
            raise ValueError(f"reward {name!r}: checks name {unknown}, which are not keyword parameters of {fn!r}")
        _REWARDS.add(name, RewardEntry(fn, dict(checks or {})))
        return fn

    return decorator


def reward_names() -> list[str]:
    """The registered rewards' names, sorted."""
    return _REWARDS.names()


def reward_params(fn: RewardFn) -> dict[str, inspect.Parameter]:
    """The keyword-only parameters of a reward function, in order."""
    return {p.name: p for p in inspect.signature(fn).parameters.values() if p.kind is inspect.Parameter.KEYWORD_ONLY}


def _type_of(fn: RewardFn, name: str) -> type | None:
    try:
        hint = typing.get_type_hints(fn).get(name)
    except (NameError, TypeError):  # an annotation that cannot be evaluated: no type check
        return None
    return hint if hint in _TYPES else None


def _check_type(key: str, value: Any, expected: type | None) -> None:
    if expected is None:
        return
    ok = isinstance(value, expected) and not (expected is not bool and isinstance(value, bool))
    if expected is float and isinstance(value, int) and not isinstance(value, bool):
        ok = True
    if not ok:
        words = _TYPE_WORDS[expected]
        raise RewardParamError(key, value, f"must be {words}", f"write {words}")


def check_reward_params(name: str, params: Mapping[str, Any]) -> dict[str, Any]:
    """The parameters of reward ``name`` checked (known, typed, in range, the required ones present) and
    completed with the defaults. Raises ValueError for an unknown reward, :class:`RewardParamError` otherwise."""
    entry = _REWARDS.lookup(name)
    declared = reward_params(entry.fn)
    for key in params:
        if key not in declared:
            accepted = ", ".join(declared) or "none"
            raise RewardParamError(key, params[key], f"reward {name!r} takes no such parameter", f"use {accepted}")
    out: dict[str, Any] = {}
    for key, param in declared.items():
        if key not in params:
            if param.default is inspect.Parameter.empty:
                raise RewardParamError(key, None, f"reward {name!r} needs it", f"set algo.reward_params.{key}")
            out[key] = param.default
            continue
        value = params[key]
        _check_type(key, value, _type_of(entry.fn, key))
        if key in entry.checks:
            predicate, rule = entry.checks[key]
            if not predicate(value):
                raise RewardParamError(key, value, rule, f"use a value that {_as_statement(rule)}")
        out[key] = float(value) if _type_of(entry.fn, key) is float else value
    return out


def _as_statement(rule: str) -> str:
    """``must be >= 0`` -> ``is >= 0``, ``must lie in [0, 1)`` -> ``lies in [0, 1)`` (for the fix of an error)."""
    for must, verb in (("must be ", "is "), ("must lie ", "lies "), ("must name ", "names ")):
        if rule.startswith(must):
            return verb + rule[len(must) :]
    return "meets the rule: " + rule


def as_result(value: RewardResult | float, name: str) -> RewardResult:
    """A reward's return value as a :class:`RewardResult` (a float is the total, the outcome and the one
    component ``name``); a non-finite total is refused (it would poison every advantage of the batch)."""
    result = (
        value if isinstance(value, RewardResult) else RewardResult(float(value), float(value), {name: float(value)})
    )
    if not math.isfinite(result.total) or not math.isfinite(result.outcome):
        raise ValueError(f"reward {name!r} returned a non-finite value ({result.total!r}, outcome {result.outcome!r})")
    return result


def build_reward(name: str, params: Mapping[str, Any] | None = None) -> BoundReward:
    """Reward ``name`` with ``params`` checked and bound: ``trajectory -> RewardResult``."""
    bound = check_reward_params(name, params or {})
    fn = _REWARDS.lookup(name).fn

    def reward(trajectory: Trajectory) -> RewardResult:
        return as_result(fn(trajectory, **bound), name)

    reward.__name__ = f"reward_{name}"
    return reward
