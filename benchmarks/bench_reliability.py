"""Reliability figures: kill -9 at seeded random points of a tiny run (the checkpoint writer and the
re-save of the last step included), resume, and compare with an uninterrupted run; then every bad
input of the table in tests/reliability/fault_injection.py.

    python benchmarks/bench_reliability.py                 # 40 kills, seed 0
    python benchmarks/bench_reliability.py --kills 100 --seed 3

Prints:

    kills survived: K / N         the resume started at or after the newest checkpoint that was
                                  complete before the kill (no completed work lost, no silent restart)
    resumes bit-exact: R / N      final weights and metrics.jsonl identical to the uninterrupted run
    bad inputs with clear errors: B / M   one error line naming the file, field or value; no traceback

The tests in tests/reliability/ run a small fixed subset of the same kills on every CI run.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "reliability"))

STEPS = 3
REWARD = "def length_parity_reward(response_text, golds):\n    return float(len(response_text) % 2 == 0)\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--kills", type=int, default=40, help="kill points to try (default 40)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the kill points (default 0)")
    parser.add_argument("--keep", action="store_true", help="keep the temporary run folders")
    args = parser.parse_args()

    import torch

    torch.set_num_threads(1)
    from fault_injection import (bad_input_cases, clear_error, compare_runs, count_calls, random_targets, run_cli,
                                 run_killed)

    from stratarl.trainer.config import load_config, save_config
    from stratarl.trainer.rl import train

    work = Path(tempfile.mkdtemp(prefix="stratarl-reliability-"))
    (work / "reward.py").write_text(REWARD)
    overrides = [f"data.synthetic.cache_dir={work / 'kb'}", f"algo.reward={work / 'reward.py'}:length_parity_reward",
                 f"trainer.steps={STEPS}", "trainer.save_every=1", "logging.tensorboard=false",
                 "logging.num_transcripts=0", "data.synthetic.options.num_train=8"]
    cfg = load_config(ROOT / "configs" / "tiny.yaml", overrides)
    straight = work / "straight"
    train(cfg, straight)
    counts = count_calls(cfg, work / "count")
    targets = random_targets(counts, args.kills, seed=args.seed)

    survived = exact = 0
    failures = []
    for index, target in enumerate(targets):
        run_dir = work / f"kill{index}"
        killed, completed = run_killed(cfg, run_dir, target)
        try:
            summary = train(cfg, run_dir, resume=True, start_over=not completed)
        except Exception as error:  # noqa: BLE001 - counted as a kill not survived
            failures.append(f"{target}: resume failed: {error}")
            continue
        if summary["start_step"] >= max(completed, default=0):
            survived += 1
        else:
            failures.append(f"{target}: resumed at step {summary['start_step']}, newest complete was {max(completed)}")
        problems = compare_runs(straight, run_dir, STEPS)
        exact += not problems
        if problems:
            failures.append(f"{target}: {problems}")
        if not killed:
            failures.append(f"{target}: the kill point was never reached")
        shutil.rmtree(run_dir, ignore_errors=True)

    no_ckpt = work / "no_checkpoint"
    no_ckpt.mkdir()
    save_config(cfg, no_ckpt / "config.yaml")
    cases = bad_input_cases(work / "bad", ROOT / "configs" / "tiny.yaml", work / "kb", no_ckpt, straight)
    clear = 0
    for name, argv, expected in cases:
        code, stderr = run_cli(argv)
        if clear_error(code, stderr, expected):
            clear += 1
        else:
            failures.append(f"bad input {name!r}: exit {code}, stderr {stderr[-300:]!r}")

    print()
    for line in failures:
        print(f"FAIL {line}")
    print(f"kill points (seed {args.seed}): " + ", ".join(f"{n}#{i}/{w}" for n, i, w in targets))
    print(f"kills survived: {survived} / {len(targets)}")
    print(f"resumes bit-exact: {exact} / {len(targets)}")
    print(f"bad inputs with clear errors: {clear} / {len(cases)}")
    if not args.keep:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
