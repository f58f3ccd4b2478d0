"""Demonstrations have the rollout engine's exact token layout; SFT trains only on policy tokens."""

from __future__ import annotations

import copy
import itertools

import pytest
import torch
from warmstart_lab import mask_runs

from stratarl.data.examples import Example
from stratarl.infra.schedules import sft_lr_factor
from stratarl.retrieval.base import Passage
from stratarl.retrieval.bm25 import BM25Retriever
from stratarl.trainer.warmstart.demos import Demonstration, render_demonstration, render_demonstrations
from stratarl.trainer.warmstart.render import DemoRenderer
from stratarl.trainer.warmstart.sft import demo_shortfall, run_sft, sft_step

PASSAGES = [
    Passage("0", '"Bavir Institute"\nBavir Institute was founded by Doushil Revedi.'),
    Passage("1", '"Doushil Revedi"\nDoushil Revedi was born in Likrix.'),
    Passage("2", '"Zorvanta Press"\nZorvanta Press is headquartered in Staitru.'),
    Passage("3", '"Likrix"\nLikrix is a city in Amberland.'),
]


def _example(i: int = 0) -> Example:
    hops = [
        {"query": "Who founded Bavir Institute?", "passage_id": "0", "answer": "Doushil Revedi"},
        {"query": "Where was Doushil Revedi born?", "passage_id": "1", "answer": "Likrix"},
    ]
    return Example(
        f"q{i}",
        "Where was the founder of Bavir Institute born?",
        ("Likrix",),
        "synthkb",
        {"hops": hops, "question_type": "multi_hop_2"},
    )


@pytest.fixture(scope="module")
def retriever():
    return BM25Retriever.from_passages(PASSAGES)


def test_demonstration_layout_matches_the_protocol(smollm2_tokenizer, retriever):
    from stratarl.rollout.engine import observation_ids
    from stratarl.rollout.parsing import information_observation, parse_action

    tok = smollm2_tokenizer
    demo = render_demonstration(
        _example(),
        DemoRenderer.build(tok, retriever, topk=2, max_obs_tokens=200),
        prompt_ids=[1, 2, 3],
        calls=[("search", h["query"]) for h in _example().metadata["hops"]],
        answer="Likrix",
        kind="correct",
    )
    segments = mask_runs(demo.response_mask)
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
    demos = render_demonstrations(
        examples,
        smollm2_tokenizer,
        retriever,
        num_demos=40,
        topk=2,
        max_obs_tokens=100,
        no_search_fraction=0.3,
        wrong_hop_fraction=0.3,
        seed=0,
    )
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
        render_demonstrations(
            [plain],
            smollm2_tokenizer,
            retriever,
            num_demos=1,
            topk=1,
            max_obs_tokens=50,
            no_search_fraction=0,
            wrong_hop_fraction=0,
            seed=0,
        )


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


def test_sft_lr_factor_warmup_then_constant_or_cosine():
    # 10 steps, 2 warm-up steps: factors 1/2, 2/2, then constant 1 ...
    assert [sft_lr_factor(s, 10, 2, "constant") for s in range(4)] == [0.5, 1.0, 1.0, 1.0]
    # ... or cosine over steps 2..9 (p = (s - 2) / 7): 1 at p = 0, 0.1 + 0.9 * (1 + cos(pi/2)) / 2 = 0.55
    # at p = 1/2 (s = 5.5, so not a step; check s = 2 and the last step), 0.1 at p = 1.
    assert sft_lr_factor(2, 10, 2, "cosine") == 1.0
    assert sft_lr_factor(9, 10, 2, "cosine") == pytest.approx(0.1)
    cosine = [sft_lr_factor(s, 10, 2, "cosine") for s in range(2, 10)]
    assert all(a > b for a, b in itertools.pairwise(cosine))  # strictly decreasing after warm-up
    # midpoint of a 2-step warm-up + 3-step decay (steps 2, 3, 4; p = 0, 1/2, 1): 0.1 + 0.9 * 0.5 = 0.55
    assert sft_lr_factor(3, 5, 2, "cosine") == pytest.approx(0.55)
    # one step only: warm-up of 1 gives factor 1 at step 0, never a division by zero
    assert sft_lr_factor(0, 1, 1, "cosine") == 1.0
    with pytest.raises(ValueError, match="cosine"):
        sft_lr_factor(0, 10, 1, "linear")


