"""The lab on worlds never used in development: `stratarl demo` (configs/demo.yaml, its warm start ending
when the reading probe passes) once per knowledge-base seed, and the table of what each one shows.

    python benchmarks/bench_lab_worlds.py --seeds 2001-2010 --runs /tmp/worlds --json benchmarks/lab/demo_worlds.json

Each seed gets its own task world and so its own warm start (the cache key holds the data settings). Two
demos run at a time (the lab's policy runs on one thread). A seed already in ``--json`` is not run again, so
a sweep can span sessions. Per seed: the reading probe of the warm start (greedy single-hop EM on a world
the warm start never saw), the warm start's greedy single-hop EM on the task world's held-out questions, and
GRPO's held-out gain with its paired 95% CI. Exits non-zero when a target is missed: single-hop EM >= 0.6 on
every world, a gain >= +0.15 whose CI excludes 0 on at least 9 of 10.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# What WarmStartFailed says (stratarl.trainer.warmstart.sft): the demo stopped before RL, and nothing was cached.
WARM_START_FAILED = "did not pass its reading probe"
PROBE = re.compile(r"probe at step (\d+): single-hop EM ([\d.]+) \((\d+) questions.*?(passed|below)")
WARM = re.compile(r"warm start done in (\d+)s")


def parse_seeds(text: str) -> list[int]:
    """``1001-1010`` or ``3,5,7``."""
    if "-" in text:
        lo, hi = text.split("-")
        return list(range(int(lo), int(hi) + 1))
    return [int(s) for s in text.split(",")]


def warm_start_failed(log: Path) -> bool:
    """Whether the demo logged to ``log`` stopped at its warm start's reading probe."""
    return log.is_file() and WARM_START_FAILED in log.read_text(errors="replace")


def collect(seed: int, run_dir: Path, log: Path) -> dict:
    """One seed's row: the probes (only the log has them, also for a failed warm start) and, from the run
    directory, the demo's own before/after numbers (stratarl.evaluation.headline.run_headline, what its verdict
    prints); raises if the demo neither failed at its warm start nor finished."""
    from stratarl.evaluation.headline import run_headline

    text = log.read_text(errors="replace")
    probes = [
        {"step": int(m[0]), "single_hop_em": float(m[1]), "questions": int(m[2]), "passed": m[3] == "passed"}
        for m in PROBE.findall(text)
    ]
    if WARM_START_FAILED in text:  # no RL ran: a miss on both targets
        return {"seed": seed, "probes": probes, "warm_start_failed": True}
    head = run_headline(run_dir) if (run_dir / "eval").is_dir() else {"gain": None, "missing": "no eval folder"}
    if head["gain"] is None:
        raise RuntimeError(
            f"{log}: the demo of world {seed} has no before/after gain ({head['missing']}); "
            "read the log's end for the error"
        )
    before = json.loads((run_dir / "eval" / "before.json").read_text())["per_type"]
    after = json.loads((run_dir / "eval" / "after.json").read_text())["per_type"]
    gain = head["gain"]["em"]
    warm = WARM.search(text)
    return {
        "seed": seed,
        "probes": probes,
        "warm_start_s": int(warm[1]) if warm else None,
        "single_hop_em_before": before["single_hop"]["em"],
        "two_hop_em_before": before["multi_hop_2"]["em"],
        "single_hop_em_after": after["single_hop"]["em"],
        "two_hop_em_after": after["multi_hop_2"]["em"],
        "em_before": head["before"]["em"]["mean"],
        "em_after": head["after"]["em"]["mean"],
        "gain": gain["mean"],
        "gain_ci": [gain["low"], gain["high"]],
        "up": gain["up"],
        "down": gain["down"],
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seeds", default="2001-2010", help="world seeds: 2001-2010 or 3,5,7")
    ap.add_argument("--runs", default="runs/lab-worlds", help="folder for the demos' run directories and logs")
    ap.add_argument("--json", default=str(REPO / "benchmarks" / "lab" / "demo_worlds.json"))
    ap.add_argument("--parallel", type=int, default=2)
    ap.add_argument("overrides", nargs="*", help="config overrides passed to every demo")
    args = ap.parse_args()
    out = Path(args.json)
    rows = {r["seed"]: r for r in json.loads(out.read_text())["worlds"]} if out.is_file() else {}
    runs = Path(args.runs)
    runs.mkdir(parents=True, exist_ok=True)
    todo = [s for s in parse_seeds(args.seeds) if s not in rows]
    for i in range(0, len(todo), args.parallel):
        procs = []
        for seed in todo[i : i + args.parallel]:
            run_dir, log = runs / f"demo-{seed}", runs / f"demo-{seed}.log"
            if not (run_dir / "summary.json").is_file() and not warm_start_failed(log):
                cmd = [
                    str(Path(sys.executable).parent / "stratarl"),
                    "demo",
                    "--run-dir",
                    str(run_dir),
                    f"data.synthetic.seed={seed}",
                    *args.overrides,
                ]
                procs.append(subprocess.Popen(cmd, stdout=log.open("w"), stderr=subprocess.STDOUT, cwd=REPO))
        for p in procs:
            p.wait()
        for seed in todo[i : i + args.parallel]:
            rows[seed] = collect(seed, runs / f"demo-{seed}", runs / f"demo-{seed}.log")
            out.write_text(
                json.dumps(
                    {
                        "config": "configs/demo.yaml",
                        "overrides": args.overrides,
                        "worlds": [rows[s] for s in sorted(rows)],
                    },
                    indent=1,
                )
                + "\n"
            )
    print(
        "| world | warm start | probe: single-hop EM (step) | task world single-hop EM | EM before -> after | gain [95% CI] | up / down |"
    )
    print("|---|---|---|---|---|---|---|")
    for r in (rows[s] for s in sorted(rows)):
        probe = r["probes"][-1] if r["probes"] else None
        probe_text = f"{probe['single_hop_em']:.3f} ({probe['step']})" if probe else "-"
        if r.get("warm_start_failed"):
            print(
                f"| {r['seed']} | failed: probe below sft.probe_min_em to the step limit | {probe_text} | - | - | - | - |"
            )
            continue
        print(
            f"| {r['seed']} | {r['warm_start_s']} s | {probe_text} | {r['single_hop_em_before']:.3f} | "
            f"{r['em_before']:.3f} -> {r['em_after']:.3f} | {r['gain']:+.3f} [{r['gain_ci'][0]:+.2f}, {r['gain_ci'][1]:+.2f}] "
            f"| {r['up']} / {r['down']} |"
        )
    done = [rows[s] for s in sorted(rows)]
    reading = sum(r.get("single_hop_em_before", 0.0) >= 0.6 for r in done)
    learned = sum(r.get("gain", 0.0) >= 0.15 and r["gain_ci"][0] > 0 for r in done if "gain" in r)
    print(
        f"single-hop EM >= 0.6 after the warm start: {reading} of {len(done)} worlds (target: all); "
        f"gain >= +0.15 with CI excluding 0: {learned} of {len(done)} (target: >= 90%)"
    )
    ok = reading == len(done) and learned >= 0.9 * len(done)
    if not ok:
        print("error: a target is missed (above); read the failing worlds' logs in", runs)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
