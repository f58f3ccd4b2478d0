"""A sweep's cost: the same runs solo (today's runner: one `stratarl train` process per run, ``--jobs`` at a
time, one thread each) and as populations (`stratarl population`: ``--population`` runs per process, ``--jobs``
processes at a time), in one benchmark run on this machine.

    python benchmarks/bench_sweep.py                                   # 4 worlds x 2 arms, 300 steps (issue 44)
    python benchmarks/bench_sweep.py --steps 5 --worlds 2001-2002 --set eval.before_after=false   # a smoke test

Every run is configs/lab.yaml from the lab's cached warm start (``model.init_from``; the warm start never sees a
task world, so every world runs from it), on world ``data.synthetic.seed = W`` with ``trainer.seed`` = the world's
index, for each arm. The knowledge bases are generated before any timing. Printed, all measured in this run:

1. per mode: wall time of the whole sweep, runs per core-hour (runs / (wall x cores used)), the ratio to solo
   (the issue's target: >= 2.5x), and the mean seconds per RL step of a run (wall / runs / steps x processes);
2. the FLOP share: the useful work of the sweep's RL steps (bench_lab's FLOP model on each step's logged mean
   lengths: a group's prompt once, every response token once per pass, the LM head on policy tokens; evals
   excluded) over wall x cores x the one-thread matmul peak measured here; and the executed share, from the
   executed / useful ratio of ``--count-steps`` steps counted by ``torch.utils.flop_counter``'s formulas in
   process (solo: the step; population: every member's step);
3. a verdict against the 2.5x target;
4. same results: the populations' held-out greedy EM after training against the solo run of the same world,
   arm and seed, paired over the sweep's runs (mean difference with its 95% t-interval, the largest |difference|,
   and how many runs' metrics.jsonl are bit-identical to the solo run's outside ``time/`` and ``perf/``). The
   stated tolerance: every member must be bit-identical to its solo run.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))
import bench_lab  # noqa: E402  (benchmarks/bench_lab.py: the matmul peak, the FLOP model and counter formulas)

TARGET_RATIO = 2.5
MODES = ("solo", "alone")
STRATARL = [sys.executable, "-m", "stratarl.cli"]


def parse_worlds(text: str) -> list[int]:
    """``2001-2004`` or ``2001,2005`` -> the world seeds."""
    if "-" in text:
        first, last = text.split("-")
        return list(range(int(first), int(last) + 1))
    return [int(w) for w in text.split(",")]


def sweep_runs(args, init_from: str) -> list[dict]:
    """The sweep's runs: name and overrides (seed = the world's index, paired across arms)."""
    runs = []
    for index, world in enumerate(parse_worlds(args.worlds)):
        for arm in args.arms:
            runs.append(
                {
                    "name": f"{arm}-w{world}",
                    "overrides": [
                        f"model.init_from={init_from}",
                        "sft.enabled=false",
                        f"data.synthetic.seed={world}",
                        f"algo.name={arm}",
                        f"trainer.seed={index}",
                        f"trainer.steps={args.steps}",
                        "trainer.num_threads=1",
                        "logging.progress=false",
                        "logging.tensorboard=false",
                        *args.set,
                    ],
                }
            )
    return runs


def env() -> dict:
    return {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}


def run_solo(args, runs: list[dict], out: Path) -> float:
    """Today's runner: one `stratarl train` process per run, ``--jobs`` at a time; returns the wall seconds."""

    def one(run: dict) -> int:
        run_dir = out / run["name"]
        run_dir.mkdir(parents=True, exist_ok=True)
        with open(run_dir / "train.log", "w") as log:
            return subprocess.call(
                [*STRATARL, "train", args.config, *run["overrides"], "--run-dir", str(run_dir)],
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env(),
                cwd=REPO,
            )

    started = time.perf_counter()
    with ThreadPoolExecutor(max_workers=args.jobs) as pool:
        codes = list(pool.map(one, runs))
    if any(codes):
        raise RuntimeError(f"solo runs failed: {codes} (see their train.log under {out})")
    return time.perf_counter() - started


