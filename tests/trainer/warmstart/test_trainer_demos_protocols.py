"""Demonstrations in the run's protocol and tools: the tokens a rollout would write and read for the same actions
and observations (token-in/token-out), a loss mask on the assistant's tokens only, and Search-R1's demonstrations
unchanged bit for bit."""

from __future__ import annotations

import hashlib
import json
import random
from collections.abc import Sequence

import pytest
from warmstart_lab import mask_runs

from stratarl.data.examples import Example
from stratarl.retrieval.base import Passage
from stratarl.retrieval.bm25 import BM25Retriever
from stratarl.rollout.collect import encode_prompts
from stratarl.rollout.config import RolloutConfig
from stratarl.rollout.engine import RolloutEngine
from stratarl.rollout.generation import Generation, Generator, SamplingParams, StopMatcher
from stratarl.rollout.protocols import make_protocol
from stratarl.trainer.warmstart.demos import hop_calls, render_demonstrations, render_reading_examples
from stratarl.trainer.warmstart.render import ANSWER_THOUGHT, SEARCH_THOUGHT, DemoRenderer

PASSAGES = [
    Passage("0", '"Bavir Institute"\nBavir Institute was founded by Doushil Revedi.'),
    Passage("1", '"Doushil Revedi"\nDoushil Revedi was born in Likrix.'),
    Passage("2", '"Zorvanta Press"\nZorvanta Press is headquartered in Staitru.'),
    Passage("3", '"Likrix"\nLikrix is a city in Amberland.'),
    Passage("4", '"Doushil Revedi"\nDoushil Revedi later moved to Staitru.'),
]
HOPS = [
    {"query": "Who founded Bavir Institute?", "passage_id": "0", "answer": "Doushil Revedi"},
    {"query": "Where was Doushil Revedi born?", "passage_id": "1", "answer": "Likrix"},
]
EXAMPLE = Example("q0", "Where was the founder of Bavir Institute born?", ("Likrix",), "synthkb", {"hops": HOPS})
TOPK, MAX_OBS = 2, 200


@pytest.fixture(scope="module")
def retriever():
    return BM25Retriever.from_passages(PASSAGES)


class TextScript(Generator):
    """Writes a fixed list of turn texts (one row), token by token, stopping at the protocol's stop strings and
    appending EOS after ``</answer>``, as the sampler does."""

    supports_cache_keys = False

    def __init__(self, tokenizer, turns: Sequence[str]):
        self.tokenizer, self.turns = tokenizer, list(turns)

    def generate(self, prompts, params: SamplingParams, max_new_tokens=None):
        (budget,) = max_new_tokens
        matcher = StopMatcher(self.tokenizer, params.stop_strings)
        text = self.turns.pop(0)
        ids, out, stop = self.tokenizer(text.removesuffix(EOS), add_special_tokens=False)["input_ids"], [], None
        for token in ids[:budget]:
            out.append(token)
            if (stop := matcher.check(out)) is not None:
                break
        if stop in params.eos_after or text.endswith(EOS):
            out.append(self.tokenizer.eos_token_id)
        reason = "eos" if text.endswith(EOS) else "stop" if stop else "length"
        return [Generation(out, [0.0] * len(out), reason, stop)]


EOS = "<EOS>"
"""A turn text ending in EOS ends with the end-of-sequence token (a llama3_json call)."""


def _demo(tokenizer, retriever, protocol: str, tools: Sequence[str], open_fraction: float = 1.0):
    (demo,) = render_demonstrations(
        [EXAMPLE],
        tokenizer,
        retriever,
        num_demos=1,
        topk=TOPK,
        max_obs_tokens=MAX_OBS,
        no_search_fraction=0.0,
        wrong_hop_fraction=0.0,
        seed=0,
        protocol=protocol,
        tools=tools,
        open_fraction=open_fraction,
    )
    return demo


def _rollout(tokenizer, retriever, protocol: str, tools: Sequence[str], turns: Sequence[str]):
    config = RolloutConfig(
        protocol=protocol, tools=list(tools), topk=TOPK, max_obs_tokens=MAX_OBS, max_turns=4, max_total_tokens=4096
    )
    prompt = encode_prompts(tokenizer, [EXAMPLE], template="search_r1", protocol=config.tool_protocol())[0]
    (rollout,) = RolloutEngine(TextScript(tokenizer, turns), retriever, tokenizer, config).run([prompt])
    return rollout


