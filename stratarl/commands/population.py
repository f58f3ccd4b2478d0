"""`stratarl population`: several `stratarl train` runs in one process (a sweep's runs as a population)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from stratarl.commands import guard
from stratarl.commands.train import add_retriever_check_flag

SPEC_HELP = """a JSON or YAML file: {"runs": [RUN, ...]} or a list of RUNs, where RUN is
{"run_dir": DIR, "config": YAML, "overrides": [...]} (as `stratarl train YAML OVERRIDES --run-dir DIR`) or
{"run_dir": DIR, "resume": true, "overrides": [...]} (as `stratarl train --resume DIR OVERRIDES`), optionally with
"name", "start_over" and "allow_lag_change" (as --start-over and --allow-lag-change); unknown keys are refused.
The exit code is 0 when every run is done, else the first unfinished run's (1 for a dropped run)"""


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "population",
        help="train several runs in one process, one after another (a sweep as populations; docs/lab.md)",
        description="Train several runs as one population: each run is what `stratarl train` "
        "would train, bit for bit, in its own run directory, laid out as a solo run's "
        "(train.log gets its output); a run that fails is reported and the "
        "others go on. Each run ends done, stopped (with its reason and exit code) or dropped; the exit code "
        "is 0 only when every run is done.",
    )
    p.add_argument("spec", help=SPEC_HELP)
    p.add_argument("--summary", help="write the population's result (members, errors, seconds) here as JSON")
    p.add_argument("--no-logs", action="store_true", help="print the members' output here instead of their train.log")
    add_retriever_check_flag(p)
    p.set_defaults(func=run_population_command)


SPEC_KEYS = ("runs",)
RUN_KEYS = ("run_dir", "config", "overrides", "resume", "name", "start_over", "allow_lag_change")


def _spec_error(path, where: str, value, why: str, fix: str) -> None:
    from stratarl.config_errors import ConfigError

    shown = repr(value)
    shown = shown if len(shown) <= 80 else shown[:77] + "..."
    raise ConfigError(f"population spec {path}: {where} = {shown}: {why}. Fix: {fix}")


def _check_keys(path, where: str, entry: dict, allowed: tuple[str, ...], elsewhere: tuple[str, ...] = ()) -> None:
    """Refuse a key not in ``allowed`` with the nearest one; ``elsewhere``: keys of the spec's top level, named
    when a run entry holds one of them (or something close)."""
    from stratarl.config_errors import close_match

    for key in entry:
        if key not in allowed:
            hint = close_match(str(key), allowed)
            if not hint and (other := close_match(str(key), elsewhere)):
                hint = f"{other[:-2]}, a key of the spec itself, not of a run? "
            _spec_error(
                path,
                f"{where}.{key}",
                entry[key],
                f"unknown key; {hint}the keys are {', '.join(allowed)}",
                "spell the key as one of those (a misspelt key would be ignored)",
            )


def _check_bool(path, where: str, value) -> bool:
    if not isinstance(value, bool):
        _spec_error(path, where, value, "not true or false", "write true or false")
    return value


def load_spec(path: str | Path) -> dict:
    """The spec as {"runs": [...], ...} (a bare list is the runs), its keys and values checked: one line naming
    the run and the key for an unknown key (with the nearest valid one) or a value of the wrong type."""
    import yaml  # start-up cost: only this command reads YAML here

    from stratarl.config_errors import ConfigError, yaml_syntax_error

    try:
        data = yaml.safe_load(Path(path).read_text())
    except yaml.YAMLError as error:
        raise ConfigError(f"population spec {yaml_syntax_error(path, error)}") from None
    if data is not None and not isinstance(data, (list, dict)):
        _spec_error(path, "the file", data, "not a mapping or a list", 'write {"runs": [RUN, ...]} or a list of RUNs')
    spec = {"runs": data} if isinstance(data, list) else dict(data or {})
    if not isinstance(spec.get("runs"), list) or not spec["runs"]:
        raise ConfigError(f"{path}: no runs. Fix: give a list of runs, each with run_dir and config (or resume: true)")
    _check_keys(path, "spec", spec, SPEC_KEYS)
    for index, run in enumerate(spec["runs"]):
        check_run_entry(path, index, run)
    return spec


def member_label(index: int, run) -> str:
    """How messages name run ``index`` of a spec: ``run 2 (name)``, the name or run_dir when it has one."""
    label = (run.get("name") or run.get("run_dir")) if isinstance(run, dict) else None
    return f"run {index} ({label})" if label else f"run {index}"


