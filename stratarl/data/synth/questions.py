"""The questions: fixed families (``FAMILIES``), each a chain of 1 to 3 relation hops from a subject
entity, every hop answered by exactly one entity passage; and the seeded draw of distinct
(family, subject) pairs by question type."""

from __future__ import annotations

import random
from typing import NamedTuple

from stratarl.data.examples import Example
from stratarl.data.synth.names import OCCUPATIONS, WORK_KINDS
from stratarl.data.synth.world import World

QUESTION_TYPES = ("single_hop", "multi_hop_2", "multi_hop_3")

Hop = tuple[str, str, str, str, int]  # query, passage kind, answer, next kind, next index


def _hop(world: World, relation: str, index: int) -> Hop:
    """One retrieval step: the query a good searcher writes, and where the answer is."""
    w = world
    if relation == "birthplace":
        c = w.person_city[index]
        return f"Where was {w.person_names[index]} born?", "person", w.city_names[c], "city", c
    if relation == "occupation":
        return f"What was the occupation of {w.person_names[index]}?", "person", w.person_occupation[index], "", -1
    if relation == "employer":
        o = w.person_employer[index]
        return f"Which organisation did {w.person_names[index]} work for?", "person", w.org_names[o], "org", o
    if relation == "founder":
        p = w.org_founder[index]
        return f"Who founded {w.org_names[index]}?", "org", w.person_names[p], "person", p
    if relation == "headquarters":
        c = w.org_hq[index]
        return f"Where is {w.org_names[index]} headquartered?", "org", w.city_names[c], "city", c
    if relation == "creator":
        p, kind = w.work_creator[index], w.work_kind[index]
        return f"Who {WORK_KINDS[kind][1]} the {kind} {w.work_titles[index]}?", "work", w.person_names[p], "person", p
    if relation == "publisher":
        o, kind = w.work_publisher[index], w.work_kind[index]
        return f"Who published the {kind} {w.work_titles[index]}?", "work", w.org_names[o], "org", o
    if relation == "country":
        k = w.city_country[index]
        return f"Which country is {w.city_names[index]} in?", "city", w.countries[k], "country", k
    raise ValueError(f"unknown relation {relation!r}")


class Family(NamedTuple):
    """A question family: a relation chain from a subject entity, and its question text.

    ``template`` is filled with ``_subject_fields``: {name} (the subject's name or
    title), and for works {kind} and {creator} ("author", "director", ...).
    ``answer_set`` names the small closed set a guessable family answers from.
    """

    question_type: str
    subject: str
    relations: tuple[str, ...]
    template: str
    answer_set: str | None = None


_WORK = "the {kind} {name}"
_CREATOR = "the {creator} of the {kind} {name}"
FAMILIES: dict[str, Family] = {
    "person_birthplace": Family("single_hop", "person", ("birthplace",), "Where was {name} born?"),
    "person_occupation": Family(
        "single_hop", "person", ("occupation",), "What was the occupation of {name}?", "occupation"
    ),
    "person_employer": Family("single_hop", "person", ("employer",), "Which organisation did {name} work for?"),
    "org_founder": Family("single_hop", "org", ("founder",), "Who founded {name}?"),
    "org_headquarters": Family("single_hop", "org", ("headquarters",), "In which city is {name} headquartered?"),
    "work_creator": Family("single_hop", "work", ("creator",), "Who {verb} " + _WORK + "?"),
    "work_publisher": Family("single_hop", "work", ("publisher",), "Which company published " + _WORK + "?"),
    "city_country": Family("single_hop", "city", ("country",), "In which country is {name}?", "country"),
    "org_founder_birthplace": Family(
        "multi_hop_2", "org", ("founder", "birthplace"), "Where was the founder of {name} born?"
    ),
    "work_creator_birthplace": Family(
        "multi_hop_2", "work", ("creator", "birthplace"), "Where was " + _CREATOR + " born?"
    ),
    "work_publisher_founder": Family(
        "multi_hop_2", "work", ("publisher", "founder"), "Who founded the company that published " + _WORK + "?"
    ),
    "person_employer_headquarters": Family(
        "multi_hop_2",
        "person",
        ("employer", "headquarters"),
        "In which city is the organisation that {name} worked for headquartered?",
    ),
    "person_birth_country": Family(
        "multi_hop_2", "person", ("birthplace", "country"), "In which country was {name} born?", "country"
    ),
    "org_headquarters_country": Family(
        "multi_hop_2", "org", ("headquarters", "country"), "In which country is {name} headquartered?", "country"
    ),
    "org_founder_birth_country": Family(
        "multi_hop_3",
        "org",
        ("founder", "birthplace", "country"),
        "In which country was the founder of {name} born?",
        "country",
    ),
    "work_creator_birth_country": Family(
        "multi_hop_3",
        "work",
        ("creator", "birthplace", "country"),
        "In which country was " + _CREATOR + " born?",
        "country",
    ),
    "work_publisher_founder_birthplace": Family(
        "multi_hop_3",
        "work",
        ("publisher", "founder", "birthplace"),
        "Where was the founder of the company that published " + _WORK + " born?",
    ),
    "work_creator_employer_headquarters": Family(
        "multi_hop_3",
        "work",
        ("creator", "employer", "headquarters"),
        "In which city is the organisation that " + _CREATOR + " worked for headquartered?",
    ),
}


