"""Summarising a finished run: the small JSON committed under results/ (identity, per-step headline curves, binned
diagnostics, every held-out eval, provenance), and the aggregate report of an experiment's run folders.

A summary is what tables.py reads; ``config_hash`` ties it to its design (planning.RunSpec.config_hash), so a
summary whose hash still matches is never run again (``committed``).
"""

from __future__ import annotations

import json
import os
import re
import time
from pathlib import Path

import yaml
from planning import MACHINE_KEYS, RunSpec, in_condition, rl_steps
from provenance import child_env, provenance
from provenance import commit as _commit

PER_STEP_KEYS = ("reward/mean", "rollout/search_calls_mean")
BIN_STEPS = 10  # the other headline metrics are kept as means over consecutive 10-step bins
BINNED_KEYS = (
    "reward/em",
    "rollout/valid_action_rate",
    "stratum/cross_var",
    "stratum/zero_san_frac",
    "stratum/live_groups_frac",
    "offpolicy/lag",
    "offpolicy/is_weight_mean",
    "loss/clip_frac",
    "loss/clip_frac_turn",
    "loss/approx_kl",
    "optim/grad_norm",
    "optim/update_norm",
    "sorl/c_norm",
    "sorl/scale",
    "sorl/engaged",
    "sorl/delta",
    "sorl/effective_scale",
    "advantage/negative_mass_share",
    "critic/explained_variance",
    "critic/vpred_mean",
)
# With the experiment's `summary_strata: true`: per search count k, binned (stratum_bins).
STRATUM_METRIC = re.compile(r"stratum/(\d+)/(reward_mean|count)")
SEARCH_SHARE = re.compile(r"rollout/search_calls_frac/\d+\+?")


def finished(run_dir: Path, steps: int) -> bool:
    path = run_dir / "summary.json"
    if not path.is_file():
        return False
    try:
        summary = json.loads(path.read_text())
    except json.JSONDecodeError:
        return False
    return not summary.get("interrupted") and int(summary.get("steps", -1)) >= steps


def result_path(spec: RunSpec, exp: dict, results: Path) -> Path:
    return results / exp["name"] / spec.condition / f"{spec.arm}-s{spec.seed}.json"


def committed(spec: RunSpec, exp: dict, steps: int, results: Path, config_hash: str) -> bool:
    """A summary of this very run (same config hash, at least ``steps`` steps) is already under ``results``."""
    try:
        summary = json.loads(result_path(spec, exp, results).read_text())
    except (OSError, json.JSONDecodeError):
        return False
    return summary.get("config_hash") == config_hash and int(summary.get("steps", -1)) >= steps


def _round(value: float) -> float:
    return float(f"{value:.4g}")


def _eval_summary(result: dict) -> dict:
    """Overall means over the eval's per-question records (every source), and EM per question type."""
    rows = result.get("per_question") or []
    n = len(rows)

    def mean(key: str) -> float | None:
        return _round(sum(float(r[key]) for r in rows) / n) if n else None

    return {
        "em": mean("em"),
        "f1": mean("f1"),
        "searches": mean("searches"),
        "answer_rate": mean("answered"),
        "n": n,
        "em_by_type": {t: _round(m["em"]) for t, m in result.get("per_type", {}).items()},
    }