# The turns a model writes in Qwen2.5's format, spelled out here (not through the protocol's call_text):
# a search of the first hop, then open of the name the first search showed.
HERMES_TURNS = [
    SEARCH_THOUGHT
    + '<tool_call>\n{"name": "search", "arguments": {"query": "Who founded Bavir Institute?"}}\n</tool_call>',
    SEARCH_THOUGHT + '<tool_call>\n{"name": "open", "arguments": {"title": "Doushil Revedi"}}\n</tool_call>',
    ANSWER_THOUGHT + "<answer> Likrix </answer>",
]


def test_a_hermes_demonstration_is_the_token_sequence_a_hermes_rollout_writes(smollm2_tokenizer, retriever):
    tok = smollm2_tokenizer
    demo = _demo(tok, retriever, "hermes", ["search", "open"])
    rollout = _rollout(tok, retriever, "hermes", ["search", "open"], HERMES_TURNS)
    assert [c.tool for c in rollout.calls] == ["search", "open"] and rollout.answer == "Likrix"
    assert demo.prompt_ids == rollout.prompt_ids
    assert demo.response_ids == rollout.response_ids  # the turns and the tool turns, token for token
    assert demo.response_mask == rollout.response_mask
    text = tok.decode(demo.response_ids)
    assert "<tool_call>" in text and "<tool_response>" in text and "<|im_start|>user\n<tool_response>\n" in text
    assert "<search>" not in text and "<information>" not in text
    assert demo.meta["calls"] == [
        {"tool": "search", "argument": "Who founded Bavir Institute?"},
        {"tool": "open", "argument": "Doushil Revedi"},
    ]
    # the opened document is the whole of "Doushil Revedi" (both of its passages), gold passage included
    assert demo.meta["retrieved"][1] == ["1", "4"]


def test_a_search_r1_demonstration_with_open_is_what_a_search_r1_rollout_writes(smollm2_tokenizer, retriever):
    tok = smollm2_tokenizer
    turns = [
        SEARCH_THOUGHT + "<search> Who founded Bavir Institute? </search>",
        SEARCH_THOUGHT + "<open> Doushil Revedi </open>",
        ANSWER_THOUGHT + "<answer> Likrix </answer>",
    ]
    demo = _demo(tok, retriever, "search_r1", ["search", "open"])
    rollout = _rollout(tok, retriever, "search_r1", ["search", "open"], turns)
    assert (demo.prompt_ids, demo.response_ids, demo.response_mask) == (
        rollout.prompt_ids,
        rollout.response_ids,
        rollout.response_mask,
    )
    assert "<open> Doushil Revedi </open>" in tok.decode(demo.response_ids)


def test_the_loss_mask_covers_the_assistants_tokens_only(smollm2_tokenizer, retriever):
    tok = smollm2_tokenizer
    demo = _demo(tok, retriever, "hermes", ["search", "open"])
    protocol = make_protocol("hermes", ["search", "open"])
    runs = mask_runs(demo.response_mask)
    assert [v for v, _, _ in runs] == [1, 0, 1, 0, 1]
    written = [tok.decode(demo.response_ids[a:b]) for v, a, b in runs if v == 1]
    assert [protocol.parse(t).kind for t in written] == ["search", "open", "answer"]
    assert written == [*HERMES_TURNS[:2], HERMES_TURNS[2] + "<|im_end|>"]  # the answer turn ends with EOS
    for v, a, b in runs:
        if v == 0:  # every masked token is the tool turn: from the assistant's end of turn to its next header
            read = tok.decode(demo.response_ids[a:b])
            assert read.startswith("<|im_end|>\n<|im_start|>user\n<tool_response>\n")
            assert read.endswith("\n</tool_response><|im_end|>\n<|im_start|>assistant\n")