def _subject_fields(world: World, kind: str, index: int) -> dict[str, str]:
    """The fields a family's ``template`` is filled with for subject ``index`` of ``kind``."""
    if kind == "work":
        work_kind = world.work_kind[index]
        _, verb, creator = WORK_KINDS[work_kind]
        return {"name": world.work_titles[index], "kind": work_kind, "verb": verb, "creator": creator}
    names = {"person": world.person_names, "org": world.org_names, "city": world.city_names}[kind]
    return {"name": names[index]}


def make_question(world: World, family: str, subject: int, *, example_id: str, split: str, data_source: str) -> Example:
    """Walk the family's relation chain from ``subject``; record every hop."""
    spec = FAMILIES[family]
    hops, current = [], subject
    for relation in spec.relations:
        query, passage_kind, answer, _, next_index = _hop(world, relation, current)
        hops.append({"query": query, "passage_id": world.passage_of[(passage_kind, current)], "answer": answer})
        current = next_index
    sizes = {"country": len(world.countries), "occupation": len(OCCUPATIONS)}
    return Example(
        id=example_id,
        question=spec.template.format(**_subject_fields(world, spec.subject, subject)),
        golden_answers=(hops[-1]["answer"],),
        data_source=data_source,
        metadata={
            "question_type": spec.question_type,
            "family": family,
            "hops": hops,
            "guessable": spec.answer_set is not None,
            "answer_set_size": sizes[spec.answer_set] if spec.answer_set else None,
            "split": split,
        },
    )


def _families(guessable: str) -> dict[str, list[str]]:
    """Question type -> the families ``guessable`` keeps: "any", "only" the guessable ones, or "none" of them."""
    if guessable not in ("any", "only", "none"):
        raise ValueError(f"guessable must be 'any', 'only' or 'none', got {guessable!r}")
    chosen: dict[str, list[str]] = {t: [] for t in QUESTION_TYPES}
    for name, spec in FAMILIES.items():
        if guessable == "any" or (guessable == "only") == (spec.answer_set is not None):
            chosen[spec.question_type].append(name)
    return chosen


def sample_questions(
    world: World, rng: random.Random, count: int, *, hop_mix: tuple[float, ...], guessable: str
) -> list[tuple[str, int]]:
    """``count`` distinct (family, subject) pairs: question type drawn by ``hop_mix``
    (weights for single_hop, multi_hop_2, multi_hop_3), then a family, then a subject."""
    if len(hop_mix) != 3 or any(x < 0 for x in hop_mix) or sum(hop_mix) <= 0:
        raise ValueError(f"hop_mix must be 3 non-negative weights (single, 2-hop, 3-hop), got {hop_mix}")
    families = _families(guessable)
    weights = [w if families[t] else 0.0 for t, w in zip(QUESTION_TYPES, hop_mix)]
    if sum(weights) <= 0:
        raise ValueError(f"no question family fits hop_mix={hop_mix} and guessable={guessable!r}")
    population = {
        "person": len(world.person_names),
        "org": len(world.org_names),
        "work": len(world.work_titles),
        "city": len(world.city_names),
    }
    capacity = sum(
        population[FAMILIES[f].subject] for t, w in zip(QUESTION_TYPES, weights) if w > 0 for f in families[t]
    )
    if count > capacity // 2:
        raise ValueError(
            f"asked for {count} questions but this world supports about {capacity // 2}; use a larger size"
        )
    chosen: list[tuple[str, int]] = []
    seen: set[tuple[str, int]] = set()
    while len(chosen) < count:
        question_type = rng.choices(QUESTION_TYPES, weights=weights)[0]
        family = rng.choice(families[question_type])
        pair = (family, rng.randrange(population[FAMILIES[family].subject]))
        if pair not in seen:
            seen.add(pair)
            chosen.append(pair)
    return chosen
