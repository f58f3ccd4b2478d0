"""The warm start's settings taken together are checked only when a warm start runs: at load with sft.enabled,
and by the warm start itself (``stratarl sft``) whatever sft.enabled says. An RL-only run on files data keeps the
sft section of its base config."""

from __future__ import annotations

import pytest

from stratarl.trainer.config import ConfigError, load_config
from stratarl.trainer.warmstart.settings import WarmStartSettings


@pytest.fixture
def files_data(tmp_path):
    train = tmp_path / "train.jsonl"
    train.write_text('{"question": "q?", "golden_answers": ["a"]}\n')
    return ["data.source=files", f"data.train_files=[{train}]", f"data.test_files=[{train}]"]


def test_an_rl_only_run_on_files_keeps_a_worlds_sft_section(files_data):
    worlds = ["sft.source=worlds", "sft.steps=10", "sft.probe_every=5"]
    cfg = load_config(None, ["model.name=tiny-random", "sft.enabled=false", *files_data, *worlds])
    assert cfg.sft.source == "worlds" and cfg.sft.probe_every == 5
    with pytest.raises(ConfigError, match=r"sft.source.*demonstration worlds are synthetic knowledge bases"):
        load_config(None, ["model.name=tiny-random", "sft.enabled=true", *files_data, *worlds])
    with pytest.raises(ConfigError, match=r"sft.source.*demonstration worlds are synthetic knowledge bases"):
        WarmStartSettings.from_config(cfg)  # `stratarl sft` on that config: the warm start checks it itself


def test_a_probe_without_worlds_is_refused_only_when_the_warm_start_runs():
    task_probe = ["model.name=tiny-random", "sft.source=task", "sft.probe_every=5"]
    cfg = load_config(None, [*task_probe, "sft.enabled=false"])
    with pytest.raises(ConfigError, match=r"sft.probe_every.*the reading probe draws an unseen world"):
        load_config(None, [*task_probe, "sft.enabled=true"])
    with pytest.raises(ConfigError, match=r"sft.probe_every.*the reading probe draws an unseen world"):
        WarmStartSettings.from_config(cfg)


def test_a_value_out_of_range_is_refused_even_in_a_disabled_section():
    with pytest.raises(ConfigError, match=r"sft.lr"):
        load_config(None, ["model.name=tiny-random", "sft.enabled=false", "sft.lr=-1"])
