"""`stratarl index build|info|search`: build a BM25 or dense index from a Search-R1 corpus and inspect it."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from stratarl.commands import error_line


def register(subparsers) -> None:
    parser = subparsers.add_parser("index", help="build and inspect retrieval indexes (BM25, dense)")
    commands = parser.add_subparsers(dest="index_command", metavar="SUBCOMMAND")
    parser.set_defaults(func=lambda args: (parser.print_help(), 0)[1])

    build = commands.add_parser(
        "build",
        help="index a Search-R1 corpus jsonl into a directory",
        description='Index a Search-R1 corpus jsonl ({"id", "contents"} per line) into DIR; '
        "serve it with `stratarl serve --index DIR`.",
    )
    build.add_argument("--corpus", required=True, help="corpus jsonl (or .jsonl.gz), one passage a line")
    build.add_argument("--out", required=True, help="index directory to write (created if needed)")
    build.add_argument("--kind", choices=("bm25", "dense"), default="bm25", help="index kind (default: bm25)")
    build.add_argument("--stemmer", default="english", help="bm25: PyStemmer language, or 'none' (default: english)")
    build.add_argument(
        "--model", default=None, help="dense: encoder folder or HF id (default: bundled all-MiniLM-L6-v2)"
    )
    build.add_argument(
        "--prefixes", choices=("none", "e5"), default=None, help="dense: 'e5' adds 'query: '/'passage: '"
    )
    build.add_argument("--query-prefix", default=None, help="dense: text put before each query")
    build.add_argument("--passage-prefix", default=None, help="dense: text put before each passage")
    build.add_argument(
        "--max-length", type=int, default=None, help="dense: max tokens per text (default: model's, else 256)"
    )
    build.add_argument("--batch-size", type=int, default=64, help="dense: encoder batch size (default: 64)")
    build.add_argument("--device", default="cpu", help="dense: torch device for encoding (default: cpu)")
    build.add_argument(
        "--chunk-passages",
        type=int,
        default=250_000,
        help="bm25: passages tokenised at a time; memory grows with it (default: 250000)",
    )
    build.add_argument(
        "--dense-index",
        choices=("exact", "ivf", "hnsw"),
        default="exact",
        help="dense: exact search, or an approximate faiss index for big corpora (needs faiss-cpu)",
    )
    build.add_argument(
        "--codes",
        choices=("flat", "fp16", "sq8", "pq"),
        default="flat",
        help="dense ivf/hnsw: vector storage: float32, fp16, 8-bit (sq8), product-quantised (pq, ivf)",
    )
    build.add_argument("--nlist", type=int, default=None, help="dense ivf: number of lists (default: 4*sqrt(N))")
    build.add_argument("--nprobe", type=int, default=32, help="dense ivf: lists scanned per query (default: 32)")
    build.add_argument(
        "--pq-m", type=int, default=48, help="dense ivf pq: bytes per vector (divides the dim; default: 48)"
    )
    build.add_argument("--hnsw-m", type=int, default=32, help="dense hnsw: links per vector (default: 32)")
    build.add_argument("--ef-search", type=int, default=128, help="dense hnsw: candidates per query (default: 128)")
    build.set_defaults(func=_build)

    info = commands.add_parser("info", help="print an index's settings")
    info.add_argument("index", help="index directory")
    info.set_defaults(func=_info)

    search = commands.add_parser("search", help="query an index from the command line")
    search.add_argument("index", help="index directory (or corpus jsonl, indexed with BM25 on the fly)")
    search.add_argument("queries", nargs="+", help="one or more queries")
    search.add_argument("-k", "--topk", type=int, default=3, help="passages per query (default: 3)")
    search.add_argument("--json", action="store_true", help="print the /retrieve response JSON instead of text")
    search.set_defaults(func=_search)


def _fail(message: str) -> int:
    print(f"stratarl index: error: {message}", file=sys.stderr)
    return 2


def index_folder_for(corpus: Path) -> Path:
    """A folder next to ``corpus`` for its index (``wiki.jsonl.gz`` -> ``wiki_index``): never one holding it."""
    return corpus.parent / f"{corpus.name.split('.')[0]}_index"


def _build(args: argparse.Namespace) -> int:
    from stratarl.retrieval.corpus import CorpusError, load_corpus

    start = time.perf_counter()
    corpus, out = Path(args.corpus).resolve(), Path(args.out).resolve()
    if out == corpus or out in corpus.parents:
        return _fail(
            f"--out {args.out} contains the corpus {args.corpus}: building the index there would overwrite "
            f"the file it reads. Fix: choose an --out that does not contain it, e.g. "
            f"--out {index_folder_for(Path(args.corpus))}"
        )
    try:
        if args.kind == "bm25":
            from stratarl.retrieval.bm25_build import build_bm25_index
            from stratarl.retrieval.index_files import read_index_meta

            # Streamed: memory stays bounded however big the corpus (21M Wikipedia passages included).
            stemmer = None if args.stemmer.lower() == "none" else args.stemmer
            build_bm25_index(args.corpus, args.out, stemmer=stemmer, chunk_passages=args.chunk_passages)
            num_passages = read_index_meta(args.out)["num_passages"]
        else:
            from stratarl.retrieval.dense import DenseRetriever

            dense_index = {"kind": args.dense_index}
            if args.dense_index != "exact":
                dense_index.update(
                    codes=args.codes,
                    nlist=args.nlist,
                    nprobe=args.nprobe,
                    pq_m=args.pq_m,
                    hnsw_m=args.hnsw_m,
                    ef_search=args.ef_search,
                )
            passages = load_corpus(args.corpus)
            num_passages = len(passages)
            retriever = DenseRetriever.from_passages(
                passages,
                model=args.model,
                prefixes=args.prefixes,
                query_prefix=args.query_prefix,
                passage_prefix=args.passage_prefix,
                max_length=args.max_length,
                batch_size=args.batch_size,
                device=args.device,
                cache_dir=False,  # the index directory is the cache
                dense_index=dense_index,
            )
            retriever.save(args.out)
    except (CorpusError, FileNotFoundError, ValueError, ModuleNotFoundError, OSError) as error:
        return _fail(error_line(error))
    elapsed = time.perf_counter() - start
    print(f"built {args.kind} index of {num_passages} passages in {elapsed:.1f} s -> {args.out}")
    print(f"serve it with: stratarl serve --index {args.out}")
    return 0


def _info(args: argparse.Namespace) -> int:
    from stratarl.retrieval.index_files import read_index_meta

    try:
        meta = read_index_meta(args.index)
    except (FileNotFoundError, ValueError) as error:
        return _fail(error_line(error))
    print(json.dumps(meta, indent=2))
    return 0


def _search(args: argparse.Namespace) -> int:
    from stratarl.retrieval.corpus import CorpusError
    from stratarl.retrieval.factory import build_retriever
    from stratarl.retrieval.protocol import format_retrieve_response

    try:
        retriever = build_retriever(args.index)
        results = retriever.search(args.queries, args.topk)
    except (CorpusError, FileNotFoundError, ValueError, ModuleNotFoundError, OSError) as error:
        return _fail(error_line(error))
    if args.json:
        print(json.dumps(format_retrieve_response(results, return_scores=True), ensure_ascii=False))
        return 0
    for query, hits in zip(args.queries, results):
        print(f"query: {query}")
        for rank, passage in enumerate(hits, start=1):
            score = "" if passage.score is None else f"score {passage.score:.4f}, "  # a retriever may give none
            print(f"  Doc {rank}(Title: {passage.title}) {passage.text}  [{score}id {passage.id}]")
        if not hits:
            print("  (no passage matches)")
    return 0
