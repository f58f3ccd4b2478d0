"""Run one evidence experiment end to end: warm starts, every arm x condition x seed, aggregation.

    python benchmarks/evidence/run.py stratified            # paper A: Stratified GRPO vs GRPO
    python benchmarks/evidence/run.py sorl --seeds 3        # paper B: SORL under off-policy reuse
    python benchmarks/evidence/run.py sorl --reduced --out /tmp/ev   # CI smoke test sizes
    python benchmarks/evidence/run.py stratified --aggregate-only    # re-aggregate what exists

Everything goes through the real CLI: ``stratarl sft`` once per task (the shared warm start),
``stratarl train`` per run (``model.init_from`` = that task's SFT model, so arms differ only by
algorithm and seed), ``stratarl report --aggregate`` at the end. ``--jobs`` runs execute in
parallel, each with one thread. A run whose directory has a finished summary.json is skipped; a
run with checkpoints but no summary continues with ``stratarl train --resume``; anything else
starts over. Layout::

    <out>/warmstart/<task>/model                       shared SFT checkpoint of a task (both experiments
                                                       share a task of the same name and settings)
    <out>/<experiment>/<condition>/<arm>-s<seed>/      one run (arm.json says arm, condition, seed)
    <out>/<experiment>/aggregate/{aggregate.json, aggregate.md, curves_*.png, report.html}
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import yaml

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import admission as admission_check  # noqa: E402  (benchmarks/evidence/admission.py)
import pilot as pilots  # noqa: E402  (benchmarks/evidence/pilot.py: the mechanism admission on pilot worlds)
import population as populations  # noqa: E402  (benchmarks/evidence/population.py: --population K)
from provenance import commit as _commit  # noqa: E402  (benchmarks/evidence/provenance.py)
from provenance import provenance  # noqa: E402

WARMSTART = HERE / "warmstart.yaml"
# Committed per-run summaries (small JSON): a sweep finished in parts, on several machines, regenerates its
# tables from these alone (benchmarks/evidence/tables.py).
RESULTS = HERE / "results"
# Overrides that name paths of this machine: not part of what a run *is* (its config hash).
MACHINE_KEYS = ("model.init_from=", "data.synthetic.cache_dir=")
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
# The real CLI of the interpreter running this script (`stratarl ...` without relying on PATH).
STRATARL = [sys.executable, "-m", "stratarl.cli"]


@dataclass
class RunSpec:
    """One `stratarl train` invocation of the sweep."""

    condition: str
    arm: str
    seed: int
    task: str
    run_dir: Path
    overrides: list[str] = field(default_factory=list)
    base: str = ""
    steps: int = 0  # RL steps of this run (rl_steps: the budget over the condition's steps_per_batch)

    def config_hash(self) -> str:
        """sha256 (16 hex digits) of what the run is in the design: its base config's name and its overrides
        without this machine's paths. Equal on every machine; it changes when the experiment's YAML changes
        this run, not when stratarl gains a config field or the base config's contents change: the summary's
        ``provenance`` records those (commit, dirty tree, sha256 of the base config's contents, the warm
        start's digest, torch, threads, CPU)."""
        portable = [o for o in self.overrides if not o.startswith(MACHINE_KEYS)]
        design = {"base": Path(self.base).name, "overrides": portable}
        return hashlib.sha256(json.dumps(design, sort_keys=True).encode()).hexdigest()[:16]


def _value(value) -> str:
    """A YAML value as one command-line token (flow style: dicts and lists stay on one line)."""
    if isinstance(value, str):
        return value
    return yaml.safe_dump(value, default_flow_style=True, width=10**6).strip().removesuffix("...").strip()


def flatten(mapping: dict, prefix: str = "") -> dict:
    """Nested config sections -> dotted keys; ``options`` mappings stay whole (they are one field)."""
    out = {}
    for key, value in (mapping or {}).items():
        path = f"{prefix}{key}"
        if isinstance(value, dict) and key != "options" and "." not in key:
            out.update(flatten(value, f"{path}."))
        else:
            out[path] = value
    return out


def as_overrides(mapping: dict) -> list[str]:
    return [f"{k}={_value(v)}" for k, v in flatten(mapping).items()]


def load_experiment(name: str) -> dict:
    path = Path(name) if name.endswith((".yaml", ".yml")) else HERE / f"{name}.yaml"
    if not path.is_file():
        known = sorted(p.stem for p in HERE.glob("*.yaml") if p.stem not in ("base", "warmstart"))
        sys.exit(f"error: no experiment {name!r} ({path}). Fix: use one of {', '.join(known)}")
    try:
        exp = yaml.safe_load(path.read_text())
    except yaml.YAMLError as error:
        from stratarl.config_errors import yaml_syntax_error

        sys.exit(f"error: experiment file {yaml_syntax_error(path, error)}")
    exp["name"] = path.stem
    exp["base_path"] = str((path.parent / exp.get("base", "base.yaml")).resolve())
    # The warm-start fragment layered over the base (v1 experiments: warmstart.yaml); null: the base's own sft.
    fragment = exp.get("warmstart", "warmstart.yaml")
    exp["warmstart_path"] = None if fragment is None else (path.parent / fragment).resolve()
    for cond, spec in exp["conditions"].items():
        if spec["task"] not in exp["tasks"]:
            sys.exit(f"error: {path}: condition {cond!r} names task {spec['task']!r}; tasks: {sorted(exp['tasks'])}")
    return exp


# What warmstart.yaml contributes: everything that shapes the warm-start checkpoint and must match it in RL
# (model, task data, retrieval, rollout format, the SFT itself). The RL settings (algo, optim, trainer,
# eval, logging, data.max_*, rollout.group_size) stay the experiment's, so it cannot resize the sweeps.
WARMSTART_KEYS = ("model.", "data.source", "data.synthetic.", "retrieval.", "rollout.", "sft.")


def warmstart_overrides(path: Path | None = None) -> list[str]:
    """SFT settings from the warm-start fragment ``path`` (default: warmstart.yaml; owned by the warm-start
    tuning: a config fragment or a complete config, nested sections or dotted keys), restricted to
    WARMSTART_KEYS; [] while it does not exist (the base config's own sft section applies)."""
    path = WARMSTART if path is None else path
    if not path.is_file():
        return []
    data = yaml.safe_load(path.read_text()) or {}
    if not isinstance(data, dict):
        sys.exit(f"error: {path} must be a mapping of config sections, got {type(data).__name__}")
    flat = flatten(data)
    return [
        f"{k}={_value(v)}"
        for k, v in flat.items()
        if k.startswith(WARMSTART_KEYS) and k not in ("sft.enabled", "rollout.group_size")
    ]


def _in_condition(spec: dict, arm: str) -> bool:
    """A condition may list the arms it runs (``arms: [...]``); default: every arm."""
    return not spec.get("arms") or arm in spec["arms"]


def rl_steps(exp: dict, condition: str, steps: int) -> int:
    """RL steps of a run of ``condition``: ``steps``, or with the condition's ``steps_per_batch: d`` (d optimizer
    steps per RL step) ``steps`` optimizer steps, i.e. steps // d RL steps (at least 1), so every degree gets
    the same number of optimizer steps and, with a fixed mini-batch, consumes the same rollouts."""
    d = int(exp["conditions"][condition].get("steps_per_batch", 1))
    if d < 1:
        sys.exit(f"error: {exp['name']}: condition {condition!r} has steps_per_batch {d}. Fix: use an integer >= 1")
    return max(1, steps // d)


def _select(kind: str, all_names: list[str], wanted: list[str] | None) -> list[str]:
    if not wanted:
        return all_names
    unknown = sorted(set(wanted) - set(all_names))
    if unknown:
        sys.exit(f"error: unknown {kind} {unknown}; the experiment has {all_names}")
    return [n for n in all_names if n in wanted]


def plan(
    exp: dict,
    out: Path,
    *,
    seeds: int,
    steps: int,
    reduced: bool,
    extra: list[str],
    arms: list[str] | None = None,
    conditions: list[str] | None = None,
    cache: Path | None = None,
    condition_seeds: bool = False,
) -> tuple[dict, list[RunSpec]]:
    """(warm start -> SFT overrides, run specs ordered seed-major so early results cover whole seeds). A warm start
    is named by its task, or with the experiment's ``world_from`` by task and world (``multihop-w3001``); a
    RunSpec's ``task`` is the name of the warm start it starts from. With ``condition_seeds`` a condition's own
    ``seeds: N`` replaces ``seeds`` for its runs (e.g. more seeds at the degree where a collapse is expected)."""
    red = exp.get("reduced", {}) if reduced else {}
    arms = _select("arms", list(exp["arms"]), arms or red.get("arms"))
    conditions = _select("conditions", list(exp["conditions"]), conditions or red.get("conditions"))
    tail = as_overrides(red.get("overrides", {})) + list(extra)
    common = (warmstart_overrides(exp["warmstart_path"]) if exp["warmstart_path"] is not None else []) + as_overrides(
        exp.get("common", {})
    )
    tasks = {exp["conditions"][c]["task"] for c in conditions}
    root = out / exp["name"]
    if cache is not None:  # one KB folder per task (an explicit cache_dir is the KB folder itself)
        tail += [f"data.synthetic.cache_dir={cache / '{task}'}"]
    world_from = exp.get("world_from")
    if world_from is not None and (not isinstance(world_from, int) or isinstance(world_from, bool) or world_from < 0):
        sys.exit(
            f"error: {exp['name']}.yaml: world_from {world_from!r} must be a knowledge-base seed (an integer "
            ">= 0): seed s then runs on world world_from + s. Fix: use e.g. 3001, or drop it (one world)"
        )

    def world(seed: int) -> list[str]:
        """With ``world_from``: seed s trains on its own world (data.synthetic.seed = world_from + s) and its own
        warm start, so the CIs over seeds cover worlds and warm starts, not only RL seeds."""
        return [] if world_from is None else [f"data.synthetic.seed={world_from + seed}"]

    # ``shared_warmstart: true``: one warm start per task for every world (a warm start that never sees the task's
    # world, as the lab's: its demonstrations come from fresh worlds), so the worlds differ only in the RL task.
    shared = bool(exp.get("shared_warmstart", False))

    def key(task: str, seed: int) -> str:  # one warm start per key
        return task if world_from is None or shared else f"{task}-w{world_from + seed}"

    def seeds_of(cond: str) -> int:
        own = exp["conditions"][cond].get("seeds") if condition_seeds else None
        if own is not None and (not isinstance(own, int) or isinstance(own, bool) or own < 1):
            sys.exit(f"error: {exp['name']}.yaml: condition {cond!r} has seeds {own!r}. Fix: use an integer >= 1")
        return seeds if own is None else own

    sft = {}
    for t in sorted(tasks):
        task_seeds = max(seeds_of(c) for c in conditions if exp["conditions"][c]["task"] == t)
        for seed in range(task_seeds if world_from is not None and not shared else 1):
            sft[key(t, seed)] = (
                common
                + as_overrides(exp["tasks"][t])
                + [x.replace("{task}", t) for x in tail]
                + ([] if shared else world(seed))
            )
    runs = []
    for seed in range(max(seeds_of(c) for c in conditions)):
        for cond in conditions:
            spec = exp["conditions"][cond]
            if seed >= seeds_of(cond):
                continue
            n_steps = rl_steps(exp, cond, steps)
            for arm in arms:
                if not _in_condition(spec, arm):
                    continue
                task = spec["task"]
                overrides = (
                    common
                    + as_overrides(exp["tasks"][task])
                    + as_overrides(spec.get("overrides", {}))
                    + as_overrides(exp["arms"][arm])
                    + [x.replace("{task}", task) for x in tail]
                    + world(seed)
                    + [
                        f"trainer.seed={seed}",
                        f"trainer.steps={n_steps}",
                        "trainer.num_threads=1",
                        "sft.enabled=false",
                        f"model.init_from={out / 'warmstart' / key(task, seed) / 'model'}",
                    ]
                )
                runs.append(
                    RunSpec(
                        cond,
                        arm,
                        seed,
                        key(task, seed),
                        root / cond / f"{arm}-s{seed}",
                        overrides,
                        exp["base_path"],
                        n_steps,
                    )
                )
    return sft, runs


def _env() -> dict:
    env = dict(os.environ)
    env.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    return env


def _call(cmd: list[str], log: Path) -> int:
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "a") as f:
        f.write(f"\n$ {' '.join(cmd)}\n")
        f.flush()
        return subprocess.call(cmd, stdout=f, stderr=subprocess.STDOUT, env=_env())


def _stale(lock: Path) -> bool:
    """A lock whose runner is gone (killed): its pid no longer exists."""
    try:
        os.kill(int(lock.read_text() or "0"), 0)
    except (ValueError, ProcessLookupError, FileNotFoundError):
        return True
    except PermissionError:
        return False
    return False


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
    lock = out / "warmstart" / f"{task}.lock"  # _try_lock creates the folder
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
        if (fd := _try_lock(lock)) is not None:
            break
        if not wait:
            return None
        time.sleep(1)  # another runner is training it
    try:
        started = time.perf_counter()
        rc = _call(cmd, out / "warmstart" / f"{task}.log")
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


def pilot_gate(exp: dict, pilot_root: Path, results: Path) -> str | None:
    """pilot.gate on the pilot summaries under ``results`` (<experiment>-pilot/): None when the sweep may run."""
    if not exp.get("pilot"):
        return None
    import tables  # here: tables.py imports this module

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


def finished(run_dir: Path, steps: int) -> bool:
    path = run_dir / "summary.json"
    if not path.is_file():
        return False
    try:
        summary = json.loads(path.read_text())
    except json.JSONDecodeError:
        return False
    return not summary.get("interrupted") and int(summary.get("steps", -1)) >= steps


def _try_lock(lock: Path) -> int | None:
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


def summarize_run(spec: RunSpec, exp: dict, config_hash: str) -> dict:
    """The committed summary of a finished run: identity, per-step headline curves, binned diagnostics,
    every held-out eval (before, step_N, after)."""
    d = spec.run_dir
    from stratarl.evaluation.rundir import train_rows  # here, not at the top: the plan needs no torch

    train = {int(row["step"]): row for row in train_rows(d)}  # a resumed step counts once, its last row
    steps = sorted(train)
    per_step = {k: [_round(train[s][k]) if k in train[s] else None for s in steps] for k in PER_STEP_KEYS}
    binned = {}
    for key in BINNED_KEYS:
        bins = []
        for start in range(0, len(steps), BIN_STEPS):
            values = [float(train[s][key]) for s in steps[start : start + BIN_STEPS] if key in train[s]]
            bins.append(_round(sum(values) / len(values)) if values else None)
        if any(v is not None for v in bins):
            binned[key] = bins
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
    record = started or {**provenance(spec, _env()), "commit": _run_commit(d), "dirty": None, "recorded": "at summary"}
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
    now = provenance(spec, _env())
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
    fd = _try_lock(lock)
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
        rc = _call(cmd, d / "train.log")
        if rc != 0 or not finished(d, steps):
            return f"FAIL rc={rc}"
        if results is not None:
            write_result(spec, exp, results, config_hash)
        return "resumed" if has_checkpoint else "done"
    finally:
        os.close(fd)
        lock.unlink(missing_ok=True)


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
    while (fd := _try_lock(lock)) is None:
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
        rc = _call(
            [*STRATARL, "train", exp["base_path"], *overrides, "--run-dir", str(folder)],
            folder.parent / f"{spec.task}.log",
        )
        row = admission_check.first_step_row(folder)
        failures = admission_check.check(row, adm["bounds"]) if rc == 0 else [f"the admission run failed (rc={rc})"]
        keys = {admission_check.ALIASES.get(k, k) for k in adm["bounds"]}
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


def aggregate(exp: dict, root: Path, steps: int, include_unfinished: bool) -> int:
    dirs = []
    for path in sorted(root.glob("*/*/arm.json")):
        info, d = json.loads(path.read_text()), path.parent
        spec = exp["conditions"].get(info.get("condition"))
        if spec is None or info.get("arm") not in exp["arms"] or not _in_condition(spec, info["arm"]):
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


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("experiment", help="stratified, sorl, or a path to an experiment YAML")
    p.add_argument("--seeds", type=int, help="seeds 0..N-1 (default: the experiment's)")
    p.add_argument("--steps", type=int, help="RL steps per run (default: the experiment's)")
    p.add_argument("--jobs", type=int, default=2, help="runs in parallel, one thread each (default 2)")
    p.add_argument(
        "--population",
        type=int,
        default=1,
        metavar="K",
        help="train K runs per process as a population "
        "(`stratarl population`; docs/lab.md), --jobs processes at a time (default 1: one process per run)",
    )
    p.add_argument("--reduced", action="store_true", help="CI sizes: the experiment's `reduced` section")
    p.add_argument(
        "--pilot",
        action="store_true",
        help="run the experiment's mechanism admission on its pilot worlds "
        "(its `pilot` section; benchmarks/evidence/pilot.py) and write the record the sweep needs",
    )
    p.add_argument("--out", default="runs/evidence", help="output root (default runs/evidence)")
    p.add_argument(
        "--set",
        dest="extra",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="extra override for every run and warm start (repeatable)",
    )
    p.add_argument("--arms", nargs="+", help="only these arms (default: all)")
    p.add_argument("--conditions", nargs="+", help="only these conditions (default: all)")
    p.add_argument(
        "--cache",
        type=Path,
        help="keep the generated knowledge bases under this folder (default: $STRATARL_CACHE/synth)",
    )
    p.add_argument(
        "--results",
        type=Path,
        help="where finished runs write their summaries (default: "
        "benchmarks/evidence/results, committed; with --reduced: <out>/results); a run whose summary "
        "is there with the same config hash is not run again",
    )
    p.add_argument(
        "--resummarize",
        action="store_true",
        help="rewrite the summaries of every finished run "
        "under --out from its run folder (e.g. after the summary format changed), then stop",
    )
    p.add_argument("--aggregate-only", action="store_true", help="only aggregate the runs that exist")
    p.add_argument("--include-unfinished", action="store_true", help="aggregate runs still in progress too")
    args = p.parse_args(argv)
    exp = load_experiment(args.experiment)
    red = exp.get("reduced", {}) if args.reduced else {}
    results = args.results or (Path(args.out) / "results" if args.reduced else RESULTS)
    # Pilot records sit beside the committed summaries (pilots/), or in a --results folder of one's own.
    pilot_root = pilots.PILOTS if results == RESULTS else results / "pilots"
    design = exp
    if args.pilot:
        import tables  # here: tables.py imports this module

        try:
            pilot = pilots.validate(exp, tables.METRICS)
        except ValueError as e:
            sys.exit(f"error: {e}")
        exp = pilots.pilot_experiment(exp, pilot)
        args.seeds, args.arms = pilot["seeds"], pilot["arms"]
        args.conditions = pilot.get("conditions") or args.conditions
    elif not args.reduced and not args.aggregate_only and (why := pilot_gate(exp, pilot_root, results)):
        sys.exit(f"error: {why}")
    seeds = args.seeds or red.get("seeds") or exp.get("seeds", 3)
    # A condition's own `seeds` holds unless the command line or the reduced section sets one count for all.
    condition_seeds = not (args.seeds or red.get("seeds"))
    steps = args.steps or red.get("steps") or exp.get("steps", 30)
    root = Path(args.out) / exp["name"]
    if args.aggregate_only:
        return aggregate(exp, root, steps, args.include_unfinished)
    sft, runs = plan(
        exp,
        Path(args.out),
        seeds=seeds,
        steps=steps,
        reduced=args.reduced,
        extra=args.extra,
        arms=args.arms,
        conditions=args.conditions,
        cache=args.cache,
        condition_seeds=condition_seeds,
    )
    if args.resummarize:
        finished_here = [r for r in runs if finished(r.run_dir, r.steps)]
        for r in finished_here:
            write_result(r, exp, results, r.config_hash())
        print(f"rewrote {len(finished_here)} of {len(runs)} summaries under {results / exp['name']}", flush=True)
        return 0
    total, total_seeds, cells = len(runs), len({r.seed for r in runs}), len({(r.condition, r.arm) for r in runs})
    # Runs summarised under `results` (finished here or on another machine) need neither a run nor a warm start.
    done = [r for r in runs if committed(r, exp, r.steps, results, r.config_hash())]
    runs = [r for r in runs if r not in done]
    sft = {t: o for t, o in sft.items() if any(r.task == t for r in runs)}
    print(
        f"{exp['name']}: {total} runs ({total_seeds} seeds, {cells} arm-conditions), {steps} steps; "
        f"{len(done)} already summarised under {results}; {len(runs)} to run after {len(sft)} warm start(s), "
        f"{args.jobs} in parallel -> {root}",
        flush=True,
    )
    for r in done:
        print(f"[skip (summary)] {r.condition}/{r.arm} seed {r.seed} ({result_path(r, exp, results)})", flush=True)
    started = time.perf_counter()
    with ThreadPoolExecutor(max_workers=max(1, args.jobs)) as pool:
        # Tasks another runner is training right now go last, so this runner trains its own first.
        ok = dict(zip(sft, pool.map(lambda t: run_warmstart(exp, t, sft[t], Path(args.out), wait=False), sft)))
        busy = [t for t, v in ok.items() if v is None]
        ok.update(zip(busy, pool.map(lambda t: run_warmstart(exp, t, sft[t], Path(args.out)), busy)))
        todo = [r for r in runs if ok[r.task]]
        if args.reduced and "admission" in red:  # CI sizes: the reduced section's own check (false: none)
            exp["admission"] = red["admission"]
        if exp.get("admission") and todo:
            admission_check.validate(exp["admission"], f"{exp['name']}.yaml")
            for task in sorted({r.task for r in todo}):
                first = (
                    next(r for r in todo if r.task == task and r.arm == exp["baseline"])
                    if any(r.task == task and r.arm == exp["baseline"] for r in todo)
                    else next(r for r in todo if r.task == task)
                )
                failures = admit(exp, first, Path(args.out))
                if failures:
                    print(
                        f"error: the warm start of task {task!r} fails {exp['name']}'s admission check: "
                        f"{'; '.join(failures)}. Fix: retune the task's sft settings (the regime is not what the "
                        f"design assumes); details in {Path(args.out) / exp['name'] / 'admission' / (task + '.json')}",
                        flush=True,
                    )
                    return 1
                print(f"[admitted] warm start {task}", flush=True)

        def job(spec: RunSpec) -> str:
            t0 = time.perf_counter()
            status = run_one(spec, exp, steps, results)
            print(
                f"[{status}] {spec.condition}/{spec.arm} seed {spec.seed} ({time.perf_counter() - t0:.0f}s; "
                f"{spec.run_dir})",
                flush=True,
            )
            return status

        if args.population > 1:
            statuses = populations.run_in_populations(
                sys.modules[__name__],
                todo,
                exp,
                steps,
                results,
                size=args.population,
                jobs=args.jobs,
                out=Path(args.out),
            )
        else:
            statuses = list(pool.map(job, todo))
    failed = sum(s.startswith("FAIL") for s in statuses) + len(runs) - len(todo)
    busy = sum(s.startswith("busy") for s in statuses)
    if busy:
        print(f"{busy} runs were in progress in another runner; the last runner to finish aggregates them", flush=True)
    print(f"all runs finished in {(time.perf_counter() - started) / 60:.1f} min; {failed} failed", flush=True)
    rc = aggregate(exp, root, steps, args.include_unfinished)
    if args.pilot and failed:
        print(
            f"error: {failed} pilot runs failed, so the pilot wrote no record. Fix: see their train.log, then run "
            f"the pilot again (finished runs are kept)",
            flush=True,
        )
        return 1
    if args.pilot:
        import tables

        record = pilots.judge(design, pilot, tables.load_runs(exp, results), tables.METRICS)
        pilot_root.mkdir(parents=True, exist_ok=True)
        path = pilots.record_path(design, pilot_root)
        try:  # an unreadable earlier record has no history to keep
            previous = pilots.read_record(path) if path.is_file() else None
        except ValueError as error:
            print(f"warning: {error}; writing a new record", flush=True)
            previous = None
        record = pilots.keep_history(record, previous)
        path.write_text(json.dumps(record, indent=1) + "\n")
        print(pilots.describe(record), flush=True)
        print(f"wrote {pilots.record_path(design, pilot_root)}", flush=True)
        return 1 if failed else (0 if record["admitted"] else 2)
    return 1 if failed else rc


if __name__ == "__main__":
    sys.exit(main())
