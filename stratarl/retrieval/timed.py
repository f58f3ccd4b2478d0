"""A retriever proxy that times and counts the searches of a training step, within a time budget."""

from __future__ import annotations

import time
from contextlib import contextmanager

from stratarl.retrieval.base import Passage, RetrievalError, Retriever


class TimedRetriever:
    """Retriever proxy that adds the wall time of every ``search`` call to ``seconds`` and counts the
    queries that failed (raised, or a reply with the wrong number of result lists).

    ``budget_s`` bounds the time searches may take between two `start_step` calls: a retriever with a
    ``deadline`` attribute (`RemoteRetriever`) stops retrying at it, and once the budget is spent every
    further search of the step fails at once instead of waiting on a hanging server."""

    def __init__(self, inner: Retriever, budget_s: float | None = None) -> None:
        self.inner = inner
        self.budget_s = budget_s
        self.seconds = 0.0
        self.calls = 0
        self.start_step()

    def start_step(self) -> None:
        """Reset the per-step counters and the time budget."""
        self.step_queries = self.step_failed = 0
        self.step_seconds = 0.0
        self.last_error = ""

    @property
    def where(self) -> str:
        """The server URL (remote retrievers) or the retriever's repr."""
        return getattr(self.inner, "url", None) or repr(self.inner)

    def search(self, queries: list[str], k: int) -> list[list[Passage]]:

        start = time.perf_counter()
        self.step_queries += len(queries)
        try:
            remaining = None if self.budget_s is None else self.budget_s - self.step_seconds
            if remaining is not None and remaining <= 0:
                raise RetrievalError(
                    f"this step's retrieval time budget (retrieval.step_budget_s={self.budget_s:g}) "
                    "is spent; the search was not sent"
                )
            if hasattr(self.inner, "deadline"):
                self.inner.deadline = None if remaining is None else time.monotonic() + remaining
            results = self.inner.search(queries, k)
            if not isinstance(results, list) or len(results) != len(queries):
                got = len(results) if isinstance(results, list) else type(results).__name__
                raise RetrievalError(f"retriever returned {got} result lists for {len(queries)} queries")
            return results
        except Exception as error:
            self.step_failed += len(queries)
            self.last_error = f"{type(error).__name__}: {error}"
            raise
        finally:
            elapsed = time.perf_counter() - start
            self.seconds += elapsed
            self.step_seconds += elapsed
            self.calls += len(queries)

    @contextmanager
    def unbudgeted(self):
        """No step budget inside (evaluation: its searches are not a training step's)."""
        budget, self.budget_s = self.budget_s, None
        try:
            yield self
        finally:
            self.budget_s = budget

    def pop_seconds(self) -> float:
        seconds, self.seconds = self.seconds, 0.0
        return seconds
