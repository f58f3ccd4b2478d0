"""`stratarl train`: RL, optionally after a warm start (`stratarl demo`, the main job, is in commands/demo.py)."""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from stratarl.commands import CommandFailed, guard

CONFIG_HELP = "dotted overrides, e.g. algo.name=grpo trainer.steps=20 rollout.group_size=4"
REPO_CONFIGS = Path(__file__).resolve().parents[2] / "configs"


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "train",
        help="train a search agent with RL (algo.name: grpo, stratified_grpo, ppo, so_ppo, so_grpo, "
        "drgrpo, gspo, gigpo; or parts of your own with --import)",
        description="Train with RL. The run directory gets config.yaml, metrics.jsonl, "
        "tensorboard/, transcripts/, checkpoints/, eval/ and summary.json.",
    )
    p.add_argument("config", nargs="?", help="YAML config (e.g. configs/demo.yaml); omit with --resume")
    p.add_argument("overrides", nargs="*", help=CONFIG_HELP)
    p.add_argument(
        "--resume",
        metavar="RUN_DIR",
        help="continue RUN_DIR exactly from its latest checkpoint "
        "(its config.yaml is used; overrides such as trainer.steps=N still apply)",
    )
    p.add_argument(
        "--start-over",
        action="store_true",
        help="with --resume: when RUN_DIR holds no intact "
        "checkpoint (e.g. it was killed before its first one), train it again from step 0 instead of failing",
    )
    p.add_argument(
        "--allow-lag-change",
        action="store_true",
        help="with --resume: resume even when the checkpoint cannot reproduce the policy lags (trainer.policy_lag "
        "or policy_lag_mode changed, or weight snapshots are missing): the next steps sample with shorter lags",
    )
    p.add_argument("--run-dir", help="write the run here instead of <trainer.output_dir>/<trainer.run_name>")
    add_retriever_check_flag(p)
    p.set_defaults(func=run_train)


def add_retriever_check_flag(parser) -> None:
    parser.add_argument(
        "--no-retriever-check",
        action="store_true",
        help="do not send the probe search to a remote retriever (retrieval.spec a URL) before starting",
    )


PROBE_TIMEOUT_S = 10.0


def check_retriever(cfg, args) -> None:
    """Before any warm start, rollout or evaluation: one probe search to a remote retriever
    (`probe_retriever`, at most the spec's timeout_s or 10 s); if it fails, one error line naming the URL and
    exit code 3, as when retrieval failures stop a run. Local retrievers and ``--no-retriever-check`` skip it."""
    from stratarl.retrieval.factory import remote_url

    url = remote_url(cfg.retrieval.spec)
    if url is None or getattr(args, "no_retriever_check", False):
        return
    from stratarl.retrieval.base import RetrievalError
    from stratarl.retrieval.remote import probe_retriever
    from stratarl.trainer.stops import RETRIEVAL_STOP_CODE

    spec = cfg.retrieval.spec
    timeout = spec.get("timeout_s", PROBE_TIMEOUT_S) if isinstance(spec, dict) else PROBE_TIMEOUT_S
    try:
        probe_retriever(url, timeout_s=min(float(timeout), PROBE_TIMEOUT_S))
    except RetrievalError as error:  # the exit code of a run that retrieval failures stopped
        raise CommandFailed(str(error), RETRIEVAL_STOP_CODE) from None
    print(f"retriever {url} answered a probe search", flush=True)


def resolve_run_dir(cfg, run_dir: str | None) -> Path:
    if run_dir:
        return Path(run_dir)
    name = cfg.trainer.run_name or f"{cfg.algo.name}-{time.strftime('%Y%m%d-%H%M%S')}"
    return Path(cfg.trainer.output_dir) / name


def load_run_config(args):
    """(config, run_dir, resume) from the command line; raises ConfigError on bad input."""
    from stratarl.trainer.config import ConfigError, load_config

    if args.resume:
        run_dir = Path(args.resume)
        overrides = ([args.config] if args.config else []) + list(args.overrides)
        if not (run_dir / "config.yaml").is_file():
            raise ConfigError(
                f"--resume {run_dir}: no config.yaml there. Fix: pass the run directory `stratarl train` wrote."
            )
        return load_config(run_dir / "config.yaml", overrides), run_dir, True
    if not args.config:
        raise ConfigError(
            "no config given. Fix: `stratarl train configs/demo.yaml [key=value ...]` "
            "or `stratarl train --resume RUN_DIR`."
        )
    if "=" in args.config and not Path(args.config).exists():
        raise ConfigError(f"{args.config!r} looks like an override, not a config file. Fix: put the YAML path first.")
    cfg = load_config(args.config, list(args.overrides))
    return cfg, resolve_run_dir(cfg, args.run_dir), False


