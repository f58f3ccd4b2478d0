"""Fixtures for trainer tests: the tiny config with everything written under tmp_path,
and a reward with variance (a random tiny model never answers correctly, so EM would
give all-zero advantages and no policy gradient)."""

from __future__ import annotations

from pathlib import Path

import pytest

TINY = Path(__file__).resolve().parents[2] / "configs" / "tiny.yaml"

REWARD_MODULE = '''
def length_parity_reward(response_text, golds):
    """Deterministic, varied across rollouts: exercises the whole loop with non-zero advantages."""
    return float(len(response_text) % 2 == 0)
'''


@pytest.fixture
def reward_path(tmp_path, monkeypatch):
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
