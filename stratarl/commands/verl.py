"""`stratarl verl convert-data | check`: data for veRL's multi-turn trainer, and a plugin check."""

from __future__ import annotations

import argparse

from stratarl.commands import print_error


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "verl",
        help="veRL integration: convert question files to veRL's Search-R1 parquet, check the plugins",
        description="Multi-GPU / multi-node training runs on veRL with stratarl's plugins; see docs/verl.md.",
    )
    commands = parser.add_subparsers(dest="verl_command", metavar="SUBCOMMAND")
    parser.set_defaults(func=lambda args: parser.print_help() or 0)

    convert = commands.add_parser(
        "convert-data",
        help="write a question file as veRL's Search-R1 parquet (tool-call prompt, tools_kwargs, agent_name)",
        description="Read any question file stratarl reads (Search-R1 / veRL / SkyRL rows; parquet, jsonl or json) "
        "and write veRL's Search-R1 variant, ready for data.train_files / data.val_files of recipes/verl.",
    )
    convert.add_argument("input", help="input file, folder (with --split) or hub dataset name")
    convert.add_argument("output", help="output .parquet")
    convert.add_argument("--split", default=None, help="keep rows of this split (or pick {split}.parquet in a folder)")
    convert.add_argument("--limit", type=int, default=None, help="keep the first N rows")
    convert.set_defaults(func=_convert)

    check = commands.add_parser(
        "check",
        help="import the veRL plugins and list what they registered (run inside the veRL environment)",
    )
    check.set_defaults(func=_check)


def _convert(args: argparse.Namespace) -> int:
    from stratarl.data.search_r1 import DatasetFormatError, load_examples
    from stratarl.integrations.verl_data import write_verl_parquet

    if args.limit is not None and args.limit < 1:
        return print_error(f"--limit must be >= 1, got {args.limit}")
    if not args.output.endswith(".parquet"):
        return print_error(f"{args.output}: veRL reads parquet; name the output *.parquet")
    try:
        examples = load_examples(args.input, split=args.split, limit=args.limit)
        path = write_verl_parquet(examples, args.output, split=args.split)
    except (DatasetFormatError, FileNotFoundError, ValueError) as error:
        return print_error(str(error))
    sources = sorted({example.data_source for example in examples})
    print(f"wrote {len(examples)} rows to {path} (data sources: {', '.join(sources)})")
    return 0


def _check(args: argparse.Namespace) -> int:
    try:
        import stratarl.integrations.verl as plugin
    except ImportError as error:
        return print_error(str(error))
    from verl import __version__ as verl_version
    from verl.trainer.ppo import core_algos

    print(f"veRL {verl_version}")
    estimator = core_algos.get_adv_estimator_fn(plugin.ESTIMATOR_NAME)
    print(f"advantage estimator {plugin.ESTIMATOR_NAME!r}: {estimator.__module__}")
    for name in (plugin.TURN_PPO, plugin.SORL):
        print(f"policy loss {name!r}: {core_algos.get_policy_loss_fn(name).__module__}")
    if plugin.ACTOR_WORKER_INSTALLED:
        print("actor worker: SORLTrainingWorker (SORL normalisation active for loss_mode=sorl)")
    else:
        print("actor worker: a different custom worker is installed; loss_mode=sorl will refuse to run")
    return 0
