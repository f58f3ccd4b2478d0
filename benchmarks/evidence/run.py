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

This file is the command line; each job has its module: planning.py (the experiment's YAML -> warm starts and
run specs, with their config hashes), running.py (the processes, their lock files and arm.json), summaries.py
(a finished run's committed summary, the aggregate report), admission.py (the warm start's admission check and
the pilot gate), population.py (``--population K``).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import admission  # noqa: E402  (benchmarks/evidence/admission.py)
import pilot as pilots  # noqa: E402  (benchmarks/evidence/pilot.py: the mechanism admission on pilot worlds)
import population as populations  # noqa: E402  (benchmarks/evidence/population.py: --population K)
import tables  # noqa: E402  (benchmarks/evidence/tables.py: the metrics a pilot checks)
from planning import RESULTS, RunSpec, load_experiment, plan  # noqa: E402
from running import run_one, run_warmstart  # noqa: E402
from summaries import aggregate, committed, finished, result_path, write_result  # noqa: E402


def _parser() -> argparse.ArgumentParser:
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
    return p


def _pilot_design(exp: dict, args: argparse.Namespace) -> tuple[dict, dict]:
    """(the pilot's experiment, its ``pilot`` section) for ``--pilot``; the pilot's seeds, arms and conditions
    replace the command line's."""
    try:
        pilot = pilots.validate(exp, tables.METRICS)
    except ValueError as e:
        sys.exit(f"error: {e}")
    args.seeds, args.arms = pilot["seeds"], pilot["arms"]
    args.conditions = pilot.get("conditions") or args.conditions
    return pilots.pilot_experiment(exp, pilot), pilot


def _resummarize(exp: dict, runs: list[RunSpec], results: Path) -> int:
    finished_here = [r for r in runs if finished(r.run_dir, r.steps)]
    for r in finished_here:
        write_result(r, exp, results, r.config_hash())
    print(f"rewrote {len(finished_here)} of {len(runs)} summaries under {results / exp['name']}", flush=True)
    return 0


def _warm_starts(exp: dict, sft: dict[str, list[str]], out: Path, pool: ThreadPoolExecutor) -> dict[str, bool]:
    """Train every warm start in ``sft``; task -> whether it is ready. Tasks another runner is training right now
    go last, so this runner trains its own first."""
    ok = dict(zip(sft, pool.map(lambda t: run_warmstart(exp, t, sft[t], out, wait=False), sft)))
    busy = [t for t, v in ok.items() if v is None]
    ok.update(zip(busy, pool.map(lambda t: run_warmstart(exp, t, sft[t], out), busy)))
    return ok


def _admit_tasks(exp: dict, todo: list[RunSpec], out: Path) -> bool:
    """The experiment's admission check of each task's warm start (on its baseline arm's run when there is one);
    False, after a one-line error, when one fails."""
    admission.validate(exp["admission"], f"{exp['name']}.yaml")
    for task in sorted({r.task for r in todo}):
        of_task = [r for r in todo if r.task == task]
        first = next((r for r in of_task if r.arm == exp["baseline"]), of_task[0])
        failures = admission.admit(exp, first, out)
        if failures:
            print(
                f"error: the warm start of task {task!r} fails {exp['name']}'s admission check: "
                f"{'; '.join(failures)}. Fix: retune the task's sft settings (the regime is not what the "
                f"design assumes); details in {out / exp['name'] / 'admission' / (task + '.json')}",
                flush=True,
            )
            return False
        print(f"[admitted] warm start {task}", flush=True)
    return True


def _run_all(exp: dict, todo: list[RunSpec], steps: int, results: Path, args, pool: ThreadPoolExecutor) -> list[str]:
    """Every run of ``todo`` (one process each, or ``--population K`` per process); one status each."""
    if args.population > 1:
        return populations.run_in_populations(
            todo, exp, steps, results, size=args.population, jobs=args.jobs, out=Path(args.out)
        )

    def job(spec: RunSpec) -> str:
        t0 = time.perf_counter()
        status = run_one(spec, exp, steps, results)
        print(
            f"[{status}] {spec.condition}/{spec.arm} seed {spec.seed} ({time.perf_counter() - t0:.0f}s; "
            f"{spec.run_dir})",
            flush=True,
        )
        return status

    return list(pool.map(job, todo))


def _sweep(exp: dict, args, red: dict, plan_: tuple, steps: int, results: Path) -> int | None:
    """The planned warm starts and runs not yet summarised under ``results``: the number that failed, or None
    when a warm start failed its admission check."""
    sft, runs = plan_
    root = Path(args.out) / exp["name"]
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
        ok = _warm_starts(exp, sft, Path(args.out), pool)
        todo = [r for r in runs if ok[r.task]]
        if args.reduced and "admission" in red:  # CI sizes: the reduced section's own check (false: none)
            exp["admission"] = red["admission"]
        if exp.get("admission") and todo and not _admit_tasks(exp, todo, Path(args.out)):
            return None
        statuses = _run_all(exp, todo, steps, results, args, pool)
    failed = sum(s.startswith("FAIL") for s in statuses) + len(runs) - len(todo)
    busy = sum(s.startswith("busy") for s in statuses)
    if busy:
        print(f"{busy} runs were in progress in another runner; the last runner to finish aggregates them", flush=True)
    print(f"all runs finished in {(time.perf_counter() - started) / 60:.1f} min; {failed} failed", flush=True)
    return failed


def _record_pilot(design: dict, pilot: dict, exp: dict, results: Path, pilot_root: Path, failed: int) -> int:
    """Judge the pilot's summaries and write its record (keeping the verdicts of earlier designs): 0 admitted,
    2 not admitted, 1 when runs failed (then no record)."""
    if failed:
        print(
            f"error: {failed} pilot runs failed, so the pilot wrote no record. Fix: see their train.log, then run "
            f"the pilot again (finished runs are kept)",
            flush=True,
        )
        return 1
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
    return 0 if record["admitted"] else 2


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    exp = load_experiment(args.experiment)
    red = exp.get("reduced", {}) if args.reduced else {}
    results = args.results or (Path(args.out) / "results" if args.reduced else RESULTS)
    # Pilot records sit beside the committed summaries (pilots/), or in a --results folder of one's own.
    pilot_root = pilots.PILOTS if results == RESULTS else results / "pilots"
    design, pilot = exp, None
    if args.pilot:
        exp, pilot = _pilot_design(exp, args)
    elif not args.reduced and not args.aggregate_only and (why := admission.pilot_gate(exp, pilot_root, results)):
        sys.exit(f"error: {why}")
    seeds = args.seeds or red.get("seeds") or exp.get("seeds", 3)
    # A condition's own `seeds` holds unless the command line or the reduced section sets one count for all.
    condition_seeds = not (args.seeds or red.get("seeds"))
    steps = args.steps or red.get("steps") or exp.get("steps", 30)
    root = Path(args.out) / exp["name"]
    if args.aggregate_only:
        return aggregate(exp, root, steps, args.include_unfinished)
    planned = plan(
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
        return _resummarize(exp, planned[1], results)
    failed = _sweep(exp, args, red, planned, steps, results)
    if failed is None:
        return 1
    rc = aggregate(exp, root, steps, args.include_unfinished)
    if pilot is not None:
        return _record_pilot(design, pilot, exp, results, pilot_root, failed)
    return 1 if failed else rc


if __name__ == "__main__":
    sys.exit(main())
