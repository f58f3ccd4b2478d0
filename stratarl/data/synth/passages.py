"""The corpus: one wiki-style passage per entity (Search-R1 corpus format ``"\\"Title\\"\\ntext"``), each in
one of two phrasings, and surname pages as distractors that share name words but answer no question."""

from __future__ import annotations

import random
from collections.abc import Iterator

from stratarl.data.synth.names import ORG_KINDS, WORK_KINDS
from stratarl.data.synth.world import World
from stratarl.retrieval.base import Passage

_PASSIVE = {"wrote": "written", "recorded": "recorded", "directed": "directed", "designed": "designed"}


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
        text = (
            f"{name} ({_years(world, p)}) was {_a(job)}. {name} was born in {city}. "
            f"{last} later lived in {lived} and worked for {org} for many years, "
            f"becoming one of its best known figures."
        )
    else:
        text = (
            f"{name} ({_years(world, p)}) was {_a(job)} who was born in the city of {city}. "
            f"After moving to {lived}, {last} worked for {org}. "
            f"Colleagues described {last} as patient and exacting."
        )
    return f'"{name}"\n{text}'


def _render_org(world: World, o: int, rng: random.Random) -> str:
    name, kind = world.org_names[o], ORG_KINDS[world.org_kind[o]]
    city, founder = world.city_names[world.org_hq[o]], world.person_names[world.org_founder[o]]
    year = world.org_founded[o]
    if rng.random() < 0.5:
        text = (
            f"{name} is {_a(kind)} headquartered in {city}. {name} was founded in {year} by {founder}. "
            f"It grew steadily through the following decades."
        )
    else:
        text = (
            f"{name} is {_a(kind)}. It was founded by {founder} in {year}, and {name} is headquartered "
            f"in {city}, where most of its staff work."
        )
    return f'"{name}"\n{text}'


def _render_city(world: World, c: int, rng: random.Random) -> str:
    name, country = world.city_names[c], world.countries[world.city_country[c]]
    text = (
        f"{name} is a city in the country of {country}. {name} has a population of about "
        f"{world.city_population[c]:,} and was first settled around {world.city_settled[c]}."
    )
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
        text = (
            f"{title} is a {world.work_year[w]} {kind} {_PASSIVE[verb]} by {creator}. "
            f"{title} was published by {publisher}."
        )
    else:
        text = (
            f"{title} is {_a(kind)} {_PASSIVE[verb]} by {creator} and published by {publisher} "
            f"in {world.work_year[w]}. Critics praised {title} on its release."
        )
    return f'"{title}"\n{text}'


def _render_surname(world: World, surname: str, people: list[int]) -> str:
    listed = "; ".join(f"{world.person_names[p]} ({_years(world, p)})" for p in people[:5])
    return f'"{surname} (surname)"\n{surname} is a surname. Notable people with the surname {surname} include {listed}.'


def _entity_passages(world: World, rng: random.Random) -> Iterator[tuple[str, int, str]]:
    """(entity kind, entity index, passage text) of every entity, in corpus order: countries, cities,
    organisations, people, works (the order the phrasings are drawn from ``rng`` in)."""
    cities_of: list[list[int]] = [[] for _ in world.countries]
    for c, k in enumerate(world.city_country):
        cities_of[k].append(c)
    for k in range(len(world.countries)):
        yield "country", k, _render_country(world, k, cities_of)
    for c in range(len(world.city_names)):
        yield "city", c, _render_city(world, c, rng)
    for o in range(len(world.org_names)):
        yield "org", o, _render_org(world, o, rng)
    for p in range(len(world.person_names)):
        yield "person", p, _render_person(world, p, rng)
    for w in range(len(world.work_titles)):
        yield "work", w, _render_work(world, w, rng)


def render_passages(world: World, rng: random.Random, *, num_distractors: int) -> list[Passage]:
    """Every entity's passage plus up to ``num_distractors`` surname pages; fills ``world.passage_of``."""
    contents: list[str] = []
    for kind, index, text in _entity_passages(world, rng):
        world.passage_of[(kind, index)] = str(len(contents))
        contents.append(text)
    by_surname: dict[str, list[int]] = {}
    for p, surname in enumerate(world.person_surname):
        by_surname.setdefault(surname, []).append(p)
    shared = [s for s, people in by_surname.items() if len(people) >= 2]
    contents.extend(_render_surname(world, surname, by_surname[surname]) for surname in shared[:num_distractors])
    return [Passage(id=str(i), contents=text) for i, text in enumerate(contents)]