def run_populations(args, runs: list[dict], out: Path) -> float:
    """The same runs as populations of ``--population`` members, ``--jobs`` processes at a time."""
    size = args.population or -(-len(runs) // args.jobs)
    groups = [runs[i : i + size] for i in range(0, len(runs), size)]

    def one(index: int) -> int:
        spec = out / f"population-{index}.json"
        out.mkdir(parents=True, exist_ok=True)
        spec.write_text(
            json.dumps(
                {
                    "runs": [
                        {
                            "name": r["name"],
                            "config": args.config,
                            "overrides": r["overrides"],
                            "run_dir": str(out / r["name"]),
                        }
                        for r in groups[index]
                    ],
                }
            )
        )
        with open(out / f"population-{index}.log", "w") as log:
            command = [*STRATARL, "population", str(spec), "--summary", str(out / f"population-{index}.out.json")]
            return subprocess.call(command, stdout=log, stderr=subprocess.STDOUT, env=env(), cwd=REPO)

    started = time.perf_counter()
    with ThreadPoolExecutor(max_workers=args.jobs) as pool:
        codes = list(pool.map(one, range(len(groups))))
    if any(codes):
        raise RuntimeError(f"populations failed: {codes} (see population-*.log under {out})")
    return time.perf_counter() - started


# --------------------------------------------------------------------------- FLOPs


def step_useful_flops(fm: bench_lab.FlopModel, row: dict, cfg) -> float:
    """bench_lab's useful work of one logged step, from its mean lengths (``rollout/*_length_mean``)."""
    n = row.get("rollout/num", 0.0)
    if not n:
        return 0.0
    G = cfg.rollout.group_size
    p, r = row["rollout/prompt_length_mean"], row["rollout/response_length_mean"]
    o = row["rollout/observation_length_mean"]
    prompts = n / G * fm.sequence(0, round(p))
    responses = n * fm.sequence(round(p), round(r + o))
    decoder_pass = prompts + responses
    policy = n * r
    generation = decoder_pass - n * fm.tokens(1, p + r + o) + policy * fm.head
    passes = (cfg.algo.old_logprobs == "recompute" or cfg.algorithm.uses_critic) + (cfg.algo.kl_coef > 0)
    head_passes = (cfg.algo.old_logprobs == "recompute") + (cfg.algo.kl_coef > 0)
    logprobs = passes * decoder_pass + head_passes * policy * fm.head
    update = 3 * cfg.trainer.epochs * (decoder_pass + policy * fm.head)
    return generation + logprobs + update


def useful_flops(run_dirs: list[Path], fm: bench_lab.FlopModel) -> tuple[float, int]:
    """(useful FLOPs of every logged RL step of the runs, number of steps)."""
    from stratarl.infra.metrics import read_metrics
    from stratarl.trainer.config import load_config

    total, steps = 0.0, 0
    for run_dir in run_dirs:
        cfg = load_config(run_dir / "config.yaml")
        for row in read_metrics(run_dir):
            if "rollout/num" in row:
                total += step_useful_flops(fm, row, cfg)
                steps += 1
    return total, steps


class FlopCounter:
    """Executed FLOPs of the ops dispatched in the threads that enter it (bench_lab's formulas); one total."""

    def __init__(self) -> None:
        from torch.utils.flop_counter import flop_registry

        self.registry = dict(flop_registry)
        self.registry[torch.ops.aten.linear] = bench_lab._linear_flops
        self.registry[torch.ops.aten.matmul] = bench_lab._matmul_flops
        self.registry[torch.ops.aten.scaled_dot_product_attention] = bench_lab._cpu_attention_flops
        if hasattr(torch.ops.mkldnn, "_linear_pointwise"):
            self.registry[torch.ops.mkldnn._linear_pointwise] = bench_lab._linear_flops
        if hasattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu"):
            self.registry[torch.ops.aten._scaled_dot_product_flash_attention_for_cpu] = bench_lab._cpu_attention_flops
            self.registry[torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward] = (
                bench_lab._cpu_attention_backward_flops
            )
        self.total = 0.0

    def mode(self):
        from torch.utils._python_dispatch import TorchDispatchMode

        counter = self

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                kwargs = kwargs or {}
                out = func(*args, **kwargs)
                formula = counter.registry.get(func.overloadpacket)
                if formula is not None:
                    counter.total += int(formula(*args, **kwargs, out_val=out))
                return out

        return Mode()


def executed_per_useful(args, runs: list[dict], out: Path, fm, population: bool) -> float:
    """Executed / useful FLOPs of ``--count-steps`` steps, in this process: a solo run or (``population``) a
    population of the first ``--population`` runs (no evals: training steps only)."""
    from stratarl.trainer.config import load_config
    from stratarl.trainer.population import Member, run_population
    from stratarl.trainer.rl import train
    from stratarl.trainer.step import rl_step

    counter = FlopCounter()
    size = args.population or -(-len(runs) // args.jobs)
    chosen = runs[:size] if population else runs[:1]
    extra = [
        f"trainer.steps={args.count_steps}",
        "eval.before_after=false",
        "trainer.eval_every=0",
        "trainer.save_every=0",
    ]
    members = [Member(r["name"], load_config(args.config, r["overrides"] + extra), out / r["name"]) for r in chosen]

    def counted(run):
        with counter.mode():
            return rl_step(run)

    if not population:
        train(members[0].cfg, members[0].run_dir, step=counted)
    else:

        def pipeline(cfg, run_dir, *, resume, start_over, parts):
            return train(cfg, run_dir, resume=resume, start_over=start_over, parts=parts, step=counted)

        report = run_population(members, pipeline=pipeline, logs=True)
        if not all(r.ok for r in report.members):
            raise RuntimeError(f"the counted population failed: {[r.error for r in report.members]}")
    useful, _ = useful_flops([m.run_dir for m in members], fm)
    return counter.total / useful if useful else float("nan")


# --------------------------------------------------------------------------- main


def prepare(args) -> tuple[str, bench_lab.FlopModel]:
    """The warm start (cached) and the worlds' knowledge bases, before any timing; the FLOP model."""
    from stratarl.models import load_model
    from stratarl.trainer.config import load_config
    from stratarl.trainer.setup import load_task
    from stratarl.trainer.warmstart.stages import cached_warm_start

    init_from = args.init_from or str(cached_warm_start(load_config(args.config))[0])
    for world in parse_worlds(args.worlds):
        load_task(
            load_config(
                args.config,
                [f"model.init_from={init_from}", "sft.enabled=false", f"data.synthetic.seed={world}", *args.set],
            )
        )
    return init_from, bench_lab.FlopModel(load_model(init_from))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--config", default=str(REPO / "configs" / "lab.yaml"))
    parser.add_argument("--init-from", help="the warm start (default: the config's cached warm start)")
    parser.add_argument("--steps", type=int, default=300, help="RL steps per run")
    parser.add_argument("--worlds", default="2001-2004", help="world seeds: 2001-2004 or 2001,2003")
    parser.add_argument("--arms", nargs="+", default=["grpo", "stratified_grpo"], help="algo.name of each arm")
    parser.add_argument("--jobs", type=int, default=2, help="processes at a time (cores used), both modes")
    parser.add_argument("--population", type=int, default=None, help="runs per population (default runs / jobs)")
    parser.add_argument(
        "--modes",
        nargs="+",
        default=list(MODES),
        choices=MODES,
        help="solo: one process per run; alone: populations (`stratarl population`)",
    )
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override for every run")
    parser.add_argument("--count-steps", type=int, default=2, help="steps counted for the executed FLOPs (0: none)")
    parser.add_argument("--out", help="keep the runs here (default: a temporary folder)")
    parser.add_argument("--json", help="write the results here as JSON")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    init_from, fm = prepare(args)
    runs = sweep_runs(args, init_from)
    out = Path(args.out or tempfile.mkdtemp(prefix="bench_sweep_"))
    peak = max(bench_lab.gemm_rate(1024, 1024, 1024, 1.0), bench_lab.gemm_rate(2048, 2048, 2048, 1.0))
    print(
        f"sweep: {len(runs)} runs ({args.worlds} x {', '.join(args.arms)}), {args.steps} steps each, {args.jobs} "
        f"processes at a time; one-thread matmul peak {peak / 1e9:.0f} GFLOP/s; runs in {out}",
        flush=True,
    )
    results = {}
    for mode in args.modes:
        folder = out / mode
        if mode == "solo":
            wall = run_solo(args, runs, folder)
        else:
            wall = run_populations(args, runs, folder)
        useful, steps = useful_flops([folder / r["name"] for r in runs], fm)
        ratio = float("nan")
        if args.count_steps:
            with open(out / f"count-{mode}.log", "w") as log, contextlib.redirect_stdout(log):
                ratio = executed_per_useful(args, runs, out / f"count-{mode}", fm, mode != "solo")
        share = useful / (wall * args.jobs * peak)
        results[mode] = {
            "wall_s": wall,
            "runs_per_core_hour": len(runs) / (wall * args.jobs / 3600),
            "step_s": wall * args.jobs / max(steps, 1),
            "useful_share": share,
            "executed_per_useful": ratio,
            "executed_share": share * ratio,
            "steps": steps,
        }
        print(f"{mode}: {wall:.0f} s", flush=True)
    if "solo" in results:
        for mode in (m for m in results if m != "solo"):
            results[mode]["same_results"] = same_results(out, runs, mode)
    report(args, results, len(runs))
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "peak": peak, "results": results}, indent=1) + "\n")
    return 0