def test_run_sft_cosine_schedule_reaches_a_tenth_of_the_lr(tiny_model):
    model = copy.deepcopy(tiny_model)
    demos = [_demo([10, 11, 12, 13, 14], [1, 1, 0, 1, 1]), _demo([20, 21, 22], [1, 1, 1])]
    lrs = []
    run_sft(
        model,
        demos,
        0,
        lr=1e-2,
        epochs=4,
        batch_size=1,
        seed=0,
        micro_batch_tokens=64,
        chunk_tokens=8,
        warmup_fraction=0.25,
        schedule="cosine",
        on_step=lambda step, total, m: lrs.append(m["sft/lr"]),
    )
    # 8 steps, warm-up int(0.25 * 8) = 2 steps. get_last_lr after step s is the lr of step s + 1:
    # 1e-2 * [1 (s=2), ..., 0.1 (s=7)] from the second logged value on.
    assert len(lrs) == 8
    assert lrs[0] == pytest.approx(1e-2)  # lr after the first step = warm-up factor 2/2
    assert lrs[-2] == pytest.approx(1e-3)  # the last step (s = 7) runs at 10% of the lr
    assert all(a >= b for a, b in itertools.pairwise(lrs))


def test_sft_schedule_is_validated():
    from stratarl.trainer.config import ConfigError, SFTConfig

    SFTConfig(schedule="cosine").validate("sft")
    with pytest.raises(ConfigError, match="sft.schedule"):
        SFTConfig(schedule="linear").validate("sft")


def _render(examples, tokenizer, retriever, *, num_demos: int, **options):
    """``render_demonstrations`` with top-2 retrieval, 64 observation tokens, seed 0 and no imperfect demonstrations
    unless ``options`` say otherwise."""
    settings = {"topk": 2, "max_obs_tokens": 64, "no_search_fraction": 0.0, "wrong_hop_fraction": 0.0, "seed": 0}
    return render_demonstrations(examples, tokenizer, retriever, num_demos=num_demos, **{**settings, **options})


def test_imperfect_demonstrations_borrow_from_the_same_family(smollm2_tokenizer):
    from stratarl.data.synth import generate_knowledge_base

    kb = generate_knowledge_base(seed=0, size=200, num_train=60, num_test=5, hop_mix=(0.5, 0.5, 0.0))
    retriever = BM25Retriever.from_passages(kb.passages)
    answers_of: dict[str, set[str]] = {}
    for e in kb.train:
        answers_of.setdefault(e.metadata["family"], set()).add(e.golden_answers[0])
    family = {e.id: e.metadata["family"] for e in kb.train}
    guesses = _render(kb.train, smollm2_tokenizer, retriever, num_demos=60, no_search_fraction=1.0)
    assert len(guesses) == 60 and {d.kind for d in guesses} == {"no_search"}
    size = {f: sum(family[i] == f for i in family) for f in answers_of}
    shared = [d for d in guesses if size[family[d.example_id]] > 1]  # a family of one borrows from any question
    # every guess is an answer of another question of the own family (a country for a country question, ...)
    assert all(d.meta["answer"] in answers_of[family[d.example_id]] for d in shared)
    assert len({family[d.example_id] for d in shared}) > 3  # several families, so the check has teeth
    wrong = _render(kb.train, smollm2_tokenizer, retriever, num_demos=60, wrong_hop_fraction=1.0)
    hops_of = {e.id: e.metadata["hops"] for e in kb.train}
    wrong = [d for d in wrong if d.kind == "wrong_hop" and size[family[d.example_id]] > 1]
    assert len(wrong) > 10
    for d in wrong:
        # the last search asks the own last relation ("Where was", "Who founded", ...) about another entity
        own = hops_of[d.example_id][-1]["query"]
        assert d.meta["searches"][-1].split()[:2] == own.split()[:2]
        assert d.meta["searches"][:-1] == [h["query"] for h in hops_of[d.example_id][:-1]]


def test_demo_shortfall_names_the_fix():
    assert demo_shortfall(100, 100, 400) is None and demo_shortfall(100, 120, 400) is None
    message = demo_shortfall(2000, 96, 100)
    assert "sft.num_demos=2000" in message and "only 96" in message and "100 training questions" in message
    assert "data.synthetic.options.num_train" in message


