"""The hermes protocol with both tools through the real loop: the tiny Llama over SmolLM2's tokenizer
(configs/tiny.yaml), BM25 on the synthetic corpus, one RL step and the eval."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from stratarl.trainer.config import load_config
from stratarl.trainer.rl import train

TINY = Path(__file__).resolve().parents[2] / "configs" / "tiny.yaml"


@pytest.mark.slow
def test_hermes_with_search_and_open_trains_a_step(tmp_path, tiny_overrides):
    cfg = load_config(
        TINY,
        [
            *tiny_overrides,
            "rollout.protocol=hermes",
            "rollout.tools=[search,open]",
            "rollout.tool_params.open.max_calls=1",
            "algo.stratum_key=tool_calls",
            "trainer.steps=1",
            "rollout.max_tokens_per_turn=24",
        ],
    )
    run_dir = tmp_path / "hermes"
    assert train(cfg, run_dir)["steps"] == 1
    (row,) = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    for key in (
        "tools/search/calls_mean",
        "tools/open/calls_mean",
        "tools/open/over_budget",
        "rollout/malformed_calls",
    ):
        assert isinstance(row[key], float) and math.isfinite(row[key]), key
    records = [json.loads(line) for line in (run_dir / "transcripts" / "step_000001.jsonl").read_text().splitlines()]
    prompt = records[0]["prompt"]
    # The tools reached the prompt in Qwen2.5's format, and the user turn speaks the JSON protocol, not the tags.
    assert prompt.startswith("<|im_start|>system\nYou are a helpful assistant.\n\n# Tools\n")
    assert '"name": "open"' in prompt and "<search> query </search>" not in prompt
    assert prompt.endswith("<|im_start|>assistant\n")
    assert all("calls" in r for r in records)
