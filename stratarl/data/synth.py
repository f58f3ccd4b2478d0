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
"""

from __future__ import annotations

import dataclasses
import json
import random
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

from stratarl.data.examples import Example
from stratarl.data.multiple_choice import LETTERS
from stratarl.data.search_r1 import write_search_r1_parquet
from stratarl.retrieval.base import Passage
from stratarl.retrieval.corpus import write_corpus

# Bumped whenever the same arguments would generate a different world, so caches
# keyed by (SYNTH_VERSION, arguments) never serve an outdated benchmark.
SYNTH_VERSION = 1
SIZE_PRESETS = {"small": 500, "medium": 10_000, "large": 100_000}
OCCUPATIONS = (
    "painter", "composer", "architect", "engineer", "novelist", "physician",
    "chemist", "sculptor", "astronomer", "botanist", "poet", "cartographer",
)
# organisation kind -> description; the first four publish works
ORG_KINDS = {
    "Press": "publishing house", "Records": "record label", "Pictures": "film studio", "Games": "game studio",
    "University": "university", "Institute": "research institute", "Bank": "bank", "Company": "trading company",
}
# work kind -> (publisher kind, creator verb, creator noun)
WORK_KINDS = {
    "novel": ("Press", "wrote", "author"),
    "album": ("Records", "recorded", "performer"),
    "film": ("Pictures", "directed", "director"),
    "game": ("Games", "designed", "designer"),
}
_PASSIVE = {"wrote": "written", "recorded": "recorded", "directed": "directed", "designed": "designed"}
TITLE_NOUNS = (
    "Lantern", "River", "Garden", "Mirror", "Harbor", "Winter", "Crown", "Orchard",
    "Tower", "Echo", "Voyage", "Compass", "Meadow", "Ember", "Silence", "Signal",
)
_ONSETS = ("b", "d", "f", "g", "k", "l", "m", "n", "p", "r", "s", "t", "v", "z", "br", "dr", "kr", "tr", "st", "th", "sh", "qu")
_VOWELS = ("a", "e", "i", "o", "u", "a", "e", "i", "o", "u", "ai", "ou")
_CODAS = ("", "", "", "n", "r", "l", "s", "th", "x")
QUESTION_TYPES = ("single_hop", "multi_hop_2", "multi_hop_3")
# Words a generated name must not be: English stopwords (a retriever drops them from
# queries) and words of our own templates (a city called "River" or "Games" would be ambiguous).
_RESERVED = {
    "then", "there", "these", "they", "this", "that", "with", "will", "such", "into", "their", "were", "here",
    "born", "city", "country", "capital", "town", "river", "later", "lived", "founded", "surname", "company",
    "novel", "album", "film", "game", "games", "press", "records", "pictures", "bank", "university", "institute",
    *(noun.lower() for noun in TITLE_NOUNS), *OCCUPATIONS,
}


@dataclass
class World:
    """The entities, as parallel lists indexed by entity number (cheap at 100k scale)."""

    countries: list[str]
    city_names: list[str]
    city_country: list[int]
    city_population: list[int]
    city_settled: list[int]
    org_names: list[str]
    org_kind: list[str]
    org_hq: list[int]
    org_founder: list[int]
    org_founded: list[int]
    person_names: list[str]
    person_surname: list[str]
    person_born: list[int]
    person_died: list[int | None]
    person_city: list[int]
    person_lived: list[int]
    person_occupation: list[str]
    person_employer: list[int]
    work_titles: list[str]
    work_kind: list[str]
    work_creator: list[int]
    work_publisher: list[int]
    work_year: list[int]
    # passage id of each entity, filled in when rendering
    passage_of: dict[tuple[str, int], str] = field(default_factory=dict)


@dataclass
class SyntheticKB:
    """A generated benchmark: the corpus, the question splits, the arguments and counts."""

    passages: list[Passage]
    train: list[Example]
    test: list[Example]
    config: dict
    stats: dict


# --------------------------------------------------------------------------- names


def _unique_words(rng: random.Random, count: int) -> list[str]:
    """``count`` distinct pronounceable capitalised words of 2-3 syllables."""
    words: list[str] = []
    seen: set[str] = set()
    while len(words) < count:
        syllables = 2 if rng.random() < 0.7 else 3  # short names: fewer tokens per name
        word = "".join(rng.choice(_ONSETS) + rng.choice(_VOWELS) for _ in range(syllables)) + rng.choice(_CODAS)
        word = word.capitalize()
        if word not in seen and word.lower() not in _RESERVED:
            seen.add(word)
            words.append(word)
    return words


# Seed of the shared name pool (``name_pool``): fixed, so every knowledge base drawn from a pool of
# the same size uses the same words, and one word-level vocabulary covers all of them.
NAME_POOL_SEED = 20_261_201


def name_pool_words(size: int) -> list[str]:
    """The shared pool of ``size`` invented words (the same list for the same size, in any process)."""
    if size < 50:
        raise ValueError(f"name_pool must be at least 50 words, got {size}")
    return _unique_words(random.Random(NAME_POOL_SEED), size)


def _sizes(size: str | int) -> int:
    if isinstance(size, str) and size.isdigit():
        size = int(size)
    if isinstance(size, int):
        if size < 50:
            raise ValueError(f"size must be at least 50 passages, got {size}")
        return size
    if size not in SIZE_PRESETS:
        raise ValueError(f"unknown size {size!r}; use one of {sorted(SIZE_PRESETS)} or a number of passages (>= 50)")
    return SIZE_PRESETS[size]


# --------------------------------------------------------------------------- the world


def build_world(
    rng: random.Random, *, num_countries: int, num_cities: int, num_orgs: int, num_people: int, num_works: int,
    name_pool: list[str] | None = None,
) -> World:
    """Draw every entity and relation. Publishers exist for every work kind.

    With ``name_pool`` every name word is drawn (without replacement) from that list instead of
    being invented, so worlds of different seeds share one vocabulary but not one fact."""
    num_surnames = max(2, num_people // 3)  # ~3 people per surname: shared-word distractors
    num_first = max(4, num_people // 4)
    num_stems = max(2, (num_orgs * 2) // 3)  # some stems are shared by two organisations
    needed = num_countries + num_cities + num_surnames + num_first + num_stems + num_works
    if name_pool is not None and needed > len(name_pool):
        raise ValueError(f"this world needs {needed} distinct name words but name_pool has {len(name_pool)}; "
                         "use a larger name_pool or a smaller size")
    words = iter(rng.sample(name_pool, needed) if name_pool is not None else _unique_words(rng, needed))
    take = lambda n: [next(words) for _ in range(n)]  # noqa: E731
    countries, cities, surnames, firsts, stems, title_words = (
        take(num_countries), take(num_cities), take(num_surnames), take(num_first), take(num_stems), take(num_works)
    )
    city_country = [i % num_countries if i < num_countries else rng.randrange(num_countries) for i in range(num_cities)]

    kinds = list(ORG_KINDS)
    org_kind = [kinds[i] if i < len(kinds) else rng.choice(kinds) for i in range(num_orgs)]
    org_names, used = [], set()
    for kind in org_kind:
        name = f"{rng.choice(stems)} {kind}"
        while name in used:
            name = f"{rng.choice(stems)} {kind}"
        used.add(name)
        org_names.append(name)

    person_names, person_surname, taken = [], [], set()
    while len(person_names) < num_people:
        first, last = rng.choice(firsts), rng.choice(surnames)
        if (first, last) not in taken:
            taken.add((first, last))
            person_names.append(f"{first} {last}")
            person_surname.append(last)
    person_born = [rng.randrange(1780, 1960) for _ in range(num_people)]
    person_died = [b + rng.randrange(45, 95) if b + 95 < 2020 or rng.random() < 0.5 else None for b in person_born]
    person_died = [d if d is None or d < 2020 else None for d in person_died]

    founders = [rng.randrange(num_people) for _ in range(num_orgs)]
    org_founded = [person_born[p] + rng.randrange(25, 45) for p in founders]
    by_kind: dict[str, list[int]] = {}
    for index, kind in enumerate(org_kind):
        by_kind.setdefault(kind, []).append(index)
    work_kinds = list(WORK_KINDS)
    work_kind = [rng.choice(work_kinds) for _ in range(num_works)]
    work_creator = [rng.randrange(num_people) for _ in range(num_works)]
    return World(
        countries=countries,
        city_names=cities,
        city_country=city_country,
        city_population=[rng.randrange(2_000, 900_000) for _ in range(num_cities)],
        city_settled=[rng.randrange(900, 1800) for _ in range(num_cities)],
        org_names=org_names,
        org_kind=org_kind,
        org_hq=[rng.randrange(num_cities) for _ in range(num_orgs)],
        org_founder=founders,
        org_founded=org_founded,
        person_names=person_names,
        person_surname=person_surname,
        person_born=person_born,
        person_died=person_died,
        person_city=[rng.randrange(num_cities) for _ in range(num_people)],
        person_lived=[rng.randrange(num_cities) for _ in range(num_people)],
        person_occupation=[rng.choice(OCCUPATIONS) for _ in range(num_people)],
        person_employer=[rng.randrange(num_orgs) for _ in range(num_people)],
        work_titles=[f"The {rng.choice(TITLE_NOUNS)} of {word}" for word in title_words],
        work_kind=work_kind,
        work_creator=work_creator,
        work_publisher=[rng.choice(by_kind[WORK_KINDS[k][0]]) for k in work_kind],
        work_year=[person_born[p] + rng.randrange(20, 50) for p in work_creator],
    )


# --------------------------------------------------------------------------- passages


def _a(noun: str) -> str:
    return f"an {noun}" if noun[0] in "aeiou" else f"a {noun}"


def _years(world: World, person: int) -> str:
    died = world.person_died[person]
    return f"{world.person_born[person]}–{died}" if died else f"born {world.person_born[person]}"


def _render_person(world: World, p: int, rng: random.Random) -> str:
    name, last = world.person_names[p], world.person_surname[p]
    city, lived = world.city_names[world.person_city[p]], world.city_names[world.person_lived[p]]
    org, job = world.org_names[world.person_employer[p]], world.person_occupation[p]
    if rng.random() < 0.5:
        text = (f"{name} ({_years(world, p)}) was {_a(job)}. {name} was born in {city}. "
                f"{last} later lived in {lived} and worked for {org} for many years, "
                f"becoming one of its best known figures.")
    else:
        text = (f"{name} ({_years(world, p)}) was {_a(job)} who was born in the city of {city}. "
                f"After moving to {lived}, {last} worked for {org}. "
                f"Colleagues described {last} as patient and exacting.")
    return f'"{name}"\n{text}'


def _render_org(world: World, o: int, rng: random.Random) -> str:
    name, kind = world.org_names[o], ORG_KINDS[world.org_kind[o]]
    city, founder = world.city_names[world.org_hq[o]], world.person_names[world.org_founder[o]]
    year = world.org_founded[o]
    if rng.random() < 0.5:
        text = (f"{name} is {_a(kind)} headquartered in {city}. {name} was founded in {year} by {founder}. "
                f"It grew steadily through the following decades.")
    else:
        text = (f"{name} is {_a(kind)}. It was founded by {founder} in {year}, and {name} is headquartered "
                f"in {city}, where most of its staff work.")
    return f'"{name}"\n{text}'


def _render_city(world: World, c: int, rng: random.Random) -> str:
    name, country = world.city_names[c], world.countries[world.city_country[c]]
    text = (f"{name} is a city in the country of {country}. {name} has a population of about "
            f"{world.city_population[c]:,} and was first settled around {world.city_settled[c]}.")
    if rng.random() < 0.5:
        text += f" The old town of {name} lies along a slow river."
    return f'"{name}"\n{text}'


def _render_country(world: World, k: int, cities_of: list[list[int]]) -> str:
    name = world.countries[k]
    capital, *others = (world.city_names[c] for c in cities_of[k][:4])
    text = f"{name} is a country. Its capital is {capital}."
    if others:
        text += f" Other cities include {', '.join(others)}."
    return f'"{name}"\n{text}'


def _render_work(world: World, w: int, rng: random.Random) -> str:
    title, kind = world.work_titles[w], world.work_kind[w]
    _, verb, _ = WORK_KINDS[kind]
    creator, publisher = world.person_names[world.work_creator[w]], world.org_names[world.work_publisher[w]]
    if rng.random() < 0.5:
        text = (f"{title} is a {world.work_year[w]} {kind} {_PASSIVE[verb]} by {creator}. "
                f"{title} was published by {publisher}.")
    else:
        text = (f"{title} is {_a(kind)} {_PASSIVE[verb]} by {creator} and published by {publisher} "
                f"in {world.work_year[w]}. Critics praised {title} on its release.")
    return f'"{title}"\n{text}'


def _render_surname(world: World, surname: str, people: list[int]) -> str:
    listed = "; ".join(f"{world.person_names[p]} ({_years(world, p)})" for p in people[:5])
    return f'"{surname} (surname)"\n{surname} is a surname. Notable people with the surname {surname} include {listed}.'


def render_passages(world: World, rng: random.Random, *, num_distractors: int) -> list[Passage]:
    """Every entity's passage plus up to ``num_distractors`` surname pages; fills ``world.passage_of``."""
    contents: list[str] = []

    def add(kind: str, index: int, text: str) -> None:
        world.passage_of[(kind, index)] = str(len(contents))
        contents.append(text)

    cities_of: list[list[int]] = [[] for _ in world.countries]
    for c, k in enumerate(world.city_country):
        cities_of[k].append(c)
    for k in range(len(world.countries)):
        add("country", k, _render_country(world, k, cities_of))
    for c in range(len(world.city_names)):
        add("city", c, _render_city(world, c, rng))
    for o in range(len(world.org_names)):
        add("org", o, _render_org(world, o, rng))
    for p in range(len(world.person_names)):
        add("person", p, _render_person(world, p, rng))
    for w in range(len(world.work_titles)):
        add("work", w, _render_work(world, w, rng))
    by_surname: dict[str, list[int]] = {}
    for p, surname in enumerate(world.person_surname):
        by_surname.setdefault(surname, []).append(p)
    shared = [s for s, people in by_surname.items() if len(people) >= 2]
    for surname in shared[:num_distractors]:
        contents.append(_render_surname(world, surname, by_surname[surname]))
    return [Passage(id=str(i), contents=text) for i, text in enumerate(contents)]


