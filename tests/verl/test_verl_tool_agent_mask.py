"""veRL's ToolAgentLoop, replayed in process: the response mask that Stratified GRPO's strata come from.

`stratified_grpo` counts a rollout's searches as the runs of `response_mask = 0` between runs of 1
(stratarl.algos.search_counts). That is only right if veRL's `tool_agent` loop writes 1 on generated
tokens and one block of 0s per tool round, and appends a tool response whole or not at all. These
tests pin that contract on the installed veRL (no Ray, no model: a scripted server returns fixed
assistant turns in the hermes format, the recipe's search tool answers from a stub retriever), so
a veRL upgrade that changes it fails here, loudly, instead of silently shifting strata.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

pytest.importorskip("verl.trainer.ppo.core_algos", reason="needs veRL (make test-verl runs these in .venv-verl)")

import torch
from harness.agent_model import QUERY, build_agent_tokenizer, tool_call_text
from omegaconf import OmegaConf
from verl.experimental.agent_loop.agent_loop import DictConfigWrap, ToolListWrap
from verl.experimental.agent_loop.tool_agent_loop import ToolAgentLoop
from verl.tools.function_tool import load_function_tools_from_path
from verl.workers.rollout.replica import TokenOutput

from stratarl.algos import search_counts
from stratarl.integrations.verl_data import VERL_USER_TEMPLATE

RECIPES = Path(__file__).resolve().parents[2] / "recipes" / "verl"
CALL = tool_call_text() + " <|im_end|>"
TWO_CALLS = tool_call_text() + " " + tool_call_text() + " <|im_end|>"
ANSWER = "<answer> Paris </answer> <|im_end|>"
PLAIN_QUERY_CALL = f"<tool_call> {QUERY} </tool_call> <|im_end|>"  # what the old prompt asked for


class ScriptedServer:
    """veRL's server-manager ``generate`` returning the scripted assistant turns, in order."""

    def __init__(self, tokenizer, turns):
        self.tokenizer, self.turns = tokenizer, list(turns)

    async def generate(self, request_id, *, prompt_ids, sampling_params, **kwargs):
        ids = self.tokenizer.convert_tokens_to_ids(self.turns.pop(0).split())
        return TokenOutput(token_ids=ids, log_probs=[-0.5] * len(ids), stop_reason="completed")


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return build_agent_tokenizer(tmp_path_factory.mktemp("tokenizer"))


def replay(tokenizer, turns, *, response_length=256, max_assistant_turns=4, max_parallel_calls=1):
    """One ToolAgentLoop rollout with the recipe's search tool; returns veRL's AgentLoopOutput."""
    (tool,) = [t for t in load_function_tools_from_path(str(RECIPES / "search_tool.py")) if t.name == "search"]
    config = OmegaConf.create(
        {
            "actor_rollout_ref": {
                "rollout": {
                    "prompt_length": 256,
                    "response_length": response_length,
                    "full_determinism": False,
                    "multi_turn": {
                        "format": "hermes",
                        "max_assistant_turns": max_assistant_turns,
                        "max_user_turns": None,
                        "max_parallel_calls": max_parallel_calls,
                        "max_tool_response_length": 2000,
                        "tool_response_truncate_side": "middle",
                    },
                }
            }
        }
    )

    async def run():
        loop = ToolAgentLoop(
            DictConfigWrap(config),
            server_manager=ScriptedServer(tokenizer, turns),
            tokenizer=tokenizer,
            processor=None,
            dataset_cls=None,
            data_config=DictConfigWrap(OmegaConf.create({})),
            tools=ToolListWrap([tool]),
        )
        prompt = [{"role": "user", "content": VERL_USER_TEMPLATE.format(question="what is the capital of france?")}]
        return await loop.run({"temperature": 1.0}, raw_prompt=prompt)

    return asyncio.run(run())


def blocks(output) -> int:
    return int(search_counts(torch.tensor([output.response_mask]))[0])


def rounds(output) -> int:
    """Tool rounds veRL appended: num_turns = user turns + assistant turns + 1, assistant = user + 1."""
    assert (output.num_turns - 2) % 2 == 0, output.num_turns
    return (output.num_turns - 2) // 2


