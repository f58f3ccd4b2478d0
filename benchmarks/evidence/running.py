"""Running an evidence experiment's processes: the shared warm starts (``stratarl sft``) and the runs
(``stratarl train``, resumed from a checkpoint when one exists), each claimed with a lock file so that several
runners can share one sweep. A finished run's summary is written by summaries.py.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

from planning import RunSpec
from provenance import child_env, provenance
from summaries import committed, finished, write_result

# The real CLI of the interpreter running this script (`stratarl ...` without relying on PATH).
STRATARL = [sys.executable, "-m", "stratarl.cli"]


def call(cmd: list[str], log: Path) -> int:
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "a") as f:
        f.write(f"\n$ {' '.join(cmd)}\n")
        f.flush()
        return subprocess.call(cmd, stdout=f, stderr=subprocess.STDOUT, env=child_env())


def _stale(lock: Path) -> bool:
    """A lock whose runner is gone (killed): its pid no longer exists."""
    try:
        os.kill(int(lock.read_text() or "0"), 0)
    except (ValueError, ProcessLookupError, FileNotFoundError):
        return True
    except PermissionError:
        return False
    return False


def try_lock(lock: Path) -> int | None:
    """Create ``lock`` holding our pid (a stale lock of a dead runner is taken over); None when held."""
    lock.parent.mkdir(parents=True, exist_ok=True)
    while True:
        try:
            fd = os.open(lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
        except FileExistsError:
            if _stale(lock):
                lock.unlink(missing_ok=True)
                continue
            return None
        os.write(fd, str(os.getpid()).encode())
        return fd


def warmstart_key(exp: dict, overrides: list[str]) -> dict:
    """What a warm start of the experiment's base config with ``overrides`` depends on: stratarl's own cache key
    (``warm_start_key``: model, data, retrieval, prompt format, the sft section, gradient clip and micro-batch),
    not the RL settings. Round-tripped through JSON so that it compares with a record read back."""
    from stratarl.trainer.config import load_config
    from stratarl.trainer.warmstart.stages import warm_start_key

    return json.loads(json.dumps(warm_start_key(load_config(exp["base_path"], overrides)), default=str))


def same_warmstart(have: dict, wanted: dict) -> bool:
    """Whether a warm start recorded as ``have`` is the one ``wanted`` asks for: on the warm-start key when the
    record has one; a record written before keys were recorded matches only the same base and overrides."""
    if "key" in have:
        return have["key"] == wanted["key"]
    return Path(have.get("base", "")).name == wanted["base"] and have.get("overrides") == wanted["overrides"]


def run_warmstart(exp: dict, task: str, overrides: list[str], out: Path, *, wait: bool = True) -> bool | None:
    """Train the task's shared SFT checkpoint once (a lock file keeps two runners from doing it twice).

    Returns True when the checkpoint is ready, False when training it failed, and None when another
    runner holds the lock and ``wait`` is False (try again later)."""
    folder = out / "warmstart" / task
    record = out / "warmstart" / f"{task}.json"
    cmd = [*STRATARL, "sft", exp["base_path"], *overrides, "trainer.num_threads=1", "--out", str(folder)]
    # The base config by name (a sweep continued from another checkout trusts the same warm start), the overrides
    # as given, and what the warm start depends on: a record matches on that key, so an RL-only setting in the
    # overrides (optim.lr, say) reuses the checkpoint instead of refusing it.
    wanted = {"base": Path(exp["base_path"]).name, "overrides": overrides, "key": warmstart_key(exp, overrides)}
    lock = out / "warmstart" / f"{task}.lock"  # try_lock creates the folder
    while True:
        if (folder / "model" / "config.json").is_file() and record.is_file():
            if not same_warmstart(json.loads(record.read_text()), wanted):
                sys.exit(
                    f"error: {folder} was trained with other settings ({record}); the runs of task {task!r} "
                    f"would not start from the warm start they ask for. Fix: delete {folder} and {record}, "
                    "or use another --out"
                )
            print(f"[skip] warm start {task}: {folder / 'model'} exists", flush=True)
            return True
        if (fd := try_lock(lock)) is not None:
            break
        if not wait:
            return None
        time.sleep(1)  # another runner is training it
    try:
        started = time.perf_counter()
        rc = call(cmd, out / "warmstart" / f"{task}.log")
        ok = rc == 0 and (folder / "model" / "config.json").is_file()
        if ok:
            record.write_text(json.dumps(wanted, indent=1) + "\n")
        print(
            f"[{'done' if ok else 'FAIL'}] warm start {task} in {time.perf_counter() - started:.0f}s "
            f"(log {out / 'warmstart' / f'{task}.log'})",
            flush=True,
        )
        return ok
    finally:
        os.close(fd)
        lock.unlink(missing_ok=True)


def write_arm(run_dir: Path, spec: RunSpec, exp: dict, *, resumed: bool) -> dict:
    """arm.json: the run's identity and, under ``started``, its provenance at the first start. A resume keeps
    that record and appends the commit it resumed at to ``resumed_at``, so the summary names the commit and
    warm start the run began with."""
    old = {}
    if resumed:
        try:
            old = json.loads((run_dir / "arm.json").read_text())
        except (OSError, json.JSONDecodeError):
            old = {}
    now = provenance(spec, child_env())
    started = old.get("started") or now
    if resumed and not old.get("started"):  # begun before provenance was recorded: only its commit is known
        started = {**now, "commit": old.get("commit"), "dirty": None, "recorded": "at resume"}
    info = {
        "experiment": exp["name"],
        "condition": spec.condition,
        "arm": spec.arm,
        "seed": spec.seed,
        "task": spec.task,
        "commit": now["commit"],
        "started": started,
        "resumed_at": [*old.get("resumed_at", []), now["commit"]] if resumed else [],
    }
    (run_dir / "arm.json").write_text(json.dumps(info) + "\n")
    return info


def run_one(spec: RunSpec, exp: dict, steps: int, results: Path | None = None) -> str:
    """Train one run (skip when finished here or summarised under ``results``, resume from a checkpoint,
    else start over), then write its summary under ``results``; returns a status.

    A lock file next to the run directory lets several runners share one sweep (start another
    ``run.py`` with the same arguments to add a worker): a run another runner holds is left to it."""
    d = spec.run_dir
    steps = spec.steps or steps
    config_hash = spec.config_hash() if results is not None else ""
    if results is not None and committed(spec, exp, steps, results, config_hash):
        return "skip (summary)"
    if finished(d, steps):
        if results is not None:
            write_result(spec, exp, results, config_hash)
        return "skip"
    lock = d.parent / f".{d.name}.lock"
    fd = try_lock(lock)
    if fd is None:
        return "busy (another runner has it)"
    try:
        if finished(d, steps):
            return "skip"
        has_checkpoint = any((d / "checkpoints").glob("step_*")) if (d / "checkpoints").is_dir() else False
        if has_checkpoint:
            cmd = [*STRATARL, "train", "--resume", str(d), f"trainer.steps={steps}"]
        else:
            if d.exists():
                shutil.rmtree(d)  # a run that died before its first checkpoint: nothing to keep
            cmd = [*STRATARL, "train", exp["base_path"], *spec.overrides, "--run-dir", str(d)]
        d.mkdir(parents=True, exist_ok=True)
        write_arm(d, spec, exp, resumed=has_checkpoint)
        rc = call(cmd, d / "train.log")
        if rc != 0 or not finished(d, steps):
            return f"FAIL rc={rc}"
        if results is not None:
            write_result(spec, exp, results, config_hash)
        return "resumed" if has_checkpoint else "done"
    finally:
        os.close(fd)
        lock.unlink(missing_ok=True)
