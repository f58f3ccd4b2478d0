"""The multi-turn rollout engine: an explicit state machine over a batch of rollouts.

Each turn, every live rollout is in state GENERATE; all of them go to the
generator in one call (prompt + response so far, as token ids: the history is
never decoded and re-tokenized; a generator with ``supports_cache_keys`` keeps each
rollout's KV between turns, so a turn reads only the new observation). The turn's text is then parsed (``parse_action``):

    GENERATE --answer-------------------------------> DONE (answered)
    GENERATE --search, not last turn----------------> SEARCH --observation--> GENERATE
    GENERATE --invalid, not last turn---------------> GENERATE (invalid-action feedback appended)
    GENERATE --EOS, no action, not last turn--------> GENERATE (the EOS token dropped, feedback appended),
                                                      or DONE (no answer) with ``stop_on_eos``
    GENERATE --search or invalid in the last turn---> DONE (hit_max_turns; no search, no feedback)
    GENERATE --EOS, no action, last turn------------> DONE (no answer)
    any state --total token budget spent------------> DONE (truncated)

Turns follow Search-R1's ``run_llm_loop`` (search_r1/llm_agent/generation.py): ``max_turns``
turns that may search, then one final turn in which no search runs.

The protocol (``rollout.protocol``, stratarl.rollout.protocols) parses each turn and renders what follows it;
"search" above stands for a call of any tool of ``rollout.tools`` (stratarl.rollout.tools). A malformed call
(bad JSON, an unknown tool, wrong arguments) is answered by an observation that says what is wrong and counted
(``malformed_calls``, and as an invalid action); a call past its tool's ``max_calls`` is answered the same way
without running (``over_budget_calls``).

Observations are tokenized once and appended with response_mask 0 and log-prob 0.
A tool that raises (a retriever fault) becomes an observation that says so (``tool_errors``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal

from stratarl.retrieval.base import Passage, Retriever
from stratarl.rollout.config import RolloutConfig
from stratarl.rollout.generation import Generation, Generator
from stratarl.rollout.parsing import INFORMATION_SUFFIX, TRUNCATION_MARKER, Action
from stratarl.rollout.protocols import ToolProtocol, error_text, make_protocol
from stratarl.rollout.tools import ToolCall, ToolContext, get_tool, run_tool, tool_budget, tool_kwargs

EndReason = Literal["answer", "eos", "max_turns", "max_length"]

__all__ = ["EndReason", "Rollout", "RolloutConfig", "RolloutEngine", "Turn", "observation_ids"]


@dataclass
class Turn:
    """One policy turn: its span in response coordinates [start, end), its action, and
    the span of the observation appended after it (None if none)."""

    start: int
    end: int
    action: Action
    finish_reason: str
    observation_span: tuple[int, int] | None = None


@dataclass
class Rollout:
    """Everything the trainer and the logger need about one rollout.

    ``response_ids``, ``response_mask`` (1 = written by the policy, 0 = observation)
    and ``sampling_logprobs`` (0.0 on observation tokens) have the same length.
    ``passages[i]`` are the passages returned for ``queries[i]`` (empty on a tool error): the ``search`` calls;
    ``calls`` holds every call of every tool, malformed and over-budget ones included, in order.
    """

    prompt_ids: list[int]
    response_ids: list[int] = field(default_factory=list)
    response_mask: list[int] = field(default_factory=list)
    sampling_logprobs: list[float] = field(default_factory=list)
    turns: list[Turn] = field(default_factory=list)
    queries: list[str] = field(default_factory=list)
    passages: list[list[Passage]] = field(default_factory=list)
    num_searches: int = 0
    answered: bool = False
    answer: str | None = None
    truncated: bool = False
    hit_max_turns: bool = False
    invalid_actions: int = 0
    tool_errors: int = 0
    truncated_observations: int = 0
    calls: list[ToolCall] = field(default_factory=list)
    malformed_calls: int = 0
    over_budget_calls: int = 0
    end_reason: EndReason | None = None
    response_text: str = ""
    policy_version: int = 0
    """The weights version that sampled it: the number of RL steps the learner had taken when those weights
    were current (the trainer sets it; with ``trainer.policy_lag`` it trails the learner's step)."""
    # (tokens, hidden states [len(tokens), H]) entering the generator's capture layer, from the last turn
    # (``RolloutEngine.run(..., capture_layer=k)``): what the trainer's frozen prefix would recompute.
    frozen_states: tuple[list[int], object] | None = field(default=None, repr=False, compare=False)

    def calls_of(self, tools: Sequence[str] | None = None) -> int:
        """Calls that ran (ok or failed in the tool) of ``tools`` (None: every tool)."""
        ran = [c for c in self.calls if c.status in ("ok", "error")]
        return sum(tools is None or c.tool in tools for c in ran)

    @property
    def done(self) -> bool:
        return self.end_reason is not None

    @property
    def turn_spans(self) -> list[tuple[int, int]]:
        return [(turn.start, turn.end) for turn in self.turns]

    @property
    def total_length(self) -> int:
        return len(self.prompt_ids) + len(self.response_ids)

    def _append(self, ids: Sequence[int], mask: int, logprobs: Sequence[float] | None = None) -> tuple[int, int]:
        start = len(self.response_ids)
        self.response_ids.extend(ids)
        self.response_mask.extend([mask] * len(ids))
        self.sampling_logprobs.extend(logprobs if logprobs is not None else [0.0] * len(ids))
        return start, len(self.response_ids)


def observation_ids(
    tokenizer, text: str, cap: int, suffixes: Sequence[str] = (INFORMATION_SUFFIX,)
) -> tuple[list[int], bool]:
    """Token ids of an observation, cut to ``cap`` with a visible marker when longer.

    A cut observation keeps the first of ``suffixes`` it ends with (an information block its closing
    ``</information>\\n\\n``, a tool turn the template's closing and the next assistant header), so it stays
    well formed.
    """
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    if len(ids) <= cap:
        return list(ids), False
    suffix = next((s for s in suffixes if text.endswith(s)), "")
    tail = tokenizer(TRUNCATION_MARKER + suffix, add_special_tokens=False)["input_ids"]
    return list(ids[: cap - len(tail)]) + list(tail), True


class RolloutEngine:
    """Runs batches of prompts to completion with a ``Generator`` and a ``Retriever`` (the tools' context), in
    the config's protocol."""

    def __init__(self, generator: Generator, retriever: Retriever, tokenizer, config: RolloutConfig | None = None):
        self.generator = generator
        self.retriever = retriever
        self.tokenizer = tokenizer
        self.config = config or RolloutConfig()
        self.protocol: ToolProtocol = make_protocol(self.config.protocol, self.config.tools)
        self.context = ToolContext(retriever, tokenizer, self.config.topk)

    def run(self, prompts: Sequence[Sequence[int]], capture_layer: int | None = None) -> list[Rollout]:
        """One rollout per prompt (token ids, e.g. from ``encode_prompt``), in order.

        ``capture_layer`` k: each rollout keeps the hidden states entering decoder layer k of the tokens
        the generator read (``Rollout.frozen_states``) when the generator can capture them (the fast
        decode path); otherwise it stays None."""
        config = self.config
        rollouts = [Rollout(prompt_ids=list(p)) for p in prompts]
        for rollout in rollouts:
            if rollout.total_length >= config.max_total_tokens:
                raise ValueError(
                    f"a prompt has {rollout.total_length} tokens, which leaves no room under "
                    f"max_total_tokens={config.max_total_tokens}; raise it or shorten the prompt"
                )
        params = config.sampling_params()
        for turn_index in range(config.max_turns + 1):
            live_index = [i for i, r in enumerate(rollouts) if not r.done]
            if not live_index:
                break
            live = [rollouts[i] for i in live_index]
            budgets = [min(config.max_tokens_per_turn, config.max_total_tokens - r.total_length) for r in live]
            histories = [r.prompt_ids + r.response_ids for r in live]
            if self.generator.supports_cache_keys:
                # Each rollout's KV from its previous turn is reused: only the observation is read.
                keys = [(id(rollouts), i) for i in live_index]
                capture = (
                    {"capture_layer": capture_layer}
                    if capture_layer is not None and self.generator.supports_capture
                    else {}
                )
                # supports_cache_keys declares the keyword, which the Protocol's signature leaves out.
                generations = self.generator.generate(histories, params, budgets, cache_keys=keys, **capture)  # type: ignore[call-arg]
            else:
                generations = self.generator.generate(histories, params, budgets)
            last_turn = turn_index == config.max_turns
            calls = [self._after_turn(r, g, last_turn) for r, g in zip(live, generations)]
            for rollout, generation in zip(live, generations):
                rollout.frozen_states = generation.frozen_states
            pending = [(r, action) for r, action in zip(live, calls) if action is not None]
            if pending:
                self._run_calls(pending)
        for rollout in rollouts:
            if not rollout.done:  # only reachable when max_turns ran out mid-state
                rollout.end_reason, rollout.hit_max_turns = "max_turns", True
            rollout.response_text = self.tokenizer.decode(rollout.response_ids, skip_special_tokens=False)
        return rollouts

    def _after_turn(self, rollout: Rollout, generation: Generation, last_turn: bool) -> Action | None:
        """Append the turn, move the state machine; return the call to run, if any."""
        ids, logprobs = generation.token_ids, generation.logprobs
        action = self.protocol.parse(self.tokenizer.decode(ids, skip_special_tokens=False))
        eos = generation.finish_reason == "eos"
        stops = self.config.stop_on_eos or last_turn
        # A call that ends in EOS (llama3_json's do) still runs with stop_on_eos; the loop goes on after it.
        goes_on = not stops or (action.is_call and not last_turn)
        if eos and action.kind != "answer" and goes_on and len(ids) > 1:
            # The loop goes on after this turn: drop its final EOS token, as Search-R1's decode with
            # skip_special_tokens=True does, so the next turn never reads an end-of-sequence. A turn
            # that is EOS alone keeps it: every turn holds at least one policy token. (The protocol's
            # observation closes the turn as its chat template does.)
            ids, logprobs = ids[:-1], logprobs[:-1]
        start, end = rollout._append(ids, 1, logprobs)
        rollout.turns.append(Turn(start, end, action, generation.finish_reason))
        out_of_room = rollout.total_length >= self.config.max_total_tokens
        malformed = action.kind == "malformed"
        if malformed:
            rollout.malformed_calls += 1
            rollout.calls.append(ToolCall(action.content, None, "malformed", action.error, (), action.error_kind))
        if action.kind == "answer":
            rollout.answered, rollout.answer, rollout.end_reason = True, action.content, "answer"
        elif eos and not goes_on:
            rollout.end_reason = "eos"
        elif out_of_room:
            rollout.truncated, rollout.end_reason = True, "max_length"
        elif last_turn:
            rollout.hit_max_turns, rollout.end_reason = True, "max_turns"
            rollout.invalid_actions += action.kind == "invalid" or malformed
        elif action.is_call:
            return action
        else:
            rollout.invalid_actions += 1
            self._observe(
                rollout,
                self.protocol.feedback_observation(action.error) if malformed else self.protocol.invalid_observation(),
            )
        return None

    def _run_calls(self, pending: list[tuple[Rollout, Action]]) -> None:
        """Run this turn's calls, each tool once over all its calls (search: one retriever call), in budget."""
        by_tool: dict[str, list[tuple[Rollout, Action]]] = {}
        for rollout, action in pending:
            budget = tool_budget(self.config.tool_params, action.kind)
            if budget is not None and rollout.calls_of([action.kind]) >= budget:
                message = f"{action.kind} may be called at most {budget} times per answer; use another tool or answer"
                rollout.over_budget_calls += 1
                rollout.calls.append(ToolCall(action.kind, action.arguments, "over_budget", message))
                self._observe(rollout, self.protocol.feedback_observation(message))
            else:
                by_tool.setdefault(action.kind, []).append((rollout, action))
        for tool, calls in by_tool.items():
            params = tool_kwargs(self.config.tool_params, tool)
            arguments = [dict(action.arguments or {}) for _, action in calls]
            outputs = run_tool(get_tool(tool), arguments, self.context, params)
            for (rollout, action), output in zip(calls, outputs):
                self._record(rollout, action, output)

    def _record(self, rollout: Rollout, action: Action, output) -> None:
        failed = isinstance(output, BaseException)
        if action.kind == "search":  # the search record and count as Search-R1 keeps them
            rollout.queries.append(action.content)
            rollout.num_searches += 1
            rollout.passages.append([] if failed else list(output.passages))
        rollout.tool_errors += failed
        rollout.calls.append(
            ToolCall(
                action.kind,
                action.arguments,
                "error" if failed else "ok",
                error_text(action.kind, output) if failed else "",
                () if failed else tuple(p.id for p in output.passages),
            )
        )
        text = error_text(action.kind, output) if failed else output.text
        self._observe(rollout, self.protocol.tool_observation(action.kind, text))

    def _observe(self, rollout: Rollout, text: str) -> None:
        room = self.config.max_total_tokens - rollout.total_length
        ids, cut = observation_ids(self.tokenizer, text, self.config.max_obs_tokens, self.protocol.observation_suffixes)
        if len(ids) >= room:
            # The observation does not fit with room left to write: keep what fits, end.
            ids, cut = ids[:room], True
            rollout.truncated, rollout.end_reason = True, "max_length"
        rollout.truncated_observations += cut
        span = rollout._append(ids, 0)
        rollout.turns[-1].observation_span = span
