"""End to end on the tiny model: every algorithm through the real loop (engine, BM25 on a small
synthetic corpus), exact resume, and the warm start."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from stratarl.trainer.config import load_config
from stratarl.trainer.rl import train

TINY = Path(__file__).resolve().parents[2] / "configs" / "tiny.yaml"

pytestmark = pytest.mark.slow


def _initial_params(cfg):
    from stratarl.trainer.setup import load_policy

    model, _ = load_policy(cfg.model, seed=cfg.trainer.seed)
    return {k: v.clone() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("algo", ["grpo", "stratified_grpo", "ppo", "so_ppo", "so_grpo"])
def test_every_algorithm_trains(algo, tmp_path, tiny_overrides):
    cfg = load_config(TINY, [*tiny_overrides, f"algo.name={algo}"])
    summary = train(cfg, tmp_path / algo)
    assert summary["steps"] == 2
    rows = [json.loads(line) for line in (tmp_path / algo / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    for row in rows:
        for key in (
            "loss/policy",
            "loss/entropy",
            "loss/clip_frac",
            "optim/grad_norm",
            "reward/mean",
            "rollout/search_calls_mean",
            "time/generation",
            "time/update",
            "perf/update_tokens_per_s",
        ):
            assert isinstance(row[key], float) and math.isfinite(row[key]), (key, row.get(key))
        if algo not in ("ppo", "so_ppo"):  # group advantages: all groups flat -> all advantages 0 (GAE's need not be)
            assert row["reward/flat_group_frac"] < 1.0 or row["advantage/std"] == 0.0
    if algo in ("so_ppo", "so_grpo"):
        assert all("sorl/c_norm" in r and "sorl/scale" in r and "loss/clip_frac_turn" in r for r in rows)
    if algo in ("ppo", "so_ppo"):
        assert all(math.isfinite(r["loss/value"]) for r in rows)
        assert all(math.isfinite(r["critic/vpred_mean"]) for r in rows)
    assert all(0.0 <= r["advantage/negative_mass_share"] <= 1.0 for r in rows)
    final = load_file(str(tmp_path / algo / "checkpoints" / "step_000002" / "model.safetensors"))
    initial = _initial_params(cfg)
    changed = [k for k, v in final.items() if not torch.equal(v, initial[k])]
    assert changed, "no parameter changed in 2 steps"
    assert (tmp_path / algo / "transcripts" / "step_000002.jsonl").is_file()
    assert list((tmp_path / algo / "tensorboard").glob("events.out.tfevents.*"))


@pytest.mark.parametrize("advantage", ["reinforce", "grpo_positive"])
def test_estimators_without_negative_advantages_train(advantage, tmp_path, tiny_overrides):
    cfg = load_config(TINY, [*tiny_overrides, "algo.name=grpo", f"algo.advantage={advantage}"])
    train(cfg, tmp_path / advantage)
    rows = [json.loads(line) for line in (tmp_path / advantage / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    for row in rows:  # the update trained on these advantages: none is negative, so no mass pushes a token down
        assert row["advantage/min"] >= 0.0 and row["advantage/negative_mass_share"] == 0.0
    if advantage == "reinforce":  # A = R: the advantages' range is the rewards' range
        assert any(r["advantage/max"] > 0.0 for r in rows) and all(r["reward/mean"] >= 0.0 for r in rows)


def test_resume_is_exact(tmp_path, tiny_overrides):
    # 4 steps straight vs 2 steps + resume + 2 steps: identical parameters, bit for bit.
    base = [*tiny_overrides, "trainer.prompts_per_step=2", "trainer.mini_batches=2", "algo.kl_coef=0.01"]
    straight = load_config(TINY, [*base, "trainer.steps=4"])
    train(straight, tmp_path / "straight")
    first = load_config(TINY, [*base, "trainer.steps=2"])
    train(first, tmp_path / "resumed")
    second = load_config(tmp_path / "resumed" / "config.yaml", ["trainer.steps=4"])
    summary = train(second, tmp_path / "resumed", resume=True)
    assert summary["start_step"] == 2 and summary["steps"] == 4
    a = load_file(str(tmp_path / "straight" / "checkpoints" / "step_000004" / "model.safetensors"))
    b = load_file(str(tmp_path / "resumed" / "checkpoints" / "step_000004" / "model.safetensors"))
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), key
    rows_a = [json.loads(x) for x in (tmp_path / "straight" / "metrics.jsonl").read_text().splitlines()]
    rows_b = [json.loads(x) for x in (tmp_path / "resumed" / "metrics.jsonl").read_text().splitlines()]
    assert [r["reward/mean"] for r in rows_a] == [r["reward/mean"] for r in rows_b]


def test_warm_start_then_train_from_it(tmp_path, tiny_overrides):
    from stratarl.trainer.warmstart.stages import warm_start

    cfg = load_config(TINY, [*tiny_overrides, "sft.num_demos=6", "sft.epochs=2", "sft.batch_size=3"])
    summary = warm_start(cfg, tmp_path / "sft")
    assert summary["num_demos"] == 6 and summary["steps"] == 4
    assert summary["last_epoch_loss"] < summary["first_epoch_loss"]
    model_dir = tmp_path / "sft" / "model"
    assert (model_dir / "config.json").is_file() and list(model_dir.glob("*.safetensors"))
    result = train(
        load_config(TINY, [*tiny_overrides, f"model.init_from={model_dir}", "trainer.steps=1"]), tmp_path / "rl"
    )
    assert result["steps"] == 1


def test_lora_run_uses_the_base_model_as_reference(tmp_path, tiny_overrides):
    pytest.importorskip("peft")
    cfg = load_config(
        TINY,
        [
            *tiny_overrides,
            "algo.name=grpo",
            "model.lora.enabled=true",
            "model.lora.r=4",
            "model.lora.target_modules=[q_proj,v_proj]",
            "algo.kl_coef=0.01",
            "trainer.steps=1",
        ],
    )
    train(cfg, tmp_path / "lora")
    rows = [json.loads(x) for x in (tmp_path / "lora" / "metrics.jsonl").read_text().splitlines()]
    # Two mini-batches: the second optimizer step sees a policy that moved away from the base model.
    assert all(math.isfinite(r["loss/kl"]) for r in rows) and rows[-1]["loss/kl"] > 0
    final = load_file(str(tmp_path / "lora" / "checkpoints" / "step_000001" / "model.safetensors"))
    lora_keys = [k for k in final if "lora_" in k]
    assert lora_keys
    initial = _initial_params(load_config(TINY, tiny_overrides))
    # Only adapters train: every base weight is unchanged.
    for key, value in final.items():
        if "lora_" not in key:
            base_key = key.replace("base_model.model.", "").replace(".base_layer", "")
            assert torch.equal(value, initial[base_key]), key
    assert any(final[k].abs().sum() > 0 for k in lora_keys if "lora_B" in k)


def test_trainable_layers_freeze_everything_below(tmp_path, tiny_overrides):
    cfg = load_config(TINY, [*tiny_overrides, "algo.name=grpo", "model.trainable_layers=1", "trainer.steps=1"])
    train(cfg, tmp_path / "top1")
    final = load_file(str(tmp_path / "top1" / "checkpoints" / "step_000001" / "model.safetensors"))
    initial = _initial_params(cfg)
    changed = {k for k, v in final.items() if not torch.equal(v, initial[k])}
    assert changed and all(k.startswith("model.layers.1.") or k == "model.norm.weight" for k in changed), changed


def test_word_level_model_warm_starts_and_trains(tmp_path, tiny_overrides):
    # model.name=word-tiny: the vocabulary is built from the task's corpus and questions, so every
    # observation and demonstration encodes without [UNK]; SFT, then RL from its output.
    from transformers import AutoTokenizer

    from stratarl.trainer.warmstart.stages import warm_start

    cfg = load_config(TINY, [*tiny_overrides, "model.name=word-tiny", "sft.num_demos=4"])
    warm_start(cfg, tmp_path / "sft", progress=False)
    tokenizer = AutoTokenizer.from_pretrained(str(tmp_path / "sft" / "model"))
    assert tokenizer.unk_token is not None and len(tokenizer) < 5000  # word-level, not SmolLM2's 49k
    rl_cfg = load_config(
        TINY, [*tiny_overrides, "model.name=word-tiny", f"model.init_from={tmp_path / 'sft' / 'model'}"]
    )
    summary = train(rl_cfg, tmp_path / "word")
    assert summary["steps"] == 2
    rows = (tmp_path / "word" / "transcripts" / "step_000002.jsonl").read_text().splitlines()
    assert rows
    for row in rows:
        turns = json.loads(row)["turns"]
        assert turns and all(tokenizer.unk_token not in t["text"] + t.get("observation", "") for t in turns)