def test_open_appears_only_with_the_open_tool_and_its_share(smollm2_tokenizer, retriever):
    tok = smollm2_tokenizer
    assert "calls" not in _demo(tok, retriever, "hermes", ["search"]).meta  # search alone: no open, no call list
    searches = _demo(tok, retriever, "hermes", ["search", "open"], open_fraction=0.0)
    assert [c["tool"] for c in searches.meta["calls"]] == ["search", "search"]
    rng = random.Random(0)
    drawn = [hop_calls(HOPS * 2, ["search", "open"], rng, 0.5, None) for _ in range(200)]
    # the first hop always searches; each later hop opens the previous answer with probability 1/2
    assert all(calls[0][0] == "search" for calls in drawn)
    share = sum(c[0] == "open" for calls in drawn for c in calls[1:]) / (3 * 200)
    assert 0.4 < share < 0.6
    assert hop_calls(HOPS, ["search", "open"], rng, 1.0, None)[1] == ("open", "Doushil Revedi")
    # within open's budget (rollout.tool_params.open.max_calls): past it, a hop searches
    assert [c[0] for c in hop_calls(HOPS * 2, ["search", "open"], rng, 1.0, 1)] == [
        "search",
        "open",
        "search",
        "search",
    ]


def test_llama3_json_with_a_chatml_tokenizer_fails_in_one_line(smollm2_tokenizer, retriever):
    with pytest.raises(ValueError, match="llama3_json.*end-of-sequence") as error:
        _demo(smollm2_tokenizer, retriever, "llama3_json", ["search"])
    assert "\n" not in str(error.value)


class EotTokenizer:
    """SmolLM2's tokenizer with Llama-3.1's end of turn: ``<|eot_id|>`` is one token, its EOS (SmolLM2's EOS id)."""

    eos_token, chat_template = "<|eot_id|>", None

    def __init__(self, base):
        self.base, self.eos_token_id = base, base.eos_token_id

    def __call__(self, text, add_special_tokens=False):
        parts = [self.base(part, add_special_tokens=False)["input_ids"] for part in text.split(self.eos_token)]
        return {"input_ids": [i for n, part in enumerate(parts) for i in ([self.eos_token_id] if n else []) + part]}

    def decode(self, ids, skip_special_tokens=False, **kwargs):
        parts, current = [], []
        for i in [*ids, None]:
            if i is None or i == self.eos_token_id:
                parts.append(self.base.decode(current, skip_special_tokens=skip_special_tokens, **kwargs))
                current = []
            else:
                current.append(i)
        return ("" if skip_special_tokens else self.eos_token).join(parts)


def test_a_llama3_json_demonstration_is_the_token_sequence_a_llama3_json_rollout_writes(smollm2_tokenizer, retriever):
    """With a tokenizer whose EOS opens llama3_json's tool turn (Llama-3.1's <|eot_id|>), the demonstration's tokens
    are the rollout's; the one difference is the mask of that token: the rollout samples it, the engine drops it
    and the tool turn writes it again (mask 0), and the demonstration trains it (mask 1) so the model learns to
    end its call."""
    tok = EotTokenizer(smollm2_tokenizer)
    demo = _demo(tok, retriever, "llama3_json", ["search", "open"])
    turns = [
        SEARCH_THOUGHT + '{"name": "search", "parameters": {"query": "Who founded Bavir Institute?"}}' + EOS,
        SEARCH_THOUGHT + '{"name": "open", "parameters": {"title": "Doushil Revedi"}}' + EOS,
        ANSWER_THOUGHT + "<answer> Likrix </answer>",
    ]
    rollout = _rollout(tok, retriever, "llama3_json", ["search", "open"], turns)
    assert [c.tool for c in rollout.calls] == ["search", "open"] and rollout.answer == "Likrix"
    assert (demo.prompt_ids, demo.response_ids) == (rollout.prompt_ids, rollout.response_ids)
    differ = [i for i, (a, b) in enumerate(zip(demo.response_mask, rollout.response_mask)) if a != b]
    assert len(differ) == 2 and all(demo.response_ids[i] == tok.eos_token_id for i in differ)
    assert all(rollout.response_mask[i - 1] == 1 and demo.response_mask[i] == 1 for i in differ)  # after a call
    assert "<|start_header_id|>ipython<|end_header_id|>" in tok.decode(demo.response_ids)


