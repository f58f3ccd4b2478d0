"""Where the off-policy regime is: stale weights (trainer.policy_lag k) x sampler numerics (rollout.precision),
on the word-level lab and on the SmolLM2 lab, measured on real training runs.

    python benchmarks/offpolicy_map.py                                   # word-level lab, k in {0,2,8,32} x fp32/bf16/int8
    python benchmarks/offpolicy_map.py --lab smollm2 --lags 0,2 --steps 6
    python benchmarks/offpolicy_map.py --lab word --lags 8 --precisions int8 --steps 300 --jobs 1

Each setting is one `stratarl train` run of the lab's own config (its cached warm start, GRPO with
``algo.old_logprobs: rollout``, so the PPO clip and the ratio are taken against the behaviour policy, as
SORL's `rollout` reading is) for ``--steps`` steps, then greedy held-out EM. The run carries SORL's
normaliser in measure-only form (``algo.normalizer=sorl``, rule ``running_pg`` with delta 1e12: the factor is
exactly 1, the update is GRPO's, and ||C|| and the policy-gradient norm are logged every optimizer step), so
one run reports:

- clip share: PPO's clipped share of policy tokens (``loss/clip_frac``), mean over the steps;
- ratio p99: the 99th percentile of pi_learner / pi_behav over the step's policy tokens (``offpolicy/ratio_p99``),
  mean over the steps, and its largest value;
- mismatch per turn: mean |log pi_learner - log pi_behav| over the tokens of turn 1, 2, 3 (mean over steps);
- ||C||: the clipping-bias gradient norm (``sorl/c_norm``), mean over the steps;
- the share of steps on which SORL's normaliser would engage: under the threshold reading (delta = 1,
  ||C|| > 1) and under the scale-free rule (delta_t = 1 x the moving average (0.9) of ||grad J_PPO|| over the
  previous steps, ||C|| > delta_t), computed from the logged norms of this run. The floor reading (a small
  delta) engages on every step with any clipping, so it is not a column;
- held-out EM after the budget (greedy, the lab's held-out questions).

The target of the off-policy work: a setting where the clip share is >= 5 % and a normaliser reading engages on
>= 20 % of steps. The table says which settings reach it. One optimizer step per rollout batch (the labs'
configs), so a step's logged ||C|| is that optimizer step's own.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from stratarl.trainer.config import load_config
from stratarl.trainer.warmstart.stages import cached_warm_start

REPO = Path(__file__).resolve().parents[1]
LABS = {"word": REPO / "configs" / "lab.yaml", "smollm2": REPO / "configs" / "smollm2.yaml"}
MEASURE_ONLY = ["algo.normalizer=sorl", "algo.sorl_delta_rule=running_pg", "algo.sorl_delta=1e12"]
TARGET_CLIP, TARGET_ENGAGED = 0.05, 0.20
SMOLLM2_SMALL = [
    "trainer.prompts_per_step=2",
    "rollout.group_size=4",
    "data.max_eval_examples=50",
    "eval.batch_size=50",
]


def run_setting(lab: str, lag: int, precision: str, steps: int, out: Path, extra: list[str], warm_start: Path) -> Path:
    """Train one setting from ``warm_start`` (skipped when its summary exists); returns its run directory."""
    run_dir = out / lab / f"k{lag}-{precision}"
    if (run_dir / "summary.json").exists():
        return run_dir
    overrides = [
        f"trainer.steps={steps}",
        f"trainer.policy_lag={lag}",
        f"rollout.precision={precision}",
        "algo.old_logprobs=rollout",
        "trainer.eval_every=0",
        "trainer.save_every=0",
        "logging.progress=false",
        "logging.num_transcripts=0",
        *MEASURE_ONLY,
        # the lab's own cached warm start, built once by main(): a run's overrides (a smaller eval) would
        # otherwise change the warm start's cache key and build another one in every run
        f"model.init_from={warm_start}",
    ]
    if lab == "smollm2":
        overrides += SMOLLM2_SMALL
    command = [
        sys.executable,
        "-m",
        "stratarl.cli",
        "train",
        str(LABS[lab]),
        *overrides,
        *extra,
        "--run-dir",
        str(run_dir),
    ]
    run_dir.parent.mkdir(parents=True, exist_ok=True)
    with open(run_dir.parent / f"{run_dir.name}.log", "w") as log:
        done = subprocess.run(
            command, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "OMP_NUM_THREADS": "1"}
        )
    if done.returncode != 0:
        raise SystemExit(f"setting {lab} k={lag} {precision} failed (exit {done.returncode}); see {log.name}")
    return run_dir


def _mean(rows: list[dict], key: str) -> float | None:
    values = [r[key] for r in rows if key in r]
    return statistics.fmean(values) if values else None


def engaged_shares(c_norms: list[float], pg_norms: list[float], ema: float = 0.9) -> tuple[float, float]:
    """Share of steps with ||C|| > 1 (threshold reading) and with ||C|| > the running mean of the policy-gradient
    norm over the previous steps (scale-free rule, delta 1; the first step's statistic is its own norm, as
    stratarl.algos.sorl's running_pg starts)."""
    if not c_norms:
        return 0.0, 0.0
    threshold = sum(c > 1.0 for c in c_norms) / len(c_norms)
    running, hits = None, 0
    for c, g in zip(c_norms, pg_norms):
        running = g if running is None else running
        hits += c > running
        running = ema * running + (1 - ema) * g
    return threshold, hits / len(c_norms)


def summarize(run_dir: Path) -> dict:
    """The table's row of one run directory (metrics.jsonl and summary.json)."""
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "loss/clip_frac" in r]
    summary = json.loads((run_dir / "summary.json").read_text())
    threshold, scale_free = engaged_shares([r["sorl/c_norm"] for r in steps], [r["sorl/pg_grad_norm"] for r in steps])
    p99 = [r["offpolicy/ratio_p99"] for r in steps if "offpolicy/ratio_p99" in r]
    return {
        "steps": len(steps),
        "clip_share": _mean(steps, "loss/clip_frac"),
        "ratio_p99": statistics.fmean(p99) if p99 else None,
        "ratio_p99_max": max(p99) if p99 else None,
        "ratio_max": max((r.get("offpolicy/ratio_max", 0.0) for r in steps), default=None),
        **{f"mismatch_turn{k}": _mean(steps, f"offpolicy/mismatch_turn{k}") for k in (1, 2, 3)},
        "kl_k3": _mean(steps, "offpolicy/kl_k3"),
        "c_norm": _mean(steps, "sorl/c_norm"),
        "c_norm_max": max((r["sorl/c_norm"] for r in steps), default=None),
        "engaged_threshold": threshold,
        "engaged_scale_free": scale_free,
        "lag_mean": _mean(steps, "offpolicy/lag"),
        "em_before": (summary.get("eval_before") or {}).get("em"),
        "em_after": (summary.get("eval_after") or {}).get("em"),
        "reward_last_fifth": statistics.fmean([r["reward/mean"] for r in steps[-max(1, len(steps) // 5) :]]),
    }


def _cell(value, fmt: str) -> str:
    return "-" if value is None else format(value, fmt)


def table(results: list[tuple[str, int, str, dict]]) -> str:
    head = (
        "| lab | k | sampler | clip share | ratio p99 (max) | mismatch t1 / t2 / t3 | k3 KL | ‖C‖ mean (max) "
        "| engaged δ=1 | engaged scale-free | EM after | target |"
    )
    lines = [head, "|---" * (head.count("|") - 1) + "|"]
    for lab, lag, precision, r in results:
        reached = (
            r["clip_share"] is not None
            and r["clip_share"] >= TARGET_CLIP
            and max(r["engaged_threshold"], r["engaged_scale_free"]) >= TARGET_ENGAGED
        )
        mismatch = " / ".join(_cell(r[f"mismatch_turn{k}"], ".1e") for k in (1, 2, 3))
        lines.append(
            f"| {lab} | {lag} | {precision} | {_cell(r['clip_share'], '.2%')} | "
            f"{_cell(r['ratio_p99'], '.3f')} ({_cell(r['ratio_p99_max'], '.3f')}) | {mismatch} | "
            f"{_cell(r['kl_k3'], '.2e')} | {_cell(r['c_norm'], '.3g')} ({_cell(r['c_norm_max'], '.3g')}) | "
            f"{r['engaged_threshold']:.0%} | {r['engaged_scale_free']:.0%} | {_cell(r['em_after'], '.3f')} | "
            f"{'yes' if reached else 'no'} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lab", choices=("word", "smollm2", "both"), default="word")
    parser.add_argument("--lags", default="0,2,8,32", help="comma-separated policy lags k")
    parser.add_argument("--precisions", default="fp32,bf16,int8", help="comma-separated sampler precisions")
    parser.add_argument("--steps", type=int, default=None, help="RL steps per setting (word 150, smollm2 6)")
    parser.add_argument("--jobs", type=int, default=2, help="settings trained at once (one thread each)")
    parser.add_argument("--out", type=Path, default=REPO / "runs" / "offpolicy_map")
    parser.add_argument("--json", type=Path, default=None, help="also write the rows here")
    parser.add_argument("overrides", nargs="*", help="dotted overrides for every run, e.g. trainer.seed=1")
    args = parser.parse_args(argv)
    labs = ["word", "smollm2"] if args.lab == "both" else [args.lab]
    settings = [(lab, int(k), p) for lab in labs for k in args.lags.split(",") for p in args.precisions.split(",")]
    # the lab's cached warm start (built once if missing), which every run of that lab starts from
    warm = {lab: cached_warm_start(load_config(LABS[lab]), progress=False)[0] for lab in labs}

    def one(setting):
        lab, lag, precision = setting
        steps = args.steps or (150 if lab == "word" else 6)
        return (
            lab,
            lag,
            precision,
            summarize(run_setting(lab, lag, precision, steps, args.out, args.overrides, warm[lab])),
        )

    with ThreadPoolExecutor(max_workers=max(1, args.jobs)) as pool:
        results = list(pool.map(one, settings))
    print(table(results))
    reached = [
        f"{lab} k={k} {p}"
        for lab, k, p, r in results
        if (r["clip_share"] or 0) >= TARGET_CLIP
        and max(r["engaged_threshold"], r["engaged_scale_free"]) >= TARGET_ENGAGED
    ]
    print(
        f"\ntarget (clip share >= {TARGET_CLIP:.0%} and a normaliser reading engaged on >= {TARGET_ENGAGED:.0%} of "
        f"steps): {', '.join(reached) if reached else 'reached by no setting'}"
    )
    if args.json is not None:
        args.json.write_text(
            json.dumps([{"lab": lab, "lag": k, "precision": p, **r} for lab, k, p, r in results], indent=1) + "\n"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
