"""The synthetic knowledge-base task, generated from a seed on first use and cached.

``stratarl.data.synth`` writes corpus.jsonl + train/test parquet into a cache
folder, published by rename (stratarl.publish: a crash never leaves a half-written
task that later runs would trust); later runs read the files.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from stratarl.data.search_r1 import load_examples
from stratarl.data.synth import generate_knowledge_base, name_pool_words, write_synthetic_kb
from stratarl.publish import staged_dir
from stratarl.trainer.task import TaskData


def _complete(directory: Path) -> bool:
    return (directory / "test.parquet").is_file() and (directory / "corpus.jsonl").is_file()


def ensure_synthetic_kb(directory: Path, *, seed: int, options: dict[str, Any]) -> Path:
    """Generate the KB into ``directory`` unless it is already there; return the folder."""
    directory = Path(directory)
    if _complete(directory):
        return directory
    try:
        kb = generate_knowledge_base(seed=seed, **options)
    except TypeError as error:
        raise ValueError(
            f"data.synthetic.options {options!r} do not fit generate_knowledge_base: {error}. "
            "Fix: use its keyword arguments (size, num_train, num_test, hop_mix, guessable, ...; "
            "see `stratarl data synth --help`)"
        ) from None
    # Another process (a parallel run) may publish the same task first: a complete one is kept.
    with staged_dir(directory, keep_existing=_complete) as tmp:
        write_synthetic_kb(kb, tmp)
    return directory


def load_synthetic_task(directory: Path, *, seed: int, options: dict[str, Any]):
    """TaskData (train, test, corpus path) of the seeded synthetic KB."""
    folder = ensure_synthetic_kb(directory, seed=seed, options=options)
    # The files' prompt column is our own Search-R1 rendering: drop it, so rollout.prompt_template decides.
    train, test = (
        [dataclasses.replace(e, prompt=None) for e in load_examples(folder / f"{split}.parquet")]
        for split in ("train", "test")
    )
    # A shared name pool is part of the vocabulary: a warm start trained on other worlds of the
    # same pool then meets no unknown word here.
    pool = options.get("name_pool")
    vocabulary = [" ".join(name_pool_words(int(pool)))] if pool else []
    return TaskData(train=train, test=test, corpus_path=folder / "corpus.jsonl", vocabulary_texts=vocabulary)
