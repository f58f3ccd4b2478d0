"""Config tree: defaults, shipped configs, overrides, and errors that name the field and the fix."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from stratarl.trainer.config import (
    ALGORITHMS,
    Config,
    ConfigError,
    apply_overrides,
    config_from_dict,
    load_config,
    parse_override,
    save_config,
)

CONFIGS = sorted((Path(__file__).resolve().parents[3] / "configs").glob("*.yaml"))


def test_defaults_validate():
    cfg = load_config(None)
    assert cfg.algo.name == "stratified_grpo" and cfg.algo.alpha == 0.6
    # Search-R1 / paper defaults (docs/algorithms.md §3).
    assert cfg.rollout.group_size == 5 and cfg.algo.clip_low == 0.2 and cfg.algo.kl_coef == 0.001
    assert cfg.retrieval.topk == 3 and cfg.rollout.max_turns == 4


def _named_data_files(path) -> list[str]:
    """The data files a shipped config names (relative paths a documented command generates first)."""
    data = (yaml.safe_load(path.read_text()) or {}).get("data") or {}
    return [
        *data.get("train_files", []),
        *data.get("test_files", []),
        *([data["corpus"]] if data.get("corpus") else []),
    ]


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_every_shipped_config_loads(path, tmp_path, monkeypatch):
    # A config over generated data (configs/phantomwiki_lab.yaml) names files its documented commands write
    # first: stand-ins at those relative paths let it load here, where nothing was generated.
    monkeypatch.chdir(tmp_path)
    for name in _named_data_files(path):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).touch()
    cfg = load_config(path)
    assert isinstance(cfg, Config)
    assert cfg.algo.name in ALGORITHMS


def test_shipped_configs_exist():
    names = {p.name for p in CONFIGS}
    assert {"demo.yaml", "lab.yaml", "smollm2.yaml", "tiny.yaml"} <= names


def test_overrides_set_nested_fields_with_yaml_types():
    cfg = load_config(
        None,
        [
            "algo.name=grpo",
            "trainer.steps=20",
            "model.lora.enabled=true",
            "optim.betas=[0.8,0.9]",
            "algo.stratum_cap=null",
            "optim.lr=3e-5",
        ],
    )
    assert cfg.algo.name == "grpo" and cfg.trainer.steps == 20 and cfg.model.lora.enabled is True
    assert cfg.optim.betas == [0.8, 0.9] and cfg.algo.stratum_cap is None
    assert cfg.optim.lr == pytest.approx(3e-5) and isinstance(cfg.optim.lr, float)


def test_override_does_not_mutate_input():
    data = {"algo": {"name": "ppo"}}
    out = apply_overrides(data, ["algo.alpha=0.5"])
    assert data == {"algo": {"name": "ppo"}} and out["algo"] == {"name": "ppo", "alpha": 0.5}


def test_parse_override_requires_equals():
    assert parse_override("a.b=1") == (["a", "b"], 1)
    with pytest.raises(ConfigError, match="no `=`"):
        parse_override("trainer.steps")


def test_unknown_key_lists_valid_keys_and_suggests():
    with pytest.raises(ConfigError) as info:
        load_config(None, ["trainer.stpes=3"])
    msg = str(info.value)
    assert "trainer.stpes" in msg and "did you mean `trainer.steps`" in msg and "prompts_per_step" in msg


def test_unknown_section_is_an_error():
    with pytest.raises(ConfigError, match="did you mean `algo`"):
        config_from_dict({"algos": {"name": "grpo"}})


def test_wrong_type_names_the_field():
    with pytest.raises(ConfigError, match=r"`trainer.steps` = 'many'.*integer"):
        load_config(None, ["trainer.steps=many"])
    with pytest.raises(ConfigError, match=r"`model.lora.enabled`.*true or false"):
        load_config(None, ["model.lora.enabled=3"])


@pytest.mark.parametrize(
    "override, field",
    [
        ("algo.name=grpoo", "algo.name"),
        ("algo.alpha=1.5", "algo.alpha"),
        ("rollout.group_size=0", "rollout.group_size"),
        ("optim.lr=-1", "optim.lr"),
        ("algo.clip_low=1.2", "algo.clip_low"),
        ("rollout.max_obs_tokens=4", "rollout.max_obs_tokens"),
        ("data.source=web", "data.source"),
        ("trainer.mini_batches=0", "trainer.mini_batches"),
        ("sft.no_search_fraction=2", "sft.no_search_fraction"),
    ],
)
def test_validation_errors_name_field_and_fix(override, field):
    with pytest.raises(ConfigError) as info:
        load_config(None, [override])
    msg = str(info.value)
    assert f"`{field}`" in msg and "Fix:" in msg


def test_unknown_algorithm_suggests_close_name():
    with pytest.raises(ConfigError, match="did you mean 'so_grpo'"):
        load_config(None, ["algo.name=sogrpo"])


def test_missing_file_and_bad_yaml(tmp_path):
    with pytest.raises(ConfigError, match="not found"):
        load_config(tmp_path / "nope.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("trainer: [unclosed\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(bad)
    scalar = tmp_path / "scalar.yaml"
    scalar.write_text("42\n")
    with pytest.raises(ConfigError, match="mapping"):
        load_config(scalar)


def test_error_mentions_the_file(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("trainer:\n  steps: -3\n")
    with pytest.raises(ConfigError, match=r"trainer.steps.*c\.yaml"):
        load_config(path)


def test_saved_config_round_trips(tmp_path):
    cfg = load_config(None, ["algo.name=so_ppo", "trainer.steps=7", "data.synthetic.options={size: 300}"])
    save_config(cfg, tmp_path / "config.yaml")
    again = load_config(tmp_path / "config.yaml")
    assert again == cfg


def test_algorithm_properties():
    assert load_config(None, ["algo.name=so_ppo"]).algorithm.uses_critic
    assert load_config(None, ["algo.name=so_grpo"]).algorithm.ratio_level == "turn"
    assert load_config(None, ["algo.name=grpo"]).algorithm.ratio_level == "token"
    assert load_config(None, ["algo.name=grpo", "algo.turn_level_ratio=true"]).algorithm.ratio_level == "turn"
    assert load_config(None, ["algo.name=so_grpo", "algo.turn_level_ratio=false"]).algorithm.ratio_level == "token"


def test_the_older_switches_are_rewritten_once_and_leave_the_dataclass():
    import dataclasses

    from stratarl.trainer.config import AlgoConfig

    fields = {f.name for f in dataclasses.fields(AlgoConfig)}
    assert not fields & {"turn_level_ratio", "sorl_normalize"}
    cfg = load_config(
        None, ["algo.name=grpo", "algo.turn_level_ratio=true", "algo.sorl_normalize=true", "algo.policy_loss=sorl"]
    )
    assert (cfg.algo.ratio_level, cfg.algo.normalizer, cfg.algo.policy_loss) == ("turn", "sorl", "ppo")


def test_a_run_directorys_config_from_before_the_restructure_loads(tmp_path):
    """A config.yaml written by `stratarl demo` at commit d97dd6d (every field, the older switches as null), and
    one with the older switches set: both load, the switches read into their one home."""
    import yaml

    old = Path(__file__).parent / "data" / "config_before_the_restructure.yaml"
    data = yaml.safe_load(old.read_text())
    assert data["algo"]["turn_level_ratio"] is None and data["algo"]["sorl_normalize"] is None
    cfg = load_config(old)
    assert (cfg.algorithm.advantage, cfg.algorithm.ratio_level, cfg.algorithm.normalizer) == ("grpo", "token", "none")
    data["algo"].update(name="so_grpo", turn_level_ratio=False, sorl_normalize=False)
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(data))
    again = load_config(tmp_path / "config.yaml")
    assert (again.algorithm.ratio_level, again.algorithm.normalizer) == ("token", "none")
    save_config(again, tmp_path / "saved.yaml")
    assert "turn_level_ratio" not in (tmp_path / "saved.yaml").read_text()  # written back in the current spelling
