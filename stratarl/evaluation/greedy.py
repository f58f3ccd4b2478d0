"""`stratarl eval`: greedy rollouts over held-out questions, scored per data_source.

Per data_source: EM, SubEM, token F1 (of the last ``<answer>`` of the response),
mean search calls, answer rate, and count; plus the overall mean. Results are a
plain dict (written as JSON) and a terminal table. Every question's scores are kept
too (``per_question``: one record per question with its example id), so two evals of
the same questions (before / after RL) can be compared question by question.
Transcripts of the first few rollouts are kept for debugging; the questions come in
the same order in every eval, so the same example ids appear in the before and after
transcripts.
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from stratarl.evaluation.stats import mean_ci
from stratarl.infra.metrics import write_transcripts
from stratarl.infra.precision import DevicePolicy
from stratarl.infra.progress import progress
from stratarl.infra.threads import step_threads
from stratarl.retrieval.base import Retriever
from stratarl.retrieval.timed import TimedRetriever
from stratarl.rewards import answer_scores
from stratarl.rollout.backends import make_generator
from stratarl.rollout.collect import Question, Scoring, collect, scored_transcript
from stratarl.rollout.config import RolloutConfig

METRIC_COLUMNS = ("em", "subem", "f1", "searches_mean", "answer_rate", "count")
SHARED_BATCH_FACTOR = 4
"""The default path's batch, in ``eval.batch_size`` units (see ``evaluate``)."""
PREFILL_CHUNK_ROWS = 8
"""The default path's prefill runs this many rows at a time (``FastDecoder.prefill_chunk_rows``)."""


@dataclass(frozen=True)
class EvalSettings:
    """How a held-out set is evaluated: the rollout budgets and prompt, the reward and strata, where the model
    runs, and how many questions share a generation batch (a run's ``rollout``, ``algo.reward`` /
    ``stratum_key``, ``trainer`` device and precision, ``eval.batch_size``)."""

    rollout: RolloutConfig
    scoring: Scoring
    policy: DevicePolicy
    batch_size: int = 32


def default_batch_size(settings: EvalSettings) -> int:
    """The questions the default path runs per batch: ``SHARED_BATCH_FACTOR`` x ``eval.batch_size``."""
    return settings.batch_size * SHARED_BATCH_FACTOR


def score_rollout(rollout, example: Question) -> dict[str, float]:
    """EM / SubEM / F1 of one rollout's final answer (0 when it never answered), as its data source defines them
    (``stratarl.rewards.answer_scores``: multiple choice by letter or option text, PhantomWiki by answer sets)."""
    answer = rollout.answer if rollout.answered else None
    return {
        **answer_scores(example.data_source, answer, example.golden_answers),
        "searches": float(rollout.num_searches),
        "answered": float(rollout.answered),
    }


def aggregate(
    scores: Sequence[dict[str, float]], sources: Sequence[str], *, with_all: bool = True
) -> dict[str, dict[str, float]]:
    """Per-source means (plus ``all`` when there are several sources) of per-rollout scores."""
    groups: dict[str, list[dict[str, float]]] = {}
    for s, src in zip(scores, sources):
        groups.setdefault(src, []).append(s)
    if len(groups) > 1 and with_all:
        groups["all"] = list(scores)
    out = {}
    for src, rows in groups.items():
        n = len(rows)
        out[src] = {
            "em": sum(r["em"] for r in rows) / n,
            "subem": sum(r["subem"] for r in rows) / n,
            "f1": sum(r["f1"] for r in rows) / n,
            "searches_mean": sum(r["searches"] for r in rows) / n,
            "answer_rate": sum(r["answered"] for r in rows) / n,
            "count": n,
        }
    return out


def evaluate(
    model,
    tokenizer,
    retriever: Retriever,
    examples: Sequence[Question],
    settings: EvalSettings,
    *,
    num_transcripts: int = 4,
    progress: bool = False,
    desc: str = "eval",
    reference: bool = False,
) -> dict:
    """Greedy rollouts (one per question), scored; see ``_evaluate``. A small policy runs on one thread
    (``stratarl.infra.threads.step_threads``).

    With ``reference`` the questions run ``settings.batch_size`` at a time, every prompt prefilled in full (the
    path as first written, kept as the oracle of tests and benchmarks/bench_eval.py); by default in batches of
    ``default_batch_size(settings)`` whose prompts' common prefix (the template) is computed once per turn-0
    call (``KVCacheGenerator(share_prompts=True)``) and whose prefills run ``PREFILL_CHUNK_ROWS`` rows at a
    time. The tokens are the reference's up to float rounding: in fp32 identical (tests/evaluation/test_greedy_fast.py);
    in bf16 a near-tie may flip, as it does between two batch sizes of the reference (docs/training.md)."""
    with step_threads(model):
        return _evaluate(
            model,
            tokenizer,
            retriever,
            examples,
            settings,
            num_transcripts=num_transcripts,
            progress=progress,
            desc=desc,
            reference=reference,
        )


def _eval_generator(model, tokenizer, settings: EvalSettings, reference: bool):
    """The eval's greedy generator: the prompts' common prefix computed once and prefill in row chunks, or (with
    ``reference``) the path as first written."""
    return make_generator(
        model,
        tokenizer,
        settings.rollout.backend,
        seed=0,
        policy=settings.policy,
        share_prompts=not reference,
        prefill_chunk_rows=None if reference else PREFILL_CHUNK_ROWS,
    )


