"""The reward registry: the built-in rewards equal the answer scores of earlier releases under their defaults,
the format gate, the penalty and the cost follow their formulas, components add up to the total, the raw
outcome is never shaped, and parameters are checked when the config loads."""

from __future__ import annotations

import math

import pytest

from stratarl.config_errors import ConfigError
from stratarl.rewards import (
    REWARDS,
    RewardParamError,
    RewardResult,
    Trajectory,
    build_reward,
    check_reward_params,
    em_reward,
    is_valid_format,
    make_format_reward,
    multiple_choice_reward,
    register_reward,
    reward_for_source,
    reward_names,
)
from stratarl.rewards import registry as reward_registry
from stratarl.trainer.config import load_config

VALID = "<think>a</think>\n<search>q</search>\n\n<information>docs</information>\n\n<think>b</think><answer>{}</answer>"
INVALID = "<answer>{}</answer>"
TEXTS = [
    VALID.format("Paris"),
    INVALID.format("paris"),
    VALID.format("the city of Paris"),
    INVALID.format("Lyon"),
    "no answer at all",
    "<answer>B</answer>",
    "<answer>B. Aspirin</answer>",
    "<answer></answer>",
]
GOLDS = [("Paris",), ("B", "Aspirin"), ("paris", "Paris, France")]


def _traj(text: str, golds=("Paris",), **kwargs) -> Trajectory:
    return Trajectory(response_text=text, golds=tuple(golds), **kwargs)


@pytest.mark.parametrize("name", ["em", "subem", "f1", "multiple_choice"])
@pytest.mark.parametrize("source", ["nq", "synthetic", "medqa", "phantomwiki"])
def test_defaults_are_the_answer_scores_bit_for_bit(name, source):
    # The reward of earlier releases: reward_for_source(source, REWARDS[name])(text, golds).
    old = reward_for_source(source, REWARDS[name])
    assert (old is multiple_choice_reward) == (source == "medqa" or name == "multiple_choice")
    reward = build_reward(name)
    for text in TEXTS:
        for golds in GOLDS:
            result = reward(_traj(text, golds, data_source=source, tool_calls=3, invalid_actions=2))
            expected = old(text, golds)
            assert result.total == expected and result.outcome == expected
            assert dict(result.components) == {"answer": expected}


def test_format_gate_table_hand_derived():
    # format_score 0.3: right+valid 1, right+invalid 1 - 0.3, wrong+valid 0.3, wrong+invalid 0.
    reward = build_reward("em_format", {"format_score": 0.3})
    cases = {
        VALID.format("Paris"): 1.0,
        INVALID.format("Paris"): 0.7,
        VALID.format("Lyon"): 0.3,
        INVALID.format("Lyon"): 0.0,
    }
    for text, expected in cases.items():
        result = reward(_traj(text))
        assert result.total == pytest.approx(expected)
        assert result.outcome == em_reward(text, ["Paris"])  # the raw outcome is never gated
        assert result.components["answer"] + result.components["format"] == pytest.approx(result.total)
    # The default gate is make_format_reward's (0.2), reached by name.
    default = build_reward("em_format")
    gate = make_format_reward(em_reward, 0.2)
    for text in TEXTS:
        assert default(_traj(text)).total == gate(text, ["Paris"])


def test_format_gate_orders_partial_answers_between_wrong_and_right():
    # F1 0.5 ("Paris France" against "Paris"): valid -> 0.2 + 0.8 x 0.5 = 0.6, invalid -> 0.8 x 0.5 = 0.4.
    reward = build_reward("f1_format")
    wrong, partial, right = (reward(_traj(VALID.format(a))).total for a in ("Lyon", "Paris France", "Paris"))
    assert wrong == pytest.approx(0.2) and partial == pytest.approx(0.2 + 0.8 * (2 / 3)) and right == 1.0
    # (F1 of "paris france" vs "paris": P = 1/2, R = 1, F1 = 2/3.)
    assert wrong < partial < right
    assert reward(_traj(INVALID.format("Paris France"))).total == pytest.approx(0.8 * 2 / 3)


def test_penalty_and_cost_hand_derived_and_components_add_up():
    # em 1 - 0.1 x 2 invalid actions - 0.05 x 3 tool calls = 0.65.
    reward = build_reward("em", {"invalid_action_penalty": 0.1, "tool_call_cost": 0.05})
    result = reward(_traj(VALID.format("Paris"), invalid_actions=2, tool_calls=3))
    assert result.total == pytest.approx(0.65) and result.outcome == 1.0
    assert result.components == pytest.approx({"answer": 1.0, "invalid_penalty": -0.2, "tool_cost": -0.15})
    assert sum(result.components.values()) == pytest.approx(result.total)
    # Each term moves the total by itself: a dropped component would leave it where it was.
    assert reward(_traj(VALID.format("Paris"), invalid_actions=3, tool_calls=3)).total == pytest.approx(0.55)
    assert reward(_traj(VALID.format("Paris"), invalid_actions=2, tool_calls=4)).total == pytest.approx(0.60)


