"""Tools as registered parts: `open` returns the whole document in the observation tokens and is counted, budgets,
a user's own tool from one decorated function, the config checks, and strata that count tool calls."""

from __future__ import annotations

import pytest
from rollout_fakes import DictRetriever, ScriptedGenerator

from stratarl.config_errors import ConfigError
from stratarl.retrieval.base import Passage
from stratarl.rollout import RolloutConfig, RolloutEngine
from stratarl.rollout import tools as tools_module
from stratarl.rollout.collect import CollectedBatch, batch_metrics, stratum_function
from stratarl.rollout.parsing import TRUNCATION_MARKER
from stratarl.rollout.tools import get_tool, register_tool
from stratarl.rollout.transcript import transcript

P1 = (101, 102)
PARIS = [
    Passage("7", '"Paris"\nParis is the capital of France.'),
    Passage("8", '"Rome"\nRome is the capital of Italy.'),
    Passage("9", '"Paris"\nIt lies on the Seine.'),
]


class CorpusRetriever(DictRetriever):
    """A retriever that holds its passages (as BM25 and dense indexes do), so `open` indexes their titles."""

    def __init__(self, passages=PARIS):
        super().__init__()
        self.passages = list(passages)


def run(tokenizer, turns, retriever=None, **config):
    engine = RolloutEngine(
        ScriptedGenerator(tokenizer, {P1: turns}), retriever or CorpusRetriever(), tokenizer, RolloutConfig(**config)
    )
    (rollout,) = engine.run([list(P1)])
    return rollout


def observations(tokenizer, rollout):
    return [
        tokenizer.decode(rollout.response_ids[t.observation_span[0] : t.observation_span[1]], skip_special_tokens=False)
        for t in rollout.turns
        if t.observation_span is not None
    ]


def open_call(title):
    return '<tool_call>\n{"name": "open", "arguments": {"title": "' + title + '"}}\n</tool_call>'


def metrics(rollouts, tools):
    n = len(rollouts)
    batch = CollectedBatch(rollouts, [None] * n, list(range(n)), [0.0] * n, [0.0] * n, [0] * n, 0.0, 0.0, tools)
    return batch_metrics(batch)