def _em_after(run_dir: Path) -> float | None:
    try:
        return float(json.loads((run_dir / "summary.json").read_text())["eval_after"]["em"])
    except (OSError, KeyError, TypeError, ValueError):
        return None


def _training_rows(run_dir: Path) -> list[dict]:
    """metrics.jsonl without the wall-clock keys (time/, perf/): what must be equal for runs to be the same run."""
    rows = []
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        row = json.loads(line)
        rows.append({k: v for k, v in row.items() if not k.startswith(("time/", "perf/"))})
    return rows


def same_results(out: Path, runs: list[dict], mode: str) -> dict:
    """Paired held-out EM of ``mode``'s members against the solo runs (see the module docstring, item 4)."""
    from stratarl.evaluation.stats import mean_ci

    diffs, identical = [], 0
    for run in runs:
        solo, member = out / "solo" / run["name"], out / mode / run["name"]
        a, b = _em_after(solo), _em_after(member)
        if a is None or b is None:
            continue
        diffs.append(b - a)
        with contextlib.suppress(OSError, ValueError):
            identical += _training_rows(solo) == _training_rows(member)
    ci = mean_ci(diffs)
    ok = identical == len(runs)
    return {
        "n": len(diffs),
        "mean": ci.mean,
        "low": ci.low,
        "high": ci.high,
        "max_abs": max((abs(d) for d in diffs), default=None),
        "identical": identical,
        "ok": ok,
        "solo_em": [_em_after(out / "solo" / r["name"]) for r in runs],
        "member_em": [_em_after(out / mode / r["name"]) for r in runs],
    }


