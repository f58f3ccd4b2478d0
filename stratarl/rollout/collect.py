"""G rollouts per question, scored and stratified: the stage every RL step, eval and probe starts with.

``collect`` runs G rollouts for each question with the real engine and a ``TimedRetriever`` (so generation
and retrieval time are reported apart), rewards each final answer and gives each rollout its stratum.
Groups get fresh ids per question occurrence in the batch, never the dataset's index (docs/compatibility.md).
``Scoring`` is the reward and the stratum key, resolved once per run from their names.
"""

from __future__ import annotations

import re
import time
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from stratarl.algos.gigpo import anchor_state
from stratarl.algos.turns import search_counts
from stratarl.infra.callables import resolve_callable
from stratarl.retrieval.timed import TimedRetriever
from stratarl.rewards import answer_match, get_reward, reward_for_source
from stratarl.rollout.config import RolloutConfig
from stratarl.rollout.engine import Rollout, RolloutEngine
from stratarl.rollout.generation import Generator
from stratarl.rollout.prompt import build_prompt, encode_messages, resolve_template
from stratarl.rollout.protocols import ToolProtocol, make_protocol
from stratarl.rollout.transcript import rollout_metrics, tool_metrics, transcript

STRATUM_KEYS = ("num_searches", "observation_blocks", "answered", "random", "tool_calls")
"""Built-in stratum keys (``algo.stratum_key``); ``random`` is the control the trainer draws from num_searches.
``tool_calls`` counts the calls of every tool; ``tool_calls[open,search]`` those of the tools named."""
TOOL_CALLS_RE = re.compile(r"tool_calls\[\s*(\w+(?:\s*,\s*\w+)*)\s*\]")


def is_stratum_key(key: str) -> bool:
    """A built-in stratum key, ``tool_calls[name, ...]``, or ``module:function``."""
    return key in STRATUM_KEYS or TOOL_CALLS_RE.fullmatch(key) is not None or ":" in key


def named_tools(key: str) -> list[str] | None:
    """The tools a ``tool_calls[...]`` stratum key counts (None: not such a key)."""
    match = TOOL_CALLS_RE.fullmatch(key)
    return [name.strip() for name in match.group(1).split(",")] if match else None


class Question(Protocol):
    """What a rollout needs of a question (``stratarl.data.examples.Example`` is one); read-only."""

    @property
    def id(self) -> str: ...

    @property
    def question(self) -> str: ...

    @property
    def golden_answers(self) -> tuple[str, ...]: ...

    @property
    def data_source(self) -> str: ...

    @property
    def metadata(self) -> Mapping[str, Any]: ...

    @property
    def prompt(self) -> Sequence[Mapping[str, str]] | None: ...


@dataclass(frozen=True)
class Scoring:
    """How collected rollouts are scored and stratified: ``reward(response_text, golds)`` (a data source with a
    reward of its own keeps it, ``stratarl.rewards.reward_for_source``) and ``stratum(rollout) -> int``."""

    reward: Callable[[str, Sequence[str]], float]
    stratum: Callable[[Rollout], int]

    @classmethod
    def from_names(
        cls, reward: str = "em", stratum_key: str = "num_searches", stratum_cap: int | None = None
    ) -> Scoring:
        """Resolve ``algo.reward`` and ``algo.stratum_key`` once. ``random`` collects the num_searches strata: the
        trainer permutes them inside each group afterwards (the control arm)."""
        key = "num_searches" if stratum_key == "random" else stratum_key
        return cls(reward_function(reward), stratum_function(key, stratum_cap))


@dataclass(frozen=True)
class CollectedBatch:
    """Rollouts of one step with their question, group id, reward, EM and stratum (all aligned)."""

    rollouts: list[Rollout]
    examples: list[Question]
    group_ids: list[int]
    rewards: list[float]
    em: list[float]
    strata: list[int]
    generation_s: float
    retrieval_s: float
    tools: tuple[str, ...] = ("search",)
    """The run's tools (``rollout.tools``): each gets its ``tools/<name>/*`` metrics, called or not."""


def stratum_function(key: str, stratum_cap: int | None) -> Callable[[Rollout], int]:
    """Rollout -> integer stratum: number of searches (capped), tool calls (capped: every tool's, or the named
    tools' with ``tool_calls[open]``), observation blocks (capped), answered, or a user function.

    ``num_searches`` counts the calls of the ``search`` tool the engine ran (as Search-R1's retriever calls);
    ``tool_calls`` counts calls that ran (not malformed or over-budget ones). ``observation_blocks`` is the definition the
    veRL plugin must use, having only the response mask: the observation blocks between two policy turns
    (``stratarl.algos.search_counts``), which also counts invalid-action feedback and misses an observation
    after the last turn."""
    if key == "num_searches":
        return lambda r: min(r.num_searches, stratum_cap) if stratum_cap is not None else r.num_searches
    if key == "observation_blocks":

        def blocks(r) -> int:
            count = int(search_counts(torch.tensor([r.response_mask], dtype=torch.long))[0]) if r.response_mask else 0
            return min(count, stratum_cap) if stratum_cap is not None else count

        return blocks
    if key == "answered":
        return lambda r: int(r.answered)
    if key == "tool_calls" or named_tools(key) is not None:
        tools = named_tools(key)  # None: every tool

        def calls(r) -> int:
            count = r.calls_of(tools)
            return min(count, stratum_cap) if stratum_cap is not None else count

        return calls
    fn = resolve_callable(key, "algo.stratum_key", num_args=1)
    seen: dict = {}
    # Any hashable key becomes a stable small integer id.
    return lambda r: seen.setdefault(fn(r), len(seen))


