"""The retriever Protocol and the passage type every retriever returns."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, runtime_checkable


@dataclass(frozen=True)
class Passage:
    """One corpus passage, in Search-R1's corpus format.

    ``contents`` is ``'"<title>"\\n<text>'``: the title is the first line (quotes
    stripped), the text the rest. ``score`` is the retriever's score, if any.
    """

    id: str
    contents: str
    score: float | None = None

    @property
    def title(self) -> str:
        return self.contents.split("\n", 1)[0].strip().strip('"')

    @property
    def text(self) -> str:
        parts = self.contents.split("\n", 1)
        return parts[1] if len(parts) == 2 else ""

    def to_document(self) -> dict:
        """The ``document`` object of Search-R1's ``/retrieve`` response."""
        return {"id": self.id, "contents": self.contents}


@runtime_checkable
class Retriever(Protocol):
    """Anything that answers a batch of queries with top-k passages each.

    Returns one list per query, in query order, each at most ``k`` long, best first.
    Raises on failure (the rollout engine turns a raised error into an observation).
    """

    def search(self, queries: list[str], k: int) -> list[list[Passage]]: ...


def check_k(k: int) -> None:
    """Raise `ValueError` unless ``k`` (passages per query) is a positive integer."""
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise ValueError(f"k must be a positive integer, got {k!r}")


class RetrievalError(RuntimeError):
    """A retriever could not answer (server unreachable, timed out, bad response).

    The message says what was tried and how to fix it; the rollout engine turns it into
    an observation and a counted tool error instead of a crash.
    """
