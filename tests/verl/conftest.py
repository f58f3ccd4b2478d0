"""tests/verl run against a real veRL in .venv-verl (`make test-verl`); in the main venv they skip."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from stratarl.retrieval.base import Passage

REPO = Path(__file__).resolve().parents[2]


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


@pytest.fixture(scope="session")
def smoke_multiturn():
    """``run(workdir, *args, timeout=1200) -> (stdout, main_ppo.log text)``: one run of
    ``python -m harness.smoke_multiturn --workdir DIR *args`` that must succeed (its output's
    tail is the failure message); the test skips when no Python can run `stratarl serve`."""
    from harness import smoke_multiturn as mt  # imports veRL: only in .venv-verl

    def run(workdir: Path, *args: str, timeout: float = 1200) -> tuple[str, str]:
        try:
            mt.serve_python()
        except RuntimeError as error:
            pytest.skip(str(error))
        command = [sys.executable, "-m", "harness.smoke_multiturn", "--workdir", str(workdir)]
        result = subprocess.run(
            [*command, *args],
            capture_output=True,
            text=True,
            timeout=timeout,
            cwd=REPO,
            env={**os.environ, "PYTHONPATH": mt.smoke.pythonpath()},
        )
        log = (workdir / "main_ppo.log").read_text() if (workdir / "main_ppo.log").exists() else ""
        assert result.returncode == 0, (result.stdout + result.stderr + log)[-6000:]
        return result.stdout, log

    return run