class TestOpen:
    def test_the_whole_document_comes_back_and_is_counted(self, smollm2_tokenizer):
        tok = smollm2_tokenizer
        rollout = run(
            tok, [open_call("paris"), "<answer> Paris </answer>"], protocol="hermes", tools=["search", "open"]
        )
        (text,) = observations(tok, rollout)
        # Both passages titled Paris, in corpus order; not Rome.
        assert "Title: Paris\nParis is the capital of France.\nIt lies on the Seine." in text
        assert "Rome" not in text
        assert rollout.num_searches == 0 and rollout.calls_of(["open"]) == 1 and rollout.calls_of() == 1
        assert [c.passage_ids for c in rollout.calls] == [("7", "9")]
        m = metrics([rollout], ("search", "open"))
        assert m["tools/open/calls_mean"] == 1.0 and m["tools/search/calls_mean"] == 0.0
        assert stratum_function("tool_calls[open]", None)(rollout) == 1
        assert stratum_function("tool_calls", None)(rollout) == 1
        assert stratum_function("tool_calls[search]", None)(rollout) == 0
        assert stratum_function("num_searches", None)(rollout) == 0
        assert transcript(rollout, tok)["calls"][0]["arguments"] == {"title": "paris"}

    def test_open_as_a_search_r1_tag(self, smollm2_tokenizer):
        tok = smollm2_tokenizer
        rollout = run(tok, ["<open> Rome </open>", "<answer> Rome </answer>"], tools=["search", "open"])
        (text,) = observations(tok, rollout)
        assert text == "\n\n<information>Title: Rome\nRome is the capital of Italy.</information>\n\n"

    def test_an_unknown_title_says_so(self, smollm2_tokenizer):
        rollout = run(
            smollm2_tokenizer, [open_call("Berlin"), "<answer> x </answer>"], protocol="hermes", tools=["open"]
        )
        assert "No document is titled 'Berlin'" in observations(smollm2_tokenizer, rollout)[0]
        assert rollout.calls[0].status == "ok"

    def test_the_document_is_bounded_in_tokens(self, smollm2_tokenizer):
        tok = smollm2_tokenizer
        long = [Passage(str(i), f'"Long"\n{"word " * 50}{i}') for i in range(5)]
        rollout = run(
            tok,
            [open_call("Long"), "<answer> x </answer>"],
            CorpusRetriever(long),
            protocol="hermes",
            tools=["open"],
            tool_params={"open": {"max_tokens": 30}},
        )
        (text,) = observations(tok, rollout)
        body = text.split("<tool_response>\n", 1)[1].split("\n</tool_response>", 1)[0]
        assert body.endswith(TRUNCATION_MARKER) and len(tok(body, add_special_tokens=False)["input_ids"]) <= 32

    def test_the_budget_stops_the_second_call(self, smollm2_tokenizer):
        tok = smollm2_tokenizer
        turns = [open_call("Paris"), open_call("Rome"), "<answer> x </answer>"]
        rollout = run(
            tok, turns, protocol="hermes", tools=["open"], tool_params={"open": {"max_calls": 1}}, max_turns=3
        )
        first, second = observations(tok, rollout)
        assert "Seine" in first and "at most 1 times" in second and "Italy" not in second
        assert rollout.calls_of(["open"]) == 1 and rollout.over_budget_calls == 1
        assert metrics([rollout], ("open",))["tools/open/over_budget"] == 1.0

    def test_a_search_budget_in_search_r1(self, smollm2_tokenizer):
        tok = smollm2_tokenizer
        retriever = CorpusRetriever()
        turns = ["<search> a </search>", "<search> b </search>", "<answer> x </answer>"]
        rollout = run(tok, turns, retriever, tool_params={"search": {"max_calls": 1}})
        assert retriever.calls == [(["a"], 3)] and rollout.num_searches == 1 and rollout.queries == ["a"]
        assert observations(tok, rollout)[1] == (
            "\n\n<information>Error: search may be called at most 1 times per answer; use another tool or "
            "answer</information>\n\n"
        )
        assert stratum_function("num_searches", None)(rollout) == 1 and rollout.answered

    def test_a_failing_lookup_is_a_tool_error(self, smollm2_tokenizer):
        class Broken(DictRetriever):
            def search(self, queries, k):
                raise TimeoutError("down")

        rollout = run(
            smollm2_tokenizer, [open_call("Paris"), "<answer> x </answer>"], Broken(), protocol="hermes", tools=["open"]
        )
        assert (
            rollout.tool_errors == 1
            and "Open failed (TimeoutError: down)" in observations(smollm2_tokenizer, rollout)[0]
        )


@pytest.fixture
def calc(monkeypatch):
    """A user's tool, registered for one test."""
    monkeypatch.setattr(tools_module, "_TOOLS", tools_module._TOOLS.copy())

    @register_tool("calc")
    def calc(expression: str, *, digits: int = 3) -> str:
        """Evaluate an arithmetic expression."""
        return f"{round(eval(expression, {'__builtins__': {}}), digits)}"  # noqa: S307  a test's sandbox

    return calc


