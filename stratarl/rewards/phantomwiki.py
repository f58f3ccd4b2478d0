"""PhantomWiki's answer scoring: answers are sets, compared after splitting on a comma.

Source: PhantomWiki (Gong et al., ICML 2025, arXiv 2502.20377), ``phantom_eval/score.py`` and
``phantom_eval/utils.py::normalize_pred`` of the ``phantom-wiki`` 1.0.3 package. A PhantomWiki question lists
every correct answer ("Who is the friend of X?" has one gold per friend); the gold string is those answers joined
by ``ANSWER_SEP``, and a prediction is a string of answers joined the same way. Both are normalised by

    normalize_pred(s) = { part.strip().lower() for part in s.split(",") }

(nothing else: punctuation and articles are kept, unlike Search-R1's ``normalize_answer``; an empty string is the
set {""}). With P = normalize_pred(prediction) and T = normalize_pred(",".join(golds)):

    EM        = 1 if P == T else 0
    precision = |P ∩ T| / |P|,  recall = |P ∩ T| / |T|
    F1        = 2·precision·recall / (precision + recall), and 0 when both are 0.

``subem`` here is "every gold answer is among the predicted ones" (recall = 1), the set analogue of SubEM.
Reward functions take the whole response and score the content of its last ``<answer>`` (0 when there is none),
as the Search-R1 rewards do.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from stratarl.rewards.qa import extract_answer

ANSWER_SEP = ","
"""PhantomWiki's answer separator (``phantom_eval.constants.answer_sep``)."""

DATA_SOURCE = "phantomwiki"
"""The ``data_source`` of PhantomWiki questions; the rewards and the evaluation score it with this module."""


def normalize_pred(text: str, sep: str = ANSWER_SEP) -> set[str]:
    """PhantomWiki's normalisation: split on ``sep``, strip each part, lower-case it, and make a set."""
    return {part.strip().lower() for part in text.split(sep)}


def _gold_set(golds: str | Sequence[str], sep: str) -> set[str]:
    """The normalised gold set: the golds joined by ``sep`` and normalised, as ``phantom_eval`` builds it."""
    if isinstance(golds, str):
        return normalize_pred(golds, sep)
    golds = list(golds)
    for gold in golds:
        if not isinstance(gold, str):
            raise TypeError(f"gold answers must be strings, got {type(gold).__name__}: {gold!r}")
    return normalize_pred(sep.join(golds), sep)


def set_precision_recall(prediction: str, golds: str | Sequence[str], sep: str = ANSWER_SEP) -> tuple[float, float]:
    """(precision, recall) of the predicted answer set against the gold set (module docstring)."""
    predicted, gold = normalize_pred(prediction, sep), _gold_set(golds, sep)
    common = len(predicted & gold)
    return common / len(predicted), common / len(gold)


def set_exact_match(prediction: str, golds: str | Sequence[str], sep: str = ANSWER_SEP) -> float:
    """1.0 if the predicted answer set equals the gold set, else 0.0."""
    return float(normalize_pred(prediction, sep) == _gold_set(golds, sep))


def set_f1(prediction: str, golds: str | Sequence[str], sep: str = ANSWER_SEP) -> float:
    """The harmonic mean of set precision and recall; 0.0 when both are 0."""
    precision, recall = set_precision_recall(prediction, golds, sep)
    if precision + recall == 0:
        return 0.0
    return 2 * precision * recall / (precision + recall)


def set_covers(prediction: str, golds: str | Sequence[str], sep: str = ANSWER_SEP) -> float:
    """1.0 if every gold answer is among the predicted ones (recall 1), else 0.0."""
    return float(set_precision_recall(prediction, golds, sep)[1] == 1.0)


def _answer_score(response_text: str, golds: str | Sequence[str], metric: Callable[..., float]) -> float:
    """``metric`` of the last ``<answer>`` in the response against the golds; 0.0 without one."""
    answer = extract_answer(response_text)
    return 0.0 if answer is None else metric(answer, golds)


def phantomwiki_em_reward(response_text: str, golds: str | Sequence[str]) -> float:
    """Set EM of the last ``<answer>`` in the response; 0.0 without one."""
    return _answer_score(response_text, golds, set_exact_match)


def phantomwiki_f1_reward(response_text: str, golds: str | Sequence[str]) -> float:
    """Set F1 of the last ``<answer>`` in the response; 0.0 without one."""
    return _answer_score(response_text, golds, set_f1)


def phantomwiki_subem_reward(response_text: str, golds: str | Sequence[str]) -> float:
    """1.0 if the last ``<answer>`` names every gold answer; 0.0 otherwise or without one."""
    return _answer_score(response_text, golds, set_covers)
