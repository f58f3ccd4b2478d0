"""Optional format check and multiple-choice (MedQA-style) answers.

The format check is our reading of Search-R1's ``qa_em_format.py``: the response
must be the tag sequence ``think -> (search -> information -> think)* -> answer``
with only whitespace between tags. It is off by default (Search-R1's default
reward is plain EM).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence

from stratarl.rewards.qa import em_reward, extract_answer, normalize_answer

RewardFn = Callable[[str, Sequence[str]], float]

_TAG_RE = re.compile(r"<(/?)(think|search|information|answer)>")
# Allowed transitions of the tag automaton: state -> {tag: next state}.
_TRANSITIONS: dict[str, dict[str, str]] = {
    "start": {"<think>": "in_think"},
    "in_think": {"</think>": "after_think"},
    "after_think": {"<search>": "in_search", "<answer>": "in_answer"},
    "in_search": {"</search>": "after_search"},
    "after_search": {"<information>": "in_information"},
    "in_information": {"</information>": "after_information"},
    "after_information": {"<think>": "in_think"},
    "in_answer": {"</answer>": "end"},
    "end": {},
}
# States whose surrounding text is free (inside a tag); elsewhere only whitespace is allowed.
_INSIDE = {"in_think", "in_search", "in_information", "in_answer"}


def is_valid_format(response_text: str) -> bool:
    """True if the response follows ``think -> (search -> information -> think)* -> answer``.

    Text inside a tag pair is free; text between tag pairs must be whitespace;
    nothing but whitespace may follow ``</answer>``.
    """
    state = "start"
    position = 0
    for match in _TAG_RE.finditer(response_text):
        between = response_text[position : match.start()]
        if state not in _INSIDE and between.strip():
            return False
        tag = match.group(0)
        next_state = _TRANSITIONS[state].get(tag)
        if next_state is None:
            return False
        state = next_state
        position = match.end()
    return state == "end" and not response_text[position:].strip()


def make_format_reward(base: RewardFn = em_reward, format_score: float = 0.2) -> RewardFn:
    """Wrap ``base`` with a format term (our reading of Search-R1's ``qa_em_format``).

    correct and valid -> base; correct and invalid -> base - format_score;
    wrong and valid -> format_score; wrong and invalid -> 0.

    A partial score s in (0, 1) (token F1) is blended the same way, so that a partly right answer never earns
    less than a wrong one in the same format: valid -> format_score + (1 - format_score) s, invalid ->
    (1 - format_score) s. At s = 0 and s = 1 this is the table above.
    """
    if not 0.0 <= format_score <= 1.0:
        raise ValueError(f"format_score must be in [0, 1], got {format_score}")

    def reward(response_text: str, golds: Sequence[str]) -> float:
        score = base(response_text, golds)
        valid = is_valid_format(response_text)
        if score <= 0 or score >= 1:  # Search-R1's table, exactly
            if score > 0:
                return score if valid else score - format_score
            return format_score if valid else 0.0
        return format_score + (1.0 - format_score) * score if valid else (1.0 - format_score) * score

    return reward


# "B", "(B)", "B.", "B)", "B:", "Option B", "B. aspirin" -> "B" (letters A-J only).
_CHOICE_RE = re.compile(r"^\s*(?:option\s+|answer\s*:?\s*)?\(?([A-J])\)?(?:[.:)\s]|$)", re.IGNORECASE)


def extract_choice_letter(prediction: str) -> str | None:
    """The option letter a prediction starts with (upper case), or None.

    A letter counts when it stands alone at the start: "B", "(B)", "B.", "B) x",
    "Option b", "B aspirin". A word that merely starts with a letter ("Bacteria")
    does not. Known ambiguity: "A lot" reads as letter A.
    """
    match = _CHOICE_RE.match(prediction)
    return match.group(1).upper() if match else None


def multiple_choice_match(prediction: str, golds: str | Sequence[str]) -> float:
    """1.0 if the prediction names the gold option by letter or by text, else 0.0.

    ``golds`` holds the gold letter (e.g. "B") and/or the gold option text
    (e.g. "Aspirin"). Accepted: "B", "(b)", "B. Aspirin", "aspirin".
    A leading option letter takes precedence when the gold letter is known: "A. aspirin"
    scores 0 when the gold is "B"/"Aspirin" (it names option A).
    """
    golds = [golds] if isinstance(golds, str) else list(golds)
    gold_letters = {g.strip().upper() for g in golds if len(g.strip()) == 1 and g.strip().isalpha()}
    gold_texts = {normalize_answer(g) for g in golds if len(g.strip()) > 1}
    gold_texts.discard("")
    letter = extract_choice_letter(prediction)
    # A leading letter decides when the gold letter is known ("A. aspirin" names option A;
    # normalisation alone would drop the "A" as an article and match the text).
    if letter is not None and gold_letters:
        return float(letter in gold_letters)
    if normalize_answer(prediction) in gold_texts:
        return 1.0
    if letter is None:
        return 0.0
    # Only texts are known: accept "X. <gold text>" whatever the letter.
    rest = normalize_answer(_CHOICE_RE.sub("", prediction, count=1))
    return float(rest in gold_texts)


def multiple_choice_reward(response_text: str, golds: str | Sequence[str]) -> float:
    """Multiple-choice reward of the last ``<answer>``; no answer -> 0."""
    answer = extract_answer(response_text)
    return 0.0 if answer is None else multiple_choice_match(answer, golds)
