"""configs/lab.yaml end to end at a reduced size: the warm start (reading + fresh-world demonstrations)
is built once and cached, every algorithm trains from it unchanged, and the demo config shares it."""

from __future__ import annotations

from pathlib import Path

import pytest

from stratarl.trainer.config import load_config

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("lab")]
CONFIGS = Path(__file__).resolve().parents[2] / "configs"
# The lab's own sections at a size that runs in seconds; every key exists in configs/lab.yaml.
REDUCED = [
    "model.tiny_hidden_size=32",
    "model.tiny_intermediate_size=64",
    "model.tiny_num_heads=2",
    (
        "data.synthetic.options={size: 150, num_train: 40, num_test: 8, hop_mix: [0.3, 0.7, 0.0], guessable: none, "
        "name_pool: 300}"
    ),
    "data.max_eval_examples=8",
    "eval.batch_size=8",
    "sft.reading_steps=4",
    "sft.reading_curriculum=2",
    "sft.reading_batch_size=8",
    "sft.steps=4",
    "sft.batch_size=4",
    "sft.world_options={size: 100, num_train: 20, num_test: 4}",
    "sft.probe_every=2",
    "sft.probe_questions=2",
    "sft.probe_min_em=0.0",  # the probe runs, and passes at once
    "trainer.steps=2",
    "trainer.prompts_per_step=2",
    "trainer.eval_every=1",
    "trainer.save_every=0",
    "rollout.group_size=2",
]


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    import os

    root = tmp_path_factory.mktemp("cache")
    old = os.environ.get("STRATARL_CACHE")
    os.environ["STRATARL_CACHE"] = str(root)
    yield root
    if old is None:
        os.environ.pop("STRATARL_CACHE", None)
    else:
        os.environ["STRATARL_CACHE"] = old


def _run(tmp_path, name: str, extra: list[str], config: str = "lab.yaml") -> dict:
    from stratarl.commands.train import run_pipeline

    cfg = load_config(CONFIGS / config, REDUCED + extra)
    return run_pipeline(cfg, tmp_path / name, resume=False)


def test_lab_config_is_the_documented_recipe():
    cfg = load_config(CONFIGS / "lab.yaml")
    assert cfg.model.name == "word-tiny" and cfg.model.tiny_copy_init == 1.0
    assert cfg.sft.source == "worlds" and cfg.sft.cache and cfg.sft.reading_steps > 0
    assert cfg.sft.early_answer_fraction > 0.5  # the weak search policy RL improves on
    # The warm start ends when its reading probe passes, not after a fixed step count.
    assert cfg.sft.probe_every > 0 and cfg.sft.probe_min_em >= 0.6 and cfg.sft.probe_questions >= 100
    assert (
        cfg.rollout.group_size * cfg.trainer.prompts_per_step >= 32
        and cfg.rollout.max_turns == 3
        and cfg.rollout.stop_on_eos
    )
    assert cfg.data.max_eval_examples >= 200 and cfg.data.synthetic.options["num_test"] >= 200
    demo = load_config(CONFIGS / "demo.yaml")
    from stratarl.trainer.warmstart.stages import warm_start_cache_dir

    assert warm_start_cache_dir(demo) == warm_start_cache_dir(cfg)  # the demo reuses the lab's warm start


def test_lab_trains_end_to_end_and_every_algorithm_reuses_its_warm_start(tmp_path, cache):
    first = _run(tmp_path, "grpo", ["algo.name=grpo"])
    assert first["sft"]["source"] == "worlds" and first["sft"]["reading"]["steps"] == 4
    assert first["sft"]["probe_passed"] and [p["step"] for p in first["sft"]["probes"]] == [4]
    assert first["steps"] == 2 and first["eval_before"]["count"] == 8 and first["eval_after"]["count"] == 8
    evals = sorted(p.name for p in (tmp_path / "grpo" / "eval").glob("*.json"))
    assert evals == ["after.json", "before.json", "step_000001.json"]
    built = list((cache / "warmstart").iterdir())
    assert len(built) == 1
    for algo in ("stratified_grpo", "ppo", "so_ppo", "so_grpo"):
        summary = _run(
            tmp_path, algo, [f"algo.name={algo}", "trainer.steps=1", "trainer.eval_every=0", "eval.before_after=false"]
        )
        assert summary["steps"] == 1 and "sft" not in summary  # warm start reused, not rebuilt
        assert summary["algo"] == algo
    assert list((cache / "warmstart").iterdir()) == built
