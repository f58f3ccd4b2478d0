"""`stratarl demo`: the main job. The config (configs/demo.yaml unless --config) is warm-started and trained
with RL, evaluated before and after, and reported as a headline and an HTML page.

(`stratarl demo-algos`, the algorithm core on hand-made rollouts, is in commands/demo_algos.py.)
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from stratarl.commands import guard
from stratarl.commands.train import CONFIG_HELP, REPO_CONFIGS, add_retriever_check_flag, check_retriever, run_pipeline


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "demo",
        help="the main job: warm start + RL (GRPO in configs/demo.yaml) on the synthetic task, "
        "eval before/after and an HTML report",
    )
    parser.add_argument("overrides", nargs="*", help=CONFIG_HELP)
    parser.add_argument(
        "--config", default=str(REPO_CONFIGS / "demo.yaml"), help="config to run (default: configs/demo.yaml)"
    )
    parser.add_argument("--run-dir", help="run directory (default: runs/demo-<timestamp>)")
    add_retriever_check_flag(parser)
    parser.set_defaults(func=run_demo)


def run_demo(args: argparse.Namespace) -> int:
    def body() -> int:
        from stratarl.evaluation.report import build_report
        from stratarl.trainer.config import load_config
        from stratarl.trainer.config.resolve import describe

        started = time.perf_counter()
        cfg = load_config(args.config, list(args.overrides))
        run_dir = (
            Path(args.run_dir)
            if args.run_dir
            else Path(cfg.trainer.output_dir) / f"demo-{time.strftime('%Y%m%d-%H%M%S')}"
        )
        print(f"stratarl demo: {cfg.model.name}, synthetic KB + BM25; run directory {run_dir}", flush=True)
        print(f"algorithm {describe(cfg.algo.name, cfg.algorithm)}", flush=True)
        check_retriever(cfg, args)
        summary = run_pipeline(cfg, run_dir, resume=False)
        report = build_report([run_dir])
        from stratarl.evaluation.headline import format_headline, headline

        wall = time.perf_counter() - started
        print("\n=== stratarl demo ===")
        # What was measured and how sure it is: EM / F1 before -> after RL with 95% CIs over the held-out
        # questions, the paired gain, the held-out EM at every eval, and a verdict (stratarl.evaluation.report).
        print(format_headline(headline([run_dir])))
        if cfg.sft.enabled and not cfg.model.init_from:
            print("(before RL = after the warm start, so the gain measures the RL steps alone)")
        print(f"wall time: {wall / 60:.1f} min")
        print(f"report: {report}")
        print(f"run directory: {run_dir}")
        return summary.get("exit_code", 0)

    return guard(body)
