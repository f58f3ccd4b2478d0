"""``generate_knowledge_base``: a world, its corpus and its train / test questions from one seed."""

from __future__ import annotations

import random
from collections import Counter
from dataclasses import dataclass

from stratarl.data.examples import Example
from stratarl.data.synth.names import ORG_KINDS, name_pool_words
from stratarl.data.synth.options import add_options
from stratarl.data.synth.passages import render_passages
from stratarl.data.synth.questions import make_question, sample_questions
from stratarl.data.synth.world import World, build_world
from stratarl.retrieval.base import Passage

# Bumped whenever the same arguments would generate a different world, so caches
# keyed by (SYNTH_VERSION, arguments) never serve an outdated benchmark.
SYNTH_VERSION = 1
SIZE_PRESETS = {"small": 500, "medium": 10_000, "large": 100_000}


@dataclass
class SyntheticKB:
    """A generated benchmark: the corpus, the question splits, the arguments and counts."""

    passages: list[Passage]
    train: list[Example]
    test: list[Example]
    config: dict
    stats: dict


def generate_knowledge_base(
    *,
    seed: int = 0,
    size: str | int = "small",
    num_people: int | None = None,
    num_cities: int | None = None,
    num_orgs: int | None = None,
    num_works: int | None = None,
    num_countries: int = 5,
    num_train: int | None = None,
    num_test: int | None = None,
    hop_mix: tuple[float, ...] = (0.4, 0.4, 0.2),
    guessable: str = "any",
    data_source: str | None = None,
    name_pool: int | None = None,
    multiple_choice: int = 0,
    shared_countries: bool = False,
) -> SyntheticKB:
    """Generate a fictional world, its corpus and train/test questions.

    ``size`` ("small" ~500 passages, "medium" ~10k, "large" ~100k, or a number) sets
    the entity counts (42% people, 25% works, 15% organisations, 10% cities, 8%
    surname-page distractors); ``num_*`` override them. ``num_countries`` is the
    answer-set size of the country families; ``guessable`` keeps "any" family, "only"
    the guessable ones (small answer set) or "none" of them. Questions: train and
    test hold distinct (family, subject) pairs. ``name_pool`` (a number of words) draws
    every name from the shared pool ``name_pool_words(name_pool)``: worlds of different
    seeds then share one vocabulary but no facts, so a model warm-started on some worlds
    meets no unknown word in another and can only answer by reading (docs/lab.md).
    ``multiple_choice`` (0: off) makes every question an N-option multiple-choice question
    (see ``stratarl.data.synth``); ``data_source`` defaults to "synthkb", or "synthetic_mc" with options.
    ``shared_countries`` (with ``name_pool``) gives every world the same country names (the pool's first
    ``num_countries`` words): a country guessed from other worlds can then be right in this one, which makes
    the guessable families a real shortcut for a warm start trained on other worlds.
    """
    data_source = data_source or ("synthetic_mc" if multiple_choice else "synthkb")
    if num_countries < 2:
        raise ValueError(f"num_countries must be >= 2, got {num_countries}")
    total = _sizes(size)
    counts = _entity_counts(
        total, num_countries, num_people=num_people, num_works=num_works, num_orgs=num_orgs, num_cities=num_cities
    )
    num_train = num_train if num_train is not None else min(20_000, max(100, total // 5))
    num_test = num_test if num_test is not None else min(2_000, max(50, total // 20))
    rng = random.Random(seed)
    pool = name_pool_words(name_pool) if name_pool is not None else None
    world = build_world(rng, num_countries=num_countries, name_pool=pool, shared_countries=shared_countries, **counts)
    passages = render_passages(world, rng, num_distractors=max(0, total - sum(counts.values()) - num_countries))
    pairs = sample_questions(world, rng, num_train + num_test, hop_mix=hop_mix, guessable=guessable)
    questions = _questions(world, {"test": pairs[:num_test], "train": pairs[num_test:]}, data_source)
    if multiple_choice:
        questions = add_options(world, questions, seed, multiple_choice)
    config = {
        "version": SYNTH_VERSION,
        "seed": seed,
        "size": size,
        **counts,
        "num_countries": num_countries,
        "num_train": num_train,
        "num_test": num_test,
        "hop_mix": list(hop_mix),
        "guessable": guessable,
        "data_source": data_source,
        **({"name_pool": name_pool} if name_pool is not None else {}),
        **({"multiple_choice": multiple_choice} if multiple_choice else {}),
        **({"shared_countries": True} if shared_countries else {}),
    }
    return SyntheticKB(
        passages=passages,
        train=questions["train"],
        test=questions["test"],
        config=config,
        stats=_stats(world, passages, questions),
    )


def _sizes(size: str | int) -> int:
    """The number of passages ``size`` (a preset name, a number, or a number as text) stands for."""
    if isinstance(size, str) and size.isdigit():
        size = int(size)
    if isinstance(size, int):
        if size < 50:
            raise ValueError(f"size must be at least 50 passages, got {size}")
        return size
    if size not in SIZE_PRESETS:
        raise ValueError(f"unknown size {size!r}; use one of {sorted(SIZE_PRESETS)} or a number of passages (>= 50)")
    return SIZE_PRESETS[size]


def _entity_counts(total: int, num_countries: int, **overrides: int | None) -> dict[str, int]:
    """``num_people``, ``num_works``, ``num_orgs``, ``num_cities`` for ``total`` passages (an override
    that is not None wins), each checked against the smallest world the generator can build."""
    counts = {
        "num_people": overrides["num_people"] or max(10, round(0.42 * total)),
        "num_works": overrides["num_works"] or max(8, round(0.25 * total)),
        "num_orgs": overrides["num_orgs"] or max(len(ORG_KINDS), round(0.15 * total)),
        "num_cities": overrides["num_cities"] or max(num_countries, round(0.10 * total)),
    }
    minimum = {"num_people": 10, "num_works": 1, "num_orgs": len(ORG_KINDS), "num_cities": num_countries}
    for name, value in counts.items():
        if value < minimum[name]:
            raise ValueError(f"{name}={value} is too small: it must be >= {minimum[name]}")
    return counts


def _questions(world: World, splits: dict[str, list[tuple[str, int]]], data_source: str) -> dict[str, list[Example]]:
    """Split -> its questions, one per (family, subject) pair, with ids "<data_source>-<split>-<i>"."""
    return {
        split: [
            make_question(
                world, family, subject, example_id=f"{data_source}-{split}-{i}", split=split, data_source=data_source
            )
            for i, (family, subject) in enumerate(chosen)
        ]
        for split, chosen in splits.items()
    }


def _stats(world: World, passages: list[Passage], questions: dict[str, list[Example]]) -> dict:
    """The counts stats.json records: passages by kind, and each split's questions."""
    kinds = Counter(kind for kind, _ in world.passage_of)
    return {
        "passages": len(passages),
        "entity_passages": dict(sorted(kinds.items())),
        "distractor_passages": len(passages) - len(world.passage_of),
        **{f"{split}_questions": _question_stats(examples) for split, examples in questions.items()},
    }


def _question_stats(examples: list[Example]) -> dict:
    return {
        "total": len(examples),
        "by_type": dict(sorted(Counter(e.metadata["question_type"] for e in examples).items())),
        "by_family": dict(sorted(Counter(e.metadata["family"] for e in examples).items())),
        "guessable": sum(e.metadata["guessable"] for e in examples),
    }