@pytest.mark.parametrize("searches", [0, 1, 2, 3])
def test_one_mask_block_per_tool_round(tokenizer, retriever, searches):
    out = replay(tokenizer, [CALL] * searches + [ANSWER])
    assert blocks(out) == rounds(out) == searches
    assert len(out.extra_fields["tool_rewards"]) == len(retriever.queries) == searches
    # Generated tokens are 1, and every block is followed by generated tokens (never trailing).
    assert out.response_mask[0] == 1 and out.response_mask[-1] == 1
    assert sum(out.response_mask) == searches * len(CALL.split()) + len(ANSWER.split())
    assert len(out.response_ids) == len(out.response_mask)


def test_a_tool_response_that_does_not_fit_is_dropped_whole(tokenizer, retriever):
    """The search runs, but its response would pass response_length: veRL ends the rollout without it."""
    out = replay(tokenizer, [CALL, CALL, ANSWER], response_length=len(CALL.split()) + 3)
    assert len(retriever.queries) == len(out.extra_fields["tool_rewards"]) == 1  # searched ...
    assert blocks(out) == rounds(out) == 0  # ... but no observation in the rollout
    assert out.response_mask == [1] * len(CALL.split())


def test_a_dropped_final_response_after_kept_ones(tokenizer, retriever):
    """Two rounds fit, the third response does not: two blocks, three retriever calls."""
    first = replay(tokenizer, [CALL, CALL, ANSWER])
    retriever.queries.clear()
    budget = len(first.response_mask) - len(ANSWER.split()) + len(CALL.split()) + 1  # 2 rounds + 3rd call
    out = replay(tokenizer, [CALL, CALL, CALL, ANSWER], response_length=budget)
    assert blocks(out) == rounds(out) == 2
    assert len(retriever.queries) == len(out.extra_fields["tool_rewards"]) == 3
    assert out.response_mask[-1] == 1


def test_parallel_calls_in_one_turn_are_one_block(tokenizer, retriever):
    out = replay(tokenizer, [TWO_CALLS, ANSWER], max_parallel_calls=2)
    assert blocks(out) == rounds(out) == 1
    assert len(retriever.queries) == len(out.extra_fields["tool_rewards"]) == 2


def test_an_error_observation_is_a_block(tokenizer, retriever):
    """A failed search still appends a tool response (the error text): it counts as a round."""
    retriever.fail_on = {1}
    out = replay(tokenizer, [CALL, CALL, ANSWER])
    assert blocks(out) == rounds(out) == 2
    assert len(retriever.queries) == 2 and out.extra_fields["tool_rewards"] == [0.0, 0.0]


def test_a_call_in_the_last_allowed_turn_is_not_executed(tokenizer, retriever):
    out = replay(tokenizer, [CALL, CALL], max_assistant_turns=2)
    assert blocks(out) == rounds(out) == 1
    assert len(retriever.queries) == 1


def test_a_plain_query_between_tool_call_tags_is_no_search(tokenizer, retriever):
    """hermes needs JSON: `<tool_call> query </tool_call>` ends the rollout with 0 searches, silently.

    That is why the recipe's prompt (VERL_USER_TEMPLATE) asks for the JSON form.
    """
    out = replay(tokenizer, [PLAIN_QUERY_CALL, ANSWER])
    assert blocks(out) == rounds(out) == 0 and retriever.queries == []


def test_the_recipe_prompt_shows_a_call_the_hermes_parser_accepts(tokenizer):
    """The example in the prompt decodes, as hermes decodes it, to the recipe tool's name and arguments."""
    import json

    from verl.experimental.agent_loop.tool_parser import ToolParser

    (tool,) = [t for t in load_function_tools_from_path(str(RECIPES / "search_tool.py")) if t.name == "search"]
    prompt = VERL_USER_TEMPLATE.format(question="what is the capital of france?")
    (example,) = ToolParser.get_tool_parser("hermes", tokenizer).tool_call_regex.findall(prompt)
    call = json.loads(example)
    assert call["name"] == tool.name
    assert sorted(call["arguments"]) == sorted(tool.tool_schema.function.parameters.properties)
    assert isinstance(call["arguments"]["query_list"], list)
