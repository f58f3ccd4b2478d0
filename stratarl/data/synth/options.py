"""Multiple-choice questions (``generate_knowledge_base(multiple_choice=N)``): each question's gold answer
among N - 1 wrong answers of the same kind, drawn from their own RNG so a world with and without options
has the same corpus and questions."""

from __future__ import annotations

import dataclasses
import random

from stratarl.data.examples import Example
from stratarl.data.multiple_choice import LETTERS
from stratarl.data.synth.names import OCCUPATIONS
from stratarl.data.synth.questions import FAMILIES
from stratarl.data.synth.world import World

# The kind of entity each relation's answer names: the pool a multiple-choice question's wrong options come from.
ANSWER_KINDS = {
    "birthplace": "city",
    "headquarters": "city",
    "employer": "org",
    "publisher": "org",
    "founder": "person",
    "creator": "person",
    "country": "country",
    "occupation": "occupation",
}


def _answer_pools(world: World) -> dict[str, list[str]]:
    """Every name of each answer kind: the pools wrong options are drawn from."""
    return {
        "city": world.city_names,
        "org": world.org_names,
        "person": world.person_names,
        "country": world.countries,
        "occupation": list(OCCUPATIONS),
    }


def with_options(example: Example, pools: dict[str, list[str]], rng: random.Random, num_options: int) -> Example:
    """``example`` as a multiple-choice question: its answer among ``num_options - 1`` distinct wrong
    answers of the same kind, in random order; golds = (letter, answer text)."""
    answer = example.golden_answers[0]
    pool = pools[ANSWER_KINDS[FAMILIES[example.metadata["family"]].relations[-1]]]
    wrong: list[str] = []
    while len(wrong) < num_options - 1:
        candidate = pool[rng.randrange(len(pool))]
        if candidate != answer and candidate not in wrong:
            wrong.append(candidate)
    texts = [answer, *wrong]
    rng.shuffle(texts)
    options = dict(zip(LETTERS, texts))
    letter = LETTERS[texts.index(answer)]
    metadata = {**example.metadata, "options": options, "answer_letter": letter}
    return dataclasses.replace(example, golden_answers=(letter, answer), metadata=metadata)


def add_options(
    world: World, questions: dict[str, list[Example]], seed: int, num_options: int
) -> dict[str, list[Example]]:
    """Every question of ``questions`` (split -> examples) with ``num_options`` options, drawn from an RNG of
    its own (seeded from ``seed``), so adding options changes neither the corpus nor the questions."""
    if not 2 <= num_options <= len(LETTERS):
        raise ValueError(
            f"multiple_choice={num_options}: a multiple-choice question needs 2 to {len(LETTERS)} options "
            "(0 turns options off)"
        )
    pools = _answer_pools(world)
    used = {ANSWER_KINDS[FAMILIES[e.metadata["family"]].relations[-1]] for es in questions.values() for e in es}
    for kind in sorted(used):
        if len(set(pools[kind])) < num_options:
            raise ValueError(
                f"multiple_choice={num_options}: only {len(set(pools[kind]))} distinct {kind} names to "
                f"draw options from; use fewer options or a larger world (num_countries for countries)"
            )
    rng = random.Random(f"{seed}:multiple_choice")
    return {split: [with_options(e, pools, rng, num_options) for e in es] for split, es in questions.items()}