def check_run_entry(path, index: int, run) -> None:
    """One run entry's keys and value types (one line naming the run and the key on the first problem)."""
    where = member_label(index, run)
    if not isinstance(run, dict):
        _spec_error(path, where, run, "not a mapping", 'write {"run_dir": DIR, "config": YAML, "overrides": [...]}')
    _check_keys(path, where, run, RUN_KEYS, SPEC_KEYS)
    for key in ("run_dir", "config", "name"):
        if key in run and not (isinstance(run[key], str) and run[key].strip()):
            _spec_error(path, f"{where}.{key}", run[key], "not a non-empty string", f"give {key} as a string")
    if "run_dir" not in run:
        _spec_error(path, where, run, "no run_dir", "give each run its own run_dir")
    overrides = run.get("overrides", [])
    if not isinstance(overrides, list) or not all(isinstance(o, (str, int, float, bool)) for o in overrides):
        _spec_error(
            path,
            f"{where}.overrides",
            overrides,
            "not a list of key=value strings",
            'write e.g. "overrides": ["algo.name=grpo", "trainer.steps=20"]',
        )
    for key in ("resume", "start_over", "allow_lag_change"):
        if key in run:
            _check_bool(path, f"{where}.{key}", run[key])
    resume = run.get("resume", False)
    if resume and "config" in run:
        _spec_error(
            path,
            f"{where}.config",
            run["config"],
            "a resumed run uses its own config.yaml",
            "drop config (overrides still apply), or drop resume: true to start a new run",
        )
    if not resume and "config" not in run:
        _spec_error(path, where, run, "neither config nor resume: true", "give a config YAML, or resume: true")
    for key in ("start_over", "allow_lag_change"):
        if run.get(key) and not resume:
            _spec_error(path, f"{where}.{key}", True, "applies only with resume: true", f"drop {key}, or resume")


def members_of(spec: dict, path: str | Path = "") -> list:
    """The spec's runs as population members (configs loaded as `stratarl train` loads them; an error names the
    member)."""
    from stratarl.config_errors import ConfigError
    from stratarl.trainer.config import load_config
    from stratarl.trainer.population import Member

    members: list = []
    names: dict[object, str] = {}
    dirs: dict[object, str] = {}
    for index, run in enumerate(spec["runs"]):
        where = member_label(index, run)
        run_dir = Path(run["run_dir"])
        overrides = [str(o) for o in run.get("overrides", [])]
        resume = bool(run.get("resume", False))
        try:
            if resume:
                if not (run_dir / "config.yaml").is_file():
                    raise ConfigError(f"resume {run_dir}: no config.yaml there. Fix: name a run directory that ran")
                cfg = load_config(run_dir / "config.yaml", overrides)
            else:
                cfg = load_config(run["config"], overrides)
        except (ConfigError, OSError) as error:
            from stratarl.commands import error_line  # the one-line OSError text

            raise ConfigError(f"population spec {path}: {where}: {error_line(error)}") from None
        name = str(run.get("name") or run_dir.name)
        for seen, key, what in ((names, name, "name"), (dirs, run_dir.resolve(), "run_dir")):
            if key in seen:
                raise ConfigError(
                    f"population spec {path}: {where} has the {what} of {seen[key]} ({key}). Fix: give each run "
                    f"its own {what}"
                )
            seen[key] = where
        members.append(
            Member(
                name,
                cfg,
                run_dir,
                resume=resume,
                start_over=bool(run.get("start_over", False)),
                allow_lag_change=bool(run.get("allow_lag_change", False)),
            )
        )
    return members


def check_members(members: list, args: argparse.Namespace) -> None:
    """The start-up checks `stratarl train` makes, for each member: the probe search of a remote retriever
    (exit code 3 when it fails, the member named)."""
    from stratarl.commands import CommandFailed
    from stratarl.commands.train import check_retriever

    for member in members:
        try:
            check_retriever(member.cfg, args)
        except CommandFailed as error:
            raise CommandFailed(f"member {member.name}: {error}", error.code) from None


def member_line(result) -> str:
    """``name: done: N steps``, ``name: STOPPED (exit code 3): reason`` or ``name: DROPPED: error``."""
    steps = (result.summary or {}).get("steps")
    if result.status == "done":
        return f"{result.name}: done: {steps} steps ({result.run_dir})"
    if result.status == "stopped":
        return (
            f"{result.name}: STOPPED at step {steps} (exit code {result.exit_code}): {result.reason} ({result.run_dir})"
        )
    return f"{result.name}: DROPPED (exit code 1): {result.reason} ({result.run_dir})"


def population_exit_code(results) -> int:
    """0 when every member is done; else the exit code of the first member that did not finish (1: dropped)."""
    return next((r.exit_code or 1 for r in results if r.status != "done"), 0)


def run_population_command(args: argparse.Namespace) -> int:
    def body() -> int:
        from stratarl.commands.train import run_pipeline
        from stratarl.trainer.population import run_population

        spec = load_spec(args.spec)
        members = members_of(spec, args.spec)
        check_members(members, args)
        print(f"population of {len(members)} runs, one after another", flush=True)
        report = run_population(members, pipeline=run_pipeline, logs=not args.no_logs)
        for result in report.members:
            print(f"  {member_line(result)}", flush=True)
        counts = {s: sum(r.status == s for r in report.members) for s in ("done", "stopped", "dropped")}
        code = population_exit_code(report.members)
        print(
            f"population finished in {report.seconds:.0f}s: {counts['done']} of {len(report.members)} runs done, "
            f"{counts['stopped']} stopped, {counts['dropped']} dropped (exit code {code})",
            flush=True,
        )
        if args.summary:
            write_summary(Path(args.summary), report, code)
        return code

    return guard(body)


def write_summary(path: Path, report, code: int) -> None:
    """The population's result as JSON: each member's status (done / stopped / dropped), exit code and reason."""
    out = {
        "seconds": report.seconds,
        "exit_code": code,
        "members": [
            {
                "name": r.name,
                "run_dir": str(r.run_dir),
                "status": r.status,
                "ok": r.ok,
                "exit_code": r.exit_code,
                "reason": r.reason,
                "error": r.error,
                "steps": (r.summary or {}).get("steps"),
            }
            for r in report.members
        ],
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=1) + "\n")