def stratum_bins(train: dict[int, dict], steps: list[int], group_size: int) -> dict[str, list]:
    """Per search count k, per BIN_STEPS-step bin: ``stratum/k/count_per_group`` (mean rollouts with k searches
    per prompt group; 0 on a step without any), ``stratum/k/reward_mean`` (their mean reward, weighted by
    count: the success rate given k searches; None in a bin without any), and ``rollout/search_calls_frac/k``
    (the share of rollouts with k searches). Strata are the observed search counts (also under random strata:
    those permute only what the advantage sees)."""
    strata = sorted({int(m.group(1)) for s in steps for k in train[s] if (m := STRATUM_METRIC.fullmatch(k))})
    shares = sorted({k for s in steps for k in train[s] if SEARCH_SHARE.fullmatch(k)})
    out: dict[str, list] = {}
    for k in strata:
        counts, rewards = [], []
        for start in range(0, len(steps), BIN_STEPS):
            rows = [train[s] for s in steps[start : start + BIN_STEPS]]
            groups = [float(r.get("rollout/num", 0.0)) / group_size for r in rows]
            n = [float(r.get(f"stratum/{k}/count", 0.0)) for r in rows]
            counts.append(_round(sum(c / g for c, g in zip(n, groups) if g) / len(rows)))
            total = sum(n)
            rewards.append(
                _round(sum(c * float(r.get(f"stratum/{k}/reward_mean", 0.0)) for c, r in zip(n, rows)) / total)
                if total
                else None
            )
        out[f"stratum/{k}/count_per_group"], out[f"stratum/{k}/reward_mean"] = counts, rewards
    for key in shares:
        out[key] = [
            _round(sum(float(train[s].get(key, 0.0)) for s in steps[i : i + BIN_STEPS]) / len(steps[i : i + BIN_STEPS]))
            for i in range(0, len(steps), BIN_STEPS)
        ]
    return out


def _group_size(run_dir: Path) -> int:
    """rollout.group_size of the run's resolved config (config.yaml)."""
    cfg = yaml.safe_load((run_dir / "config.yaml").read_text()) or {}
    return int((cfg.get("rollout") or {}).get("group_size", 1))


def binned_metrics(train: dict[int, dict], steps: list[int]) -> dict[str, list]:
    """Per BINNED_KEYS metric the run logged: its mean over each BIN_STEPS-step bin (None in a bin without it)."""
    binned = {}
    for key in BINNED_KEYS:
        bins = []
        for start in range(0, len(steps), BIN_STEPS):
            values = [float(train[s][key]) for s in steps[start : start + BIN_STEPS] if key in train[s]]
            bins.append(_round(sum(values) / len(values)) if values else None)
        if any(v is not None for v in bins):
            binned[key] = bins
    return binned


def summarize_run(spec: RunSpec, exp: dict, config_hash: str) -> dict:
    """The committed summary of a finished run: identity, per-step headline curves, binned diagnostics,
    every held-out eval (before, step_N, after)."""
    d = spec.run_dir
    from stratarl.evaluation.rundir import train_rows  # here, not at the top: the plan needs no torch

    train = {int(row["step"]): row for row in train_rows(d)}  # a resumed step counts once, its last row
    steps = sorted(train)
    per_step = {k: [_round(train[s][k]) if k in train[s] else None for s in steps] for k in PER_STEP_KEYS}
    binned = binned_metrics(train, steps)
    first_step = {}
    if exp.get("summary_strata"):
        binned.update(stratum_bins(train, steps, _group_size(d)))
        # Step 1's rollouts are the warm start's own (sampled before any update): the regime as it started.
        first_step = {
            k: _round(v)
            for k, v in (train[steps[0]] if steps else {}).items()
            if STRATUM_METRIC.fullmatch(k) or SEARCH_SHARE.fullmatch(k)
        }
    evals = {}
    for path in sorted((d / "eval").glob("*.json")):
        try:
            evals[path.stem] = _eval_summary(json.loads(path.read_text()))
        except (OSError, json.JSONDecodeError, AttributeError):
            continue
    run_summary = json.loads((d / "summary.json").read_text())
    # A population member's clock also runs while the other members compute (they take turns on one thread), so
    # its train_seconds is its share of the population's wall time.
    population = _population_size(d)
    started = _started(d)
    # A run older than the provenance record: what can still be read now, marked as such.
    record = started or {
        **provenance(spec, child_env()),
        "commit": _run_commit(d),
        "dirty": None,
        "recorded": "at summary",
    }
    return {
        "experiment": exp["name"],
        "condition": spec.condition,
        "arm": spec.arm,
        "seed": spec.seed,
        "task": spec.task,
        "steps": len(steps),
        "config_hash": config_hash,
        "overrides": [o for o in spec.overrides if not o.startswith(MACHINE_KEYS)],
        "commit": record.get("commit"),
        "provenance": record,
        "train_seconds": _round(_train_seconds(d, run_summary) / population),
        **({"population": population} if population > 1 else {}),
        "measured": time.strftime("%Y-%m-%d"),
        "per_step": per_step,
        "binned": {"bin_steps": BIN_STEPS, "metrics": binned},
        **({"first_step": first_step} if first_step else {}),
        "eval": evals,
    }


