"""The task of a run: its questions and the corpus its retriever searches."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from stratarl.data.examples import Example
from stratarl.retrieval.base import Passage


@dataclass
class TaskData:
    """Questions and the corpus the retriever searches."""

    train: list[Example]
    test: list[Example]
    corpus_path: Path | None
    passages: list[Passage] | None = None
    vocabulary_texts: list[str] = field(default_factory=list)
    """Extra texts a word-level vocabulary must cover (a synthetic task's shared name pool)."""
    question_files: list[str] = field(default_factory=list)
    """The files the questions were read from (train, then test; empty for a synthetic task)."""
