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
search found.
"""

from __future__ import annotations

import random
from typing import Sequence

from stratarl.data.examples import Example
from stratarl.trainer.sft import Demonstration

# The two thoughts differ from their first word on, so the search-or-answer decision is one
# clear token for the model to learn (a shared prefix made greedy decoding pick the wrong one).
SEARCH_THOUGHT = "<think> I need to search for this. </think>\n"
ANSWER_THOUGHT = "<think> The information gives the answer. </think>\n"


def _policy_ids(tokenizer, text: str) -> list[int]:
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def render_demonstration(example: Example, tokenizer, retriever, *, topk: int, max_obs_tokens: int,
                         prompt_ids: list[int], searches: Sequence[str], answer: str, kind: str) -> Demonstration:
    """One trajectory: a search turn per query in ``searches``, then the answer turn."""
    from stratarl.rollout.engine import observation_ids
    from stratarl.rollout.parsing import information_observation

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
    return Demonstration(prompt_ids=list(prompt_ids), response_ids=response, response_mask=mask, kind=kind,
                         example_id=example.id, meta={"retrieved": retrieved, "searches": list(searches), "answer": answer})


def _other(pool: Sequence[Example], example: Example, rng: random.Random) -> Example:
    """A uniformly drawn member of ``pool`` other than ``example`` (itself only if it is alone)."""
    j = rng.randrange(len(pool))
    if pool[j] is example and len(pool) > 1:
        j = (j + 1 + rng.randrange(len(pool) - 1)) % len(pool)
    return pool[j]


def render_demonstrations(examples: Sequence[Example], tokenizer, retriever, *, num_demos: int, topk: int,
                          max_obs_tokens: int, no_search_fraction: float, wrong_hop_fraction: float,
                          seed: int) -> list[Demonstration]:
    """Up to ``num_demos`` demonstrations from examples that carry hops.

    A "correct" demonstration is kept only if every hop's gold passage was retrieved
    (otherwise the demo would teach answering what the passages do not say).
    """
    from stratarl.rollout.prompt import encode_prompt

    usable = [e for e in examples if e.metadata.get("hops")]
    if not usable:
        raise ValueError("no training example has metadata['hops']: warm-start demonstrations need the synthetic "
                         "task (data.source=synthetic) or files whose rows carry hops; set sft.enabled=false otherwise")
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
        prompt_ids = encode_prompt(tokenizer, example.question)
        peers = by_family[example.metadata.get("family", "")]
        pool = peers if len(peers) > 1 else usable
        other = _other(pool, example, rng)
        draw = rng.random()
        common = dict(topk=topk, max_obs_tokens=max_obs_tokens, prompt_ids=prompt_ids)
        if draw < no_search_fraction:
            guess = other.golden_answers[0]
            demos.append(render_demonstration(example, tokenizer, retriever, searches=[], answer=guess,
                                              kind="no_search", **common))
        elif len(hops) > 1 and draw < no_search_fraction + wrong_hop_fraction:
            wrong = other.metadata["hops"][-1]
            queries = [h["query"] for h in hops[:-1]] + [wrong["query"]]
            demos.append(render_demonstration(example, tokenizer, retriever, searches=queries, answer=wrong["answer"],
                                              kind="wrong_hop", **common))
        else:
            demo = render_demonstration(example, tokenizer, retriever, searches=[h["query"] for h in hops],
                                        answer=example.golden_answers[0], kind="correct", **common)
            found = all(h["passage_id"] in ids for h, ids in zip(hops, demo.meta["retrieved"]))
            if found:
                demos.append(demo)
    return demos