# --------------------------------------------------------------------------- questions

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
    "person_occupation": Family("single_hop", "person", ("occupation",), "What was the occupation of {name}?", "occupation"),
    "person_employer": Family("single_hop", "person", ("employer",), "Which organisation did {name} work for?"),
    "org_founder": Family("single_hop", "org", ("founder",), "Who founded {name}?"),
    "org_headquarters": Family("single_hop", "org", ("headquarters",), "In which city is {name} headquartered?"),
    "work_creator": Family("single_hop", "work", ("creator",), "Who {verb} " + _WORK + "?"),
    "work_publisher": Family("single_hop", "work", ("publisher",), "Which company published " + _WORK + "?"),
    "city_country": Family("single_hop", "city", ("country",), "In which country is {name}?", "country"),
    "org_founder_birthplace": Family("multi_hop_2", "org", ("founder", "birthplace"), "Where was the founder of {name} born?"),
    "work_creator_birthplace": Family("multi_hop_2", "work", ("creator", "birthplace"), "Where was " + _CREATOR + " born?"),
    "work_publisher_founder": Family(
        "multi_hop_2", "work", ("publisher", "founder"), "Who founded the company that published " + _WORK + "?"),
    "person_employer_headquarters": Family(
        "multi_hop_2", "person", ("employer", "headquarters"),
        "In which city is the organisation that {name} worked for headquartered?"),
    "person_birth_country": Family(
        "multi_hop_2", "person", ("birthplace", "country"), "In which country was {name} born?", "country"),
    "org_headquarters_country": Family(
        "multi_hop_2", "org", ("headquarters", "country"), "In which country is {name} headquartered?", "country"),
    "org_founder_birth_country": Family(
        "multi_hop_3", "org", ("founder", "birthplace", "country"), "In which country was the founder of {name} born?",
        "country"),
    "work_creator_birth_country": Family(
        "multi_hop_3", "work", ("creator", "birthplace", "country"), "In which country was " + _CREATOR + " born?",
        "country"),
    "work_publisher_founder_birthplace": Family(
        "multi_hop_3", "work", ("publisher", "founder", "birthplace"),
        "Where was the founder of the company that published " + _WORK + " born?"),
    "work_creator_employer_headquarters": Family(
        "multi_hop_3", "work", ("creator", "employer", "headquarters"),
        "In which city is the organisation that " + _CREATOR + " worked for headquartered?"),
}


