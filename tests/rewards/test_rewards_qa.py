"""Rewards: hand-derived cases of Search-R1's normalisation, EM, SubEM, F1 and extraction."""

from __future__ import annotations

import pytest

from stratarl.rewards import (
    em_reward,
    exact_match,
    extract_answer,
    f1_reward,
    f1_score,
    get_reward,
    normalize_answer,
    sub_exact_match,
    subem_reward,
)


class TestNormalizeAnswer:
    @pytest.mark.parametrize(
        ("raw", "expected"),
        [
            ("The Eiffel Tower!", "eiffel tower"),  # lower, punctuation dropped, article removed
            ("  an  apple,  a pear ", "apple pear"),  # articles -> space, whitespace collapsed
            ("theater", "theater"),  # "the" only as a whole word
            ("U.S.A.", "usa"),  # punctuation removed, not replaced by space
            ("Rock-'n'-Roll", "rocknroll"),
            ("A", ""),
            ("", ""),
            ("Tab\tand\nnewline", "tab and newline"),
        ],
    )
    def test_cases(self, raw, expected):
        assert normalize_answer(raw) == expected

    def test_idempotent(self):
        for text in ["The  Beatles", "a.b.c", "AN Answer, the end"]:
            assert normalize_answer(normalize_answer(text)) == normalize_answer(text)


class TestExactMatch:
    def test_any_gold(self):
        assert exact_match("the Beatles", ["Rolling Stones", "Beatles"]) == 1.0
        assert exact_match("Beatles band", ["Beatles"]) == 0.0

    def test_single_string_gold(self):
        assert exact_match("Paris.", "paris") == 1.0

    def test_empty_gold_list(self):
        assert exact_match("Paris", []) == 0.0

    def test_non_string_gold_is_a_clear_error(self):
        with pytest.raises(TypeError, match="gold answers must be strings"):
            exact_match("1", [1])


class TestSubExactMatch:
    def test_gold_inside_prediction(self):
        assert sub_exact_match("It is Paris, France", ["paris"]) == 1.0
        assert sub_exact_match("Par", ["Paris"]) == 0.0

    def test_empty_normalised_gold_never_matches(self):
        # "The" normalises to "", which would be a substring of anything.
        assert sub_exact_match("anything", ["The"]) == 0.0


class TestF1:
    def test_hand_derived(self):
        # pred tokens [barack, obama, jr], gold [barack, obama]: common 2,
        # P = 2/3, R = 1, F1 = 2 * (2/3) / (5/3) = 0.8
        assert f1_score("Barack Obama Jr.", ["Barack Obama"]) == pytest.approx(0.8)

    def test_multiset_common(self):
        # pred [a?] -> "new new york" vs gold "new york": common = {new:1, york:1} = 2,
        # P = 2/3, R = 1 -> 0.8
        assert f1_score("new new york", "New York") == pytest.approx(0.8)

    def test_max_over_golds_and_empty(self):
        assert f1_score("york", ["new york", "york"]) == 1.0
        assert f1_score("", ["york"]) == 0.0
        assert f1_score("the", ["the"]) == 0.0  # both normalise to nothing


class TestExtractAnswer:
    def test_last_answer_wins(self):
        assert extract_answer("<answer> a </answer> then <answer>\n b \n</answer>") == "b"

    def test_no_answer(self):
        assert extract_answer("<answer> unclosed") is None
        assert extract_answer("") is None

    def test_empty_answer_is_empty_string(self):
        assert extract_answer("<answer></answer>") == ""


class TestRewardCallables:
    def test_em_reward_uses_response_only(self):
        # The prompt's example "<answer> Beijing </answer>" is not part of the response.
        assert em_reward("<think>x</think><answer> Beijing </answer>", ["Beijing"]) == 1.0
        assert em_reward("no answer here", ["Beijing"]) == 0.0

    def test_subem_and_f1(self):
        response = "<answer>Barack Obama Jr.</answer>"
        assert subem_reward(response, ["Barack Obama"]) == 1.0
        assert f1_reward(response, ["Barack Obama"]) == pytest.approx(0.8)
        assert f1_reward("nothing", ["Barack Obama"]) == 0.0

    def test_registry(self):
        assert get_reward("em") is em_reward
        with pytest.raises(ValueError, match="valid: \\['em', 'f1', 'multiple_choice', 'subem'\\]"):
            get_reward("bleu")
