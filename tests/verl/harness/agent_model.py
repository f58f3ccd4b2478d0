"""A tiny policy that calls veRL's search tool in hermes format, built offline and deterministically.

For CPU runs of veRL's multi-turn ``tool_agent`` loop (:mod:`harness.smoke_multiturn`)
and the in-process replay test of its response mask. The tokenizer is word-level (whitespace split,
decoded by joining tokens with one space), so a tool call is a fixed run of tokens that decodes to

    <tool_call> {"name": "search", "arguments": {"query_list": ["France"]}} </tool_call>

which veRL's ``hermes`` parser reads as ``search(query_list=["France"])`` (its regex takes the text
between the tags and ``json.loads`` it; the spaces are JSON whitespace). The model is
:func:`harness.smoke.build_model`'s one-layer Llama set to a bigram table with
:data:`AGENT_RULES`: after ``assistant`` it calls the tool or answers with equal odds, so a
rollout makes k = 0, 1, 2, … searches with probability about 2^-(k+1) (until the turn limit), and
the answer is Paris or Rome with equal odds. Tool responses are mostly unknown words (``[UNK]``);
the model reads only the last token, so each assistant turn starts afresh after ``assistant``.
"""

from __future__ import annotations

from pathlib import Path

from harness import smoke

QUERY = "France"
# One token each (whitespace split); joined with spaces they are the JSON of one hermes tool call.
TOOL_CALL = [
    "<tool_call>",
    '{"name":',
    '"search",',
    '"arguments":',
    '{"query_list":',
    f'["{QUERY}"]}}}}',
    "</tool_call>",
]
AGENT_WORDS = [*smoke.WORDS, "tool", *TOOL_CALL]
AGENT_RULES: dict[str, list[str]] = {
    "assistant": ["<tool_call>", "<answer>"],
    **{TOOL_CALL[i]: [TOOL_CALL[i + 1]] for i in range(len(TOOL_CALL) - 1)},
    "<answer>": smoke.ANSWERS,
    **{answer: ["</answer>"] for answer in smoke.ANSWERS},
}


def tool_call_text() -> str:
    """The decoded text of one tool call, as the hermes parser sees it."""
    return " ".join(TOOL_CALL)


def build_agent_tokenizer(folder: Path):
    """The word-level tokenizer over :data:`AGENT_WORDS` (saved in ``folder``)."""
    return smoke.build_tokenizer(folder, AGENT_WORDS)


def build_agent_model(folder: Path, seed: int = 0) -> Path:
    """Tokenizer + bigram Llama with :data:`AGENT_RULES`, saved with safetensors in ``folder``."""
    return smoke.build_model(folder, seed, words=AGENT_WORDS, rules=AGENT_RULES)