def _subject_fields(world: World, kind: str, index: int) -> dict[str, str]:
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


# The kind of entity each relation's answer names: the pool a multiple-choice question's wrong options come from.
ANSWER_KINDS = {"birthplace": "city", "headquarters": "city", "employer": "org", "publisher": "org",
                "founder": "person", "creator": "person", "country": "country", "occupation": "occupation"}


def _answer_pools(world: World) -> dict[str, list[str]]:
    return {"city": world.city_names, "org": world.org_names, "person": world.person_names,
            "country": world.countries, "occupation": list(OCCUPATIONS)}


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


def _add_options(world: World, questions: dict[str, list[Example]], seed: int, num_options: int) -> dict[str, list[Example]]:
    if not 2 <= num_options <= len(LETTERS):
        raise ValueError(f"multiple_choice={num_options}: a multiple-choice question needs 2 to {len(LETTERS)} options "
                         "(0 turns options off)")
    pools = _answer_pools(world)
    used = {ANSWER_KINDS[FAMILIES[e.metadata["family"]].relations[-1]] for es in questions.values() for e in es}
    for kind in sorted(used):
        if len(set(pools[kind])) < num_options:
            raise ValueError(f"multiple_choice={num_options}: only {len(set(pools[kind]))} distinct {kind} names to "
                             f"draw options from; use fewer options or a larger world (num_countries for countries)")
    rng = random.Random(f"{seed}:multiple_choice")
    return {split: [with_options(e, pools, rng, num_options) for e in es] for split, es in questions.items()}