def _digest(demos) -> str:
    rows = [[d.prompt_ids, d.response_ids, d.response_mask, d.kind, d.example_id] for d in demos]
    return hashlib.sha256(json.dumps(rows).encode()).hexdigest()


def test_search_r1_demonstrations_are_unchanged_bit_for_bit(smollm2_tokenizer):
    """The digests were printed by the code before demonstrations spoke other protocols (same seeds)."""
    from stratarl.data.synth import generate_knowledge_base

    tok = smollm2_tokenizer
    kb = generate_knowledge_base(seed=7, size=120, num_train=60, num_test=5, hop_mix=(0.3, 0.7, 0.0))
    retriever = BM25Retriever.from_passages(kb.passages)
    demos = render_demonstrations(
        kb.train,
        tok,
        retriever,
        num_demos=40,
        topk=2,
        max_obs_tokens=120,
        no_search_fraction=0.2,
        wrong_hop_fraction=0.2,
        early_answer_fraction=0.3,
        seed=3,
    )
    assert {d.kind for d in demos} == {"correct", "no_search", "wrong_hop", "early_answer"}
    assert _digest(demos) == "9972876c3c4fcf7f305f065bd777846a6884a1acb1fc9e85d0e40dd31047e1e0"
    reads = render_reading_examples(
        kb.train,
        tok,
        retriever,
        {p.id: p.contents for p in kb.passages},
        topk=2,
        max_obs_tokens=120,
        rng=random.Random(5),
        sentence_probability=0.3,
        agent_probability=0.5,
    )
    assert {d.kind for d in reads} == {"reading", "reading_agent"}
    assert _digest(reads) == "ab6abfa7a39317eff322ea9b59cd37dd9b6b721947a3f4e9a377f6b9c65f6589"


def test_hermes_reading_examples_read_the_tool_turn(smollm2_tokenizer):
    from stratarl.data.synth import generate_knowledge_base

    tok = smollm2_tokenizer
    kb = generate_knowledge_base(seed=7, size=120, num_train=60, num_test=5, hop_mix=(1.0, 0.0, 0.0))
    reads = render_reading_examples(
        kb.train,
        tok,
        BM25Retriever.from_passages(kb.passages),
        {p.id: p.contents for p in kb.passages},
        topk=2,
        max_obs_tokens=120,
        rng=random.Random(5),
        agent_probability=1.0,
        protocol="hermes",
        tools=["search"],
    )
    text = tok.decode(reads[0].response_ids)
    assert "<tool_response>" in text and "<information>" not in text and "<search>" not in text


def test_the_warm_start_of_a_hermes_run_writes_hermes_demonstrations(smollm2_tokenizer):
    """Wiring: the run's rollout.protocol, tools and tool_params reach every demonstration source (fresh worlds,
    reading rehearsal), and its open budget bounds the opens."""
    from stratarl.trainer.config import load_config
    from stratarl.trainer.warmstart.settings import WarmStartSettings
    from stratarl.trainer.warmstart.worlds import reading_batches, world_demonstrations

    cfg = load_config(
        None,
        [
            "model.name=tiny-random",
            "rollout.protocol=hermes",
            "rollout.tools=[search,open]",
            "rollout.tool_params={open: {max_calls: 1, max_tokens: 40}}",
            "sft.enabled=true",
            "sft.open_fraction=1.0",
            "sft.no_search_fraction=0.0",
            "sft.wrong_hop_fraction=0.0",
            "data.synthetic.options={size: 120, num_train: 30, num_test: 4, hop_mix: [0.0, 1.0, 0.0]}",
        ],
    )
    tok = smollm2_tokenizer
    settings = WarmStartSettings.from_config(cfg)
    demos = world_demonstrations(settings, tok, 0)
    texts = [tok.decode(d.response_ids) for d in demos]
    assert demos and all("<tool_call>" in t and "<search>" not in t and "<information>" not in t for t in texts)
    correct = [d for d in demos if d.kind == "correct"]
    assert correct and all([c["tool"] for c in d.meta["calls"]] == ["search", "open"] for d in correct)
    assert all(" ...[truncated]" in t for d, t in zip(demos, texts) if d.kind == "correct")  # open's 40 tokens
    reading = next(reading_batches(settings, tok, batch_size=2, curriculum=0))
    assert all("<tool_response>" in tok.decode(d.prompt_ids + d.response_ids) for d in reading)


