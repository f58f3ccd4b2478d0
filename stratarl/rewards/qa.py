"""Answer extraction and QA rewards, exactly as Search-R1 computes them.

Source: Search-R1 ``verl/utils/reward_score/qa_em.py`` (itself SQuAD's
``normalize_answer`` and token F1). Reward functions are plain callables
``(response_text, golds) -> float`` so users can pass their own.
"""

from __future__ import annotations

import re
import string
from collections import Counter
from collections.abc import Sequence

_ANSWER_RE = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
_ARTICLES_RE = re.compile(r"\b(a|an|the)\b")
_PUNCTUATION = frozenset(string.punctuation)


def normalize_answer(text: str) -> str:
    """SQuAD / Search-R1 normalisation.

    lower-case -> drop every ``string.punctuation`` character -> replace the whole
    words a / an / the by a space -> collapse whitespace (split + join).
    """
    text = text.lower()
    text = "".join(ch for ch in text if ch not in _PUNCTUATION)
    text = _ARTICLES_RE.sub(" ", text)
    return " ".join(text.split())


def _as_golds(golds: str | Sequence[str]) -> list[str]:
    if isinstance(golds, str):
        return [golds]
    golds = list(golds)
    for gold in golds:
        if not isinstance(gold, str):
            raise TypeError(f"gold answers must be strings, got {type(gold).__name__}: {gold!r}")
    return golds


def exact_match(prediction: str, golds: str | Sequence[str]) -> float:
    """EM = 1.0 if normalize(prediction) equals normalize(g) for any gold g, else 0.0."""
    pred = normalize_answer(prediction)
    return float(any(pred == normalize_answer(gold) for gold in _as_golds(golds)))


def sub_exact_match(prediction: str, golds: str | Sequence[str]) -> float:
    """SubEM = 1.0 if some normalised gold is a substring of the normalised prediction.

    An empty normalised gold never matches (it would be a substring of anything).
    """
    pred = normalize_answer(prediction)
    for gold in _as_golds(golds):
        norm_gold = normalize_answer(gold)
        if norm_gold and norm_gold in pred:
            return 1.0
    return 0.0


def _f1_one(prediction_tokens: list[str], gold_tokens: list[str]) -> float:
    common = Counter(prediction_tokens) & Counter(gold_tokens)
    num_same = sum(common.values())
    if num_same == 0:
        return 0.0
    precision = num_same / len(prediction_tokens)
    recall = num_same / len(gold_tokens)
    return 2 * precision * recall / (precision + recall)


def f1_score(prediction: str, golds: str | Sequence[str]) -> float:
    """SQuAD token F1 of the normalised strings, max over gold answers.

    F1 = 2PR / (P + R) with P = |common| / |pred tokens|, R = |common| / |gold tokens|
    (common counted as a multiset). Empty prediction or gold -> 0.
    """
    pred_tokens = normalize_answer(prediction).split()
    best = 0.0
    for gold in _as_golds(golds):
        best = max(best, _f1_one(pred_tokens, normalize_answer(gold).split()))
    return best


def extract_answer(response_text: str) -> str | None:
    """Content of the *last* ``<answer>...</answer>`` in the response, stripped; None if none.

    Pass the response only (what the policy wrote after the prompt): the prompt's
    own example ``<answer> Beijing </answer>`` must never count as an answer.
    """
    matches: list[str] = _ANSWER_RE.findall(response_text)
    if not matches:
        return None
    return matches[-1].strip()


def em_reward(response_text: str, golds: str | Sequence[str]) -> float:
    """Search-R1's default reward: EM of the last answer; no answer -> 0."""
    answer = extract_answer(response_text)
    return 0.0 if answer is None else exact_match(answer, golds)


def subem_reward(response_text: str, golds: str | Sequence[str]) -> float:
    """SubEM of the last answer; no answer -> 0."""
    answer = extract_answer(response_text)
    return 0.0 if answer is None else sub_exact_match(answer, golds)


def f1_reward(response_text: str, golds: str | Sequence[str]) -> float:
    """Token F1 of the last answer; no answer -> 0."""
    answer = extract_answer(response_text)
    return 0.0 if answer is None else f1_score(answer, golds)
