"""`stratarl population`: several `stratarl train` runs in one process (a sweep's runs as a population)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from stratarl.commands import guard

SPEC_HELP = """a JSON or YAML file: {"runs": [RUN, ...], "stack": false, "threads": 1} or a list of RUNs, where RUN is
{"run_dir": DIR, "config": YAML, "overrides": [...]} (as `stratarl train YAML OVERRIDES --run-dir DIR`) or
{"run_dir": DIR, "resume": true, "overrides": [...]} (as `stratarl train --resume DIR OVERRIDES`), optionally with
"name" and "start_over" """


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "population",
        help="train several runs in one process, their generation and updates "
        "computed together (a sweep as populations; docs/lab.md)",
        description="Train several runs as one population: each run is what `stratarl train` "
        "would train, in its own run directory, laid out as a solo run's "
        "(train.log gets its output); a run that fails is reported and the "
        "others go on.",
    )
    p.add_argument("spec", help=SPEC_HELP)
    p.add_argument(
        "--stack",
        action="store_true",
        help="run the members' generate / update calls as one stacked "
        "computation (equal to the solo runs up to float rounding; on the lab's shapes slower than the "
        "default, which runs each call alone and equals the solo run bit for bit)",
    )
    p.add_argument(
        "--threads", type=int, default=None, help="intra-op threads of the batched calls (default: the spec's, else 1)"
    )
    p.add_argument("--summary", help="write the population's result (members, errors, seconds, batches) here as JSON")
    p.add_argument("--no-logs", action="store_true", help="print the members' output here instead of their train.log")
    p.set_defaults(func=run_population_command)


def load_spec(path: str | Path) -> dict:
    """The spec as {"runs": [...], ...} (a bare list is the runs)."""
    import yaml  # start-up cost: only this command reads YAML here

    from stratarl.config_errors import ConfigError, yaml_syntax_error

    try:
        data = yaml.safe_load(Path(path).read_text())
    except yaml.YAMLError as error:
        raise ConfigError(f"population spec {yaml_syntax_error(path, error)}") from None
    spec = {"runs": data} if isinstance(data, list) else dict(data or {})
    if not isinstance(spec.get("runs"), list) or not spec["runs"]:
        raise ConfigError(f"{path}: no runs. Fix: give a list of runs, each with run_dir and config (or resume: true)")
    return spec


def members_of(spec: dict) -> list:
    """The spec's runs as population members (configs loaded as `stratarl train` loads them)."""
    from stratarl.config_errors import ConfigError
    from stratarl.trainer.config import load_config
    from stratarl.trainer.population import Member

    members = []
    for index, run in enumerate(spec["runs"]):
        if "run_dir" not in run:
            raise ConfigError(f"run {index} has no run_dir. Fix: give each run its own run_dir")
        run_dir = Path(run["run_dir"])
        overrides = [str(o) for o in run.get("overrides", [])]
        resume = bool(run.get("resume", False))
        if resume:
            if not (run_dir / "config.yaml").is_file():
                raise ConfigError(f"run {index}: resume {run_dir}: no config.yaml there")
            cfg = load_config(run_dir / "config.yaml", overrides)
        elif "config" in run:
            cfg = load_config(run["config"], overrides)
        else:
            raise ConfigError(f"run {index} ({run_dir}) has neither config nor resume: true")
        members.append(
            Member(
                str(run.get("name") or run_dir.name),
                cfg,
                run_dir,
                resume=resume,
                start_over=bool(run.get("start_over", False)),
            )
        )
    return members


def run_population_command(args: argparse.Namespace) -> int:
    def body() -> int:
        from stratarl.commands.train import run_pipeline
        from stratarl.trainer.population import run_population

        spec = load_spec(args.spec)
        members = members_of(spec)
        stack = bool(spec.get("stack", False)) or args.stack
        threads = args.threads or int(spec.get("threads", 1))
        print(
            f"population of {len(members)} runs ({'stacked' if stack else 'each call alone'}, {threads} "
            f"thread(s) for the batched calls)",
            flush=True,
        )
        report = run_population(members, pipeline=run_pipeline, stack=stack, threads=threads, logs=not args.no_logs)
        for result in report.members:
            steps = (result.summary or {}).get("steps")
            status = f"done: {steps} steps" if result.ok else f"FAILED: {result.error}"
            print(f"  {result.name}: {status} ({result.run_dir})", flush=True)
        print(
            f"population finished in {report.seconds:.0f}s: {sum(r.ok for r in report.members)} of "
            f"{len(report.members)} runs ok",
            flush=True,
        )
        if args.summary:
            out = {
                "seconds": report.seconds,
                "stack": stack,
                "threads": threads,
                "batches": report.batches,
                "members": [
                    {
                        "name": r.name,
                        "run_dir": str(r.run_dir),
                        "ok": r.ok,
                        "error": r.error,
                        "steps": (r.summary or {}).get("steps"),
                        "exit_code": (r.summary or {}).get("exit_code"),
                    }
                    for r in report.members
                ],
            }
            Path(args.summary).parent.mkdir(parents=True, exist_ok=True)
            Path(args.summary).write_text(json.dumps(out, indent=1) + "\n")
        return 0 if all(r.ok for r in report.members) else 1

    return guard(body)
