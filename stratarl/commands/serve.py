"""`stratarl serve`: a Search-R1-compatible `/retrieve` server over a BM25 or dense index."""

from __future__ import annotations

import argparse
import sys
from dataclasses import asdict

from stratarl.commands import error_line

LOOPBACK_HOSTS = {"127.0.0.1", "localhost", "::1"}


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "serve",
        help="serve an index over Search-R1's /retrieve protocol",
        description="Serve a retrieval index at http://HOST:PORT/retrieve (Search-R1's protocol) and /health. "
        "Binds 127.0.0.1 unless --host says otherwise.",
    )
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--index", help="index directory from `stratarl index build`")
    source.add_argument("--corpus", help="corpus jsonl: index it now (BM25 unless --kind dense) and serve it")
    parser.add_argument(
        "--kind", choices=("bm25", "dense"), default="bm25", help="with --corpus: index kind (default: bm25)"
    )
    parser.add_argument("--model", default=None, help="dense: encoder folder (overrides the one stored in the index)")
    parser.add_argument("--prefixes", choices=("none", "e5"), default=None, help="dense with --corpus: e5 prefixes")
    parser.add_argument("--device", default="cpu", help="dense: torch device (default: cpu)")
    parser.add_argument(
        "--mmap",
        action="store_true",
        help="with --index: memory-map the index (BM25 score arrays, a faiss index) instead of reading "
        "it into memory; --workers > 1 maps a BM25 index always",
    )
    parser.add_argument(
        "--mmap-corpus",
        action="store_true",
        help="with --index: read passages from the index's corpus copy on disk when returned "
        "(8 bytes a passage in memory instead of the text); for Wikipedia-size corpora",
    )
    parser.add_argument(
        "--nprobe", type=int, default=None, help="with --index, a faiss IVF index: lists searched per query"
    )
    parser.add_argument("--ef-search", type=int, default=None, help="with --index, a faiss HNSW index: search breadth")
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default: 127.0.0.1, this machine only)")
    parser.add_argument("--port", type=int, default=8000, help="port (default: 8000)")
    parser.add_argument(
        "--topk", type=int, default=3, help="passages per query when a request has no topk (default: 3)"
    )
    parser.add_argument("--max-topk", type=int, default=100, help="largest topk a request may ask for (default: 100)")
    parser.add_argument("--max-queries", type=int, default=4096, help="most queries in one request (default: 4096)")
    parser.add_argument("--max-query-chars", type=int, default=2048, help="longest query in characters (default: 2048)")
    parser.add_argument(
        "--max-batch-queries",
        type=int,
        default=1024,
        help="most queries merged into one retriever call across concurrent requests (default: 1024; 1 = no merging)",
    )
    parser.add_argument(
        "--max-hits",
        type=int,
        default=16384,
        help="most passages one request may ask for, queries x topk (default: 16384)",
    )
    parser.add_argument(
        "--workers",
        type=int,
        default=1,
        help="server processes sharing the port, each loading the index (BM25 memory-mapped, so its arrays "
        "are shared); about one per CPU core the server may use (default: 1)",
    )
    parser.add_argument(
        "--request-timeout",
        type=float,
        default=5.0,
        metavar="SECONDS",
        help="close a connection that has not sent a whole request (headers and body) within this "
        "many seconds of opening or of its previous answer: slow or stalled clients cannot hold "
        "the server's sockets (default: 5)",
    )
    parser.add_argument("--log-level", default="info", choices=("critical", "error", "warning", "info", "debug"))
    parser.set_defaults(func=run_serve)


def _retriever_spec(args: argparse.Namespace) -> dict:
    if args.index is not None:
        spec: dict = {"index": args.index}
        from stratarl.retrieval.index_files import read_index_meta

        spec.update({key: True for key in ("mmap", "mmap_corpus") if getattr(args, key)})
        if read_index_meta(args.index)["kind"] == "dense":
            spec.update(device=args.device, **({"model": args.model} if args.model else {}))
            spec.update({key: getattr(args, key) for key in ("nprobe", "ef_search") if getattr(args, key) is not None})
        elif args.nprobe is not None or args.ef_search is not None:
            raise ValueError(f"--nprobe / --ef-search apply to a dense faiss index; {args.index} is a BM25 index")
        return spec
    if args.mmap or args.mmap_corpus or args.nprobe is not None or args.ef_search is not None:
        raise ValueError(
            "--mmap, --mmap-corpus, --nprobe and --ef-search apply when loading a built index (--index DIR); "
            "build one with `stratarl index build`"
        )
    spec = {"kind": args.kind, "corpus": args.corpus}
    if args.kind == "dense":
        spec.update(device=args.device, prefixes=args.prefixes, **({"model": args.model} if args.model else {}))
    return spec