class TestUserTool:
    def test_one_decorated_function_is_a_tool(self, smollm2_tokenizer, calc):
        spec = get_tool("calc")
        assert spec.parameters == {
            "type": "object",
            "properties": {"expression": {"type": "string"}},
            "required": ["expression"],
        }
        assert spec.description == "Evaluate an arithmetic expression." and spec.params == {"digits": 3}
        call = '<tool_call>{"name": "calc", "arguments": {"expression": "2/3"}}</tool_call>'
        rollout = run(
            smollm2_tokenizer,
            [call, "<answer> x </answer>"],
            protocol="hermes",
            tools=["search", "calc"],
            tool_params={"calc": {"digits": 2}},
        )
        assert "<tool_response>\n0.67\n</tool_response>" in observations(smollm2_tokenizer, rollout)[0]

    def test_a_raising_tool_is_an_observation(self, smollm2_tokenizer, calc):
        call = '<tool_call>{"name": "calc", "arguments": {"expression": "1/0"}}</tool_call>'
        rollout = run(smollm2_tokenizer, [call, "<answer> x </answer>"], protocol="hermes", tools=["calc"])
        assert "Calc failed (ZeroDivisionError" in observations(smollm2_tokenizer, rollout)[0]
        assert rollout.tool_errors == 1 and rollout.answered

    @pytest.mark.parametrize(
        ("config", "says"),
        [
            ({"tool_params": {"calc": {"digitz": 2}}}, "tool_params.calc.digitz"),
            ({"tool_params": {"calc": {"digits": "two"}}}, "expected int"),
            ({"tool_params": {"calc": {"max_calls": -1}}}, "max_calls"),
            ({"tool_params": {"open": {"max_tokens": 5}}}, "not a tool of rollout.tools"),
        ],
    )
    def test_parameters_are_checked_when_the_config_loads(self, calc, config, says):
        with pytest.raises(ConfigError, match=says):
            RolloutConfig(protocol="hermes", tools=["search", "calc"], **config)

    def test_reserved_and_taken_names(self, calc):
        with pytest.raises(ValueError, match="reserved"):
            register_tool("answer")
        with pytest.raises(ValueError, match="already registered"):
            register_tool("calc")(lambda expression: expression)


class TestConfig:
    @pytest.mark.parametrize(
        ("config", "says"),
        [
            ({"protocol": "hermez"}, "rollout.protocol|RolloutConfig.protocol"),
            ({"tools": ["search", "browse"]}, "tools\\[1\\]"),
            ({"tools": ["search", "search"]}, "listed twice"),
            ({"tools": []}, "at least one tool"),
        ],
    )
    def test_bad_values_are_one_line_errors(self, config, says):
        with pytest.raises(ConfigError, match=says) as error:
            RolloutConfig(**config)
        assert "\n" not in str(error.value)

    def test_a_tool_with_two_arguments_needs_a_json_protocol(self, monkeypatch):
        monkeypatch.setattr(tools_module, "_TOOLS", tools_module._TOOLS.copy())
        register_tool("pair")(lambda a, b: a + b)
        with pytest.raises(ConfigError, match="search_r1 tag carries one text"):
            RolloutConfig(tools=["pair"])
        RolloutConfig(protocol="hermes", tools=["pair"])

    def test_the_trainer_config_refuses_strata_of_a_tool_it_lacks(self):
        from stratarl.trainer.config import load_config

        with pytest.raises(ConfigError, match="algo.stratum_key"):
            load_config(None, ["algo.stratum_key=tool_calls[open]"])
        cfg = load_config(None, ["algo.stratum_key=tool_calls[open]", "rollout.tools=[search,open]"])
        assert cfg.rollout.tools == ["search", "open"]
        with pytest.raises(ConfigError, match="unknown stratum key"):
            load_config(None, ["algo.stratum_key=tool_call"])

    def test_the_word_level_model_keeps_the_default_protocol(self):
        from stratarl.trainer.config import load_config

        with pytest.raises(ConfigError, match="rollout.protocol.*word-tiny"):
            load_config(None, ["model.name=word-tiny", "rollout.protocol=hermes"])
        with pytest.raises(ConfigError, match="rollout.tools.*word-tiny"):
            load_config(None, ["model.name=word-tiny", "rollout.tools=[search,open]"])

    def test_the_warm_start_speaks_hermes_and_refuses_llama3_json_with_a_chatml_tokenizer(self):
        from stratarl.trainer.config import load_config

        # the demonstrations are written in the run's protocol (tests/trainer/warmstart/test_trainer_demos_protocols.py)
        cfg = load_config(None, ["sft.enabled=true", "rollout.protocol=hermes", "rollout.tools=[search,open]"])
        assert cfg.rollout.protocol == "hermes"
        for model in ("smollm2-135m-instruct", "tiny-random"):
            with pytest.raises(ConfigError, match="rollout.protocol.*llama3_json call turn") as error:
                load_config(None, ["sft.enabled=true", "rollout.protocol=llama3_json", f"model.name={model}"])
            assert "\n" not in str(error.value)
        load_config(None, ["sft.enabled=false", "rollout.protocol=llama3_json"])  # RL alone is not refused


