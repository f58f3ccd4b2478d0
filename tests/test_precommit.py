"""The shipped .pre-commit-config.yaml runs the same ruff commands as `make lint`, from the project's venv, with
nothing to download (local hooks only)."""

from __future__ import annotations

from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]


def _lint_commands() -> list[str]:
    """The commands of the Makefile's ``lint`` target, ``$(PY)`` written as ``.venv/bin/python``."""
    lines = (REPO / "Makefile").read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("lint:"))
    commands = []
    for line in lines[start + 1 :]:
        if not line.startswith("\t"):
            break
        commands.append(line.strip().replace("$(PY)", ".venv/bin/python"))
    return commands


def test_precommit_runs_make_lints_ruff_checks_from_the_local_venv():
    config = yaml.safe_load((REPO / ".pre-commit-config.yaml").read_text())
    assert [repo["repo"] for repo in config["repos"]] == ["local"]  # no hook fetched from the network
    hooks = config["repos"][0]["hooks"]
    ruff = [c for c in _lint_commands() if " ruff " in c]
    assert ruff == [".venv/bin/python -m ruff check .", ".venv/bin/python -m ruff format --check ."]
    assert [hook["entry"] for hook in hooks] == ruff
    assert all(hook["language"] == "system" and hook["pass_filenames"] is False for hook in hooks)
