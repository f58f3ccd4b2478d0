"""Demonstration trajectories for the warm-start stage, rendered from synthetic questions' hops.

For an Example whose ``metadata["hops"]`` lists ``{"query", "passage_id", "answer"}``,
the demonstration is the trajectory a competent agent would produce in the run's
protocol (``rollout.protocol``), built from the real pieces; under Search-R1's tags:

    <think> ... </think>\n<search> {hop 1 query} </search>      policy tokens   (mask 1)
    \n\n<information>Doc 1(Title: ...) ...</information>\n\n    real retriever  (mask 0)
    ... one search per hop ...
    <think> ... </think>\n<answer> {answer} </answer><eos>      policy tokens   (mask 1)

Every piece comes from the part a rollout uses (stratarl.trainer.warmstart.render): the protocol writes the
calls and the tool turns, the tools themselves produce the results, the rollout engine's own function tokenizes
and caps them; EOS follows ``</answer>`` as the engine appends it. So the demonstration has exactly the token
layout of a rollout (docs/training.md, "Warm start in another protocol"). With ``open`` among the tools, a
correct demonstration may open a later hop's article by title (``hop_calls``).

Some demonstrations are imperfect on purpose, so RL has something to improve:
``no_search_fraction`` answer at once without searching (a guess: the answer of
another question of the same family, so the guess has the right type),
``wrong_hop_fraction`` of multi-hop ones search a wrong entity in their last hop
(the same relation, from another question of the family) and answer what that
search found, and ``early_answer_fraction`` of multi-hop ones stop after their
first search and answer what it found (a weak search policy: one search where
the question needs more).
"""

from __future__ import annotations

import random
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from stratarl.data.examples import Example
from stratarl.retrieval.base import Passage
from stratarl.rollout.tools import tool_budget
from stratarl.trainer.warmstart.render import DemoRenderer, Piece


@dataclass(frozen=True)
class Demonstration:
    """One rendered trajectory; ``kind`` says whether it is a correct or an imperfect demo."""

    prompt_ids: list[int]
    response_ids: list[int]
    response_mask: list[int]
    kind: str = "correct"
    example_id: str = ""
    text: str = ""
    meta: dict = field(default_factory=dict, compare=False)


def render_demonstration(
    example: Example,
    renderer: DemoRenderer,
    *,
    prompt_ids: list[int],
    calls: Sequence[tuple[str, str]],
    answer: str,
    kind: str,
) -> Demonstration:
    """One trajectory: a call turn and its tool turn per ``(tool, argument)`` in ``calls``, then the answer turn,
    each piece rendered by ``renderer`` (the run's protocol and tools: stratarl.trainer.warmstart.render)."""
    response, mask, retrieved = [], [], []
    for tool, argument in calls:
        turn, observation = renderer.call(tool, argument)
        retrieved.append([p.id for p in observation.passages])
        response += turn.ids + observation.ids
        mask += turn.mask + observation.mask
    final = renderer.answer_turn(answer)
    response += final
    mask += [1] * len(final)
    meta: dict[str, Any] = {
        "retrieved": retrieved,
        "searches": [argument for tool, argument in calls if tool == "search"],
        "answer": answer,
    }
    if renderer.tools != ("search",):
        meta["calls"] = [{"tool": tool, "argument": argument} for tool, argument in calls]
    return Demonstration(
        prompt_ids=list(prompt_ids),
        response_ids=response,
        response_mask=mask,
        kind=kind,
        example_id=example.id,
        meta=meta,
    )


def hop_calls(
    hops: Sequence[dict], tools: Sequence[str], rng: random.Random, open_fraction: float, open_budget: int | None
) -> list[tuple[str, str]]:
    """The calls of a demonstration that follows every hop: a search of each hop's query, except that with
    ``open`` among ``tools`` a later hop opens the previous hop's answer by title (a name the last observation
    showed) with probability ``open_fraction`` (drawn from ``rng``, within ``open_budget`` calls)."""
    calls: list[tuple[str, str]] = []
    for i, hop in enumerate(hops):
        opens = sum(tool == "open" for tool, _ in calls)
        may_open = "open" in tools and i > 0 and (open_budget is None or opens < open_budget)
        if may_open and rng.random() < open_fraction:
            calls.append(("open", str(hops[i - 1]["answer"])))
        else:
            calls.append(("search", hop["query"]))
    return calls


