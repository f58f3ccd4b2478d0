"""A PhantomWiki question's solution as searches: the articles an agent must read, in an order it can search them.

A PhantomWiki article states its person's relations ("The son of X is Y." is ``son(X, Y)`` in X's article) and
attributes; a question's Prolog query composes them (the mother-in-law is the wife's mother). Replaying the
solution as searches gives the warm start its demonstrations (``metadata["hops"]``, the format
``stratarl.trainer.warmstart.demos`` renders), as the synthetic task's hops do.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from typing import Any

# The relations an article states ("The son of X is Y." is son(X, Y) in X's article); every other relation a question
# names (in-laws, cousins, grandchildren, ...) is composed of these family relations.
FAMILY_RELATIONS = frozenset({"son", "daughter", "mother", "father", "sister", "brother", "husband", "wife"})
STATED_RELATIONS = FAMILY_RELATIONS | {"friend"}
ATTRIBUTES = frozenset({"dob", "job", "hobby", "gender"})
_TERM = re.compile(r"^\s*(\w+)\((.*)\)\s*$")


def _terms(query: Sequence[str]) -> list[tuple[str, list[str]]] | None:
    """A question's Prolog goals as (predicate, arguments), arguments as written (quoted constants, variables);
    None for a counting question (``aggregate_all``: its demonstration would have to count)."""
    terms = []
    for goal in query:
        match = _TERM.match(goal)
        if match is None or match.group(1) == "aggregate_all":
            return None
        terms.append((match.group(1), [part.strip() for part in match.group(2).split(", ")]))
    return terms


def _value(argument: str, binding: dict[str, Any]) -> str | None:
    """A goal argument's value: a quoted constant, or the variable's binding in one solution (None if unbound)."""
    if argument.startswith('"') and argument.endswith('"'):
        return argument[1:-1]
    value = binding.get(argument)
    return None if value is None else str(value)


def relation_graph(articles: Sequence[dict]) -> dict[str, dict[str, list[str]]]:
    """person -> relation -> people, from the facts each article states (``son("X", "Y")`` in X's article)."""
    graph: dict[str, dict[str, list[str]]] = {}
    for row in articles:
        for fact in row.get("facts") or []:
            match = _TERM.match(fact.rstrip("."))
            if match is None or match.group(1) not in STATED_RELATIONS:
                continue
            subject, _, other = match.group(2).partition(", ")
            graph.setdefault(subject.strip('"'), {}).setdefault(match.group(1), []).append(other.strip('"'))
    return graph


def _path(graph: dict[str, dict[str, list[str]]], start: str, goal: str, relations: frozenset[str]) -> list[str] | None:
    """The shortest chain of people from ``start`` to ``goal`` along ``relations`` (breadth first), or None."""
    previous: dict[str, str | None] = {start: None}
    frontier = [start]
    while frontier and goal not in previous:
        following = []
        for person in frontier:
            for relation, others in sorted(graph.get(person, {}).items()):
                if relation in relations:
                    for other in others:
                        if other not in previous:
                            previous[other] = person
                            following.append(other)
        frontier = following
    if goal not in previous:
        return None
    chain = [goal]
    while previous[chain[-1]] is not None:
        chain.append(str(previous[chain[-1]]))
    return chain[::-1]


def solution_reads(row: dict, graph: dict[str, dict[str, list[str]]]) -> list[tuple[str, str]] | None:
    """The articles an agent must read to answer a question, in an order it can search them, as (query, person).

    The goals are solved from the last (the named person, or the person with a given attribute: searched by that
    value) to the first. A stated relation is read in its subject's article; a composed one (mother-in-law: the
    wife's mother) needs the articles along the shortest chain of family relations (friends for ``friend``)
    between the two people of each solution; an attribute asked for needs its person's article. None for a
    counting question or when a chain is missing."""
    terms = _terms(row["prolog"]["query"])
    if terms is None:
        return None
    reads: dict[str, str] = {}
    # The generator lists a question's solutions in an order that changes from run to run (set order); sorted,
    # the same universe seed gives the same searches.
    bindings = json.loads(row.get("solution_traces") or "[]")
    for binding in sorted(bindings, key=lambda b: json.dumps(b, sort_keys=True)):
        for predicate, arguments in reversed(terms):
            values = [_value(argument, binding) for argument in arguments]
            if predicate in ATTRIBUTES:
                subject, value = values
                if subject is None:
                    return None
                query = value if arguments[1].startswith('"') else subject
                reads.setdefault(subject, query or subject)
                continue
            subject, other = values
            if subject is None or other is None:
                return None
            reads.setdefault(subject, subject)
            relations = frozenset({"friend"}) if predicate == "friend" else FAMILY_RELATIONS
            chain = [subject, other] if predicate in STATED_RELATIONS else _path(graph, subject, other, relations)
            if chain is None:
                return None
            for person in chain[1:-1]:
                reads.setdefault(person, person)
    return [(query, person) for person, query in reads.items()]


def solution_hops(
    row: dict, graph: dict[str, dict[str, list[str]]], passage_ids: dict[str, str], golds: Sequence[str]
) -> list[dict[str, str]] | None:
    """The question's solution as searches (``metadata["hops"]``, what a warm start's demonstrations replay): one
    ``{"query", "passage_id", "answer"}`` per distinct query of :func:`solution_reads`, the article it must find,
    and what it tells (the next query; the gold answers, comma-separated, after the last). None when
    :func:`solution_reads` has no plan or an article is missing."""
    reads = solution_reads(row, graph)
    if not reads:
        return None
    queries: dict[str, str] = {}
    for query, person in reads:
        if person not in passage_ids:
            return None
        queries.setdefault(query, passage_ids[person])
    steps = list(queries.items())
    final = ", ".join(golds)
    return [
        {"query": query, "passage_id": passage_id, "answer": steps[i + 1][0] if i + 1 < len(steps) else final}
        for i, (query, passage_id) in enumerate(steps)
    ]
