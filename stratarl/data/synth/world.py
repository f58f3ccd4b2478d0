"""The world: every entity (countries, cities, organisations, people, works), its attributes and its
relations, drawn from one seeded RNG."""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from itertools import islice

from stratarl.data.synth.names import OCCUPATIONS, ORG_KINDS, TITLE_NOUNS, WORK_KINDS, draw_name_words


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


def build_world(
    rng: random.Random,
    *,
    num_countries: int,
    num_cities: int,
    num_orgs: int,
    num_people: int,
    num_works: int,
    name_pool: list[str] | None = None,
    shared_countries: bool = False,
) -> World:
    """Draw every entity and relation. Publishers exist for every work kind.

    With ``name_pool`` every name word is drawn (without replacement) from that list instead of
    being invented, so worlds of different seeds share one vocabulary but not one fact. With
    ``shared_countries`` the countries are the pool's first ``num_countries`` words in every world
    (the other names are drawn from the rest), so a country answer learned in one world is a
    plausible guess in another: the closed answer set is the same everywhere."""
    num_surnames = max(2, num_people // 3)  # ~3 people per surname: shared-word distractors
    num_first = max(4, num_people // 4)
    num_stems = max(2, (num_orgs * 2) // 3)  # some stems are shared by two organisations
    counts = (num_countries, num_cities, num_surnames, num_first, num_stems, num_works)
    if shared_countries:
        if name_pool is None:
            raise ValueError(
                "shared_countries needs name_pool (the countries are the pool's first words). "
                "Fix: set name_pool, e.g. 1000"
            )
        fixed = list(name_pool[:num_countries])
        words = iter(fixed + draw_name_words(rng, sum(counts) - num_countries, list(name_pool[num_countries:])))
    else:
        words = iter(draw_name_words(rng, sum(counts), name_pool))
    countries, cities, surnames, firsts, stems, title_words = (list(islice(words, n)) for n in counts)
    city_country = [i % num_countries if i < num_countries else rng.randrange(num_countries) for i in range(num_cities)]
    org_kind, org_names = _organisations(rng, num_orgs, stems)
    person_names, person_surname = _person_names(rng, num_people, firsts, surnames)
    person_born, person_died = _lifespans(rng, num_people)
    founders = [rng.randrange(num_people) for _ in range(num_orgs)]
    org_founded = [person_born[p] + rng.randrange(25, 45) for p in founders]
    work_kinds = list(WORK_KINDS)
    work_kind = [rng.choice(work_kinds) for _ in range(num_works)]
    work_creator = [rng.randrange(num_people) for _ in range(num_works)]
    orgs_of_kind = _orgs_by_kind(org_kind)
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
        work_publisher=[rng.choice(orgs_of_kind[WORK_KINDS[k][0]]) for k in work_kind],
        work_year=[person_born[p] + rng.randrange(20, 50) for p in work_creator],
    )


def _organisations(rng: random.Random, num_orgs: int, stems: list[str]) -> tuple[list[str], list[str]]:
    """Each organisation's kind (every kind at least once) and its distinct name "<stem> <kind>"."""
    kinds = list(ORG_KINDS)
    org_kind = [kinds[i] if i < len(kinds) else rng.choice(kinds) for i in range(num_orgs)]
    org_names, used = [], set()
    for kind in org_kind:
        name = f"{rng.choice(stems)} {kind}"
        while name in used:
            name = f"{rng.choice(stems)} {kind}"
        used.add(name)
        org_names.append(name)
    return org_kind, org_names


def _person_names(
    rng: random.Random, num_people: int, firsts: list[str], surnames: list[str]
) -> tuple[list[str], list[str]]:
    """Distinct "<first> <surname>" names and each person's surname."""
    person_names: list[str] = []
    person_surname: list[str] = []
    taken: set[tuple[str, str]] = set()
    while len(person_names) < num_people:
        first, last = rng.choice(firsts), rng.choice(surnames)
        if (first, last) not in taken:
            taken.add((first, last))
            person_names.append(f"{first} {last}")
            person_surname.append(last)
    return person_names, person_surname


def _lifespans(rng: random.Random, num_people: int) -> tuple[list[int], list[int | None]]:
    """Birth years and death years (None: alive, or no death year before 2020)."""
    person_born = [rng.randrange(1780, 1960) for _ in range(num_people)]
    person_died = [b + rng.randrange(45, 95) if b + 95 < 2020 or rng.random() < 0.5 else None for b in person_born]
    person_died = [d if d is None or d < 2020 else None for d in person_died]
    return person_born, person_died


def _orgs_by_kind(org_kind: list[str]) -> dict[str, list[int]]:
    """Organisation kind -> the indices of the organisations of that kind."""
    by_kind: dict[str, list[int]] = {}
    for index, kind in enumerate(org_kind):
        by_kind.setdefault(kind, []).append(index)
    return by_kind
