"""tests/verl run against a real veRL in .venv-verl (`make test-verl`); in the main venv they skip."""

from __future__ import annotations

import pytest

from stratarl.retrieval.base import Passage


def pytest_configure(config):
    # veRL probes optional engines (Megatron, VeOmni, …) at import and warns for each missing one.
    config.addinivalue_line("filterwarnings", "ignore:.*engine is not available:UserWarning")
    config.addinivalue_line("filterwarnings", "ignore:Disabled critic as algorithm.adv_estimator:UserWarning")


class CountingRetriever:
    """Stub `/retrieve` backend of the search tool: records every query and returns ``k`` copies of one
    passage ("Paris is the capital of France ."); raises on the calls listed in ``fail_on`` (1-based)."""

    def __init__(self, fail_on=()):
        self.queries: list[str] = []
        self.fail_on = set(fail_on)

    def search(self, queries, k):
        self.queries.extend(queries)
        if len(self.queries) in self.fail_on:
            raise RuntimeError("retriever down")
        return [
            [Passage(id=f"{q}-{i}", contents='"Paris"\nParis is the capital of France .') for i in range(k)]
            for q in queries
        ]


@pytest.fixture
def retriever(monkeypatch):
    """A CountingRetriever behind stratarl's search tool (what veRL's recipe tool calls), top-1 results."""
    from stratarl.integrations import search_tool  # only the tests that ask for it load the tool

    stub = CountingRetriever()
    monkeypatch.setattr(search_tool, "_retriever", stub)
    monkeypatch.setenv("STRATARL_RETRIEVER_TOPK", "1")
    return stub
