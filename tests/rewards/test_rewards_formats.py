"""Format validity and multiple-choice answers."""

from __future__ import annotations

import pytest

from stratarl.rewards import (
    em_reward,
    extract_choice_letter,
    is_valid_format,
    make_format_reward,
    multiple_choice_match,
    multiple_choice_reward,
)

VALID = "<think>a</think>\n<search>q</search>\n\n<information>docs</information>\n\n<think>b</think><answer>X</answer>"


class TestIsValidFormat:
    def test_valid_sequences(self):
        assert is_valid_format(VALID)
        assert is_valid_format("<think>t</think><answer>x</answer>\n")

    @pytest.mark.parametrize(
        "text",
        [
            "<answer>x</answer>",  # no think first
            "<think>a</think><search>q</search><answer>x</answer>",  # search without information
            "<think>a</think>junk<answer>x</answer>",  # text between tag pairs
            "<think>a</think><answer>x</answer> trailing",  # text after the answer
            "<think>a</think><answer>x",  # unclosed answer
            "<think><think>a</think></think><answer>x</answer>",  # nested think
            "",
        ],
    )
    def test_invalid_sequences(self, text):
        assert not is_valid_format(text)

    def test_format_reward_table(self):
        reward = make_format_reward(em_reward, format_score=0.2)
        assert reward(VALID, ["x"]) == 1.0  # correct, valid
        assert reward("<answer>X</answer>", ["x"]) == pytest.approx(0.8)  # correct, invalid
        assert reward(VALID, ["y"]) == pytest.approx(0.2)  # wrong, valid
        assert reward("<answer>X</answer>", ["y"]) == 0.0  # wrong, invalid

    def test_format_score_range(self):
        with pytest.raises(ValueError, match="format_score"):
            make_format_reward(format_score=1.5)


class TestMultipleChoice:
    @pytest.mark.parametrize(
        ("prediction", "letter"),
        [
            ("B", "B"),
            ("(b)", "B"),
            ("B. Aspirin", "B"),
            ("B) aspirin", "B"),
            ("Option C", "C"),
            ("Bacteria", None),
            ("aspirin", None),
            ("", None),
        ],
    )
    def test_letter(self, prediction, letter):
        assert extract_choice_letter(prediction) == letter

    @pytest.mark.parametrize(
        ("prediction", "score"),
        [
            ("B", 1.0),
            ("(B)", 1.0),
            ("B. Aspirin", 1.0),
            ("aspirin", 1.0),
            ("The Aspirin.", 1.0),
            ("A", 0.0),
            ("A. aspirin", 0.0),
            ("ibuprofen", 0.0),
        ],
    )
    def test_match_letter_and_text(self, prediction, score):
        assert multiple_choice_match(prediction, ["B", "Aspirin"]) == score

    def test_text_only_gold_accepts_any_letter_prefix(self):
        assert multiple_choice_match("D. Aspirin", ["Aspirin"]) == 1.0
        assert multiple_choice_match("D. Ibuprofen", ["Aspirin"]) == 0.0

    def test_reward_reads_last_answer(self):
        assert multiple_choice_reward("<answer>A</answer> <answer>(B)</answer>", ["B"]) == 1.0
        assert multiple_choice_reward("B", ["B"]) == 0.0  # no answer tag
