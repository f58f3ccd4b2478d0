"""A real model's tool calls through veRL's loop: SmolLM2-135M-Instruct, its own tokenizer, a tool-aware template.

The tiny policy of the other smokes emits a fixed seven-token call under a template that ignores the tool
schema. Here the tokenizer is SmolLM2's (49152 tokens, from stratarl's bundled GGUF, cached under
~/.cache/stratarl/models) with `harness.smollm2.TOOL_CHAT_TEMPLATE` (Qwen2.5's tool
format on SmolLM2's ChatML tokens), and in the slow test the policy is SmolLM2-135M-Instruct itself,
warm-started to call the search tool (only its output layer moves; module doc). veRL's hermes parser reads
the JSON calls out of the model's own tokens, the recipe's search tool runs them against `stratarl serve`,
and the strata are checked as in the tiny-policy smoke.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

pytest.importorskip("verl.trainer.ppo.core_algos", reason="needs veRL (make test-verl runs these in .venv-verl)")

import torch
from harness import smoke_multiturn as mt
from harness import smollm2

from stratarl.algos import search_counts

REPO = Path(__file__).resolve().parents[2]
PROMPT = mt.user_prompt(mt.QUESTIONS[0], "smollm2")


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    try:
        source = smollm2.source_folder()
    except RuntimeError as error:
        pytest.skip(str(error))
    tokenizer = AutoTokenizer.from_pretrained(source)
    tokenizer.chat_template = smollm2.TOOL_CHAT_TEMPLATE
    return tokenizer


def test_the_template_renders_the_tool_schema_veRL_passes(tokenizer):
    schema = smollm2.search_tool().tool_schema.model_dump(exclude_unset=True, exclude_none=True)
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": PROMPT}], tools=[schema], add_generation_prompt=True, tokenize=False
    )
    assert text.startswith("<|im_start|>system\n") and text.endswith("<|im_start|>assistant\n")
    tools_block = text.split("<tools>\n", 1)[1].split("\n</tools>", 1)[0]
    assert json.loads(tools_block) == schema  # veRL's schema of recipes/verl/search_tool.py, verbatim
    assert '<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>' in text
    # SmolLM2's own template drops the schema: that is why this one exists.
    from transformers import AutoTokenizer

    own = AutoTokenizer.from_pretrained(smollm2.source_folder())
    assert "search" not in own.apply_chat_template(
        [{"role": "user", "content": "hi"}], tools=[schema], add_generation_prompt=True, tokenize=False
    )


def test_hermes_reads_json_calls_in_smollm2_tokens_and_the_mask_counts_rounds(tokenizer, retriever):
    call_ids = tokenizer.encode(smollm2.CALL_TEXT, add_special_tokens=False)
    assert len(call_ids) > 20 and tokenizer.decode(call_ids) == smollm2.CALL_TEXT  # plain text tokens, no special one
    out = smollm2.replay(tokenizer, [smollm2.CALL_TEXT, smollm2.CALL_TEXT, "<answer> Paris </answer>"], PROMPT)
    assert retriever.queries == [smollm2.QUERY, smollm2.QUERY]  # hermes parsed both calls; the tool ran them
    assert len(out.extra_fields["tool_rewards"]) == 2 and (out.num_turns - 2) // 2 == 2
    assert int(search_counts(torch.tensor([out.response_mask]))[0]) == 2
    text = tokenizer.decode(out.response_ids)
    assert text.count('<tool_response>\nDoc 1(Title: "Paris") Paris is the capital of France .\n</tool_response>') == 2


def test_a_malformed_call_is_no_search(tokenizer, retriever):
    broken = smollm2.CALL_TEXT.replace("]}}", "]}")  # one brace short: not JSON
    out = smollm2.replay(tokenizer, [broken, "<answer> Paris </answer>"], PROMPT)
    assert retriever.queries == [] and (out.num_turns - 2) // 2 == 0


@pytest.fixture(scope="module")
def run(tmp_path_factory, smoke_multiturn):
    try:
        smollm2.source_folder()
    except RuntimeError as error:
        pytest.skip(str(error))
    workdir = tmp_path_factory.mktemp("verl-smollm2")
    smoke_multiturn(workdir, "--model", "smollm2", timeout=1500)
    loaded = mt.load_run(workdir)
    loaded["warm_start"] = json.loads((workdir / "warm_start.json").read_text())
    return loaded


@pytest.mark.slow
def test_smollm2_calls_the_search_tool_in_main_ppo_and_the_strata_hold(run):
    assert sorted(run["metrics"]) == [1]
    # The warm start reached the demonstrated branch frequencies (call 2/3 → 1/2; Paris 1/2).
    assert {"answer", "tool"} <= set().union(*run["warm_start"]["branches"])
    rows = run["rollouts"][1]
    assert len(rows) == 2 * mt.SMOLLM2_GROUP_SIZE
    # The model's own tokens decode to hermes JSON calls, and the served passages came back in its context.
    calling = [row for row in rows if '<tool_call>\n{"name": "search", "arguments": {"query_list": [' in row["output"]]
    assert calling and all("<tool_response>\nDoc 1(Title:" in row["output"] for row in calling)
    (groups,) = mt.groups_by_step(run).values()
    for group in groups:
        assert len(group["estimator"]) == len(group["agent"]) == mt.SMOLLM2_GROUP_SIZE
        assert sorted((r, k) for r, k, _ in group["estimator"]) == sorted((s, k) for s, k, _ in group["agent"])
        assert all(rounds == calls for _, rounds, calls in group["agent"])
    rounds = sum(mt.tool_rounds(record) for record in run["rewards"])
    assert rounds > 0 and run["server"]["requests"] == run["server"]["queries"] == rounds
    expected = mt.expected_advantages(groups)
    for group, triples in zip(groups, expected):
        seen = sorted(group["estimator"])
        assert [a for _, _, a in seen] == pytest.approx([a for _, _, a in triples], abs=1e-4)
    m = run["metrics"][1]
    flat = [a for triples in expected for _, _, a in triples]
    assert m["critic/advantages/max"] == pytest.approx(max(flat), abs=1e-4)
    assert m["critic/advantages/min"] == pytest.approx(min(flat), abs=1e-4)
    # turn_ppo updated the real model over rows with several turns.
    assert math.isfinite(m["actor/pg_loss"]) and math.isfinite(m["actor/grad_norm"])
    assert m["actor/turns_per_row"] > 1
