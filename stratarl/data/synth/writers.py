"""``write_synthetic_kb``: a generated benchmark as files (corpus.jsonl, train / test parquet in the
Search-R1 formats, stats.json, and a README.md that says how to regenerate it)."""

from __future__ import annotations

import json
from pathlib import Path

from stratarl.data.search_r1 import write_search_r1_parquet
from stratarl.data.synth.knowledge_base import SyntheticKB
from stratarl.retrieval.corpus import write_corpus


def write_synthetic_kb(kb: SyntheticKB, out_dir: str | Path) -> dict[str, Path]:
    """Write corpus.jsonl, train.parquet, test.parquet, stats.json and README.md into ``out_dir``."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = {
        "corpus": write_corpus(kb.passages, out / "corpus.jsonl"),
        "train": write_search_r1_parquet(kb.train, out / "train.parquet", split="train"),
        "test": write_search_r1_parquet(kb.test, out / "test.parquet", split="test"),
        "stats": out / "stats.json",
        "readme": out / "README.md",
    }
    paths["stats"].write_text(json.dumps({"config": kb.config, **kb.stats}, indent=2) + "\n", encoding="utf-8")
    paths["readme"].write_text(_readme(kb), encoding="utf-8")
    return paths


def _synth_command(config: dict) -> str:
    """The CLI line that regenerates this KB (entity-count overrides and ``name_pool`` are Python-only)."""
    c = config
    return (
        f"stratarl data synth --out DIR --seed {c['seed']} --size {c['size']} --num-train {c['num_train']} "
        f"--num-test {c['num_test']} --num-countries {c['num_countries']} --guessable {c['guessable']} "
        f"--hop-mix {','.join(f'{w:g}' for w in c['hop_mix'])}"
        + (f" --multiple-choice {c['multiple_choice']}" if c.get("multiple_choice") else "")
    )


def _readme(kb: SyntheticKB) -> str:
    """README.md: what the files hold, how to regenerate them, and one question with its hops."""
    sample = kb.train[0] if kb.train else None
    lines = [
        "# Synthetic knowledge-base benchmark (stratarl data synth)",
        "",
        (
            "A fictional world: every name is invented, so a model can only answer by searching "
            "(except guessable families, whose answers come from a small set)."
        ),
        "",
        f"- corpus.jsonl: {kb.stats['passages']} passages (Search-R1 corpus format)",
        (
            f"- train.parquet: {len(kb.train)} questions; test.parquet: {len(kb.test)} (Search-R1 format; "
            "each row's `metadata` JSON holds question_type, family, hops, guessable, answer_set_size)"
        ),
        f"- regenerate: `{_synth_command(kb.config)}` (all arguments in stats.json)",
    ]
    if sample is not None:
        lines += ["", "Example:", "", f"    Q: {sample.question}", f"    A: {sample.golden_answers[0]}"]
        lines += [
            f"    hop {i + 1}: {hop['query']} -> passage {hop['passage_id']} -> {hop['answer']}"
            for i, hop in enumerate(sample.metadata["hops"])
        ]
    return "\n".join(lines) + "\n"
