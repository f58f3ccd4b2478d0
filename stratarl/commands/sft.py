"""`stratarl sft`: the warm-start stage (supervised fine-tuning on demonstration trajectories)."""

from __future__ import annotations

import argparse
from pathlib import Path


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "sft",
        help="warm start: fine-tune on rendered demonstration trajectories",
        description="Render demonstrations from the synthetic task's hops (real retriever, "
        "real protocol strings, observation tokens masked out of the loss), "
        "fine-tune, and save OUT/model. Start RL from it with "
        "`stratarl train CONFIG model.init_from=OUT/model`.",
    )
    p.add_argument("config", help="YAML config (its model, data, retrieval, rollout and sft sections are used)")
    p.add_argument("overrides", nargs="*", help="dotted overrides, e.g. sft.num_demos=128 sft.lr=1e-4")
    out = p.add_mutually_exclusive_group(required=True)
    out.add_argument("--out", help="output folder (gets model/, sft_metrics.jsonl, sft_summary.json)")
    out.add_argument(
        "--rebuild",
        action="store_true",
        help="(re)build the cached warm start that `stratarl train` uses with sft.cache=true "
        "(e.g. `stratarl sft configs/lab.yaml --rebuild`)",
    )
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from stratarl.commands import guard

    def body() -> int:
        from stratarl.infra.threads import set_threads
        from stratarl.trainer.config import load_config
        from stratarl.trainer.warmstart.stages import cached_warm_start, warm_start

        cfg = load_config(args.config, list(args.overrides))
        set_threads(cfg.trainer.num_threads)
        if args.rebuild:
            _, built = cached_warm_start(cfg, rebuild=True)
            if built is None:  # rebuild=True always builds, so a summary comes back
                raise RuntimeError("the warm start was not rebuilt")
            summary = built
        else:
            summary = warm_start(cfg, Path(args.out))
        print(
            f"sft: {summary['steps']} steps on {summary['num_demos']} demonstrations {summary['demo_kinds']} in "
            f"{summary['seconds']:.0f}s; loss (first / last 3 steps) {summary['first_steps_loss']:.3f} -> {summary['last_steps_loss']:.3f}; "
            f"model: {summary['model']}",
            flush=True,
        )
        if summary.get("probes"):
            last = summary["probes"][-1]
            print(
                f"reading probe passed at step {last['step']}: greedy single-hop EM {last['single_hop_em']:.3f} on "
                f"{last['num_single_hop']} questions of an unseen world; 2-hop answered after one search "
                f"{last['multi_hop_one_search']:.0%}",
                flush=True,
            )
        return 0

    return guard(body)
