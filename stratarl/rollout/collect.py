"""G rollouts per question, scored and stratified: the stage every RL step, eval and probe starts with.

``collect`` runs G rollouts for each question with the real engine and a ``TimedRetriever`` (so generation
and retrieval time are reported apart), rewards each final answer and gives each rollout its stratum.
Groups get fresh ids per question occurrence in the batch, never the dataset's index (docs/compatibility.md).
``Scoring`` (stratarl.rollout.scoring) is the reward, the overlong rule and the stratum key. Each rollout keeps
its reward's total, its raw outcome (the answer score before shaping) and its components; a reward that cannot
score a rollout (``RewardFault``: an unreachable judge) marks it faulty instead (``reward_faults``).
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

import torch

from stratarl.algos.gigpo import anchor_state
from stratarl.retrieval.timed import TimedRetriever
from stratarl.rewards import answer_match
from stratarl.rollout.config import RolloutConfig
from stratarl.rollout.engine import Rollout, RolloutEngine
from stratarl.rollout.generation import Generator
from stratarl.rollout.prompt import build_prompt, encode_messages, resolve_template
from stratarl.rollout.protocols import ToolProtocol, make_protocol
from stratarl.rollout.scoring import (
    OVERLONG_RULES,
    STRATUM_KEYS,
    TOOL_CALLS_RE,
    OverlongRule,
    Question,
    Scoring,
    is_overlong,
    is_stratum_key,
    named_tools,
    reward_function,
    score_rollout,
    stratum_function,
    trajectory_of,
)
from stratarl.rollout.transcript import rollout_metrics, tool_metrics, transcript


@dataclass(frozen=True)
class CollectedBatch:
    """Rollouts of one step with their question, group id, reward, EM and stratum (all aligned), and per rollout
    its raw outcome (the answer score before shaping), its reward's components, its reward fault ("" for none)
    and whether it ran out of budget without an answer (``overlong``)."""

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
    outcomes: list[float] = field(default_factory=list)
    components: list[dict[str, float]] = field(default_factory=list)
    reward_faults: list[str] = field(default_factory=list)
    overlong: list[bool] = field(default_factory=list)


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
    scored = [score_rollout(scoring, r, e) for r, e in zip(rollouts, flat_examples)]
    em = [
        float(r.answered and r.answer is not None and answer_match(e.data_source, r.answer, e.golden_answers))
        for r, e in zip(rollouts, flat_examples)
    ]
    return CollectedBatch(
        rollouts,
        flat_examples,
        group_ids,
        [float(result.total) for result, _ in scored],
        em,
        [int(scoring.stratum(r)) for r in rollouts],
        total - retrieval_s,
        retrieval_s,
        tuple(rollout.tools),
        outcomes=[float(result.outcome) for result, _ in scored],
        components=[dict(result.components) for result, _ in scored],
        reward_faults=[fault for _, fault in scored],
        overlong=[is_overlong(r) for r in rollouts],
    )


__all__ = [
    "OVERLONG_RULES",
    "STRATUM_KEYS",
    "TOOL_CALLS_RE",
    "CollectedBatch",
    "OverlongRule",
    "Question",
    "Scoring",
    "collect",
    "is_overlong",
    "is_stratum_key",
    "named_tools",
    "reward_function",
    "score_rollout",
    "stratum_function",
    "trajectory_of",
    "with_policy_version",
    "without_frozen_states",
]


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
    m.update(reward_metrics(batch))
    return m


def reward_metrics(batch: CollectedBatch) -> dict[str, float]:
    """``reward/outcome_mean`` (the raw outcome), ``reward/<component>_mean`` for every component a reward
    returned (0 for a rollout without it, so the built-in rewards' component means add up to reward/mean),
    ``reward/flat_outcome_group_frac`` (groups whose raw outcome is constant: what dynamic sampling drops),
    ``rollout/truncated_share`` (rollouts out of budget without an answer: what algo.overlong acts on) and
    ``reward/faulty_rollouts`` (rollouts the reward could not score)."""
    n = max(1, len(batch.rollouts))
    m: dict[str, float] = {}
    if batch.outcomes:
        m["reward/outcome_mean"] = sum(batch.outcomes) / n
        m["reward/flat_outcome_group_frac"] = constant_outcome_share(batch.group_ids, batch.outcomes)
    names = sorted({name for components in batch.components for name in components})
    for name in names:
        m[f"reward/{name}_mean"] = sum(c.get(name, 0.0) for c in batch.components) / n
    if batch.overlong:
        m["rollout/truncated_share"] = sum(batch.overlong) / n
    if batch.reward_faults:
        m["reward/faulty_rollouts"] = float(sum(bool(f) for f in batch.reward_faults))
    return m


def constant_outcome_groups(group_ids: Sequence[int], outcomes: Sequence[float]) -> set[int]:
    """The groups whose raw outcomes are all equal (a group of one included): they give a group-relative
    advantage no signal."""
    seen: dict[int, set[float]] = {}
    for g, outcome in zip(group_ids, outcomes):
        seen.setdefault(g, set()).add(outcome)
    return {g for g, values in seen.items() if len(values) == 1}


def constant_outcome_share(group_ids: Sequence[int], outcomes: Sequence[float]) -> float:
    """The share of groups whose raw outcome is constant (0 for an empty batch)."""
    groups = set(group_ids)
    return len(constant_outcome_groups(group_ids, outcomes)) / len(groups) if groups else 0.0


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


def faulty_rollouts(rollouts: Sequence, reward_faults: Sequence[str] = ()) -> list[bool]:
    """Per rollout: did a search of it fail in the retriever (``tool_errors``: refused, timed out, HTTP
    error, a malformed reply), or could its reward not score it (``reward_faults``: a judge that failed)?
    Its reward then reflects the fault, not the policy. A rollout that asked nothing is never faulty."""
    faults = list(reward_faults) or [""] * len(rollouts)
    return [getattr(r, "tool_errors", 0) > 0 or bool(f) for r, f in zip(rollouts, faults)]


def without_rollouts(batch: CollectedBatch, drop: Sequence[bool]) -> CollectedBatch:
    """``batch`` without the rollouts where ``drop`` is true (a new batch; group ids, rewards and strata
    stay aligned, so the advantage's group baselines see only the kept rollouts)."""
    return select_rollouts(batch, [i for i, d in enumerate(drop) if not d])


def with_policy_version(collected: CollectedBatch, version: int) -> CollectedBatch:
    """``collected`` with every rollout stamped with the version of the weights that sampled it (the generator
    does not know it); new rollouts in a new batch."""
    rollouts = [replace(r, policy_version=version) for r in collected.rollouts]
    return replace(collected, rollouts=rollouts)


def without_frozen_states(collected: CollectedBatch) -> CollectedBatch:
    """``collected`` with rollouts that no longer hold the hidden states the generator captured (new rollouts in a
    new batch): once the prefix forward holds them, dropping the old batch frees their memory before the update."""
    if all(r.frozen_states is None for r in collected.rollouts):
        return collected
    rollouts = [replace(r, frozen_states=None) for r in collected.rollouts]
    return replace(collected, rollouts=rollouts)


def select_rollouts(batch: CollectedBatch, keep: Sequence[int]) -> CollectedBatch:
    """``batch`` restricted to the rollouts ``keep`` (indices, in that order; a new batch, every list aligned)."""
    pick = lambda values: [values[i] for i in keep] if values else []  # noqa: E731
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
        outcomes=pick(batch.outcomes),
        components=pick(batch.components),
        reward_faults=pick(batch.reward_faults),
        overlong=pick(batch.overlong),
    )
