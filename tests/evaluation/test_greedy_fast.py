"""The greedy eval's default path (bigger batches, the prompt template computed once) gives the reference path's
tokens: the same per-question scores and the same transcripts, turn by turn, on the tiny random model over the
SmolLM2 tokenizer and on the lab's word-level model, both on the real synthetic task with BM25."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from stratarl.evaluation import greedy
from stratarl.models import output_head
from stratarl.rollout import prefix_cache
from stratarl.rollout.prefix_cache import common_prefix_length

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
SMALL_TASK = (
    "data.synthetic.options={size: 150, num_train: 20, num_test: 12, hop_mix: [0.3, 0.7, 0.0], guessable: none}"
)


def _setup(tmp_path, config: str, extra: list[str]):
    from stratarl.trainer.config import load_config
    from stratarl.trainer.setup import build_task_retriever, eval_settings, load_policy, load_task

    cfg = load_config(
        CONFIGS / config,
        [f"data.synthetic.cache_dir={tmp_path / 'kb'}", SMALL_TASK, "eval.batch_size=4", *extra],
    )
    task = load_task(cfg)
    model, tokenizer = load_policy(cfg.model, seed=0, task=task)
    with torch.no_grad():  # large weights: a random model whose greedy text varies from token to token
        generator = torch.Generator().manual_seed(1)
        for p in model.parameters():
            if p.dim() == 2:
                p.copy_(torch.randn(p.shape, generator=generator) * 0.5)
        # EOS's logit 2.2x as spread as any other's: it wins at a few percent of positions, so rows end at
        # different tokens (stop_on_eos) and leave the batch at different steps.
        output_head(model).weight[tokenizer.eos_token_id] *= 2.2
    return model, tokenizer, build_task_retriever(cfg, task), task.test, eval_settings(cfg)


def _shared_prefix_calls(monkeypatch) -> list[int]:
    calls: list[int] = []
    real = prefix_cache.sequence_cache

    def spy(decoder, tokens, rows):
        calls.append(len(tokens))
        return real(decoder, tokens, rows)

    monkeypatch.setattr(prefix_cache, "sequence_cache", spy)
    return calls


@pytest.mark.parametrize(
    ("config", "extra"),
    [
        (
            "tiny.yaml",
            ["rollout.max_turns=2", "rollout.stop_on_eos=true"],
        ),  # the tiny random model over the SmolLM2 tokenizer
        (
            "lab.yaml",
            [SMALL_TASK[:-1] + ", name_pool: 1000}", "model.tiny_copy_init=0.0", "rollout.stop_on_eos=false"],
        ),  # the lab's word-level model, its prompt and budgets
    ],
)
def test_default_path_gives_the_reference_tokens(tmp_path, monkeypatch, config, extra):
    model, tokenizer, retriever, questions, settings = _setup(tmp_path, config, extra)
    calls = _shared_prefix_calls(monkeypatch)
    reference = greedy.evaluate(model, tokenizer, retriever, questions, settings, num_transcripts=12, reference=True)
    assert calls == []  # the reference never shares a prefix
    fast = greedy.evaluate(model, tokenizer, retriever, questions, settings, num_transcripts=12)
    # Wiring: the default path ran all 12 questions as one batch (3 reference batches of 4) and computed the
    # template once, as long as the questions' common prefix.
    assert len(calls) == 1 and calls[0] >= 8
    assert fast["per_question"] == reference["per_question"]
    assert [t["turns"] for t in fast["transcripts"]] == [t["turns"] for t in reference["transcripts"]]
    assert [t["response_tokens"] for t in fast["transcripts"]] == [
        t["response_tokens"] for t in reference["transcripts"]
    ]
    turns = [len(t["turns"]) for t in reference["transcripts"]]
    assert max(turns) >= 2  # the later turns read a kept prefix: the multi-turn path is covered
    lengths = {t["response_tokens"] for t in reference["transcripts"]}
    assert len(lengths) > 1  # rows end at different times: finished rows leave the batch


def test_common_prefix_length_leaves_every_row_a_token():
    assert common_prefix_length([[1, 2, 3, 4], [1, 2, 3, 5], [1, 2, 9]]) == 2
    assert common_prefix_length([[1, 2, 3], [1, 2, 3]]) == 2  # identical prompts keep their last token
    assert common_prefix_length([[7], [7, 8]]) == 0
    assert common_prefix_length([]) == 0
