"""Transcripts and metrics of finished rollouts, for logging and debugging.

Decoding here is for display only; training uses the token ids.
"""

from __future__ import annotations

from collections.abc import Sequence

from stratarl.rollout.engine import Rollout


def mask_segments(rollout: Rollout) -> list[tuple[int, int, int]]:
    """Maximal runs of equal ``response_mask`` values as (start, end, mask)."""
    segments: list[tuple[int, int, int]] = []
    start = 0
    mask = rollout.response_mask
    for i in range(1, len(mask) + 1):
        if i == len(mask) or mask[i] != mask[start]:
            segments.append((start, i, mask[start]))
            start = i
    return segments


def render_mask(rollout: Rollout, tokenizer) -> str:
    """The response as labelled segments: ``[policy n tok]`` (mask 1) or ``[observation n tok]`` (mask 0)."""
    lines = []
    for start, end, mask in mask_segments(rollout):
        label = "policy" if mask else "observation"
        text = tokenizer.decode(rollout.response_ids[start:end], skip_special_tokens=False)
        lines.append(f"[{label} {end - start} tok | mask={mask}] {text!r}")
    return "\n".join(lines)


def transcript(rollout: Rollout, tokenizer, *, reward: float | None = None, golds: Sequence[str] | None = None) -> dict:
    """A JSON-ready record: prompt, each turn (text, action, observation), queries with
    passages, answer, reward, flags and the mask as segment runs."""
    decode = lambda ids: tokenizer.decode(ids, skip_special_tokens=False)  # noqa: E731
    turns = []
    for turn in rollout.turns:
        entry = {
            "text": decode(rollout.response_ids[turn.start : turn.end]),
            "action": turn.action.kind,
            "content": turn.action.content,
            "finish_reason": turn.finish_reason,
            "span": [turn.start, turn.end],
        }
        if turn.observation_span is not None:
            obs_start, obs_end = turn.observation_span
            entry["observation"] = decode(rollout.response_ids[obs_start:obs_end])
        turns.append(entry)
    return {
        "prompt": decode(rollout.prompt_ids),
        "turns": turns,
        "searches": [
            {"query": q, "passages": [{"id": p.id, "contents": p.contents, "score": p.score} for p in hits]}
            for q, hits in zip(rollout.queries, rollout.passages)
        ],
        "answer": rollout.answer,
        "golds": list(golds) if golds is not None else None,
        "reward": reward,
        "end_reason": rollout.end_reason,
        "calls": [
            {
                "tool": c.tool,
                "arguments": c.arguments,
                "status": c.status,
                "detail": c.detail,
                "passage_ids": list(c.passage_ids),
            }
            for c in rollout.calls
        ],
        "num_searches": rollout.num_searches,
        "invalid_actions": rollout.invalid_actions,
        "tool_errors": rollout.tool_errors,
        "truncated": rollout.truncated,
        "hit_max_turns": rollout.hit_max_turns,
        "response_tokens": len(rollout.response_ids),
        "policy_tokens": sum(rollout.response_mask),
        "mask_segments": [list(s) for s in mask_segments(rollout)],
    }


def transcript_text(rollout: Rollout, tokenizer, *, reward: float | None = None) -> str:
    """A human-readable transcript: the prompt, then the response segment by segment."""
    header = [
        f"end={rollout.end_reason} searches={rollout.num_searches} answer={rollout.answer!r}"
        + (f" reward={reward}" if reward is not None else "")
    ]
    header += [
        f"call {c.tool}({c.arguments}) -> {c.status}" + (f": {c.detail}" if c.detail else "") for c in rollout.calls
    ]
    prompt = tokenizer.decode(rollout.prompt_ids, skip_special_tokens=False)
    return "\n".join([*header, "--- prompt ---", prompt, "--- response ---", render_mask(rollout, tokenizer)])


def tool_metrics(rollouts: Sequence[Rollout], tools: Sequence[str] = ("search",)) -> dict[str, float]:
    """Per tool of ``tools`` (and any other called): ``tools/<t>/calls_mean`` (calls that ran, per rollout),
    ``tools/<t>/errors`` and ``tools/<t>/over_budget`` (totals); ``rollout/malformed_calls`` (total) and per kind
    (``rollout/malformed_calls/bad_json``, ``unknown_tool``, ``bad_arguments``)."""
    n = max(1, len(rollouts))
    calls = [c for r in rollouts for c in r.calls]
    names = list(dict.fromkeys([*tools, *(c.tool for c in calls if c.status != "malformed")]))
    m: dict[str, float] = {}
    for name in names:
        mine = [c for c in calls if c.tool == name]
        m[f"tools/{name}/calls_mean"] = sum(c.status in ("ok", "error") for c in mine) / n
        m[f"tools/{name}/errors"] = float(sum(c.status == "error" for c in mine))
        m[f"tools/{name}/over_budget"] = float(sum(c.status == "over_budget" for c in mine))
    malformed = [c for c in calls if c.status == "malformed"]
    m["rollout/malformed_calls"] = float(len(malformed))
    for kind in ("bad_json", "unknown_tool", "bad_arguments"):
        m[f"rollout/malformed_calls/{kind}"] = float(sum(c.error_kind == kind for c in malformed))
    return m


def rollout_metrics(rollouts: Sequence[Rollout]) -> dict[str, float]:
    """Batch means and rates under ``rollout/`` (plain floats; empty batch -> {})."""
    if not rollouts:
        return {}
    n = len(rollouts)
    mean = lambda values: float(sum(values)) / n  # noqa: E731
    return {
        "rollout/search_calls_mean": mean(r.num_searches for r in rollouts),
        "rollout/turns_mean": mean(len(r.turns) for r in rollouts),
        "rollout/answered_rate": mean(r.answered for r in rollouts),
        "rollout/truncated_rate": mean(r.truncated for r in rollouts),
        "rollout/hit_max_turns_rate": mean(r.hit_max_turns for r in rollouts),
        "rollout/eos_without_answer_rate": mean(r.end_reason == "eos" for r in rollouts),
        "rollout/invalid_actions_mean": mean(r.invalid_actions for r in rollouts),
        "rollout/valid_action_rate": _valid_action_rate(rollouts),
        "rollout/tool_errors": float(sum(r.tool_errors for r in rollouts)),
        "rollout/truncated_observations": float(sum(r.truncated_observations for r in rollouts)),
        "rollout/response_tokens_mean": mean(len(r.response_ids) for r in rollouts),
    }


def _valid_action_rate(rollouts: Sequence[Rollout]) -> float:
    turns = sum(len(r.turns) for r in rollouts)
    invalid = sum(r.invalid_actions for r in rollouts)
    return 1.0 - invalid / turns if turns else 0.0