def _families(guessable: str) -> dict[str, list[str]]:
    if guessable not in ("any", "only", "none"):
        raise ValueError(f"guessable must be 'any', 'only' or 'none', got {guessable!r}")
    chosen: dict[str, list[str]] = {t: [] for t in QUESTION_TYPES}
    for name, spec in FAMILIES.items():
        if guessable == "any" or (guessable == "only") == (spec.answer_set is not None):
            chosen[spec.question_type].append(name)
    return chosen


def sample_questions(
    world: World, rng: random.Random, count: int, *, hop_mix: tuple[float, float, float], guessable: str
) -> list[tuple[str, int]]:
    """``count`` distinct (family, subject) pairs: question type drawn by ``hop_mix``
    (weights for single_hop, multi_hop_2, multi_hop_3), then a family, then a subject."""
    if len(hop_mix) != 3 or any(x < 0 for x in hop_mix) or sum(hop_mix) <= 0:
        raise ValueError(f"hop_mix must be 3 non-negative weights (single, 2-hop, 3-hop), got {hop_mix}")
    families = _families(guessable)
    weights = [w if families[t] else 0.0 for t, w in zip(QUESTION_TYPES, hop_mix)]
    if sum(weights) <= 0:
        raise ValueError(f"no question family fits hop_mix={hop_mix} and guessable={guessable!r}")
    population = {"person": len(world.person_names), "org": len(world.org_names),
                  "work": len(world.work_titles), "city": len(world.city_names)}
    capacity = sum(population[FAMILIES[f].subject] for t, w in zip(QUESTION_TYPES, weights) if w > 0 for f in families[t])
    if count > capacity // 2:
        raise ValueError(f"asked for {count} questions but this world supports about {capacity // 2}; use a larger size")
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


