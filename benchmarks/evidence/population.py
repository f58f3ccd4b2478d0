"""The evidence runner's runs as populations (`run.py EXPERIMENT --population K`): K runs per `stratarl
population` process instead of one `stratarl train` process each, ``--jobs`` processes at a time.

Every run keeps what ``running.run_one`` gives it: skipped when summarised under ``results`` or finished, a lock file
next to its run directory (so several runners can share a sweep), resumed from its checkpoint (`--resume`) or
started over, arm.json with its provenance, its output in its own train.log, its summary under ``results`` when it
finished. A run that fails in a population (dropped, or stopped early: the population's summary says which, with
its exit code and reason) is reported as FAIL and the others go on. Runs are grouped in plan
order (seed-major), so a population holds the arms of a seed, paired runs side by side.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import running
import summaries
from provenance import child_env


def _claim(spec, exp: dict, steps: int, results: Path | None):
    """(status, None) when the run needs no training here, else (None, (lock fd, spec entry, resumed))."""
    d = spec.run_dir
    steps = spec.steps or steps
    config_hash = spec.config_hash() if results is not None else ""
    if results is not None and summaries.committed(spec, exp, steps, results, config_hash):
        return "skip (summary)", None
    if summaries.finished(d, steps):
        if results is not None:
            summaries.write_result(spec, exp, results, config_hash)
        return "skip", None
    lock = d.parent / f".{d.name}.lock"
    fd = running.try_lock(lock)
    if fd is None:
        return "busy (another runner has it)", None
    has_checkpoint = (d / "checkpoints").is_dir() and any((d / "checkpoints").glob("step_*"))
    if has_checkpoint:
        entry = {
            "name": f"{spec.condition}/{d.name}",
            "run_dir": str(d),
            "resume": True,
            "overrides": [f"trainer.steps={steps}"],
        }
    else:
        if d.exists():
            shutil.rmtree(d)  # a run that died before its first checkpoint: nothing to keep
        entry = {
            "name": f"{spec.condition}/{d.name}",
            "run_dir": str(d),
            "config": exp["base_path"],
            "overrides": list(spec.overrides),
        }
    d.mkdir(parents=True, exist_ok=True)
    running.write_arm(d, spec, exp, resumed=has_checkpoint)
    return None, (fd, lock, entry, has_checkpoint)


def _member_outcomes(summary: Path) -> dict[str, dict]:
    """run_dir -> the member's entry of a `stratarl population --summary` file (status: done / stopped / dropped,
    exit_code, reason); {} when the population wrote none (it failed before training)."""
    try:
        members = json.loads(summary.read_text()).get("members", [])
    except (OSError, ValueError, AttributeError):
        return {}
    return {str(m.get("run_dir")): m for m in members if isinstance(m, dict)}


def _run_group(group: list, exp: dict, steps: int, results: Path | None, index: int, out: Path) -> list[str]:
    statuses, claimed = [], []
    for spec in group:
        status, claim = _claim(spec, exp, steps, results)
        statuses.append(status)
        claimed.append(claim)
    todo = [(i, c) for i, c in enumerate(claimed) if c is not None]
    try:
        if todo:
            folder = out / "populations"
            folder.mkdir(parents=True, exist_ok=True)
            path = folder / f"population-{os.getpid()}-{index}.json"
            path.write_text(json.dumps({"runs": [c[2] for _, c in todo]}, indent=1))
            cmd = [*running.STRATARL, "population", str(path), "--summary", str(path.with_suffix(".out.json"))]
            with open(path.with_suffix(".log"), "a") as log:
                rc = subprocess.call(cmd, stdout=log, stderr=subprocess.STDOUT, env=child_env())
            outcome = _member_outcomes(path.with_suffix(".out.json"))
            for i, claim in todo:
                spec = group[i]
                member = outcome.get(str(spec.run_dir))
                if member is not None and member.get("status") != "done":
                    why = member.get("reason") or member.get("status")
                    statuses[i] = (
                        f"FAIL {member.get('status')} (exit code {member.get('exit_code')}: {why}; population log "
                        f"{path.with_suffix('.log')})"
                    )
                elif summaries.finished(spec.run_dir, spec.steps or steps):
                    if results is not None:
                        summaries.write_result(spec, exp, results, spec.config_hash())
                    statuses[i] = "resumed" if claim[3] else "done"
                else:
                    statuses[i] = f"FAIL rc={rc} (population log {path.with_suffix('.log')})"
    finally:
        for _, (fd, lock, _, _) in todo:
            os.close(fd)
            lock.unlink(missing_ok=True)
    return statuses


def run_in_populations(
    specs: list, exp: dict, steps: int, results: Path | None, *, size: int, jobs: int, out: Path
) -> list[str]:
    """Train ``specs`` as populations of ``size`` runs, ``jobs`` populations at a time; one status per spec (as
    ``running.run_one`` returns them), in order."""
    groups = [specs[i : i + size] for i in range(0, len(specs), size)]
    with ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
        done = list(pool.map(lambda g: _run_group(g[1], exp, steps, results, g[0], out), enumerate(groups)))
    statuses = [s for group in done for s in group]
    for spec, status in zip(specs, statuses):
        print(f"[{status}] {spec.condition}/{spec.arm} seed {spec.seed} ({spec.run_dir})", flush=True)
    return statuses
