"""A seeded fictional world rendered as a Search-R1 corpus and questions.

The world has countries, cities, organisations, people and works, with
attributes (years, occupations, populations) and relations (born in, works for,
founded by, headquartered in, created by, published by, city in country). Each
entity is one wiki-style passage (Search-R1 corpus format ``"\\"Title\\"\\ntext"``);
surname pages ("Trasva (surname)") are distractors that share name words with
questions but answer none. Organisation names share stems ("Zorvanta Press",
"Zorvanta Records") and people share first names and surnames, so a search has
to be specific.

Questions follow fixed families (see ``FAMILIES``), each a chain of 1 to 3
hops; every hop is answered by exactly one entity passage. Since every name is
invented, a model cannot answer without searching, except for the "guessable"
families whose answer comes from a small set (a country among ``num_countries``,
an occupation among ``len(OCCUPATIONS)``): those let experiments measure how
often guessing without search pays.

With ``multiple_choice=N`` every question becomes an N-option multiple-choice question (data source
``synthetic_mc``): the gold answer among N - 1 wrong options of the same type (cities for a birthplace,
people for a founder, ...), so the options reveal nothing and the right one is found only by searching.

Everything is drawn from one ``random.Random(seed)`` (the options from a second one, so a world with and
without options has the same corpus and questions): the same arguments give the same corpus and
questions, byte for byte.

Modules, in the order generation runs: ``names`` (the template vocabulary and the invented names),
``world`` (entities and relations), ``passages`` (the corpus), ``questions`` (families and the draw of
questions), ``options`` (multiple choice), ``knowledge_base`` (``generate_knowledge_base``), ``writers``
(``write_synthetic_kb``). docs/data.md describes the benchmark.
"""

from __future__ import annotations

from stratarl.data.synth.knowledge_base import SIZE_PRESETS, SYNTH_VERSION, SyntheticKB, generate_knowledge_base
from stratarl.data.synth.names import (
    NAME_POOL_SEED,
    OCCUPATIONS,
    ORG_KINDS,
    TITLE_NOUNS,
    WORK_KINDS,
    name_pool_words,
)
from stratarl.data.synth.options import ANSWER_KINDS, with_options
from stratarl.data.synth.passages import render_passages
from stratarl.data.synth.questions import FAMILIES, QUESTION_TYPES, Family, make_question, sample_questions
from stratarl.data.synth.world import World, build_world
from stratarl.data.synth.writers import write_synthetic_kb

__all__ = [
    "ANSWER_KINDS",
    "FAMILIES",
    "NAME_POOL_SEED",
    "OCCUPATIONS",
    "ORG_KINDS",
    "QUESTION_TYPES",
    "SIZE_PRESETS",
    "SYNTH_VERSION",
    "TITLE_NOUNS",
    "WORK_KINDS",
    "Family",
    "SyntheticKB",
    "World",
    "build_world",
    "generate_knowledge_base",
    "make_question",
    "name_pool_words",
    "render_passages",
    "sample_questions",
    "with_options",
    "write_synthetic_kb",
]