def run_serve(args: argparse.Namespace) -> int:
    from stratarl.retrieval.corpus import CorpusError
    from stratarl.retrieval.factory import build_retriever
    from stratarl.retrieval.protocol import ServerLimits
    from stratarl.retrieval.server import serve

    if not 0 <= args.port <= 65535:
        print(
            f"stratarl serve: error: --port {args.port} is not a TCP port. Fix: use a number in 1-65535, e.g. 8000",
            file=sys.stderr,
        )
        return 2
    if args.workers < 1:
        print(
            f"stratarl serve: error: --workers {args.workers} must be at least 1 (e.g. the number of CPU cores)",
            file=sys.stderr,
        )
        return 2
    try:
        from stratarl.retrieval.slow_clients import check_request_timeout

        check_request_timeout(args.request_timeout)
    except ValueError as error:
        print(f"stratarl serve: error: {error}", file=sys.stderr)
        return 2
    try:
        limits = ServerLimits(
            default_topk=args.topk,
            max_topk=args.max_topk,
            max_queries=args.max_queries,
            max_query_chars=args.max_query_chars,
            max_batch_queries=args.max_batch_queries,
            max_hits=args.max_hits,
        )
        spec = _retriever_spec(args)
        retriever = build_retriever(spec) if args.workers == 1 or args.corpus is not None else None
    except (CorpusError, FileNotFoundError, ValueError, ModuleNotFoundError, OSError) as error:
        print(f"stratarl serve: error: {error_line(error)}", file=sys.stderr)
        return 2
    if args.host not in LOOPBACK_HOSTS:
        print(
            f"stratarl serve: warning: binding {args.host} exposes the server beyond this machine; "
            "it has no authentication",
            file=sys.stderr,
        )
    if args.workers > 1:
        return _serve_workers(args, spec, retriever, limits)
    if retriever is None:  # one process: built above
        raise RuntimeError("stratarl serve: no retriever was built")
    print(f"serving {retriever!r} at http://{args.host}:{args.port}/retrieve", flush=True)
    try:
        serve(
            retriever,
            host=args.host,
            port=args.port,
            log_level=args.log_level,
            request_timeout_s=args.request_timeout,
            **asdict(limits),
        )
    except OSError as error:
        print(f"stratarl serve: error: {bind_error(error, args.host, args.port)}", file=sys.stderr)
        return 2
    return 0


def bind_error(error: OSError, host: str, port: int) -> str:
    """One line for a failure to listen on ``host:port``: which flag, what happened, the fix."""
    import errno
    import socket

    if error.errno == errno.EADDRINUSE:
        return f"--port {port}: {host}:{port} is already in use (another server?). Fix: stop it, or pass another --port"
    if error.errno == errno.EACCES:
        return f"--port {port}: this user may not listen on it (ports below 1024 need privileges). Fix: use e.g. --port 8000"
    if error.errno == errno.EADDRNOTAVAIL or isinstance(error, socket.gaierror):
        return f"--host {host}: not an address of this machine. Fix: use 127.0.0.1 (this machine only)"
    from stratarl.commands import describe_os_error

    return f"cannot listen on {host}:{port}: {describe_os_error(error)}"


def _serve_workers(args: argparse.Namespace, spec: dict, retriever, limits) -> int:
    """``--workers N``: N processes on one port; a corpus is indexed once, here, and saved for them to map."""
    import tempfile

    from stratarl.retrieval.workers import WorkerError, serve_workers

    with tempfile.TemporaryDirectory(prefix="stratarl-serve-") as tmp:
        if retriever is not None:  # --corpus: built above; the workers load the saved copy
            spec = {"index": str(retriever.save(tmp)), **{k: v for k, v in spec.items() if k in ("device", "model")}}
        label = args.index or args.corpus

        def announce(pool) -> None:
            print(
                f"serving {label} with {args.workers} workers (pids {', '.join(map(str, pool.pids))}) "
                f"at http://{args.host}:{pool.port}/retrieve",
                flush=True,
            )

        try:
            return serve_workers(
                spec,
                workers=args.workers,
                host=args.host,
                port=args.port,
                log_level=args.log_level,
                limits=limits,
                on_ready=announce,
                request_timeout_s=args.request_timeout,
            )
        except WorkerError as error:
            print(f"stratarl serve: error: {error}", file=sys.stderr)
            return 2
        except OSError as error:
            print(f"stratarl serve: error: {bind_error(error, args.host, args.port)}", file=sys.stderr)
            return 2