def _population_size(run_dir: Path) -> int:
    """How many runs trained together in the run's population (arm.json ``population``; 1 for a solo run)."""
    try:
        return max(1, int(json.loads((run_dir / "arm.json").read_text()).get("population", 1)))
    except (OSError, json.JSONDecodeError, TypeError, ValueError):
        return 1


def _train_seconds(run_dir: Path, run_summary: dict) -> float:
    """Seconds a run spent on its steps and evals. summary.json times the last process only, so a run resumed
    from a checkpoint (``start_step`` > 0) sums its logged ``time/step`` and ``time/eval`` instead, each step's
    last row counted once (a step re-run after a resume replaced its first row)."""
    if not run_summary.get("start_step"):
        return float(run_summary.get("train_seconds", 0.0))
    from stratarl.infra.metrics import read_metrics  # here, as train_rows: the runner's top level imports no stratarl

    last = {
        (key, int(row["step"])): float(row[key])
        for row in read_metrics(run_dir)
        for key in ("time/step", "time/eval")
        if key in row and isinstance(row.get("step"), (int, float))
    }
    return sum(last.values())


def _run_commit(run_dir: Path) -> str | None:
    """The commit a run started at (arm.json), else the current one."""
    try:
        info = json.loads((run_dir / "arm.json").read_text())
        return (info.get("started") or {}).get("commit") or info.get("commit") or _commit()
    except (OSError, json.JSONDecodeError):
        return _commit()


def _started(run_dir: Path) -> dict | None:
    """The provenance arm.json recorded when the run first started (None for a run that predates it)."""
    try:
        return json.loads((run_dir / "arm.json").read_text()).get("started")
    except (OSError, json.JSONDecodeError):
        return None


def write_result(spec: RunSpec, exp: dict, results: Path, config_hash: str) -> None:
    path = result_path(spec, exp, results)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(summarize_run(spec, exp, config_hash), separators=(",", ":")) + "\n")
    os.replace(tmp, path)


def aggregate(exp: dict, root: Path, steps: int, include_unfinished: bool) -> int:
    dirs = []
    for path in sorted(root.glob("*/*/arm.json")):
        info, d = json.loads(path.read_text()), path.parent
        spec = exp["conditions"].get(info.get("condition"))
        if spec is None or info.get("arm") not in exp["arms"] or not in_condition(spec, info["arm"]):
            continue  # a run of an arm / condition the experiment no longer has
        if (d / "metrics.jsonl").is_file() and (
            include_unfinished or finished(d, rl_steps(exp, info["condition"], steps))
        ):
            dirs.append(d)
    if not dirs:
        print(f"no finished runs under {root} to aggregate", flush=True)
        return 1
    out = root / "aggregate" / "report.html"
    from stratarl.cli import main as stratarl_main  # the CLI in-process: saves one interpreter start

    rc = stratarl_main(
        [
            "report",
            "--aggregate",
            "--baseline",
            exp["baseline"],
            "--out",
            str(out),
            "--title",
            f"{exp['name']}: {exp.get('description', '')}",
            *map(str, dirs),
        ]
    )
    if rc == 0:
        print(f"aggregated {len(dirs)} runs: {out.parent / 'aggregate.md'}", flush=True)
    return rc