def report(args, results: dict, runs: int) -> None:
    base = results.get("solo", {}).get("runs_per_core_hour")
    print(f"\n{'mode':<34}{'wall':>8}{'runs/core-h':>13}{'vs solo':>9}{'s/step':>8}{'useful':>9}{'executed':>10}")
    for mode, r in results.items():
        size = args.population or -(-runs // args.jobs)
        label = {
            "solo": f"solo (--jobs {args.jobs})",
            "alone": f"populations of {size}, calls alone",
        }[mode]
        vs = f"{r['runs_per_core_hour'] / base:.2f}x" if base else "-"
        print(
            f"{label:<34}{r['wall_s']:>7.0f}s{r['runs_per_core_hour']:>13.1f}{vs:>9}{r['step_s']:>8.3f}"
            f"{r['useful_share']:>9.1%}{r['executed_share']:>10.1%}"
        )
    print(
        "(useful / executed: share of the one-thread matmul peak x cores; s/step: core-seconds per RL step, "
        "start-up and evals included)"
    )
    if base and len(results) > 1:
        best = max((m for m in results if m != "solo"), key=lambda m: results[m]["runs_per_core_hour"])
        gain = results[best]["runs_per_core_hour"] / base
        verdict = "PASS" if gain >= TARGET_RATIO else "FAIL"
        print(
            f"VERDICT {verdict}: {best} populations give {gain:.2f}x the runs per core-hour of the solo runner "
            f"(target >= {TARGET_RATIO}x); {statistics.fmean(r['steps'] for r in results.values()):.0f} RL steps "
            "per mode"
        )
    for mode, r in results.items():
        same = r.get("same_results")
        if not same:
            continue
        if same["n"] == 0:
            print(f"SAME RESULTS {mode}: no held-out EM to compare (eval.before_after=false?)")
            continue
        rule = "bit-identical metrics to solo"
        interval = "" if same["low"] is None else f" [{same['low']:+.4f}, {same['high']:+.4f}]"
        print(
            f"SAME RESULTS {'PASS' if same['ok'] else 'FAIL'} {mode}: held-out EM member - solo, paired over "
            f"{same['n']} runs: {same['mean']:+.4f}{interval}, max |diff| {same['max_abs']:.3f}; "
            f"{same['identical']}/{same['n']} runs with bit-identical metrics (rule: {rule})"
        )


if __name__ == "__main__":
    sys.exit(main())