def _other(pool: Sequence[Example], example: Example, rng: random.Random) -> Example:
    """A uniformly drawn member of ``pool`` other than ``example`` (itself only if it is alone)."""
    j = rng.randrange(len(pool))
    if pool[j] is example and len(pool) > 1:
        j = (j + 1 + rng.randrange(len(pool) - 1)) % len(pool)
    return pool[j]


def render_demonstrations(
    examples: Sequence[Example],
    tokenizer,
    retriever,
    *,
    num_demos: int,
    topk: int,
    max_obs_tokens: int,
    no_search_fraction: float,
    wrong_hop_fraction: float,
    seed: int,
    early_answer_fraction: float = 0.0,
    prompt_template: str = "search_r1",
    guess_on: str = "any",
    wrong_hop_pool: str = "family",
    protocol: str = "search_r1",
    tools: Sequence[str] = ("search",),
    tool_params: Mapping[str, Any] | None = None,
    open_fraction: float = 0.5,
) -> list[Demonstration]:
    """Up to ``num_demos`` demonstrations from examples that carry hops, in the run's ``protocol`` with its
    ``tools`` (``rollout.protocol``, ``rollout.tools``, ``rollout.tool_params``: stratarl.trainer.warmstart.render).

    ``guess_on="guessable"`` lets only questions of a guessable family (``metadata["guessable"]``) guess; another
    question's draw is mapped onto the non-guessing part of [0, 1), so it searches with the shares the other
    fractions give among the demonstrations that search. ``wrong_hop_pool="any"`` takes a wrong last hop from any
    other question instead of one of the same family. With ``open`` among the tools, a correct demonstration's
    later hop opens the previous hop's answer by title with probability ``open_fraction`` (``hop_calls``; drawn
    from a generator of its own, so the other choices are the same as with search alone).

    A "correct" demonstration is kept only if every hop's gold passage was retrieved (or opened)
    (otherwise the demo would teach answering what the passages do not say).
    """
    usable = [e for e in examples if e.metadata.get("hops")]
    if not usable:
        raise ValueError(
            "no training example has metadata['hops']: warm-start demonstrations need the synthetic "
            "task (data.source=synthetic) or files whose rows carry hops; set sft.enabled=false otherwise"
        )
    renderer = DemoRenderer.build(
        tokenizer,
        retriever,
        topk=topk,
        max_obs_tokens=max_obs_tokens,
        protocol=protocol,
        tools=tools,
        tool_params=tool_params,
        prompt_template=prompt_template,
    )
    mix = DemoMix(no_search_fraction, wrong_hop_fraction, early_answer_fraction, guess_on, wrong_hop_pool)
    rng, open_rng = random.Random(seed), random.Random(f"open-{seed}")
    order = list(range(len(usable)))
    rng.shuffle(order)
    # Imperfect demos borrow from another question of the same family when there is one, so a guess
    # is of the right type (a country for a country question: right 1 time in num_countries) and a
    # wrong last hop is the same relation about a wrong entity.
    by_family: dict[str, list[Example]] = {}
    for e in usable:
        by_family.setdefault(e.metadata.get("family", ""), []).append(e)
    open_budget = tool_budget(renderer.tool_params, "open")
    demos: list[Demonstration] = []
    for i in order:
        if len(demos) >= num_demos:
            break
        example = usable[i]
        peers = by_family[example.metadata.get("family", "")]
        other = _other(peers if len(peers) > 1 else usable, example, rng)
        kind, calls, answer = mix.plan(example, other, usable, rng)
        if kind == "correct":
            calls = hop_calls(example.metadata["hops"], renderer.tools, open_rng, open_fraction, open_budget)
        demo = render_demonstration(
            example, renderer, prompt_ids=renderer.prompt(example), calls=calls, answer=answer, kind=kind
        )
        if _reads_its_answer(demo, example.metadata["hops"]):
            demos.append(demo)
    return demos


