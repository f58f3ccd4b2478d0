"""Demonstrations have the rollout engine's exact token layout; SFT trains only on policy tokens."""

from __future__ import annotations

import copy

import pytest
import torch

from stratarl.data.examples import Example
from stratarl.retrieval.bm25 import BM25Retriever
from stratarl.retrieval.base import Passage
from stratarl.trainer.demos import render_demonstration, render_demonstrations
from stratarl.trainer.sft import Demonstration, run_sft, sft_step

PASSAGES = [
    Passage("0", '"Bavir Institute"\nBavir Institute was founded by Doushil Revedi.'),
    Passage("1", '"Doushil Revedi"\nDoushil Revedi was born in Likrix.'),
    Passage("2", '"Zorvanta Press"\nZorvanta Press is headquartered in Staitru.'),
    Passage("3", '"Likrix"\nLikrix is a city in Amberland.'),
]


def _example(i: int = 0) -> Example:
    hops = [{"query": "Who founded Bavir Institute?", "passage_id": "0", "answer": "Doushil Revedi"},
            {"query": "Where was Doushil Revedi born?", "passage_id": "1", "answer": "Likrix"}]
    return Example(f"q{i}", "Where was the founder of Bavir Institute born?", ("Likrix",), "synthkb",
                   {"hops": hops, "question_type": "multi_hop_2"})


@pytest.fixture(scope="module")
def retriever():
    return BM25Retriever.from_passages(PASSAGES)


def _segments(mask):
    """Maximal runs of equal mask values: [(value, start, end), ...]."""
    out, start = [], 0
    for i in range(1, len(mask) + 1):
        if i == len(mask) or mask[i] != mask[start]:
            out.append((mask[start], start, i))
            start = i
    return out


def test_demonstration_layout_matches_the_protocol(smollm2_tokenizer, retriever):
    from stratarl.rollout.engine import observation_ids
    from stratarl.rollout.parsing import information_observation, parse_action

    tok = smollm2_tokenizer
    demo = render_demonstration(_example(), tok, retriever, topk=2, max_obs_tokens=200, prompt_ids=[1, 2, 3],
                                searches=[h["query"] for h in _example().metadata["hops"]], answer="Likrix", kind="correct")
    segments = _segments(demo.response_mask)
    # policy, observation, policy, observation, policy (two searches then the answer).
    assert [s[0] for s in segments] == [1, 0, 1, 0, 1]
    policy_turns = [tok.decode(demo.response_ids[a:b]) for v, a, b in segments if v == 1]
    assert parse_action(policy_turns[0]).kind == "search"
    assert parse_action(policy_turns[0]).content == "Who founded Bavir Institute?"
    assert parse_action(policy_turns[2]).kind == "answer" and parse_action(policy_turns[2]).content == "Likrix"
    assert demo.response_ids[-1] == tok.eos_token_id and demo.response_mask[-1] == 1
    # Observation tokens are exactly what the engine appends for the same hits.
    hits = retriever.search(["Who founded Bavir Institute?"], 2)[0]
    expected, _ = observation_ids(tok, information_observation(hits), 200)
    _, a, b = segments[1]
    assert demo.response_ids[a:b] == expected
    assert demo.meta["retrieved"][0][0] == "0"


def test_imperfect_demonstrations_are_mixed_in(smollm2_tokenizer, retriever):
    examples = [_example(i) for i in range(40)]
    demos = render_demonstrations(examples, smollm2_tokenizer, retriever, num_demos=40, topk=2, max_obs_tokens=100,
                                  no_search_fraction=0.3, wrong_hop_fraction=0.3, seed=0)
    kinds = {d.kind for d in demos}
    assert kinds == {"correct", "no_search", "wrong_hop"}
    for d in demos:
        if d.kind == "no_search":
            assert 0 not in d.response_mask  # answers at once: no observation
        if d.kind == "correct":
            assert d.meta["answer"] == "Likrix"


def test_demonstrations_need_hops(smollm2_tokenizer, retriever):
    plain = Example("x", "What?", ("a",))
    with pytest.raises(ValueError, match="metadata\\['hops'\\]"):
        render_demonstrations([plain], smollm2_tokenizer, retriever, num_demos=1, topk=1, max_obs_tokens=50,
                              no_search_fraction=0, wrong_hop_fraction=0, seed=0)


def _demo(ids, mask):
    return Demonstration(prompt_ids=[5, 6], response_ids=ids, response_mask=mask)


def test_sft_loss_ignores_observation_tokens(tiny_model):
    model = copy.deepcopy(tiny_model)
    a = _demo([10, 11, 12, 13], [1, 0, 0, 1])
    b = _demo([10, 99, 98, 13], [1, 0, 0, 1])  # different observation tokens...
    loss_a = sft_step(model, [a], 0, micro_batch_tokens=100, chunk_tokens=4)
    grads_a = [p.grad.clone() for p in model.parameters() if p.grad is not None]
    model.zero_grad(set_to_none=True)
    loss_b = sft_step(model, [b], 0, micro_batch_tokens=100, chunk_tokens=4)
    # ...are context, not targets: the loss counts the same 2 policy tokens in both.
    assert loss_a["policy_tokens"] == loss_b["policy_tokens"] == 2
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([[5, 6, 10, 11, 12, 13]])).logits[0].float()
        logp = torch.log_softmax(logits, -1)
        expected = -(logp[1, 10] + logp[4, 13]) / 2
    torch.testing.assert_close(torch.tensor(loss_a["loss"]), expected)
    assert grads_a


def test_sft_reduces_the_loss(tiny_model):
    model = copy.deepcopy(tiny_model)
    demos = [_demo([10, 11, 12, 13, 14], [1, 1, 0, 1, 1]), _demo([20, 21, 22], [1, 1, 1])]
    result = run_sft(model, demos, 0, lr=1e-2, epochs=6, batch_size=2, seed=0, micro_batch_tokens=64, chunk_tokens=8)
    assert result["steps"] == 6
    assert result["last_epoch_loss"] < 0.7 * result["first_epoch_loss"]
