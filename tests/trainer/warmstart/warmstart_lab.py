"""The lab at a test's size (a word-level tiny model, worlds from a shared name pool), shared by the warm
start's tests; ``lab_sections`` gives a variant with some sections' fields replaced, ``mask_runs`` cuts a loss
mask into its runs."""

from __future__ import annotations

import json

POOL = 300
LAB = {
    "model": {
        "name": "word-tiny",
        "tiny_hidden_size": 32,
        "tiny_num_layers": 2,
        "tiny_num_heads": 2,
        "tiny_intermediate_size": 64,
    },
    "data": {
        "source": "synthetic",
        "max_eval_examples": 6,
        "synthetic": {
            "seed": 0,
            "options": {
                "size": 120,
                "num_train": 30,
                "num_test": 6,
                "hop_mix": [0.5, 0.5, 0.0],
                "guessable": "none",
                "name_pool": POOL,
            },
        },
    },
    "retrieval": {"spec": "bm25", "topk": 2},
    "rollout": {
        "group_size": 2,
        "max_turns": 2,
        "max_tokens_per_turn": 24,
        "max_obs_tokens": 64,
        "max_total_tokens": 512,
    },
    "algo": {"name": "grpo", "kl_coef": 0.0},
    "trainer": {"steps": 1, "prompts_per_step": 2, "num_threads": 1, "micro_batch_tokens": 4096},
    "sft": {
        "enabled": True,
        "source": "worlds",
        "steps": 3,
        "batch_size": 4,
        "lr": 1e-3,
        "world_options": {"size": 100, "num_train": 20},
        "early_answer_fraction": 0.5,
    },
    "eval": {"before_after": False, "batch_size": 6},
    "logging": {"tensorboard": False, "progress": False, "num_transcripts": 0},
}


def lab_sections(**sections) -> dict:
    """A deep copy of LAB with the named sections' fields updated (``lab_sections(sft={"steps": 2})``)."""
    data = json.loads(json.dumps(LAB))
    for key, value in sections.items():
        data[key] = {**data[key], **value}
    return data


def mask_runs(mask):
    """Maximal runs of equal loss-mask values: [(value, start, end), ...]."""
    out, start = [], 0
    for i in range(1, len(mask) + 1):
        if i == len(mask) or mask[i] != mask[start]:
            out.append((mask[start], start, i))
            start = i
    return out