CALC = '''
from stratarl.rollout.tools import register_tool


@register_tool("calc")
def calc(expression: str, *, digits: int = 3) -> str:
    """Evaluate an arithmetic expression."""
    return str(round(float(expression), digits))
'''


def test_a_users_tool_from_the_command_line_is_checked_when_the_config_loads(tmp_path):
    import os
    import subprocess
    import sys
    from pathlib import Path

    tiny = Path(__file__).resolve().parents[2] / "configs" / "tiny.yaml"
    plugin = tmp_path / "my_tools.py"
    plugin.write_text(CALC)
    env = {**os.environ}
    env.pop("STRATARL_IMPORT", None)

    def train(*args):
        command = [sys.executable, "-m", "stratarl.cli", "train", str(tiny), *args]
        return subprocess.run(command, capture_output=True, text=True, env=env, timeout=300)

    out = train("rollout.tools=[search,calc]")
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert "`rollout.tools[1]` = 'calc': unknown tool" in out.stderr
    out = train(
        f"--import={plugin}",
        "rollout.protocol=hermes",
        "rollout.tools=[search,calc]",
        "rollout.tool_params.calc.digitz=2",
    )
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert "`rollout.tool_params.calc.digitz` = 2: tool 'calc' has no such parameter" in out.stderr
    assert "use one of max_calls, digits" in out.stderr


def test_the_policy_tokens_of_a_batch_are_logged_under_one_name(smollm2_tokenizer):
    """rollout/response_length_mean is the mean of policy tokens (response_mask 1); response_tokens_mean counts
    observation tokens too; no second key repeats the first."""
    tok = smollm2_tokenizer
    rollouts = [run(tok, ["<search> paris </search>", "<answer> Paris </answer>"]), run(tok, ["<answer> x </answer>"])]
    m = metrics(rollouts, ("search",))
    policy = [sum(r.response_mask) for r in rollouts]
    assert m["rollout/response_length_mean"] == sum(policy) / 2
    assert m["rollout/response_tokens_mean"] == sum(len(r.response_ids) for r in rollouts) / 2 > sum(policy) / 2
    assert "rollout/policy_tokens_mean" not in m


def test_stamping_and_dropping_states_return_new_rollouts(smollm2_tokenizer):
    """with_policy_version / without_frozen_states (the step's two rollout changes) leave the batch they get as it
    was: the step's stages are returned new, the rollouts too."""
    from dataclasses import replace

    from stratarl.rollout.collect import with_policy_version, without_frozen_states

    rollout = replace(run(smollm2_tokenizer, ["<answer> x </answer>"]), frozen_states=([1, 2], "states"))
    batch = CollectedBatch([rollout], [None], [0], [0.0], [0.0], [0], 0.0, 0.0)
    stamped = with_policy_version(batch, 7)
    assert stamped.rollouts[0].policy_version == 7 and rollout.policy_version == 0
    freed = without_frozen_states(stamped)
    assert freed.rollouts[0].frozen_states is None and stamped.rollouts[0].frozen_states == ([1, 2], "states")
    assert freed.rollouts[0].policy_version == 7 and without_frozen_states(freed) is freed
