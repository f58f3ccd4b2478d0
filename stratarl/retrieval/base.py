"""The retriever Protocol, the passage type every retriever returns, and the checks and result shape that the
local indexes share."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
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


def search_request(queries: Iterable[str], k: int, num_passages: int) -> tuple[list[str], int]:
    """A local index's search arguments, checked: the queries as a list and how many passages each can get
    (``k``, at most the index's ``num_passages``). Raises `ValueError` on a bad ``k`` (`check_k`)."""
    check_k(k)
    return list(queries), min(k, num_passages)


def ranked_passages(
    passages: Sequence[Passage],
    indices: list[list[int]],
    scores: list[list[float]],
    keep: Callable[[int, float], bool],
) -> list[list[Passage]]:
    """One list per query row: ``passages[i]`` scored ``s`` for each ``(i, s)`` of the row that ``keep`` admits,
    in the row's order (best first)."""
    return [
        [Passage(passages[i].id, passages[i].contents, float(s)) for i, s in zip(row_i, row_s) if keep(i, s)]
        for row_i, row_s in zip(indices, scores)
    ]


class RetrievalError(RuntimeError):
    """A retriever could not answer (server unreachable, timed out, bad response).

    The message says what was tried and how to fix it; the rollout engine turns it into
    an observation and a counted tool error instead of a crash.
    """