@dataclass(frozen=True)
class DemoMix:
    """The shares of imperfect demonstrations (``sft.no_search_fraction`` and the others; see
    ``render_demonstrations``)."""

    no_search_fraction: float
    wrong_hop_fraction: float
    early_answer_fraction: float
    guess_on: str = "any"
    wrong_hop_pool: str = "family"

    def plan(
        self, example: Example, other: Example, usable: Sequence[Example], rng: random.Random
    ) -> tuple[str, list[tuple[str, str]], str]:
        """(kind, calls, answer) of ``example``'s demonstration; ``other`` lends a guess or a wrong last hop.
        A correct demonstration's calls are searches of every hop (``hop_calls`` may make some opens)."""
        hops = example.metadata["hops"]
        draw = rng.random()
        if self.guess_on == "guessable" and not example.metadata.get("guessable", False):
            draw = self.no_search_fraction + draw * (1.0 - self.no_search_fraction)
        if draw < self.no_search_fraction:
            return "no_search", [], other.golden_answers[0]
        if len(hops) > 1 and draw < self.no_search_fraction + self.wrong_hop_fraction:
            source = other if self.wrong_hop_pool == "family" else _other(usable, example, rng)
            wrong = source.metadata["hops"][-1]
            return "wrong_hop", [("search", h["query"]) for h in [*hops[:-1], wrong]], wrong["answer"]
        if len(hops) > 1 and draw < self.no_search_fraction + self.wrong_hop_fraction + self.early_answer_fraction:
            return "early_answer", [("search", hops[0]["query"])], hops[0]["answer"]
        # a question with several answers (PhantomWiki) names them all: its metadata says how
        answer = example.metadata.get("demo_answer", example.golden_answers[0])
        return "correct", [("search", h["query"]) for h in hops], answer


def _reads_its_answer(demo: Demonstration, hops: Sequence[dict]) -> bool:
    """Whether ``demo`` answers what it read: an early answer's first hop, every hop of a correct one, found
    (imperfect guesses and wrong hops are kept as they are)."""
    if demo.kind == "early_answer":
        return hops[0]["passage_id"] in demo.meta["retrieved"][0]
    if demo.kind == "correct":
        return all(h["passage_id"] in ids for h, ids in zip(hops, demo.meta["retrieved"]))
    return True


def _answer_sentence(text: str, answer: str) -> str:
    """The first sentence of ``text`` that contains ``answer`` (all of ``text`` when none does)."""
    for sentence in re.split(r"(?<=[.])\s+", text):
        if answer in sentence:
            return sentence
    return text