def reward_function(name: str):
    """A built-in reward by name (em, subem, f1) or ``package.module:function`` (response_text, golds) -> float."""
    if ":" not in name:
        return get_reward(name)
    return resolve_callable(name, "algo.reward", num_args=2)


def encode_prompts(
    tokenizer,
    examples: Sequence[Question],
    cache: dict | None = None,
    template: str = "search_r1",
    rebuild: bool = False,
    protocol: ToolProtocol | None = None,
) -> list[list[int]]:
    """Prompt ids per example: the example's own prompt (a data file's `prompt` column) when it has
    one and ``rebuild`` is off, else ``template`` around the question (a named template in the protocol's
    wording); the protocol then describes its tools in the messages (``ToolProtocol.messages``; search_r1
    with only `search` leaves them as they are)."""
    protocol = protocol or make_protocol("search_r1", ["search"])
    out = []
    for e in examples:
        if cache is not None and e.id in cache:
            out.append(cache[e.id])
            continue
        if e.prompt and not rebuild:
            messages = (
                [{"role": "user", "content": e.prompt}] if isinstance(e.prompt, str) else [dict(m) for m in e.prompt]
            )
            try:
                ids = encode_messages(tokenizer, protocol.messages(messages))
            except ValueError as error:
                raise ValueError(f"example {e.id!r}: {error}") from None
        else:
            content = build_prompt(
                e.question, resolve_template(template, protocol.templates), e.metadata.get("options")
            )
            ids = encode_messages(tokenizer, protocol.messages([{"role": "user", "content": content}]))
        if cache is not None:
            cache[e.id] = ids
        out.append(ids)
    return out


def collect(
    generator: Generator,
    retriever: TimedRetriever,
    tokenizer,
    examples: Sequence[Question],
    rollout: RolloutConfig,
    scoring: Scoring,
    *,
    group_size: int,
    greedy: bool = False,
    prompt_cache: dict | None = None,
    capture_layer: int | None = None,
) -> CollectedBatch:
    """G rollouts per question (consecutive, one fresh group id per question), scored and stratified by
    ``scoring``. ``rollout``: the engine's budgets, sampling and prompt (``greedy`` decodes greedily).
    ``capture_layer``: the rollouts keep the hidden states entering that decoder layer (``RolloutEngine.run``)."""
    prompts = encode_prompts(
        tokenizer, examples, prompt_cache, rollout.prompt_template, rollout.rebuild_prompt, rollout.tool_protocol()
    )
    flat_prompts = [p for p in prompts for _ in range(group_size)]
    flat_examples = [e for e in examples for _ in range(group_size)]
    group_ids = [i for i in range(len(examples)) for _ in range(group_size)]
    engine = RolloutEngine(generator, retriever, tokenizer, rollout.replace(greedy=greedy))
    retriever.pop_seconds()
    start = time.perf_counter()
    rollouts = engine.run(flat_prompts, capture_layer=capture_layer)
    total = time.perf_counter() - start
    retrieval_s = retriever.pop_seconds()
    rewards, em = [], []
    for r, e in zip(rollouts, flat_examples):
        prediction = r.answer if r.answered else None
        rewards.append(float(reward_for_source(e.data_source, scoring.reward)(r.response_text, e.golden_answers)))
        em.append(float(prediction is not None and answer_match(e.data_source, prediction, e.golden_answers)))
    strata = [int(scoring.stratum(r)) for r in rollouts]
    return CollectedBatch(
        rollouts, flat_examples, group_ids, rewards, em, strata, total - retrieval_s, retrieval_s, tuple(rollout.tools)
    )


def _distribution(values: list[int], prefix: str, max_key: int = 4) -> dict[str, float]:
    counts = Counter(min(v, max_key) for v in values)
    n = max(1, len(values))
    return {f"{prefix}/{k}{'+' if k == max_key else ''}": counts.get(k, 0) / n for k in range(max_key + 1)}


