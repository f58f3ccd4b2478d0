"""`stratarl sft`: the warm-start stage (supervised fine-tuning on demonstration trajectories)."""

from __future__ import annotations

import argparse
from pathlib import Path


def register(subparsers) -> None:
    p = subparsers.add_parser("sft", help="warm start: fine-tune on rendered demonstration trajectories",
                              description="Render demonstrations from the synthetic task's hops (real retriever, "
                                          "real protocol strings, observation tokens masked out of the loss), "
                                          "fine-tune, and save OUT/model. Start RL from it with "
                                          "`stratarl train CONFIG model.init_from=OUT/model`.")
    p.add_argument("config", help="YAML config (its model, data, retrieval, rollout and sft sections are used)")
    p.add_argument("overrides", nargs="*", help="dotted overrides, e.g. sft.num_demos=128 sft.lr=1e-4")
    p.add_argument("--out", required=True, help="output folder (gets model/, sft_metrics.jsonl, sft_summary.json)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from stratarl.commands.train import _guard

    def body() -> int:
        from stratarl.trainer.config import load_config
        from stratarl.trainer.setup import set_threads
        from stratarl.trainer.sft import warm_start

        cfg = load_config(args.config, list(args.overrides))
        set_threads(cfg.trainer.num_threads)
        summary = warm_start(cfg, Path(args.out))
        print(f"sft: {summary['steps']} steps on {summary['num_demos']} demonstrations {summary['demo_kinds']} in "
              f"{summary['seconds']:.0f}s; loss (first / last 3 steps) {summary['first_steps_loss']:.3f} -> {summary['last_steps_loss']:.3f}; "
              f"model: {summary['model']}", flush=True)
        return 0

    return _guard(body)
