"""The greedy eval, the reference path against the default one, side by side in one run.

    python benchmarks/bench_eval.py                                  # SmolLM2 lab, 200 questions, its warm start
    python benchmarks/bench_eval.py --questions 40 --batch-size 10   # the same 4 reference batches, 1/5 the work
    python benchmarks/bench_eval.py --config configs/lab.yaml --repeats 3

One model, one retriever and the same held-out questions for both arms (``stratarl.evaluation.greedy.evaluate``):

- ``reference``: ``evaluate(..., reference=True)``, the eval as it was first written: ``eval.batch_size``
  questions per generator call, every prompt prefilled in full;
- ``default``: ``evaluate(...)``: batches of ``SHARED_BATCH_FACTOR`` x ``eval.batch_size`` questions whose
  prompts' common prefix (the template) is computed once per batch.

The arms alternate (reference, default, reference, default, ...; ``--repeats`` each) on one thread, so machine
noise hits both; the ratio is of the medians. Each arm's time is split into the fast decoder's prefill, its
decode steps, its cache selections (finished rows dropped, kept prefixes copied) and the rest (retrieval,
parsing, scoring), by timing those methods. Then the numerics: the questions whose transcripts (every turn's
tokens) are identical in both arms, and both arms' EM. With fewer questions than 200, pass ``--batch-size`` so
the reference runs as many batches as the full eval does (``--questions 40 --batch-size 10``: 4, as 200 at 50).
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
PARTS = ("prefill", "decode", "select")


@contextmanager
def timed_decoder(seconds: dict[str, float]):
    """Add the seconds spent in ``FastDecoder.prefill`` / ``decode`` / ``select`` / ``row_cache`` (a kept prefix's
    copy, counted as ``select``) to ``seconds`` while the block runs."""
    from stratarl.rollout.fast_forward import FastDecoder

    names = {"prefill": "prefill", "decode": "decode", "select": "select"}
    names["row_cache"] = "select"
    originals = {name: getattr(FastDecoder, name) for name in names}

    def timing(name, real):
        def method(self, *args, **kwargs):
            start = time.perf_counter()
            try:
                return real(self, *args, **kwargs)
            finally:
                seconds[names[name]] = seconds.get(names[name], 0.0) + time.perf_counter() - start

        return method

    for name, real in originals.items():
        setattr(FastDecoder, name, timing(name, real))
    try:
        yield
    finally:
        for name, real in originals.items():
            setattr(FastDecoder, name, real)


def setup(args):
    from stratarl.trainer.config import load_config
    from stratarl.trainer.setup import build_task_retriever, limit_per_source, load_policy, load_task
    from stratarl.trainer.warmstart.stages import warm_start_cache_dir

    overrides = ["logging.progress=false", *args.overrides]
    if args.batch_size:
        overrides.append(f"eval.batch_size={args.batch_size}")
    cfg = load_config(args.config, overrides)
    init = cfg.model.init_from
    folder = warm_start_cache_dir(cfg) / "model"
    if init is None and not args.no_warm_start and cfg.sft.enabled and (folder / "config.json").is_file():
        init = str(folder)
    model_cfg = type(cfg.model)(**{**cfg.model.__dict__, "init_from": init})
    task = load_task(cfg)
    questions = limit_per_source(task.test, args.questions)
    model, tokenizer = load_policy(model_cfg, seed=cfg.trainer.seed, task=task)
    return cfg, init, model, tokenizer, build_task_retriever(cfg, task), questions


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default=str(REPO / "configs" / "smollm2.yaml"))
    parser.add_argument("--questions", type=int, default=200, help="held-out questions (the first N)")
    parser.add_argument("--batch-size", type=int, default=0, help="eval.batch_size for both arms (0: the config's)")
    parser.add_argument("--repeats", type=int, default=2, help="runs per arm, alternating")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--no-warm-start", action="store_true", help="the base model, not the cached warm start")
    parser.add_argument("--json", help="also write the numbers here")
    parser.add_argument("overrides", nargs="*", help="config overrides")
    args = parser.parse_args()
    sys.path.insert(0, str(REPO))
    from stratarl.evaluation.greedy import SHARED_BATCH_FACTOR, default_batch_size, evaluate, overall
    from stratarl.infra.threads import set_threads
    from stratarl.trainer.setup import eval_settings

    set_threads(args.threads)
    cfg, init, model, tokenizer, retriever, questions = setup(args)
    settings = eval_settings(cfg)
    print(
        f"policy: {init or 'the base model (no cached warm start)'}; {len(questions)} questions; precision "
        f"{settings.policy.precision}; {torch.get_num_threads()} thread(s); batches: reference "
        f"{settings.batch_size}, default {default_batch_size(settings)} ({SHARED_BATCH_FACTOR} x)"
    )
    runs: dict[str, list[dict]] = {"reference": [], "default": []}
    results: dict[str, dict] = {}
    for _ in range(args.repeats):
        for arm in runs:
            parts: dict[str, float] = {}
            start = time.perf_counter()
            with timed_decoder(parts):
                result = evaluate(
                    model,
                    tokenizer,
                    retriever,
                    questions,
                    settings,
                    num_transcripts=len(questions),
                    reference=arm == "reference",
                )
            total = time.perf_counter() - start
            row = {"total": total, **{p: parts.get(p, 0.0) for p in PARTS}}
            row["other"] = total - sum(row[p] for p in PARTS)
            runs[arm].append(row)
            results[arm] = result
            print(f"  {arm:9s} " + " ".join(f"{k} {v:.1f}s" for k, v in row.items()), flush=True)
    summary: dict = {"policy": init, "questions": len(questions), "threads": torch.get_num_threads(), "arms": {}}
    for arm, rows in runs.items():
        medians = {k: statistics.median(r[k] for r in rows) for k in rows[0]}
        shares = {k: medians[k] / medians["total"] for k in (*PARTS, "other")}
        summary["arms"][arm] = {**medians, "share": shares, "em": overall(results[arm])["em"]}
        print(
            f"{arm:9s} median {medians['total']:.1f}s: "
            + ", ".join(f"{k} {shares[k]:.0%}" for k in (*PARTS, "other"))
            + f"; EM {summary['arms'][arm]['em']:.3f}, searches {overall(results[arm])['searches_mean']:.2f}"
        )
    ref, new = summary["arms"]["reference"], summary["arms"]["default"]
    summary["speedup"] = ref["total"] / new["total"]
    same = [
        a["turns"] == b["turns"]
        for a, b in zip(results["reference"]["transcripts"], results["default"]["transcripts"], strict=True)
    ]
    summary["identical_transcripts"] = sum(same)
    summary["peak_rss_gb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # Linux: KiB
    print(
        f"speedup: {summary['speedup']:.2f}x (reference {ref['total']:.1f}s, default {new['total']:.1f}s; "
        f"target >= 3x); identical transcripts {sum(same)} of {len(same)}; peak memory of the process "
        f"{summary['peak_rss_gb']:.1f} GiB"
    )
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=2) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