def _qwen25_tool_template() -> str:
    """Qwen2.5-Instruct's tool handling in SmolLM2's ChatML tokens, as the veRL smoke renders it (read from its
    source: importing that package needs veRL)."""
    import ast
    from pathlib import Path

    source = Path(__file__).resolve().parents[2] / "verl" / "harness" / "smollm2.py"
    for node in ast.parse(source.read_text()).body:
        if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", "") == "TOOL_CHAT_TEMPLATE":
            return ast.literal_eval(node.value)
    raise AssertionError("TOOL_CHAT_TEMPLATE not found")


def test_a_hermes_demonstration_is_the_conversation_qwen25s_template_renders(smollm2_tokenizer, retriever):
    """Token for token, the whole demonstration (prompt, two calls, their tool turns, the answer) is Qwen2.5's
    template applied to the same conversation (up to the newline the template writes after the last turn)."""
    tok = smollm2_tokenizer
    demo = _demo(tok, retriever, "hermes", ["search", "open"])
    renderer = DemoRenderer.build(
        tok, retriever, topk=TOPK, max_obs_tokens=MAX_OBS, protocol="hermes", tools=["search", "open"]
    )
    protocol = make_protocol("hermes", ["search", "open"])
    user = protocol.messages([{"role": "user", "content": ""}])[1:]  # (the system turn comes with the template)
    user[0]["content"] = tok.decode(demo.prompt_ids).split("<|im_start|>user\n")[1].split("<|im_end|>")[0]
    calls = [("search", {"query": "Who founded Bavir Institute?"}), ("open", {"title": "Doushil Revedi"})]
    conversation = [{"role": "system", "content": "You are a helpful assistant."}, *user]
    for name, arguments in calls:
        thought = SEARCH_THOUGHT.removesuffix("\n")
        call = {"name": name, "arguments": arguments}
        conversation.append({"role": "assistant", "content": thought, "tool_calls": [call]})
        conversation.append({"role": "tool", "content": renderer.run(name, next(iter(arguments.values()))).text})
    conversation.append({"role": "assistant", "content": ANSWER_THOUGHT + "<answer> Likrix </answer>"})
    text = tok.apply_chat_template(
        conversation,
        tools=[t.function_schema() for t in protocol.tools.values()],
        chat_template=_qwen25_tool_template(),
        tokenize=False,
    )
    assert text.endswith("<|im_end|>\n")
    assert demo.prompt_ids + demo.response_ids == tok(text.removesuffix("\n"), add_special_tokens=False)["input_ids"]


@pytest.mark.slow
def test_a_hermes_warm_start_then_a_hermes_rl_step(tmp_path, tiny_overrides):
    """End to end on configs/tiny.yaml: `stratarl sft` writes hermes demonstrations with both tools and saves a
    model, and one RL step in hermes starts from it."""
    from pathlib import Path

    from stratarl.trainer.config import load_config
    from stratarl.trainer.rl import train
    from stratarl.trainer.warmstart.stages import warm_start

    tiny = Path(__file__).resolve().parents[3] / "configs" / "tiny.yaml"
    overrides = [
        *tiny_overrides,
        "rollout.protocol=hermes",
        "rollout.tools=[search,open]",
        "rollout.max_tokens_per_turn=24",
        "sft.enabled=true",
        "sft.open_fraction=1.0",
        "sft.no_search_fraction=0.0",
        "sft.wrong_hop_fraction=0.0",
        "trainer.steps=1",
    ]
    cfg = load_config(tiny, overrides)
    summary = warm_start(cfg, tmp_path / "sft", progress=False)
    assert summary["num_demos"] > 0 and summary["steps"] >= 1
    samples = [json.loads(line) for line in (tmp_path / "sft" / "demos_sample.jsonl").read_text().splitlines()]
    assert samples and all("<tool_call>" in s["text"] and "<search>" not in s["text"] for s in samples)
    cfg = load_config(tiny, [*overrides, f"model.init_from={summary['model']}"])
    assert train(cfg, tmp_path / "rl")["steps"] == 1
