"""Demonstration trajectories for the warm-start stage, rendered from synthetic questions' hops.

For an Example whose ``metadata["hops"]`` lists ``{"query", "passage_id", "answer"}``,
the demonstration is the trajectory a competent agent would produce under the
Search-R1 protocol, built from the real pieces:

    <think> ... </think>\n<search> {hop 1 query} </search>      policy tokens   (mask 1)
    \n\n<information>Doc 1(Title: ...) ...</information>\n\n    real retriever  (mask 0)
    ... one search per hop ...
    <think> ... </think>\n<answer> {answer} </answer><eos>      policy tokens   (mask 1)

Observations come from the run's retriever and are tokenized and capped by the
rollout engine's own function; EOS follows ``</answer>`` as the engine appends it.
So the demonstration has exactly the token layout of a rollout.

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
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from stratarl.data.examples import Example
from stratarl.retrieval.base import Passage
from stratarl.rollout.engine import observation_ids
from stratarl.rollout.parsing import information_observation
from stratarl.rollout.prompt import encode_prompt


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


# The two thoughts differ from their first word on, so the search-or-answer decision is one
# clear token for the model to learn (a shared prefix made greedy decoding pick the wrong one).
SEARCH_THOUGHT = "<think> I need to search for this. </think>\n"
ANSWER_THOUGHT = "<think> The information gives the answer. </think>\n"


def _policy_ids(tokenizer, text: str) -> list[int]:
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def render_demonstration(
    example: Example,
    tokenizer,
    retriever,
    *,
    topk: int,
    max_obs_tokens: int,
    prompt_ids: list[int],
    searches: Sequence[str],
    answer: str,
    kind: str,
) -> Demonstration:
    """One trajectory: a search turn per query in ``searches``, then the answer turn."""
    response, mask, retrieved = [], [], []
    for query in searches:
        turn = _policy_ids(tokenizer, f"{SEARCH_THOUGHT}<search> {query} </search>")
        hits = retriever.search([query], topk)[0]
        retrieved.append([p.id for p in hits])
        obs, _ = observation_ids(tokenizer, information_observation(hits), max_obs_tokens)
        response += turn + obs
        mask += [1] * len(turn) + [0] * len(obs)
    final = _policy_ids(tokenizer, f"{ANSWER_THOUGHT}<answer> {answer} </answer>")
    if tokenizer.eos_token_id is not None:
        final.append(tokenizer.eos_token_id)
    response += final
    mask += [1] * len(final)
    return Demonstration(
        prompt_ids=list(prompt_ids),
        response_ids=response,
        response_mask=mask,
        kind=kind,
        example_id=example.id,
        meta={"retrieved": retrieved, "searches": list(searches), "answer": answer},
    )


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
) -> list[Demonstration]:
    """Up to ``num_demos`` demonstrations from examples that carry hops.

    ``guess_on="guessable"`` lets only questions of a guessable family (``metadata["guessable"]``) guess; another
    question's draw is mapped onto the non-guessing part of [0, 1), so it searches with the shares the other
    fractions give among the demonstrations that search. ``wrong_hop_pool="any"`` takes a wrong last hop from any
    other question instead of one of the same family.

    A "correct" demonstration is kept only if every hop's gold passage was retrieved
    (otherwise the demo would teach answering what the passages do not say).
    """
    usable = [e for e in examples if e.metadata.get("hops")]
    if not usable:
        raise ValueError(
            "no training example has metadata['hops']: warm-start demonstrations need the synthetic "
            "task (data.source=synthetic) or files whose rows carry hops; set sft.enabled=false otherwise"
        )
    rng = random.Random(seed)
    order = list(range(len(usable)))
    rng.shuffle(order)
    # Imperfect demos borrow from another question of the same family when there is one, so a guess
    # is of the right type (a country for a country question: right 1 time in num_countries) and a
    # wrong last hop is the same relation about a wrong entity.
    by_family: dict[str, list[Example]] = {}
    for e in usable:
        by_family.setdefault(e.metadata.get("family", ""), []).append(e)
    demos: list[Demonstration] = []
    for i in order:
        if len(demos) >= num_demos:
            break
        example = usable[i]
        hops = example.metadata["hops"]
        prompt_ids = encode_prompt(tokenizer, example.question, prompt_template, example.metadata.get("options"))
        peers = by_family[example.metadata.get("family", "")]
        pool = peers if len(peers) > 1 else usable
        other = _other(pool, example, rng)
        draw = rng.random()
        if guess_on == "guessable" and not example.metadata.get("guessable", False):
            draw = no_search_fraction + draw * (1.0 - no_search_fraction)
        common: dict[str, Any] = {"topk": topk, "max_obs_tokens": max_obs_tokens, "prompt_ids": prompt_ids}
        if draw < no_search_fraction:
            guess = other.golden_answers[0]
            demos.append(
                render_demonstration(
                    example, tokenizer, retriever, searches=[], answer=guess, kind="no_search", **common
                )
            )
        elif len(hops) > 1 and draw < no_search_fraction + wrong_hop_fraction:
            source = other if wrong_hop_pool == "family" else _other(usable, example, rng)
            wrong = source.metadata["hops"][-1]
            queries = [h["query"] for h in hops[:-1]] + [wrong["query"]]
            demos.append(
                render_demonstration(
                    example, tokenizer, retriever, searches=queries, answer=wrong["answer"], kind="wrong_hop", **common
                )
            )
        elif len(hops) > 1 and draw < no_search_fraction + wrong_hop_fraction + early_answer_fraction:
            demo = render_demonstration(
                example,
                tokenizer,
                retriever,
                searches=[hops[0]["query"]],
                answer=hops[0]["answer"],
                kind="early_answer",
                **common,
            )
            if hops[0]["passage_id"] in demo.meta["retrieved"][0]:  # it answers what it read
                demos.append(demo)
        else:
            demo = render_demonstration(
                example,
                tokenizer,
                retriever,
                searches=[h["query"] for h in hops],
                # a question with several answers (PhantomWiki) names them all: its metadata says how
                answer=example.metadata.get("demo_answer", example.golden_answers[0]),
                kind="correct",
                **common,
            )
            found = all(h["passage_id"] in ids for h, ids in zip(hops, demo.meta["retrieved"]))
            if found:
                demos.append(demo)
    return demos


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
    """
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
            obs, _ = observation_ids(tokenizer, information_observation(short), max_obs_tokens)
            questions = questions[:1]
        elif pid in {p.id for p in found}:
            obs, _ = observation_ids(tokenizer, information_observation(found), max_obs_tokens)
        else:
            continue
        if agent_probability and rng.random() < agent_probability:
            out.append(_agent_reading_example(tokenizer, questions[0], obs, pid, context, prompt_template))
        else:
            out.append(_reading_example(tokenizer, questions, obs, pid, context))
    return out


def _agent_reading_example(
    tokenizer, reading: tuple[str, str, Example], obs: list[int], pid: str, context: str, prompt_template: str
) -> Demonstration:
    """A reading example in the agent's layout: the question in the prompt, a search of it, the observation, the
    answer turn (kind ``reading_agent``; the agent's tokens are the targets)."""
    question, answer, example = reading
    prompt = encode_prompt(tokenizer, question, prompt_template, example.metadata.get("options"))
    turn = _policy_ids(tokenizer, f"{SEARCH_THOUGHT}<search> {question} </search>")
    final = _policy_ids(tokenizer, f"{ANSWER_THOUGHT}<answer> {answer} </answer>")
    if tokenizer.eos_token_id is not None:
        final.append(tokenizer.eos_token_id)
    return Demonstration(
        prompt_ids=list(prompt),
        response_ids=turn + list(obs) + final,
        response_mask=[1] * len(turn) + [0] * len(obs) + [1] * len(final),
        kind="reading_agent",
        example_id=pid,
        meta={"questions": [question], "context": context},
    )


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