def test_format_variant_with_every_term():
    reward = build_reward("em_format", {"format_score": 0.2, "tool_call_cost": 0.1, "invalid_action_penalty": 0.5})
    result = reward(_traj(VALID.format("Lyon"), tool_calls=1, invalid_actions=1))
    # wrong + valid: 0.2, - 0.1 - 0.5 = -0.4; the raw outcome stays 0.
    assert result.total == pytest.approx(-0.4) and result.outcome == 0.0
    assert set(result.components) == {"answer", "format", "invalid_penalty", "tool_cost"}
    assert sum(result.components.values()) == pytest.approx(result.total)
    assert is_valid_format(VALID.format("Lyon"))


@pytest.mark.parametrize(
    ("name", "params", "key", "words"),
    [
        ("em", {"tool_cost": 0.1}, "tool_cost", "no such parameter"),
        ("em", {"tool_call_cost": -0.1}, "tool_call_cost", ">= 0"),
        ("em", {"tool_call_cost": "a lot"}, "tool_call_cost", "must be a number"),
        ("em", {"tool_call_cost": True}, "tool_call_cost", "must be a number"),
        ("em", {"invalid_action_penalty": math.inf}, "invalid_action_penalty", "finite"),
        ("em_format", {"format_score": 1.0}, "format_score", "[0, 1)"),
        ("judge", {}, "url", "needs it"),
        ("judge", {"url": "ftp://x"}, "url", "http(s) URL"),
        ("judge", {"url": "http://127.0.0.1:1", "timeout_s": 0}, "timeout_s", "> 0"),
        ("judge", {"url": "http://127.0.0.1:1", "api_key_env": "STRATARL_NO_SUCH_VAR_53"}, "api_key_env", "set"),
    ],
)
def test_bad_params_are_refused_naming_the_key(name, params, key, words):
    with pytest.raises(RewardParamError) as caught:
        check_reward_params(name, params)
    assert caught.value.key == key and words in str(caught.value)


def test_params_are_completed_with_defaults_and_ints_read_as_floats():
    assert check_reward_params("em_format", {"tool_call_cost": 1}) == {
        "format_score": 0.2,
        "invalid_action_penalty": 0.0,
        "tool_call_cost": 1.0,
    }


@pytest.mark.parametrize(
    ("overrides", "field", "words"),
    [
        (
            ["algo.reward_params={format_score: 1.5}", "algo.reward=em_format"],
            "algo.reward_params.format_score",
            "[0, 1)",
        ),
        (["algo.reward=em_fromat"], "algo.reward", "did you mean 'em_format'"),
        (["algo.reward=judge"], "algo.reward_params.url", "needs it"),
        (["algo.reward=pkg.mod:fn", "algo.reward_params={tool_call_cost: 0.1}"], "algo.reward_params", "no parameters"),
        (["algo.overlong=drop"], "algo.overlong", "use one of keep, mask, reward"),
        (["algo.overlong_reward=.nan"], "algo.overlong_reward", "finite"),
    ],
)
def test_config_errors_are_one_line_naming_the_field(overrides, field, words):
    with pytest.raises(ConfigError) as caught:
        load_config(None, overrides)
    message = str(caught.value)
    assert f"`{field}`" in message and words in message and "\n" not in message and "Fix:" in message


def test_a_users_reward_is_one_decorated_function(monkeypatch):
    monkeypatch.setattr(reward_registry, "_REWARDS", reward_registry._REWARDS.copy())

    @register_reward("short_answer", checks={"limit": reward_registry.at_least(1)})
    def short_answer(trajectory: Trajectory, *, limit: int = 3) -> float:
        return float(trajectory.answer is not None and len(trajectory.answer) <= limit)

    assert "short_answer" in reward_names()
    result = build_reward("short_answer", {"limit": 5})(_traj("x", answer="Paris"))
    assert result == RewardResult(1.0, 1.0, {"short_answer": 1.0})
    with pytest.raises(RewardParamError, match="must be an integer"):
        check_reward_params("short_answer", {"limit": 2.5})
    cfg = load_config(None, ["algo.reward=short_answer", "algo.reward_params={limit: 4}"])
    assert cfg.algo.reward_params == {"limit": 4}
    with pytest.raises(ConfigError, match="algo.reward_params.limit"):
        load_config(None, ["algo.reward=short_answer", "algo.reward_params={limit: 0}"])


def test_a_non_finite_reward_is_refused(monkeypatch):
    monkeypatch.setattr(reward_registry, "_REWARDS", reward_registry._REWARDS.copy())
    register_reward("broken")(lambda trajectory: math.nan)
    with pytest.raises(ValueError, match="non-finite"):
        build_reward("broken")(_traj("x"))
