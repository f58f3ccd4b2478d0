"""Tool-call protocols: parsing without a model, the prompt and tool turns against Qwen2.5's template, and the
engine in each protocol with a scripted generator (a protocol silently parsed as another is caught)."""

from __future__ import annotations

import ast
import json
from pathlib import Path

import pytest
from rollout_fakes import DictRetriever, ScriptedGenerator

from stratarl.rollout import INVALID_ACTION_OBSERVATION, STOP_STRINGS, RolloutConfig, RolloutEngine, parse_action
from stratarl.rollout.collect import encode_prompts
from stratarl.rollout.parsing import format_documents
from stratarl.rollout.protocols import HermesProtocol, make_protocol
from stratarl.rollout.transcript import rollout_metrics, tool_metrics, transcript

P1 = (101, 102)
HERMES_SEARCH = (
    '<think>need it</think>\n<tool_call>\n{"name": "search", "arguments": {"query": "capital of France"}}\n</tool_call>'
)
LLAMA_SEARCH = '{"name": "search", "parameters": {"query": "capital of France"}}'
SMOLLM2_VERL = Path(__file__).resolve().parents[1] / "verl" / "harness" / "smollm2.py"


def qwen25_tool_template() -> str:
    """Qwen2.5-Instruct's tool handling in SmolLM2's ChatML tokens, as the veRL smoke renders it (read from its
    source: importing that package needs veRL)."""
    tree = ast.parse(SMOLLM2_VERL.read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", "") == "TOOL_CHAT_TEMPLATE":
            return ast.literal_eval(node.value)
    raise AssertionError("TOOL_CHAT_TEMPLATE not found")


def run(tokenizer, turns, retriever=None, **config):
    generator = ScriptedGenerator(tokenizer, {P1: turns})
    engine = RolloutEngine(generator, retriever or DictRetriever(), tokenizer, RolloutConfig(**config))
    (rollout,) = engine.run([list(P1)])
    return rollout, generator, engine


def decode(tokenizer, ids):
    return tokenizer.decode(ids, skip_special_tokens=False)


def observation(tokenizer, rollout, turn=0):
    start, end = rollout.turns[turn].observation_span
    assert set(rollout.response_mask[start:end]) == {0}
    return decode(tokenizer, rollout.response_ids[start:end])


class TestSearchR1IsTodays:
    TEXTS = [
        "<search> q </search>",
        "<think>x</think><answer> Paris </answer>",
        "no tags",
        "<search>a</search><answer>b</answer>",
        "<answer>b</answer><search>a</search>",
        "<open> Paris </open>",
    ]

    def test_default_parse_stops_and_feedback_are_search_r1s(self):
        protocol = RolloutConfig().tool_protocol()
        assert protocol.stop_strings == STOP_STRINGS
        assert RolloutConfig().sampling_params().stop_strings == STOP_STRINGS
        assert protocol.invalid_observation() == INVALID_ACTION_OBSERVATION
        for text in self.TEXTS:
            assert protocol.parse(text) == parse_action(text), text

    def test_open_is_a_tag_only_when_it_is_a_tool(self):
        assert RolloutConfig().tool_protocol().parse("<open> Paris </open>").kind == "invalid"
        protocol = RolloutConfig(tools=["search", "open"]).tool_protocol()
        action = protocol.parse("<think>t</think><open> Paris </open>")
        assert (action.kind, action.content, action.arguments) == ("open", "Paris", {"title": "Paris"})
        assert protocol.stop_strings == ("</search>", "</open>", "</answer>")
        assert "<open> and </open>" in protocol.invalid_observation()

    def test_the_prompt_describes_open_and_stays_todays_without_it(self, smollm2_tokenizer):
        from stratarl.data.examples import Example

        example = Example("e1", "who", ("x",), "nq", {}, None)
        today = encode_prompts(smollm2_tokenizer, [example])[0]
        assert encode_prompts(smollm2_tokenizer, [example], protocol=RolloutConfig().tool_protocol())[0] == today
        with_open = RolloutConfig(tools=["search", "open"]).tool_protocol()
        text = decode(smollm2_tokenizer, encode_prompts(smollm2_tokenizer, [example], protocol=with_open)[0])
        assert "<open> title </open>" in text and "<search> query </search>" in text


class TestHermesParsing:
    protocol = make_protocol("hermes", ["search", "open"])

    def test_a_call(self):
        action = self.protocol.parse(HERMES_SEARCH)
        assert (action.kind, action.content, action.arguments) == (
            "search",
            "capital of France",
            {"query": "capital of France"},
        )
        assert action.is_call

    def test_arguments_given_as_a_json_string_are_read(self):
        text = '<tool_call>{"name": "open", "arguments": "{\\"title\\": \\"Paris\\"}"}</tool_call>'
        assert self.protocol.parse(text).arguments == {"title": "Paris"}

    @pytest.mark.parametrize(
        ("text", "kind", "says"),
        [
            ("<tool_call>\n{name: search}\n</tool_call>", "bad_json", "not valid JSON"),
            ('<tool_call>["search"]</tool_call>', "bad_json", '"name"'),
            ('<tool_call>{"name": "browse", "arguments": {}}</tool_call>', "unknown_tool", "'browse'"),
            ('<tool_call>{"name": "search", "arguments": {}}</tool_call>', "bad_arguments", "query"),
            ('<tool_call>{"name": "search", "arguments": {"query": 3}}</tool_call>', "bad_arguments", "string"),
            ('<tool_call>{"name": "open", "arguments": {"title": "a", "x": 1}}</tool_call>', "bad_arguments", "x"),
        ],
    )
    def test_malformed_calls_say_what_is_wrong(self, text, kind, says):
        action = self.protocol.parse(text)
        assert (action.kind, action.error_kind) == ("malformed", kind)
        assert says in action.error and not action.is_call

    def test_the_first_complete_action_wins(self):
        assert self.protocol.parse("<answer> Paris </answer>" + HERMES_SEARCH).kind == "answer"
        assert self.protocol.parse(HERMES_SEARCH + "<answer> Paris </answer>").kind == "search"
        assert self.protocol.parse('<tool_call>\n{"name": "search"').kind == "invalid"  # cut before the close

    def test_a_protocol_parsed_as_another_yields_no_call(self):
        # The failure veRL issue 3008 reports (a wrong parser: zero searches), caught both ways.
        assert parse_action(HERMES_SEARCH).kind == "invalid"
        assert make_protocol("search_r1", ["search"]).parse(HERMES_SEARCH).kind == "invalid"
        assert self.protocol.parse("<search> capital of France </search>").kind == "invalid"
        assert make_protocol("llama3_json", ["search"]).parse(HERMES_SEARCH).kind == "search"  # JSON inside tags
        assert self.protocol.parse(LLAMA_SEARCH).kind == "invalid"


class TestLlama3Parsing:
    protocol = make_protocol("llama3_json", ["search", "open"])

    def test_a_call_ending_in_its_end_of_turn_token(self):
        action = self.protocol.parse("<|python_tag|>" + LLAMA_SEARCH + "<|eot_id|>")
        assert (action.kind, action.arguments) == ("search", {"query": "capital of France"})

    def test_bad_json_unknown_tool_and_answer(self):
        assert self.protocol.parse('{"name": "search", "parameters": {"query": "x"').error_kind == "bad_json"
        assert self.protocol.parse('{"name": "calc", "parameters": {}}').error_kind == "unknown_tool"
        assert self.protocol.parse("<answer> Paris </answer>").kind == "answer"
        assert self.protocol.stop_strings == ("</answer>",)

    def test_tools_go_into_the_first_user_turn_and_results_into_ipython(self):
        messages = self.protocol.messages([{"role": "system", "content": "s"}, {"role": "user", "content": "Q?"}])
        assert messages[0] == {"role": "system", "content": "s"}
        assert messages[1]["content"].startswith("Given the following functions")
        assert json.dumps(self.protocol.tools["open"].function_schema(), indent=4) in messages[1]["content"]
        assert messages[1]["content"].endswith("Q?")
        assert self.protocol.tool_observation("search", "R") == (
            "<|eot_id|><|start_header_id|>ipython<|end_header_id|>\n\nR<|eot_id|>"
            "<|start_header_id|>assistant<|end_header_id|>\n\n"
        )


class TestHermesAgainstQwenTemplate:
    def test_the_prompt_is_what_qwen25s_template_renders_with_tools(self, smollm2_tokenizer):
        tok = smollm2_tokenizer
        protocol = make_protocol("hermes", ["search", "open"])
        user = [{"role": "user", "content": "Q?"}]
        ours = tok.apply_chat_template(protocol.messages(user), add_generation_prompt=True, tokenize=False)
        qwen = tok.apply_chat_template(
            [{"role": "system", "content": "You are a helpful assistant."}, *user],
            tools=[t.function_schema() for t in protocol.tools.values()],
            chat_template=qwen25_tool_template(),
            add_generation_prompt=True,
            tokenize=False,
        )
        assert ours == qwen

    def test_a_tool_turn_appends_exactly_the_templates_tokens(self, smollm2_tokenizer):
        # Token in, token out: prompt + the turn's tokens + the observation's tokens equal the tokens of the
        # conversation (assistant call, tool result, next assistant header) as Qwen2.5's template renders it.
        tok = smollm2_tokenizer
        protocol = make_protocol("hermes", ["search"])
        messages = protocol.messages([{"role": "user", "content": "Q?"}])
        prompt = tok(tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False))["input_ids"]
        turn = '<tool_call>\n{"name": "search", "arguments": {"query": "x"}}\n</tool_call>'
        result = "Doc 1(Title: X) text"
        ours = prompt + tok(turn)["input_ids"] + tok(protocol.tool_observation("search", result))["input_ids"]
        conversation = [
            {"role": "system", "content": "You are a helpful assistant."},
            {"role": "user", "content": "Q?"},
            {"role": "assistant", "content": "", "tool_calls": [{"name": "search", "arguments": {"query": "x"}}]},
            {"role": "tool", "content": result},
        ]
        text = tok.apply_chat_template(
            conversation,
            tools=[t.function_schema() for t in protocol.tools.values()],
            chat_template=qwen25_tool_template(),
            add_generation_prompt=True,
            tokenize=False,
        )
        assert ours == tok(text)["input_ids"]


