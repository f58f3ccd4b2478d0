"""The pieces of a demonstration, in the run's protocol and tools, as a rollout writes and reads them.

A demonstration must be the token sequence a rollout would produce for the same actions and observations
(docs/training.md, "Warm start in another protocol"). So nothing here writes a format of its own; every piece
comes from the part the rollout itself uses:

    prompt        stratarl.rollout.collect.encode_prompts (the template in the protocol's wording, the tools
                  described by ``ToolProtocol.messages``), always templated from the question
    call turn     thought + ``ToolProtocol.call_text(tool, arguments)``            policy tokens (mask 1)
    observation   the tool itself (``run_tool``, with ``rollout.tool_params``), its text rendered by
                  ``ToolProtocol.tool_observation`` and cut by the engine's ``observation_ids``   (mask 0)
    answer turn   thought + ``ToolProtocol.answer_text(answer)`` + EOS              policy tokens (mask 1)

Each piece is tokenized on its own (``add_special_tokens=False``), as the rollout appends the policy's
tokens and each observation's tokens: the past is never re-tokenized.

A protocol whose call turn ends with the model's end-of-sequence token (``call_ends_with_eos``: llama3_json)
has the engine drop that token and the tool turn write it again; the demonstration then marks the tool turn's
first token as the policy's (mask 1), so the model learns to end its call. That needs a tokenizer whose EOS is
that token (a Llama-3.1 tokenizer); with another one the demonstration cannot show the turn's end, and
rendering fails with a one-line error.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from stratarl.data.examples import Example
from stratarl.retrieval.base import Passage
from stratarl.rollout.collect import encode_prompts
from stratarl.rollout.engine import observation_ids
from stratarl.rollout.protocols import ToolProtocol, make_protocol
from stratarl.rollout.tools import ToolContext, ToolOutput, get_tool, run_tool, search_text, tool_kwargs

# The two thoughts differ from their first word on, so the search-or-answer decision is one
# clear token for the model to learn (a shared prefix made greedy decoding pick the wrong one).
SEARCH_THOUGHT = "<think> I need to search for this. </think>\n"
ANSWER_THOUGHT = "<think> The information gives the answer. </think>\n"


@dataclass(frozen=True)
class Piece:
    """Token ids of one piece of a response and their loss mask (1: the policy writes it)."""

    ids: list[int]
    mask: list[int]
    passages: tuple[Passage, ...] = field(default=(), compare=False)


@dataclass(frozen=True)
class DemoRenderer:
    """Renders demonstration pieces in one protocol with one set of tools (``rollout.protocol``,
    ``rollout.tools``, ``rollout.tool_params``), over the run's retriever and tokenizer."""

    tokenizer: Any
    protocol: ToolProtocol
    context: ToolContext
    max_obs_tokens: int
    tool_params: Mapping[str, Any] = field(default_factory=dict)
    prompt_template: str = "search_r1"

    @classmethod
    def build(
        cls,
        tokenizer,
        retriever,
        *,
        topk: int,
        max_obs_tokens: int,
        protocol: str = "search_r1",
        tools: Sequence[str] = ("search",),
        tool_params: Mapping[str, Any] | None = None,
        prompt_template: str = "search_r1",
    ) -> DemoRenderer:
        return cls(
            tokenizer,
            make_protocol(protocol, list(tools)),
            ToolContext(retriever, tokenizer, topk),
            max_obs_tokens,
            dict(tool_params or {}),
            prompt_template,
        )

    @property
    def tools(self) -> tuple[str, ...]:
        return tuple(self.protocol.tools)

    def text_ids(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def prompt(self, example: Example) -> list[int]:
        """The prompt a rollout of ``example`` starts from (templated from the question, as before any
        data file's own prompt)."""
        return encode_prompts(self.tokenizer, [example], None, self.prompt_template, True, self.protocol)[0]

    def call_turn(self, tool: str, argument: str) -> list[int]:
        """The policy's tokens of a turn that calls ``tool`` with its main argument ``argument``."""
        arguments = {self.protocol.tools[tool].main_argument: argument}
        return self.text_ids(SEARCH_THOUGHT + self.protocol.call_text(tool, arguments))

    def answer_turn(self, answer: str) -> list[int]:
        """The policy's tokens of the final turn: the answer, then EOS (as the sampler appends it)."""
        ids = self.text_ids(ANSWER_THOUGHT + self.protocol.answer_text(answer))
        if self.tokenizer.eos_token_id is not None:
            ids.append(self.tokenizer.eos_token_id)
        return ids

    def run(self, tool: str, argument: str) -> ToolOutput:
        """One call of ``tool`` as the engine runs it; a tool that fails raises (a demonstration is never
        built on a failure)."""
        arguments = {self.protocol.tools[tool].main_argument: argument}
        (output,) = run_tool(get_tool(tool), [arguments], self.context, tool_kwargs(self.tool_params, tool))
        if isinstance(output, BaseException):
            raise output
        return output

    def observation(self, tool: str, text: str, passages: Sequence[Passage] = ()) -> Piece:
        """The tool turn that follows a call of ``tool`` whose result is ``text``, cut as the engine cuts it."""
        rendered = self.protocol.tool_observation(tool, text)
        ids, _ = observation_ids(self.tokenizer, rendered, self.max_obs_tokens, self.protocol.observation_suffixes)
        mask = [0] * len(ids)
        if self.protocol.call_ends_with_eos:
            eos = self.tokenizer.eos_token_id
            if not ids or ids[0] != eos:
                raise ValueError(
                    f"rollout.protocol={self.protocol.name}: a call turn ends with the model's end-of-sequence "
                    f"token, which this tokenizer (EOS {self.tokenizer.eos_token!r}) does not write where the tool "
                    "turn starts; use a tokenizer of that protocol's model family, or rollout.protocol=hermes"
                )
            mask[0] = 1  # the end of turn the policy samples (the engine drops it; the tool turn writes it)
        return Piece(ids, mask, tuple(passages))

    def search_observation(self, hits: Sequence[Passage]) -> Piece:
        """The tool turn after a search that found ``hits`` (the search tool's own text)."""
        return self.observation("search", search_text(hits), hits)

    def call(self, tool: str, argument: str) -> tuple[Piece, Piece]:
        """(the call turn, the tool turn after it) for a call of ``tool`` with ``argument``."""
        turn = self.call_turn(tool, argument)
        output = self.run(tool, argument)
        return Piece(turn, [1] * len(turn)), self.observation(tool, output.text, output.passages)
