"""Subcommands of the `stratarl` CLI.

Every module in this package that defines ``register(subparsers)`` adds one or
more subcommands; `stratarl.cli` discovers them, so a new command is one new file.
``register`` adds a parser and sets ``func=<callable(args) -> int>`` on it.
Keep imports of heavy modules (torch, transformers) inside the handlers so that
``stratarl --help`` stays fast.
"""