class TestEngineInEachProtocol:
    def test_hermes_search_then_answer(self, smollm2_tokenizer):
        tok = smollm2_tokenizer
        retriever = DictRetriever()
        rollout, generator, engine = run(tok, [HERMES_SEARCH, "<answer> Paris </answer>"], retriever, protocol="hermes")
        assert retriever.calls == [(["capital of France"], 3)]
        assert rollout.num_searches == 1 and rollout.queries == ["capital of France"] and rollout.answered
        docs = format_documents(rollout.passages[0]).strip()
        assert observation(tok, rollout) == HermesProtocol.response_prefix + docs + HermesProtocol.response_suffix
        # The second turn read the exact tokens so far (never re-tokenised).
        assert generator.calls[1]["inputs"][0] == list(P1) + rollout.response_ids[: rollout.turns[1].start]
        assert tool_metrics([rollout])["tools/search/calls_mean"] == 1.0
        assert engine.config.sampling_params().stop_strings == ("</tool_call>", "</answer>")

    def test_the_same_turns_under_search_r1_run_no_search(self, smollm2_tokenizer):
        # Wiring: had the protocol not reached the engine, the hermes call would still run. It must not.
        retriever = DictRetriever()
        rollout, _, _ = run(smollm2_tokenizer, [HERMES_SEARCH, "<answer> Paris </answer>"], retriever)
        assert retriever.calls == [] and rollout.num_searches == 0 and rollout.invalid_actions == 1

    def test_a_malformed_call_is_an_observation_and_a_metric(self, smollm2_tokenizer):
        tok = smollm2_tokenizer
        turns = ['<tool_call>\n{"name": "search", "arguments": {"query": }\n</tool_call>', "<answer> Paris </answer>"]
        rollout, _, _ = run(tok, turns, protocol="hermes")
        text = observation(tok, rollout)
        assert text.startswith(HermesProtocol.response_prefix + "Error: the call is not valid JSON")
        assert rollout.answered and rollout.end_reason == "answer"  # the rollout went on
        assert (rollout.malformed_calls, rollout.invalid_actions, rollout.num_searches) == (1, 1, 0)
        metrics = tool_metrics([rollout])
        assert metrics["rollout/malformed_calls"] == 1.0 and metrics["rollout/malformed_calls/bad_json"] == 1.0
        assert transcript(rollout, tok)["calls"][0]["status"] == "malformed"
        assert rollout_metrics([rollout])["rollout/valid_action_rate"] == 0.5

    def test_llama3_call_ending_in_eos_runs_and_the_observation_closes_the_turn(self, smollm2_tokenizer):
        tok = smollm2_tokenizer
        retriever = DictRetriever()
        turns = [LLAMA_SEARCH + ScriptedGenerator.EOS_MARK, "<answer> Paris </answer>"]
        rollout, _, _ = run(tok, turns, retriever, protocol="llama3_json", stop_on_eos=True)
        assert retriever.calls == [(["capital of France"], 3)] and rollout.answered
        assert decode(tok, rollout.response_ids[slice(*rollout.turn_spans[0])]) == LLAMA_SEARCH  # EOS dropped
        assert observation(tok, rollout).startswith("<|eot_id|><|start_header_id|>ipython<|end_header_id|>\n\nDoc 1")

    def test_a_cut_tool_turn_keeps_its_closing_and_the_next_header(self, smollm2_tokenizer):
        tok = smollm2_tokenizer
        rollout, _, _ = run(
            tok,
            [HERMES_SEARCH, "<answer> P </answer>"],
            DictRetriever(text_words=200),
            protocol="hermes",
            max_obs_tokens=40,
        )
        text = observation(tok, rollout)
        assert text.endswith(" ...[truncated]" + HermesProtocol.response_suffix)
        assert len(tok(text)["input_ids"]) <= 40
