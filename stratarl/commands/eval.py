"""`stratarl eval`: greedy rollouts over one or more question sets, EM / SubEM / F1 per data_source."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from stratarl.commands.train import add_retriever_check_flag


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "eval",
        help="evaluate a model or a run: EM, SubEM, F1, searches, answer rate per source",
        description="Greedy rollouts with the run's retriever. TARGET is a run directory "
        "(its config.yaml and latest checkpoint are used) or a YAML config "
        "(its model section is used).",
    )
    p.add_argument("target", help="run directory or YAML config")
    p.add_argument("overrides", nargs="*", help="dotted overrides, e.g. data.max_eval_examples=100")
    p.add_argument(
        "--data",
        action="append",
        default=[],
        metavar="FILE",
        help="question file(s) to evaluate (Search-R1 parquet/jsonl); default: the config's held-out set",
    )
    p.add_argument("--out", help="where to write eval JSON (default: <run>/eval or ./eval-<timestamp>)")
    p.add_argument("--tag", default="eval", help="name of the result file (default: eval)")
    add_retriever_check_flag(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from stratarl.commands import guard
    from stratarl.commands.train import check_retriever

    def body() -> int:
        from stratarl.evaluation.greedy import evaluate, format_table, save_eval
        from stratarl.infra import checkpoint as ckpt
        from stratarl.infra.threads import set_threads
        from stratarl.trainer.config import ConfigError, load_config
        from stratarl.trainer.setup import build_task_retriever, eval_settings, limit_per_source, load_policy, load_task

        target = Path(args.target)
        run_dir = target if target.is_dir() else None
        if run_dir is not None and not (run_dir / "config.yaml").is_file():
            raise ConfigError(
                f"{run_dir} has no config.yaml. Fix: pass a run directory written by `stratarl train` or a YAML config."
            )
        cfg = load_config(run_dir / "config.yaml" if run_dir else target, list(args.overrides))
        set_threads(cfg.trainer.num_threads)
        check_retriever(cfg, args)
        task = load_task(cfg)
        examples = task.test
        if args.data:
            from stratarl.data.search_r1 import load_example_files

            examples = load_example_files(args.data)
        examples = limit_per_source(examples, cfg.data.max_eval_examples)
        if not examples:
            raise ValueError("no questions to evaluate: pass --data FILE or a config with held-out questions")
        init_from = None
        if run_dir is not None and (run_dir / "sft" / "model" / "config.json").is_file() and not cfg.model.init_from:
            init_from = str(run_dir / "sft" / "model")
        model_cfg = (
            cfg.model if init_from is None else type(cfg.model)(**{**cfg.model.__dict__, "init_from": init_from})
        )
        model, tokenizer = load_policy(model_cfg, seed=cfg.trainer.seed, device=cfg.trainer.device, task=task)
        source = model_cfg.init_from or model_cfg.name
        if run_dir is not None:
            latest, skipped = ckpt.find_checkpoint(run_dir / "checkpoints")
            for line in skipped:
                print(f"warning: skipped checkpoint: {line}", file=sys.stderr, flush=True)
            if latest is None:
                raise ConfigError(
                    f"{run_dir} has no loadable checkpoint (checkpoints/ holds no intact step_* "
                    "folder). Fix: resume the run with `stratarl train --resume RUN_DIR`, or evaluate "
                    "a model without training: `stratarl eval CONFIG.yaml`"
                )
            ckpt.load_checkpoint(latest, model=model)
            source = str(latest)
        retriever = build_task_retriever(cfg, task)
        result = evaluate(
            model,
            tokenizer,
            retriever,
            examples,
            eval_settings(cfg),
            num_transcripts=cfg.eval.num_transcripts,
            progress=cfg.logging.progress,
        )
        result["model"] = source
        out = Path(args.out) if args.out else (run_dir or Path(f"eval-{time.strftime('%Y%m%d-%H%M%S')}"))
        path = save_eval(result, out, args.tag)
        print(format_table(result, title=f"{len(examples)} questions, model {source}"))
        print(f"results: {path}")
        return 0

    return guard(body)
