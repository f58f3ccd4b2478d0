"""The one question type every loader produces and the trainer consumes, and the loaders' one error type."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Example:
    """A question with its gold answers.

    ``id`` is unique within a loaded dataset (loaders make one when the file has
    none; never ``extra_info.index``, which restarts per source in merged files).
    ``metadata`` carries anything else a loader kept (split, original index,
    synthetic-benchmark hops and question type, multiple-choice options).
    ``prompt`` is the data file's own prompt (chat messages) when it has one: the policy sees
    it as it is (unless ``rollout.rebuild_prompt``); None builds the prompt from the question.
    """

    id: str
    question: str
    golden_answers: tuple[str, ...]
    data_source: str = "unknown"
    metadata: dict[str, Any] = field(default_factory=dict, compare=False, hash=False)
    prompt: tuple[dict[str, str], ...] | None = field(default=None, compare=False, hash=False)


class DatasetFormatError(ValueError):
    """A question file is unreadable or a row lacks a field; the message names file, row and field."""
