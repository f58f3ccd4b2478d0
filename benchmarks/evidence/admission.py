"""Admission check of a warm start: do its rollouts show the regime an experiment was designed for?

An experiment's YAML may hold ``admission: {steps: 1, prompts: 64, bounds: {metric: [low, high], ...}}``.
Before the sweep, run.py trains the baseline arm of each task for ``steps`` RL steps from the warm start with
``prompts`` prompts per step; the rollouts of step 1 are sampled from the warm start itself (no update has
happened yet). Their metrics (the trainer's metrics.jsonl row of step 1) must lie inside ``bounds``, else the
sweep does not start: a regime that the warm start does not show would make the arms' comparison answer
another question. ``admit`` runs that check (one lock file per warm start, as for runs); ``pilot_gate`` keeps a
sweep from starting before its pilot admitted the very design on file (pilot.py).
"""

from __future__ import annotations

import json
import math
import os
import shutil
import time
from pathlib import Path

import pilot as pilots
import running
import tables
from planning import RunSpec, as_overrides

# Readable names of the trainer's step metrics an admission bound may use (or any metrics.jsonl key itself).
ALIASES = {
    "two_search_share": "rollout/search_calls_frac/2",
    "success_given_2": "stratum/2/reward_mean",
    "no_search_share": "rollout/search_calls_frac/0",
    "success_given_0": "stratum/0/reward_mean",
    "reward": "reward/mean",
}


def first_step_row(run_dir: Path) -> dict:
    """The metrics.jsonl row of RL step 1 (its rollouts come from the warm start); {} when there is none."""
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        return {}
    for line in path.read_text().splitlines():
        row = json.loads(line)
        if row.get("step") == 1 and "reward/mean" in row:
            return row
    return {}


def check(row: dict, bounds: dict) -> list[str]:
    """One line per bound that ``row`` violates (a missing metric counts as a violation); [] when admitted."""
    failures = []
    for name, (low, high) in bounds.items():
        key = ALIASES.get(name, name)
        value = row.get(key)
        if value is None or not math.isfinite(float(value)):
            failures.append(f"{name} ({key}) is missing from the warm start's first step")
        elif not low <= float(value) <= high:
            failures.append(f"{name} ({key}) = {float(value):.3f}, outside [{low}, {high}]")
    return failures


def validate(admission: dict, where: str) -> None:
    """A clear error for a malformed ``admission`` section (unknown shape or low > high)."""
    bounds = admission.get("bounds")
    if not isinstance(bounds, dict) or not bounds:
        raise ValueError(
            f"{where}: admission.bounds must map metric names to [low, high]. "
            f"Fix: e.g. bounds: {{two_search_share: [0.6, 1.0]}}"
        )
    for name, pair in bounds.items():
        if not (isinstance(pair, list) and len(pair) == 2 and pair[0] <= pair[1]):
            raise ValueError(f"{where}: admission.bounds.{name} = {pair!r}. Fix: use [low, high] with low <= high")
    for key in ("steps", "prompts"):
        if int(admission.get(key, 1)) < 1:
            raise ValueError(f"{where}: admission.{key} = {admission[key]!r}. Fix: use an integer >= 1")


def admit(exp: dict, spec: RunSpec, out: Path) -> list[str]:
    """Run the experiment's admission check of ``spec.task``'s warm start (admission.py): ``spec`` (a baseline
    run of the task) for admission.steps RL steps with admission.prompts prompts per step, no evals, into
    <out>/<experiment>/admission/<task>; returns the violated bounds ([] = admitted). A passing record
    (admission/<task>.json) is reused. A lock file (as for runs) keeps two runners sharing a sweep from checking
    one warm start at once, which would delete the run directory the other is reading; the runner that waited
    takes the record the other wrote."""
    adm = exp["admission"]
    folder = out / exp["name"] / "admission" / spec.task
    record, lock = folder.parent / f"{spec.task}.json", folder.parent / f".{spec.task}.lock"
    waiting_since = time.time()
    while (fd := running.try_lock(lock)) is None:
        time.sleep(1)  # another runner is checking this warm start
    try:
        if record.is_file():
            have = json.loads(record.read_text())
            if have.get("admitted") or record.stat().st_mtime >= waiting_since:
                return list(have.get("failures", []))
        drop = ("trainer.steps=", "trainer.prompts_per_step=", "trainer.eval_every=", "eval.before_after=")
        overrides = (
            [o for o in spec.overrides if not o.startswith(drop)]
            + as_overrides(adm.get("overrides", {}))
            + [
                f"trainer.steps={int(adm.get('steps', 1))}",
                f"trainer.prompts_per_step={int(adm.get('prompts', 64))}",
                "trainer.eval_every=0",
                "eval.before_after=false",
            ]
        )
        if folder.exists():
            shutil.rmtree(folder)
        rc = running.call(
            [*running.STRATARL, "train", exp["base_path"], *overrides, "--run-dir", str(folder)],
            folder.parent / f"{spec.task}.log",
        )
        row = first_step_row(folder)
        failures = check(row, adm["bounds"]) if rc == 0 else [f"the admission run failed (rc={rc})"]
        keys = {ALIASES.get(k, k) for k in adm["bounds"]}
        record.write_text(
            json.dumps(
                {
                    "task": spec.task,
                    "admitted": not failures,
                    "failures": failures,
                    "first_step": {k: row.get(k) for k in sorted(keys)},
                },
                indent=1,
            )
            + "\n"
        )
        return failures
    finally:
        os.close(fd)
        lock.unlink(missing_ok=True)


def pilot_gate(exp: dict, pilot_root: Path, results: Path) -> str | None:
    """pilot.gate on the pilot summaries under ``results`` (<experiment>-pilot/): None when the sweep may run."""
    if not exp.get("pilot"):
        return None
    try:
        section = pilots.validate(exp, tables.METRICS)
    except ValueError as error:
        return str(error)
    pilot_exp = pilots.pilot_experiment(exp, section)
    try:
        runs = tables.load_runs(pilot_exp, results)
    except (ValueError, OSError, KeyError, TypeError) as error:  # a damaged summary: JSON, fields
        return (
            f"a pilot summary under {results / pilot_exp['name']} cannot be read ({type(error).__name__}: "
            f"{' '.join(str(error).split())[:200]}), so the pilot's verdict cannot be checked. Fix: restore the "
            f"summaries from git, or run the pilot again (python benchmarks/evidence/run.py {exp['name']} --pilot)"
        )
    return pilots.gate(exp, pilot_root, runs, tables.METRICS)
