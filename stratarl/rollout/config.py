"""The rollout engine's config: budgets, sampling and the prompt of a rollout (Search-R1 defaults).

One class serves the engine (``RolloutEngine(generator, retriever, tokenizer, RolloutConfig(...))``)
and the trainer's config tree, which embeds it as its ``rollout:`` section. It is frozen: the engine and a
training step hold the very value the config was validated with, and a changed copy is ``replace(...)``.
Invalid values raise :class:`~stratarl.config_errors.ConfigError` (a ValueError) at construction, naming the
field and the fix.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Literal

from stratarl.config_errors import fail
from stratarl.rollout.generation import SamplingParams
from stratarl.rollout.parsing import ANSWER_STOP
from stratarl.rollout.prompt import PROMPT_TEMPLATES, resolve_template
from stratarl.rollout.protocols import ToolProtocol, make_protocol, protocol_names
from stratarl.rollout.tools import check_tool_config, get_tool

BACKENDS = ("kv_cache", "kv_cache_generic", "hf")
SAMPLER_PRECISIONS = ("fp32", "bf16", "int8")


@dataclass(frozen=True)
class RolloutConfig:
    group_size: int = 5
    """Rollouts per prompt (G; Search-R1 GRPO: 5). Used by the trainer's collection, not by the engine."""
    max_turns: int = 4
    """Turns that may search, as Search-R1's `max_turns`: one final turn without search follows, so a rollout
    has at most max_turns + 1 turns and max_turns searches (0: one turn, no search)."""
    max_tokens_per_turn: int = 500
    """Generation cap per turn (tokens)."""
    max_obs_tokens: int = 500
    """Observation (retrieved passages) cap per search (tokens; at least 16); a longer one is cut and ends with
    the truncation marker + `</information>`, so the cut is visible."""
    max_total_tokens: int = 4096
    """Cap on prompt + response tokens; a rollout reaching it ends as truncated."""
    topk: int = 3
    """Passages asked of the retriever per search; every passage it returns is shown. In a `stratarl train`
    config this is `retrieval.topk` (the trainer copies it here; setting both to different values is refused)."""
    stop_on_eos: bool = False
    """A turn that ends with end-of-sequence and no action ends the rollout (true), or gets the invalid-action
    feedback and the loop goes on (false, Search-R1: its EOS token is dropped, as Search-R1 decodes turns with
    skip_special_tokens=True)."""
    eos_after_answer: bool = True
    """Append EOS (mask 1, with its log-prob) after `</answer>`, so the policy learns to stop."""
    rebuild_prompt: bool = False
    """Build every prompt from the question with `prompt_template`, ignoring a data file's own `prompt` column
    (false: a row's own prompt is what the policy sees, as in Search-R1; rows without one are templated)."""
    temperature: float = 1.0
    """Sampling temperature for training rollouts (eval is greedy)."""
    top_p: float = 1.0
    """Nucleus sampling for training rollouts."""
    greedy: bool = False
    """Greedy decoding (the trainer sets it for eval; training rollouts sample)."""
    prompt_template: str = "search_r1"
    """The user message around each question: `search_r1` (Search-R1's template, the default), `short` (the
    same protocol in a tenth of the tokens, for from-scratch models such as the lab's), or a literal
    template containing `{question}`."""
    backend: Literal["kv_cache", "kv_cache_generic", "hf"] = "kv_cache"
    """Generation backend: `kv_cache` (our batched sampler; on Llama-family models its fast forward with a prefix cache across turns), `kv_cache_generic` (the same sampler on the model's own forward) or `hf` (transformers `generate`, the reference)."""

    protocol: str = "search_r1"
    """How the agent calls tools (docs/agent_loop.md): `search_r1` (Search-R1's tags, `<search> q </search>`, results
    in `<information>`; the default), `hermes` (Qwen2.5 / Qwen3's `<tool_call>` JSON, results in the ChatML tool
    turn; SmolLM2 too) or `llama3_json` (Llama-3.1's JSON calls, results in an `ipython` turn); or a protocol
    registered with `@register_protocol` in a module loaded with `--import`. The answer is `<answer> ... </answer>`
    in each."""
    tools: list[str] = field(default_factory=lambda: ["search"])
    """The tools the agent may call: `search` (the retriever's top passages), `open` (a whole document by title,
    bounded in tokens), or a tool registered with `@register_tool` in a module loaded with `--import`."""
    tool_params: dict[str, Any] = field(default_factory=dict)
    """Per tool, its budget (`max_calls` per rollout; default: only the turns bound it) and its own parameters,
    checked against its signature, e.g. `{open: {max_calls: 2, max_tokens: 300}}`."""

    precision: Literal["fp32", "bf16", "int8"] | None = None
    """Numerics of the sampler, apart from the learner's (`trainer.precision`): null samples with the learner
    itself (today's loop); `fp32`, `bf16` (autocast) or `int8` (weights fake-quantised per output channel,
    symmetric, fp32 compute) sample with a copy of the policy in those numerics, so the behaviour policy's
    log-probs differ from the learner's on purpose (docs/training.md, Off-policy training)."""

    def __post_init__(self) -> None:
        self.validate(type(self).__name__)

    def validate(self, p: str) -> None:
        if self.group_size < 1:
            fail(f"{p}.group_size", self.group_size, "a group needs at least one rollout", "use 5 (Search-R1) or 2-8")
        if self.max_turns < 0:
            fail(
                f"{p}.max_turns",
                self.max_turns,
                "counts the turns that may search, so it cannot be negative",
                "use 4 (Search-R1's default: 4 search turns + 1 final answer turn), or 0 for a single turn",
            )
        for key in ("max_tokens_per_turn", "max_total_tokens", "topk"):
            if getattr(self, key) < 1:
                fail(f"{p}.{key}", getattr(self, key), "must be >= 1", "use e.g. 500 tokens, or 3 passages")
        if self.max_obs_tokens < 16:
            fail(
                f"{p}.max_obs_tokens",
                self.max_obs_tokens,
                "must be >= 16 (room for the truncation marker)",
                "use at least 16 (Search-R1: 500)",
            )
        if self.temperature <= 0:
            fail(
                f"{p}.temperature",
                self.temperature,
                "training rollouts sample, so the temperature must be > 0",
                "use 1.0",
            )
        if not 0 < self.top_p <= 1:
            fail(f"{p}.top_p", self.top_p, "must lie in (0, 1]", "use 1.0")
        try:
            resolve_template(self.prompt_template)
        except ValueError:
            fail(
                f"{p}.prompt_template",
                self.prompt_template,
                "neither a known template nor one containing {question}",
                f"use {', '.join(PROMPT_TEMPLATES)}, or a string with {{question}} in it",
            )
        if self.protocol not in protocol_names():
            fail(
                f"{p}.protocol",
                self.protocol,
                "unknown tool-call protocol",
                f"use one of {', '.join(protocol_names())} (one of your own: @register_protocol, loaded with --import)",
            )
        if not isinstance(self.tools, (list, tuple)) or not all(isinstance(t, str) for t in self.tools):
            fail(f"{p}.tools", self.tools, "expected a list of tool names", "write e.g. [search, open]")
        check_tool_config(self.tools, self.tool_params, p)
        if self.protocol == "search_r1":
            for name in self.tools:
                spec = get_tool(name)
                if len(spec.required) > 1:
                    fail(
                        f"{p}.tools",
                        list(self.tools),
                        f"tool {name!r} needs {len(spec.required)} arguments but a search_r1 tag carries one text",
                        "use rollout.protocol=hermes (JSON arguments), or drop the tool",
                    )
        if self.backend not in BACKENDS:
            fail(f"{p}.backend", self.backend, "unknown backend", f"use one of {', '.join(BACKENDS)}")
        if self.precision is not None and self.precision not in SAMPLER_PRECISIONS:
            fail(
                f"{p}.precision",
                self.precision,
                "unknown sampler precision",
                f"use one of {', '.join(SAMPLER_PRECISIONS)}, or null to sample with the learner itself",
            )

    def replace(self, **changes) -> RolloutConfig:
        """A copy with ``changes`` (validated)."""
        return dataclasses.replace(self, **changes)

    def tool_protocol(self) -> ToolProtocol:
        """The protocol bound to the tools (``rollout.protocol``, ``rollout.tools``)."""
        return make_protocol(self.protocol, self.tools)

    def sampling_params(self) -> SamplingParams:
        return SamplingParams(
            max_new_tokens=self.max_tokens_per_turn,
            temperature=self.temperature,
            top_p=self.top_p,
            greedy=self.greedy,
            stop_strings=self.tool_protocol().stop_strings,
            eos_after=(ANSWER_STOP,) if self.eos_after_answer else (),
        )
