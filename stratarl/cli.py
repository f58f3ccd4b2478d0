"""The `stratarl` command: discovers subcommands in `stratarl.commands`."""

from __future__ import annotations

import argparse
import importlib
import os
import pkgutil
import sys

from stratarl import __version__
from stratarl.commands import describe_os_error
from stratarl.extensions import ExtensionError, env_imports, load_extensions, split_import_args
from stratarl.infra.allocator import reuse_large_allocations


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="stratarl",
        description="Train LLM search agents with Stratified GRPO and SORL.",
    )
    parser.add_argument("--version", action="version", version=f"stratarl {__version__}")
    parser.add_argument(
        "--import",
        dest="imports",
        action="append",
        metavar="MODULE",
        default=[],
        help="import a module (a .py path or a dotted name) that registers advantage estimators, "
        "policy losses, gradient normalisers, retrievers or dataset formats before the command "
        "runs; anywhere on the line, repeatable; also $STRATARL_IMPORT (os.pathsep-separated)",
    )
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    import stratarl.commands as commands

    for info in sorted(pkgutil.iter_modules(commands.__path__), key=lambda m: m.name):
        module = importlib.import_module(f"stratarl.commands.{info.name}")
        register = getattr(module, "register", None)
        if register is not None:
            register(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    reuse_large_allocations()
    parser = build_parser()
    try:
        imports, argv = split_import_args(sys.argv[1:] if argv is None else argv)
        load_extensions([*env_imports(), *imports])
    except ExtensionError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    args, extra = parser.parse_known_args(argv)
    # `train CONFIG --run-dir DIR key=value`: argparse leaves overrides that follow an option unparsed.
    if (
        extra
        and isinstance(getattr(args, "overrides", None), list)
        and all("=" in e and not e.startswith("-") for e in extra)
    ):
        args.overrides = [*args.overrides, *extra]
    elif extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    if getattr(args, "func", None) is None:
        parser.print_help()
        return 0
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:  # a second Ctrl-C (train), or the first one elsewhere: one line, no traceback
        print(f"\n{interrupted_line(args.command)}", file=sys.stderr, flush=True)
        return 130
    except (OSError, UnicodeDecodeError) as error:
        # A path that is a file (or under one), an unwritable folder, a full disk, a binary file:
        # one line that names the path; STRATARL_DEBUG=1 shows the traceback.
        if os.environ.get("STRATARL_DEBUG"):
            raise
        print(f"error: {describe_os_error(error)}", file=sys.stderr)
        return 1


def interrupted_line(command: str) -> str:
    """What `stratarl COMMAND` prints when interrupted at once (exit 130)."""
    if command in ("train", "demo"):
        return (
            f"stratarl {command}: aborted without saving this step; `stratarl train --resume RUN_DIR` "
            "continues from the newest checkpoint"
        )
    return f"stratarl {command}: interrupted"


if __name__ == "__main__":
    sys.exit(main())