def batch_metrics(batch: CollectedBatch) -> dict[str, float]:
    """reward/*, rollout/* (search calls and their distribution, lengths, rates) and stratum/* metrics."""
    rs = batch.rollouts
    n = max(1, len(rs))
    searches = [r.num_searches for r in rs]
    policy_len = [sum(r.response_mask) for r in rs]
    obs_len = [len(r.response_mask) - sum(r.response_mask) for r in rs]
    # The engine's own rollout/* means and rates (searches, turns, answered, valid actions, ...),
    # plus what only the trainer knows: rewards, length extremes, strata.
    m: dict[str, float] = {
        **rollout_metrics(rs),
        **tool_metrics(rs, batch.tools),
        "reward/mean": sum(batch.rewards) / n,
        "reward/em": sum(batch.em) / n,
        "rollout/search_calls_max": float(max(searches, default=0)),
        "rollout/response_length_mean": sum(policy_len) / n,
        "rollout/response_length_max": float(max(policy_len, default=0)),
        "rollout/observation_length_mean": sum(obs_len) / n,
        "rollout/prompt_length_mean": sum(len(r.prompt_ids) for r in rs) / n,
        "rollout/invalid_action_rate": sum(r.invalid_actions > 0 for r in rs) / n,
        "rollout/num": float(len(rs)),
    }
    m.update(_distribution(searches, "rollout/search_calls_frac"))
    by_stratum: dict[int, list[float]] = {}
    for s, reward in zip(batch.strata, batch.rewards):
        by_stratum.setdefault(s, []).append(reward)
    for s, values in sorted(by_stratum.items()):
        m[f"stratum/{s}/reward_mean"] = sum(values) / len(values)
        m[f"stratum/{s}/count"] = float(len(values))
    m["stratum/num_strata"] = float(len(by_stratum))
    # Groups whose rewards are all equal give GRPO no signal: the share says how much of a batch is wasted.
    groups: dict[int, set[float]] = {}
    for g, reward in zip(batch.group_ids, batch.rewards):
        groups.setdefault(g, set()).add(reward)
    m["reward/flat_group_frac"] = sum(len(v) == 1 for v in groups.values()) / max(1, len(groups))
    return m


def advantage_metrics(advantages: torch.Tensor, response_mask: torch.Tensor) -> dict[str, float]:
    """Mean / std / min / max of the per-token advantages over policy tokens."""
    values = advantages[response_mask.bool()]
    if values.numel() == 0:
        return {"advantage/mean": 0.0, "advantage/std": 0.0, "advantage/min": 0.0, "advantage/max": 0.0}
    return {
        "advantage/mean": float(values.mean()),
        "advantage/std": float(values.std(unbiased=False)),
        "advantage/min": float(values.min()),
        "advantage/max": float(values.max()),
    }


def scored_transcript(
    rollout: Rollout,
    example: Question,
    tokenizer,
    *,
    reward: float,
    stratum: int | None = None,
    advantage: float | None = None,
) -> dict:
    """The engine's transcript (prompt, turns, searches with passages, answer, flags, mask runs)
    with the example, the stratum and the advantage the update used."""
    record = transcript(rollout, tokenizer, reward=reward, golds=example.golden_answers)
    return {
        "example_id": example.id,
        "question": example.question,
        **record,
        "stratum": stratum,
        "advantage": advantage,
        "observation_tokens": len(rollout.response_mask) - sum(rollout.response_mask),
        "policy_version": rollout.policy_version,
    }


def step_states(rollout: Rollout, tokenizer) -> tuple[str, ...]:
    """GiGPO's anchor state of each policy turn of ``rollout``, in order (stratarl.algos.gigpo.anchor_state): the
    text of every observation appended before the turn (search results, invalid-action feedback, tool errors), as
    the policy read it. Turn 0 has none: its state is the question alone, shared by every rollout of the group."""
    observations: list[str] = []
    states = []
    for turn in rollout.turns:
        states.append(anchor_state(observations))
        if turn.observation_span is not None:
            start, end = turn.observation_span
            observations.append(tokenizer.decode(rollout.response_ids[start:end], skip_special_tokens=False))
    return tuple(states)


def faulty_rollouts(rollouts: Sequence) -> list[bool]:
    """Per rollout: did a search of it fail in the retriever (``tool_errors``: refused, timed out, HTTP
    error, a malformed reply)? Its reward then reflects the fault, not the policy. A rollout that
    asked nothing is never faulty."""
    return [getattr(r, "tool_errors", 0) > 0 for r in rollouts]


def without_rollouts(batch: CollectedBatch, drop: Sequence[bool]) -> CollectedBatch:
    """``batch`` without the rollouts where ``drop`` is true (a new batch; group ids, rewards and strata
    stay aligned, so the advantage's group baselines see only the kept rollouts)."""
    keep = [i for i, d in enumerate(drop) if not d]
    pick = lambda values: [values[i] for i in keep]  # noqa: E731
    return CollectedBatch(
        pick(batch.rollouts),
        pick(batch.examples),
        pick(batch.group_ids),
        pick(batch.rewards),
        pick(batch.em),
        pick(batch.strata),
        batch.generation_s,
        batch.retrieval_s,
        batch.tools,
    )