def test_guess_on_guessable_guesses_only_on_small_answer_sets(smollm2_tokenizer):
    """``guess_on="guessable"``: every guess is on a guessable question; the other questions search, with the
    wrong-hop share they would have among searching demonstrations; ``"any"`` guesses on both kinds."""
    from stratarl.data.synth import generate_knowledge_base

    kb = generate_knowledge_base(seed=1, size=300, num_train=150, num_test=5, hop_mix=(0.3, 0.7, 0.0))
    retriever = BM25Retriever.from_passages(kb.passages)
    guessable = {e.id: e.metadata["guessable"] for e in kb.train}
    assert 10 < sum(guessable.values()) < len(guessable) - 10  # both kinds are there, so the check has teeth

    def render(guess_on: str):
        return _render(
            kb.train,
            smollm2_tokenizer,
            retriever,
            num_demos=150,
            no_search_fraction=0.6,
            wrong_hop_fraction=0.4,
            guess_on=guess_on,
        )

    only = render("guessable")
    guesses = [d for d in only if d.kind == "no_search"]
    assert guesses and all(guessable[d.example_id] for d in guesses)
    searching = [d for d in only if not guessable[d.example_id]]
    assert searching and all(d.kind != "no_search" for d in searching)
    # wrong_hop 0.4 of all = 1.0 of the searching share (0.4): every searching multi-hop demonstration is wrong
    assert {d.kind for d in searching if d.kind != "correct" or len(d.meta["searches"]) > 1} == {"wrong_hop"}
    anywhere = [d for d in render("any") if d.kind == "no_search"]
    assert any(not guessable[d.example_id] for d in anywhere)


def test_guess_on_is_validated_and_its_default_keeps_warm_start_keys():
    from stratarl.trainer.config import Config, ConfigError, SFTConfig
    from stratarl.trainer.warmstart.stages import warm_start_key

    with pytest.raises(ConfigError, match="sft.guess_on"):
        SFTConfig(guess_on="sometimes").validate("sft")
    with pytest.raises(ConfigError, match="sft.wrong_hop_pool"):
        SFTConfig(wrong_hop_pool="elsewhere").validate("sft")
    cfg = Config()
    cfg.validate()
    assert "guess_on" not in warm_start_key(cfg)["sft"] and "wrong_hop_pool" not in warm_start_key(cfg)["sft"]
    cfg.sft.guess_on = "guessable"
    assert warm_start_key(cfg)["sft"]["guess_on"] == "guessable"


def test_the_warm_start_key_holds_the_protocol_and_tools_only_when_they_are_not_the_default():
    """A hermes warm start never reuses a search_r1 one from the cache; the default keys stay as they were."""
    from stratarl.trainer.config import load_config
    from stratarl.trainer.warmstart.stages import warm_start_key

    default = warm_start_key(load_config(None, []))
    assert "protocol" not in default and "open_fraction" not in default["sft"]
    hermes = warm_start_key(load_config(None, ["rollout.protocol=hermes", "rollout.tools=[search,open]"]))
    assert hermes["protocol"] == {"protocol": "hermes", "tools": ["search", "open"], "tool_params": {}}
    opens = warm_start_key(load_config(None, ["rollout.tools=[search,open]", "sft.open_fraction=0.25"]))
    assert opens["protocol"]["tools"] == ["search", "open"] and opens["sft"]["open_fraction"] == 0.25


def test_wrong_hop_pool_any_takes_the_wrong_last_hop_from_other_families(smollm2_tokenizer):
    """``wrong_hop_pool="any"``: some wrong last hops ask another relation (answers of another type); ``family``
    keeps the own relation every time."""
    from stratarl.data.synth import generate_knowledge_base

    kb = generate_knowledge_base(seed=2, size=300, num_train=120, num_test=5, hop_mix=(0.0, 1.0, 0.0))
    retriever = BM25Retriever.from_passages(kb.passages)
    hops_of = {e.id: e.metadata["hops"] for e in kb.train}

    def same_relation_share(pool: str) -> float:
        demos = _render(
            kb.train, smollm2_tokenizer, retriever, num_demos=120, wrong_hop_fraction=1.0, wrong_hop_pool=pool
        )
        wrong = [d for d in demos if d.kind == "wrong_hop"]
        assert len(wrong) > 30
        own = [d.meta["searches"][-1].split()[:2] == hops_of[d.example_id][-1]["query"].split()[:2] for d in wrong]
        return sum(own) / len(own)

    assert same_relation_share("family") == 1.0
    assert same_relation_share("any") < 0.7
