"""The turn protocol as pure functions: no model, adversarial text included."""

from __future__ import annotations

import pytest

from stratarl.retrieval.base import Passage
from stratarl.rollout.parsing import (
    INVALID_ACTION_OBSERVATION,
    Action,
    find_stop,
    format_documents,
    information_observation,
    parse_action,
    tool_error_observation,
)
from stratarl.rollout.prompt import SEARCH_R1_TEMPLATE, build_prompt, encode_prompt, normalize_question


class TestParseAction:
    @pytest.mark.parametrize(
        ("text", "expected"),
        [
            ("<think>x</think><search> capital of France </search>", Action("search", "capital of France")),
            ("<answer>\n Paris \n</answer>", Action("answer", "Paris")),
            ("<search>multi\nline</search>", Action("search", "multi\nline")),  # DOTALL
            ("<search></search>", Action("search", "")),  # empty query stays a search
            ("<search>   </search>", Action("search", "")),
            ("<search>q1</search> then <answer>a</answer>", Action("search", "q1")),  # first match wins
            ("<answer>a</answer><search>q</search>", Action("answer", "a")),
            ("<search>unclosed", Action("invalid")),
            ("no tags at all", Action("invalid")),
            ("", Action("invalid")),
            ("<search>q</answer>", Action("invalid")),  # mismatched closing tag
            ("</search><search>", Action("invalid")),
            ("<SEARCH>q</SEARCH>", Action("invalid")),  # tags are case-sensitive
        ],
    )
    def test_cases(self, text, expected):
        assert parse_action(text) == expected

    def test_nested_tags(self):
        # Generation stops at the first closing tag, so a nested answer arrives as
        # "<search><answer>x</answer>": the search never closes, the answer does.
        assert parse_action("<search><answer>x</answer>") == Action("answer", "x")
        # A fully nested search keeps the inner text verbatim (non-greedy to the first </search>).
        assert parse_action("<search>a <search>b</search> c</search>") == Action("search", "a <search>b")

    def test_tags_inside_the_answer_are_kept(self):
        # The leftmost opening tag wins: a search inside an answer is part of the answer. (parse_action
        # alone: in a rollout the </search> ends the turn first, and the turn is that search, as in
        # Search-R1; tests/compat/test_search_r1_transcripts.py, test_crossing_stop_tags, case (c).)
        assert parse_action("<answer>use <search>x</search> here</answer>") == Action(
            "answer", "use <search>x</search> here"
        )
        assert parse_action("<answer>the <b>bold</b> one</answer>") == Action("answer", "the <b>bold</b> one")

    def test_huge_query(self):
        query = "word " * 50_000
        assert parse_action(f"<search>{query}</search>") == Action("search", query.strip())


class TestFindStop:
    def test_earliest_ending_stop(self):
        assert find_stop("a</answer>b</search>") == (len("a</answer>"), "</answer>")
        assert find_stop("<search>q</search><answer>") == (len("<search>q</search>"), "</search>")
        assert find_stop("nothing") is None
        assert find_stop("</searc") is None


class TestObservations:
    def test_documents_byte_exact(self):
        # Search-R1 _passages2string: title = first line as is (quotes kept), text = the rest.
        passages = [
            Passage("1", '"Paris"\nCapital of France.'),
            Passage("2", '"Notitle"'),
            Passage("3", '"Multi"\nline one\nline two'),
        ]
        assert format_documents(passages) == (
            'Doc 1(Title: "Paris") Capital of France.\n'
            'Doc 2(Title: "Notitle") \n'
            'Doc 3(Title: "Multi") line one\nline two\n'
        )
        assert information_observation(passages[:1]) == (
            '\n\n<information>Doc 1(Title: "Paris") Capital of France.</information>\n\n'
        )

    def test_no_hits(self):
        assert information_observation([]) == "\n\n<information></information>\n\n"

    def test_invalid_feedback_byte_exact(self):
        assert INVALID_ACTION_OBSERVATION == (
            "\nMy previous action is invalid. If I want to search, I should put the query between <search> "
            "and </search>. If I want to give the final answer, I should put the answer between <answer> and "
            "</answer>. Let me try again.\n"
        )

    def test_tool_error_is_an_information_block(self):
        text = tool_error_observation(TimeoutError("read timed out\nafter 5 s"))
        assert (
            text
            == "\n\n<information>Search failed (TimeoutError: read timed out after 5 s). No results.</information>\n\n"
        )


class TestPrompt:
    def test_question_normalisation(self):
        assert normalize_question("  who wrote Hamlet ") == "who wrote Hamlet?"
        assert normalize_question("who?") == "who?"
        with pytest.raises(ValueError, match="question is empty"):
            normalize_question("   ")
        with pytest.raises(TypeError, match="question must be a string"):
            normalize_question(None)

    def test_template(self):
        prompt = build_prompt("who wrote Hamlet")
        assert prompt.startswith("Answer the given question. You must conduct reasoning inside <think>")
        assert prompt.endswith("For example, <answer> Beijing </answer>. Question: who wrote Hamlet?\n")
        assert prompt == SEARCH_R1_TEMPLATE.format(question="who wrote Hamlet?")

    def test_chat_template_applied(self, smollm2_tokenizer):
        ids = encode_prompt(smollm2_tokenizer, "who wrote Hamlet")
        text = smollm2_tokenizer.decode(ids)
        assert text.count("<|im_start|>user\n") == 1
        assert text.endswith("Question: who wrote Hamlet?\n<|im_end|>\n<|im_start|>assistant\n")