def render_reading_examples(
    examples: Sequence[Example],
    tokenizer,
    retriever,
    passages: dict[str, str],
    *,
    topk: int,
    max_obs_tokens: int,
    rng: random.Random,
    sentence_probability: float = 0.0,
    agent_probability: float = 0.0,
    prompt_template: str = "search_r1",
    protocol: str = "search_r1",
    tools: Sequence[str] = ("search",),
) -> list[Demonstration]:
    """Copy pre-training ("reading") examples: an observation, then every question about its first passage.

    For each passage that answers single-hop questions, the observation is what the retriever returns for
    one of them (the same ``<information>Doc 1(Title: ...) ...</information>`` block a rollout sees; kept only
    if the passage is among the hits), followed by each question and its answer:

        <information>Doc 1(...) ... Doc 2(...) ...</information>  Question: q1 <answer> a1 </answer>  Question: q2 ...

    Only the answers are targets (mask 1). With probability ``sentence_probability`` the observation is
    shortened to the one sentence of the passage that holds the answer (a curriculum: a short context lets a
    tiny model find what to copy before it has to search a long one). Returned as Demonstrations whose
    prompt is the observation's first token.

    With probability ``agent_probability`` the example is laid out as the agent sees it instead (kind
    ``reading_agent``): the first question in the prompt (``prompt_template``), a search of that question,
    the same observation, then the answer turn; targets are the agent's tokens, as in a demonstration:

        prompt(q1)  <think> ... </think> <search> q1 </search>  <information>...</information>  <think> ... </think> <answer> a1 </answer>

    Copying learnt only after ``Question: q <answer>`` does not carry over to an answer turn whose question
    lies before the observation (docs/lab.md, "Why this recipe"); both layouts teach both.

    The observation, the prompt and the turns are those of ``protocol`` with ``tools`` (the search tool's
    result in that protocol's tool turn; stratarl.trainer.warmstart.render); the default is Search-R1's tags.
    """
    renderer = DemoRenderer.build(
        tokenizer,
        retriever,
        topk=topk,
        max_obs_tokens=max_obs_tokens,
        protocol=protocol,
        tools=tools,
        prompt_template=prompt_template,
    )
    by_passage: dict[str, list[tuple[str, str, Example]]] = {}
    for example in examples:
        hops = (example.metadata or {}).get("hops") or []
        if len(hops) == 1:
            by_passage.setdefault(hops[0]["passage_id"], []).append((example.question, hops[0]["answer"], example))
    if not by_passage:
        return []
    ids_of = list(by_passage)
    hits = retriever.search([by_passage[pid][0][0] for pid in ids_of], topk)
    out = []
    for pid, found in zip(ids_of, hits):
        questions = list(by_passage[pid])
        rng.shuffle(questions)
        context = "sentence" if rng.random() < sentence_probability else "observation"
        if context == "sentence":
            title, _, body = passages[pid].partition("\n")
            short = [Passage(pid, f"{title}\n{_answer_sentence(body, questions[0][1])}")]
            obs = renderer.search_observation(short)
            questions = questions[:1]
        elif pid in {p.id for p in found}:
            obs = renderer.search_observation(found)
        else:
            continue
        if agent_probability and rng.random() < agent_probability:
            out.append(_agent_reading_example(renderer, questions[0], obs, pid, context))
        else:
            out.append(_reading_example(tokenizer, questions, obs.ids, pid, context))
    return out


def _agent_reading_example(
    renderer: DemoRenderer, reading: tuple[str, str, Example], obs: Piece, pid: str, context: str
) -> Demonstration:
    """A reading example in the agent's layout: the question in the prompt, a search of it, the observation, the
    answer turn (kind ``reading_agent``; the agent's tokens are the targets)."""
    question, answer, example = reading
    turn = renderer.call_turn("search", question)
    final = renderer.answer_turn(answer)
    return Demonstration(
        prompt_ids=renderer.prompt(example),
        response_ids=turn + obs.ids + final,
        response_mask=[1] * len(turn) + obs.mask + [1] * len(final),
        kind="reading_agent",
        example_id=pid,
        meta={"questions": [question], "context": context},
    )


def _policy_ids(tokenizer, text: str) -> list[int]:
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def _reading_example(
    tokenizer, questions: list[tuple[str, str, Example]], obs: list[int], pid: str, context: str
) -> Demonstration:
    """A reading example in the question-after-observation layout: the observation, then each question and its
    answer (kind ``reading``; only the answers are targets)."""
    response, mask = list(obs[1:]), [0] * (len(obs) - 1)
    for question, answer, _ in questions:
        asked = _policy_ids(tokenizer, f" Question: {question} <answer>")
        answered = _policy_ids(tokenizer, f" {answer} </answer>")
        response += asked + answered
        mask += [0] * len(asked) + [1] * len(answered)
    return Demonstration(
        prompt_ids=list(obs[:1]),
        response_ids=response,
        response_mask=mask,
        kind="reading",
        example_id=pid,
        meta={"questions": [q for q, _, _ in questions], "context": context},
    )