# --------------------------------------------------------------------------- the generator


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
    hop_mix: tuple[float, float, float] = (0.4, 0.4, 0.2),
    guessable: str = "any",
    data_source: str | None = None,
    name_pool: int | None = None,
    multiple_choice: int = 0,
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
    (see the module docstring); ``data_source`` defaults to "synthkb", or "synthetic_mc" with options.
    """
    data_source = data_source or ("synthetic_mc" if multiple_choice else "synthkb")
    if num_countries < 2:
        raise ValueError(f"num_countries must be >= 2, got {num_countries}")
    total = _sizes(size)
    counts = {
        "num_people": num_people or max(10, round(0.42 * total)),
        "num_works": num_works or max(8, round(0.25 * total)),
        "num_orgs": num_orgs or max(len(ORG_KINDS), round(0.15 * total)),
        "num_cities": num_cities or max(num_countries, round(0.10 * total)),
    }
    minimum = {"num_people": 10, "num_works": 1, "num_orgs": len(ORG_KINDS), "num_cities": num_countries}
    for name, value in counts.items():
        if value < minimum[name]:
            raise ValueError(f"{name}={value} is too small: it must be >= {minimum[name]}")
    num_train = num_train if num_train is not None else min(20_000, max(100, total // 5))
    num_test = num_test if num_test is not None else min(2_000, max(50, total // 20))
    rng = random.Random(seed)
    pool = name_pool_words(name_pool) if name_pool is not None else None
    world = build_world(rng, num_countries=num_countries, name_pool=pool, **counts)
    passages = render_passages(world, rng, num_distractors=max(0, total - sum(counts.values()) - num_countries))
    pairs = sample_questions(world, rng, num_train + num_test, hop_mix=hop_mix, guessable=guessable)
    splits = {"test": pairs[:num_test], "train": pairs[num_test:]}
    questions = {
        split: [make_question(world, family, subject, example_id=f"{data_source}-{split}-{i}", split=split,
                              data_source=data_source) for i, (family, subject) in enumerate(chosen)]
        for split, chosen in splits.items()
    }
    if multiple_choice:
        questions = _add_options(world, questions, seed, multiple_choice)
    config = {
        "version": SYNTH_VERSION, "seed": seed, "size": size, **counts, "num_countries": num_countries,
        "num_train": num_train, "num_test": num_test, "hop_mix": list(hop_mix), "guessable": guessable,
        "data_source": data_source, **({"name_pool": name_pool} if name_pool is not None else {}),
        **({"multiple_choice": multiple_choice} if multiple_choice else {}),
    }
    kinds = Counter(kind for kind, _ in world.passage_of)
    stats = {
        "passages": len(passages),
        "entity_passages": dict(sorted(kinds.items())),
        "distractor_passages": len(passages) - len(world.passage_of),
        **{f"{split}_questions": _question_stats(examples) for split, examples in questions.items()},
    }
    return SyntheticKB(passages=passages, train=questions["train"], test=questions["test"], config=config, stats=stats)


def _question_stats(examples: list[Example]) -> dict:
    return {
        "total": len(examples),
        "by_type": dict(sorted(Counter(e.metadata["question_type"] for e in examples).items())),
        "by_family": dict(sorted(Counter(e.metadata["family"] for e in examples).items())),
        "guessable": sum(e.metadata["guessable"] for e in examples),
    }


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
    """The CLI line that regenerates this KB (entity-count overrides are Python-only)."""
    c = config
    return (f"stratarl data synth --out DIR --seed {c['seed']} --size {c['size']} --num-train {c['num_train']} "
            f"--num-test {c['num_test']} --num-countries {c['num_countries']} --guessable {c['guessable']} "
            f"--hop-mix {','.join(f'{w:g}' for w in c['hop_mix'])}"
            + (f" --multiple-choice {c['multiple_choice']}" if c.get("multiple_choice") else ""))


def _readme(kb: SyntheticKB) -> str:
    sample = kb.train[0] if kb.train else None
    lines = [
        "# Synthetic knowledge-base benchmark (stratarl data synth)",
        "",
        "A fictional world: every name is invented, so a model can only answer by searching "
        "(except guessable families, whose answers come from a small set).",
        "",
        f"- corpus.jsonl: {kb.stats['passages']} passages (Search-R1 corpus format)",
        f"- train.parquet: {len(kb.train)} questions; test.parquet: {len(kb.test)} (Search-R1 format; "
        "each row's `metadata` JSON holds question_type, family, hops, guessable, answer_set_size)",
        f"- regenerate: `{_synth_command(kb.config)}` (all arguments in stats.json)",
    ]
    if sample is not None:
        lines += ["", "Example:", "", f"    Q: {sample.question}", f"    A: {sample.golden_answers[0]}"]
        lines += [f"    hop {i + 1}: {hop['query']} -> passage {hop['passage_id']} -> {hop['answer']}"
                  for i, hop in enumerate(sample.metadata["hops"])]
    return "\n".join(lines) + "\n"