def _evaluate(
    model,
    tokenizer,
    retriever: Retriever,
    examples: Sequence[Question],
    settings: EvalSettings,
    *,
    num_transcripts: int,
    progress: bool,
    desc: str,
    reference: bool = False,
) -> dict:
    """Greedy rollouts (one per question) -> {"per_source", "per_type", "per_question", "transcripts", "seconds",
    "num_examples"}.

    ``per_type`` has the same columns per ``metadata['question_type']`` (synthetic KB); {} without types.
    ``per_question`` has one record per question in ``examples`` order (see :func:`question_record`).
    ``transcripts`` are those of the first ``num_transcripts`` questions, each with its ``example_id``."""
    timed = retriever if isinstance(retriever, TimedRetriever) else TimedRetriever(retriever)
    generator = _eval_generator(model, tokenizer, settings, reference)
    start = time.perf_counter()
    scores, sources, types, per_question = [], [], [], []
    transcripts: list[dict[str, Any]] = []
    bar = _progress(len(examples), desc) if progress else None
    batch_size = settings.batch_size if reference else default_batch_size(settings)
    for i in range(0, len(examples), batch_size):
        chunk = list(examples[i : i + batch_size])
        batch = collect(
            generator, timed, tokenizer, chunk, settings.rollout, settings.scoring, group_size=1, greedy=True
        )
        for r, e in zip(batch.rollouts, chunk):
            s = score_rollout(r, e)
            scores.append(s)
            sources.append(e.data_source)
            types.append((e.metadata or {}).get("question_type"))
            per_question.append(question_record(e, s))
            if len(transcripts) < num_transcripts:
                transcripts.append(scored_transcript(r, e, tokenizer, reward=s["em"], stratum=r.num_searches))
        if bar is not None:
            bar.update(len(chunk))
            bar.set_postfix(em=f"{sum(s['em'] for s in scores) / len(scores):.3f}")
    if bar is not None:
        bar.close()
    typed = [(s, str(t)) for s, t in zip(scores, types) if t is not None]
    per_type = aggregate([s for s, _ in typed], [t for _, t in typed], with_all=False) if typed else {}
    return {
        "per_source": aggregate(scores, sources),
        "per_type": dict(sorted(per_type.items())),
        "per_question": per_question,
        "transcripts": transcripts,
        "seconds": time.perf_counter() - start,
        "num_examples": len(examples),
    }


def question_record(example: Question, score: dict[str, float]) -> dict:
    """One question's eval record: ``example_id``, ``data_source``, ``question_type`` (None without one),
    ``em``, ``subem``, ``f1``, ``searches``, ``answered`` (floats, as :func:`score_rollout` gives them)."""
    return {
        "example_id": example.id,
        "data_source": example.data_source,
        "question_type": (example.metadata or {}).get("question_type"),
        **{k: score[k] for k in ("em", "subem", "f1", "searches", "answered")},
    }


def source_intervals(result: dict, metrics: Sequence[str] = ("em", "f1")) -> dict[str, dict[str, dict]]:
    """Per data_source (plus ``all`` when there are several), each metric's mean with its 95% Student-t CI over
    the questions (:func:`~stratarl.evaluation.stats.mean_ci` of ``per_question``), the CI cut to [0, 1]: a rate
    cannot leave it, though mean ± t·s/√n does on few questions."""
    groups: dict[str, list[dict]] = {}
    for record in result["per_question"]:
        groups.setdefault(str(record["data_source"]), []).append(record)
    if len(groups) > 1:
        groups["all"] = list(result["per_question"])
    out: dict[str, dict[str, dict]] = {}
    for source, records in groups.items():
        out[source] = {}
        for metric in metrics:
            interval = mean_ci([float(r[metric]) for r in records]).to_dict()
            if interval["low"] is not None:
                interval.update(low=max(0.0, interval["low"]), high=min(1.0, interval["high"]))
            out[source][metric] = interval
    return out


def _progress(total: int, desc: str):
    return progress(total, desc, unit="question", leave=False)


def overall(result: dict) -> dict[str, float]:
    per = result["per_source"]
    return per.get("all") or next(iter(per.values()), {})


def format_table(result: dict, title: str = "") -> str:
    """A fixed-width table: one row per data_source."""
    header = f"{'data_source':<20}" + "".join(f"{c:>14}" for c in METRIC_COLUMNS)
    lines = [title, header, "-" * len(header)] if title else [header, "-" * len(header)]
    rows = [(src, m) for src, m in result["per_source"].items()]
    rows += [(f"  type {t}", m) for t, m in result.get("per_type", {}).items()]
    for name, m in rows:
        cells = "".join(f"{m[c]:>14.3f}" if c != "count" else f"{m[c]:>14d}" for c in METRIC_COLUMNS)
        lines.append(f"{name:<20}{cells}")
    return "\n".join(lines)


def save_eval(result: dict, run_dir: str | Path, tag: str) -> Path:
    """Write ``<run>/eval/<tag>.json`` (everything but the transcripts: per_source, per_type, per_question, ...)
    and ``<run>/eval/<tag>_transcripts.jsonl``."""
    out = Path(run_dir) / "eval"
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{tag}.json"
    path.write_text(json.dumps({k: v for k, v in result.items() if k != "transcripts"}, indent=2) + "\n")
    write_transcripts(out / f"{tag}_transcripts.jsonl", result.get("transcripts", []))
    return path


def eval_metrics(result: dict, prefix: str = "eval") -> dict[str, float]:
    """Namespaced scalars for metrics.jsonl: eval/<source>/em, ..., and eval/type/<question_type>/em."""
    out = {}
    for src, m in result["per_source"].items():
        for key in ("em", "subem", "f1", "searches_mean", "answer_rate"):
            out[f"{prefix}/{src}/{key}"] = m[key]
    for question_type, m in result.get("per_type", {}).items():
        for key in ("em", "searches_mean"):
            out[f"{prefix}/type/{question_type}/{key}"] = m[key]
    return out