def run_pipeline(
    cfg, run_dir: Path, *, resume: bool, start_over: bool = False, parts=None, allow_lag_change: bool = False
) -> dict:
    """Warm start (if ``sft.enabled`` and no ``model.init_from``), then RL; returns the RL summary. ``parts``: the
    run's collaborators (a population member's: stratarl.trainer.population)."""
    from stratarl.infra.threads import set_threads
    from stratarl.trainer.rl import train

    set_threads(cfg.trainer.num_threads)
    if not resume:  # before the warm start: a run killed during it can be resumed (--start-over)
        from stratarl.trainer.config import save_config

        run_dir.mkdir(parents=True, exist_ok=True)
        save_config(cfg, run_dir / "config.yaml")
    init_from = None
    summary_sft = None
    if cfg.sft.enabled and not cfg.model.init_from:
        from stratarl.trainer.warmstart.stages import cached_warm_start, warm_start, warm_start_cache_dir

        what = (
            f"{cfg.sft.steps} steps x {cfg.sft.batch_size} demonstrations from fresh worlds"
            if cfg.sft.source == "worlds"
            else f"{cfg.sft.num_demos} demonstrations"
        )
        if cfg.sft.cache:
            model_dir = warm_start_cache_dir(cfg) / "model"
            if not (model_dir / "config.json").is_file():
                print(
                    f"warm start: {what} -> {model_dir} (cached; shared by runs with the same warm-start settings)",
                    flush=True,
                )
            model_dir, summary_sft = cached_warm_start(cfg)
            if summary_sft is None:
                print(f"warm start: reusing {model_dir} (rebuild: `stratarl sft CONFIG --rebuild`)", flush=True)
        else:
            model_dir = run_dir / "sft" / "model"
            if not (model_dir / "config.json").is_file():
                print(f"warm start: fine-tuning on {what} -> {model_dir}", flush=True)
                summary_sft = warm_start(cfg, run_dir / "sft")
        if summary_sft is not None:
            print(
                f"warm start done in {summary_sft['seconds']:.0f}s: loss (mean of first / last 3 steps) "
                f"{summary_sft['first_steps_loss']:.3f} -> {summary_sft['last_steps_loss']:.3f}, demos {summary_sft['demo_kinds']}",
                flush=True,
            )
        init_from = str(model_dir)
    summary = train(
        cfg,
        run_dir,
        resume=resume,
        init_from=init_from,
        start_over=start_over,
        parts=parts,
        allow_lag_change=allow_lag_change,
    )
    if summary_sft is not None:
        summary["sft"] = summary_sft
    return summary


def run_train(args: argparse.Namespace) -> int:
    def body() -> int:
        from stratarl.trainer.config import ConfigError
        from stratarl.trainer.config.resolve import describe

        cfg, run_dir, resume = load_run_config(args)
        print(f"run directory: {run_dir}", flush=True)
        print(f"algorithm {describe(cfg.algo.name, cfg.algorithm)}", flush=True)
        if args.start_over and not resume:
            raise ConfigError("--start-over only applies with --resume RUN_DIR")
        if args.allow_lag_change and not resume:
            raise ConfigError("--allow-lag-change only applies with --resume RUN_DIR")
        check_retriever(cfg, args)
        summary = run_pipeline(
            cfg, run_dir, resume=resume, start_over=args.start_over, allow_lag_change=args.allow_lag_change
        )
        code = summary.get("exit_code", 0)
        print(
            f"{'stopped' if code else 'done'}: {summary['steps']} steps in {summary['train_seconds']:.0f}s; "
            f"checkpoint {summary['checkpoint'] or 'none yet'}"
            + (f" (exit code {code}: {summary.get('stop_reason')})" if code else ""),
            flush=True,
        )
        return code

    return guard(body)
