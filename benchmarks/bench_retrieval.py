"""Retrieval benchmark: BM25 build and search on a 100k-passage corpus, and designs of the /retrieve
server under 1, 32 and 128 concurrent clients. Baselines are measured in the same run:

- build and search: bm25s's own tokenizer + index + ``retrieve`` on the same corpus and queries;
- server: one process reaching the ``/retrieve`` handler through FastAPI / Starlette's middleware and
  routing (``create_app(fast_path=False)``, uvicorn's pure-Python h11 parser), with and without request
  merging (``max_batch_queries=1``: one retriever call per query, as servers that block on each request
  do), next to one process with the fast path (the handler first, before FastAPI; uvicorn's
  httptools/uvloop when installed) and ``--workers`` processes; two "no search" designs (fixed passages)
  give the HTTP / JSON layer's own cost. Every design answers with the same handler and JSON encoder.
  Clients run in a separate asyncio process (benchmarks/load_client.py); the table gives both
  sides' CPU use, and the CPU-bound ceiling those imply on this machine.

Corpus: the synthetic knowledge base (`stratarl.data.synth`, seeded), queries: the hop queries of its
questions. Usage::

    python benchmarks/bench_retrieval.py                    # 100k passages (~3-4 min on 2 cores)
    python benchmarks/bench_retrieval.py --passages 20000 --requests 200
    python benchmarks/bench_retrieval.py --per-request 8          # rollout-like requests of 8 queries
    python benchmarks/bench_retrieval.py --per-request 8 --server-only --workers 2   # server designs only
    python benchmarks/bench_retrieval.py --dense-passages 2000   # also time the dense retriever
    python benchmarks/bench_retrieval.py --contention-only  # small requests' p99 behind the largest ones
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import random
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from stratarl.retrieval.base import Passage
from stratarl.retrieval.bm25 import BM25Retriever


def make_corpus(num_passages: int, seed: int) -> tuple[list[Passage], list[str], list, str]:
    """(passages, queries, test examples, description). Synthetic KB if present, else random words."""
    try:
        from stratarl.data.synth import generate_knowledge_base
    except ImportError:
        rng = random.Random(seed)
        words = [f"w{i}" for i in range(50_000)]
        weights = [1.0 / (i + 1) for i in range(len(words))]  # Zipf-like
        passages = [
            Passage(str(i), f'"{rng.choice(words)}"\n' + " ".join(rng.choices(words, weights, k=60)))
            for i in range(num_passages)
        ]
        queries = [" ".join(rng.choices(words, weights, k=6)) for _ in range(5000)]
        return passages, queries, [], "seeded random Zipf words (stratarl.data.synth not found)"
    kb = generate_knowledge_base(seed=seed, size=num_passages)
    queries = [hop["query"] for example in kb.train for hop in example.metadata["hops"]]
    random.Random(seed).shuffle(queries)
    return kb.passages, queries, kb.test, f"synthetic knowledge base (seed {seed})"


def timed(fn, *args, **kwargs):
    start = time.perf_counter()
    result = fn(*args, **kwargs)
    return result, time.perf_counter() - start


def bench_bm25(passages, queries, num_queries: int, out_dir: Path) -> dict:
    import bm25s
    import Stemmer

    queries = queries[:num_queries]
    ours, build_s = timed(BM25Retriever.from_passages, passages)
    _, save_s = timed(ours.save, out_dir)
    loaded, load_s = timed(BM25Retriever.load, out_dir)
    _, batched_s = timed(loaded.search, queries, 3)
    single = queries[: max(1, num_queries // 4)]
    _, single_s = timed(lambda: [loaded.search([q], 3) for q in single])

    stemmer = Stemmer.Stemmer("english")

    def native_build():
        model = bm25s.BM25()
        model.index(
            bm25s.tokenize([p.contents for p in passages], stemmer=stemmer, show_progress=False), show_progress=False
        )
        return model

    native, native_build_s = timed(native_build)

    def native_search(batch):
        tokens = bm25s.tokenize(batch, stemmer=stemmer, return_ids=False, show_progress=False)
        return native.retrieve(tokens, k=3, show_progress=False)

    _, native_batched_s = timed(native_search, queries)
    return {
        "passages": len(passages),
        "build_s": build_s,
        "save_s": save_s,
        "load_s": load_s,
        "batched_qps": len(queries) / batched_s,
        "single_qps": len(single) / single_s,
        "bm25s_build_s": native_build_s,
        "bm25s_batched_qps": len(queries) / native_batched_s,
        "retriever": loaded,
    }


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start_server(index_dir: Path, max_batch_queries: int) -> tuple[subprocess.Popen, str]:
    port = free_port()
    command = [
        sys.executable,
        "-m",
        "stratarl.cli",
        "serve",
        "--index",
        str(index_dir),
        "--port",
        str(port),
        "--log-level",
        "warning",
        "--max-batch-queries",
        str(max_batch_queries),
    ]
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    return process, wait_until_healthy(process, f"http://127.0.0.1:{port}", timeout_s=120, what="server")


def wait_until_healthy(process: subprocess.Popen, url: str, *, timeout_s: float, what: str) -> str:
    """Poll ``url``/health until it answers; raise with the process's stderr if it exits or times out."""
    import httpx

    deadline = time.monotonic() + timeout_s
    while True:
        try:
            httpx.get(url + "/health", timeout=1)
            return url
        except httpx.TransportError:
            if process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"{what} did not start: {process.stderr.read()}") from None
            time.sleep(0.2)


def drive(url: str, queries: list[str], clients: int, num_requests: int, per_request: int = 1) -> dict:
    """``num_requests`` requests of ``per_request`` queries each, from ``clients`` threads; all must succeed."""
    import httpx

    latencies, errors = [], []
    lock = threading.Lock()
    counter = iter(range(num_requests))
    with httpx.Client(timeout=60, limits=httpx.Limits(max_connections=clients + 4)) as client:
        before = client.get(url + "/health").json()["stats"]

        def worker():
            while True:
                with lock:
                    i = next(counter, None)
                if i is None:
                    return
                start = time.perf_counter()
                batch = [queries[(i * per_request + j) % len(queries)] for j in range(per_request)]
                response = client.post(url + "/retrieve", json={"queries": batch, "topk": 3})
                elapsed = time.perf_counter() - start
                with lock:
                    latencies.append(elapsed)
                    if response.status_code != 200 or len(response.json()["result"]) != per_request:
                        errors.append(response.status_code)

        start = time.perf_counter()
        with ThreadPoolExecutor(clients) as pool:
            for _ in range(clients):
                pool.submit(worker)
        wall = time.perf_counter() - start
        after = client.get(url + "/health").json()["stats"]
    latencies.sort()
    return {
        "clients": clients,
        "qps": num_requests * per_request / wall,
        "p50_ms": 1000 * statistics.median(latencies),
        "p99_ms": 1000 * latencies[min(len(latencies) - 1, int(0.99 * len(latencies)))],
        "errors": len(errors),
        "retriever_calls": after["retriever_calls"] - before["retriever_calls"],
    }


# Each design is a server process started by this snippet (the library's own code paths), driven by
# benchmarks/load_client.py in another process.
_SERVER_SNIPPET = """
import json, sys
options = json.loads(sys.argv[1])
if options["workers"] == 1:
    import uvicorn
    from stratarl.retrieval.base import Passage
    from stratarl.retrieval.bm25 import BM25Retriever
    from stratarl.retrieval.server import create_app
    retriever = BM25Retriever.load(options["index"], mmap=True)

    class FixedHits:  # the HTTP / JSON layer alone: the same k real passages for every query, no search
        def __init__(self, passages):
            self.passages = passages
        def __len__(self):
            return len(self.passages)
        def search(self, queries, k):
            return [[Passage(p.id, p.contents, 1.0 + i) for i, p in enumerate(self.passages[:k])] for _ in queries]

    if options.get("fixed_hits"):
        retriever = FixedHits(retriever.passages[:10])
    app = create_app(retriever, max_batch_queries=options["max_batch"], fast_path=options["fast_path"])
    uvicorn.run(app, host="127.0.0.1", port=options["port"], log_level="warning", http=options["http"], loop=options["loop"])
else:
    from stratarl.retrieval.protocol import ServerLimits
    from stratarl.retrieval.workers import WorkerPool
    pool = WorkerPool({"index": options["index"]}, workers=options["workers"], port=options["port"],
                      limits=ServerLimits(max_batch_queries=options["max_batch"]), fast_path=options["fast_path"])
    with pool:
        sys.exit(pool.wait())
"""


def server_designs(workers: int) -> list[tuple[str, dict]]:
    """(label, options): /retrieve through FastAPI's routing (h11, 1 process), then the fast-path designs."""
    routed = {"workers": 1, "fast_path": False, "http": "h11", "loop": "asyncio", "max_batch": 1024}
    fast = {"workers": 1, "fast_path": True, "http": "auto", "loop": "auto", "max_batch": 1024}
    faster_http = importlib.util.find_spec("httptools") is not None or importlib.util.find_spec("uvloop") is not None
    return [
        ("1 proc, via FastAPI, h11", routed),
        ("1 proc, via FastAPI, h11, no merge", {**routed, "max_batch": 1}),
        *([("1 proc, fast path, h11", {**fast, "http": "h11", "loop": "asyncio"})] if faster_http else []),
        ("1 proc, fast path", fast),
        ("1 proc, fast path, no merge", {**fast, "max_batch": 1}),
        (f"{workers} workers, fast path", {**fast, "workers": workers}),
        (f"{workers} workers, fast path, no merge", {**fast, "workers": workers, "max_batch": 1}),
        ("no search: via FastAPI", {**routed, "fixed_hits": True}),
        ("no search: fast path", {**fast, "fixed_hits": True}),
    ]


def start_design(index_dir: Path, options: dict) -> tuple[subprocess.Popen, str]:
    options = {**options, "index": str(index_dir), "port": free_port()}
    process = subprocess.Popen(
        [sys.executable, "-c", _SERVER_SNIPPET, json.dumps(options)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    return process, wait_until_healthy(
        process, f"http://127.0.0.1:{options['port']}", timeout_s=300, what=f"server {options}"
    )


def process_tree_sched_s(pid: int) -> tuple[float, float] | None:
    """(seconds on a CPU, seconds runnable but waiting for a CPU), summed over every thread of ``pid`` and of
    its direct children, from Linux's /proc/<pid>/task/<tid>/schedstat (nanoseconds); None where absent."""
    pids = []
    for entry in os.listdir("/proc") if os.path.isdir("/proc") else []:
        if entry.isdigit():
            try:
                ppid = int(Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[1])
            except OSError:
                continue
            if int(entry) == pid or ppid == pid:
                pids.append(entry)
    run = wait = 0
    found = False
    for proc in pids:
        try:
            tasks = os.listdir(f"/proc/{proc}/task")
        except OSError:
            continue
        for task in tasks:
            try:
                fields = Path(f"/proc/{proc}/task/{task}/schedstat").read_text().split()
            except OSError:
                continue
            run, wait, found = run + int(fields[0]), wait + int(fields[1]), True
    return (run / 1e9, wait / 1e9) if found else None


def drive_external(url: str, pid: int, queries_file: Path, clients: int, num_requests: int, per_request: int) -> dict:
    """One run of benchmarks/load_client.py against ``url``; adds the server's CPU seconds during the run and
    the seconds its threads were runnable but waited for a CPU (taken by other processes, the client included)."""
    client = Path(__file__).with_name("load_client.py")
    before = process_tree_sched_s(pid)
    done = subprocess.run(
        [
            sys.executable,
            str(client),
            url,
            str(queries_file),
            "--clients",
            str(clients),
            "--requests",
            str(num_requests),
            "--per-request",
            str(per_request),
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    after = process_tree_sched_s(pid)
    if done.returncode != 0:
        raise RuntimeError(f"load client failed: {done.stderr[-2000:]}")
    row = json.loads(done.stdout)
    row["server_cpu_s"] = None if before is None or after is None else after[0] - before[0]
    row["server_cpu_wait_s"] = None if before is None or after is None else after[1] - before[1]
    return row


def bench_designs(
    index_dir: Path,
    queries: list[str],
    num_requests: int,
    per_request: int,
    workers: int,
    client_counts=(1, 32, 128),
    repeats: int = 2,
) -> list[dict]:
    """Every design of `server_designs` side by side, driven in alternation at each client count, best of
    ``repeats`` runs each (so load from other processes on the machine hits all alike). At c clients
    each run sends max(``num_requests``, 4c) requests."""
    queries_file = index_dir.parent / "bench_queries.json"
    queries_file.write_text(json.dumps(queries[:5000]))
    servers: dict[str, tuple[subprocess.Popen, str]] = {}
    try:
        for label, options in server_designs(workers):
            servers[label] = start_design(index_dir, options)
        for process, url in servers.values():
            drive_external(url, process.pid, queries_file, 4, 40, per_request)  # warm-up
        rows = []
        fixed = {label for label, options in server_designs(workers) if options.get("fixed_hits")}
        for clients in client_counts:
            requests = max(num_requests, 4 * clients)
            runs: dict[str, list[dict]] = {label: [] for label in servers}
            for _ in range(repeats):
                for label, (process, url) in servers.items():
                    n = 10 * requests if label in fixed else requests  # ~10x faster: runs of similar length
                    runs[label].append(drive_external(url, process.pid, queries_file, clients, n, per_request))
            rows += [{"server": label, **max(found, key=lambda r: r["qps"])} for label, found in runs.items()]
        return rows
    finally:
        for process, _ in servers.values():
            process.terminate()
        for process, _ in servers.values():
            process.wait(timeout=60)


def report_designs(rows: list[dict], args, workers: int) -> None:
    parser = "httptools" if importlib.util.find_spec("httptools") else "h11"
    loop = "uvloop" if importlib.util.find_spec("uvloop") else "asyncio"
    print(
        f"\n/retrieve server designs: requests of {args.per_request} queries (k=3, scores), max({args.requests}, "
        f"4 x clients) requests per run, best of 2; clients: one asyncio process (benchmarks/load_client.py, "
        f"keep-alive sockets), on the same {os.cpu_count()} CPUs; fast path on uvicorn's {parser} + {loop}"
    )
    print(
        "  cores: CPU seconds per wall second of the run; server wait: its threads' seconds runnable but not on a CPU"
        " (the machine was busy), per wall second; CPU ms/req: CPU per request served"
    )
    print(
        "  server                                clients  queries/s   p50 ms   p99 ms  errors   cores: client server"
        "  server wait   CPU ms/req: client server"
    )
    for row in rows:
        server, wait = row["server_cpu_s"], row["server_cpu_wait_s"]
        server_cores = "     -" if server is None else f"{server / row['wall_s']:6.2f}"
        server_wait = "           -" if wait is None else f"{wait / row['wall_s']:12.2f}"
        server_ms = "     -" if server is None else f"{1000 * server / row['requests']:6.2f}"
        print(
            f"  {row['server']:<37} {row['clients']:7d} {row['qps']:10.0f} {row['p50_ms']:8.1f} {row['p99_ms']:8.1f} "
            f"{row['errors']:7d} {row['client_cpu_s'] / row['wall_s']:14.2f} {server_cores} {server_wait} "
            f"{1000 * row['client_cpu_s'] / row['requests']:19.2f} {server_ms}"
        )
    by = {(r["server"], r["clients"]): r["qps"] for r in rows}
    labels = list(dict.fromkeys(r["server"] for r in rows))
    print("  'no search' designs answer every query with the same k passages: the HTTP / JSON layer's own cost")
    print("  scaling (queries/s at 32 and 128 clients / at 1 client):")
    for label in labels:
        print(
            f"    {label:<37} 32: {by[(label, 32)] / by[(label, 1)]:4.1f}x   128: {by[(label, 128)] / by[(label, 1)]:4.1f}x"
            f"   vs via FastAPI at 32: {by[(label, 32)] / by[(labels[0], 32)]:4.1f}x"
        )
    cpus = os.cpu_count() or 1
    print(
        f"  CPU-bound ceiling at 32 clients if nothing else ran here = {cpus} CPUs / (client + server CPU per request), "
        "at most one core per server process; vs measured:"
    )
    for label in labels:
        row = next(r for r in rows if r["server"] == label and r["clients"] == 32)
        if not row["server_cpu_s"]:
            print(f"    {label:<37} server CPU not measured (needs Linux's /proc schedstat)")
        else:
            ceiling = cpus * row["requests"] * args.per_request / (row["client_cpu_s"] + row["server_cpu_s"])
            workers_here = int(label.split()[0]) if label[0].isdigit() else 1
            bound = min(ceiling, workers_here * row["requests"] * args.per_request / row["server_cpu_s"])
            print(
                f"    {label:<37} ceiling {bound:7.0f} q/s (server limited to {workers_here} core(s)), "
                f"measured {row['qps']:7.0f} q/s ({row['qps'] / bound:.0%})"
            )


def bench_contention(index_dir: Path, queries: list[str], num_requests: int, large_workers: int = 4) -> dict:
    """Small requests (1 query, k 3, 4 clients) alone, then while ``large_workers`` clients keep sending the
    largest request the default limits allow (4,096 queries x k 4 = 16,384 hits): p50 / p99 of the small ones in
    both phases, from one server in the same run."""
    import httpx

    process, url = start_server(index_dir, 1024)
    try:
        drive(url, queries, 4, 20)  # warm-up
        alone = drive(url, queries, 4, num_requests)
        stop = threading.Event()
        large_latencies, large_errors = [], []
        big = [queries[i % len(queries)] for i in range(4096)]

        def hammer():
            with httpx.Client(timeout=300) as client:
                while not stop.is_set():
                    start = time.perf_counter()
                    response = client.post(url + "/retrieve", json={"queries": big, "topk": 4})
                    large_latencies.append(time.perf_counter() - start)
                    if response.status_code != 200:
                        large_errors.append(response.status_code)

        threads = [threading.Thread(target=hammer, daemon=True) for _ in range(large_workers)]
        for t in threads:
            t.start()
        time.sleep(1.0)  # the large requests are in flight before the small ones start
        contended = drive(url, queries, 4, num_requests)
        stop.set()
        for t in threads:
            t.join(timeout=300)
        return {
            "alone": alone,
            "with_large": contended,
            "large_requests": len(large_latencies),
            "large_errors": len(large_errors),
            "large_p50_s": statistics.median(large_latencies) if large_latencies else None,
        }
    finally:
        process.terminate()
        process.wait(timeout=30)


def bench_dense(passages, queries, num_passages: int) -> dict:
    from stratarl.retrieval.dense import DenseRetriever

    subset = passages[:num_passages]
    retriever, build_s = timed(DenseRetriever.from_passages, subset, cache_dir=False)
    sample = queries[:512]
    _, search_s = timed(retriever.search, sample, 3)
    return {
        "passages": len(subset),
        "encode_passages_per_s": len(subset) / build_s,
        "batched_qps": len(sample) / search_s,
    }


def report_contention(row: dict, results: dict) -> None:
    results["contention"] = row
    a, c = row["alone"], row["with_large"]
    print(
        f"\nsmall requests (1 query, 4 clients) alone vs while 4 clients send 4,096-query x k 4 requests "
        f"({row['large_requests']} large requests served, median {row['large_p50_s'] or 0:.2f} s, {row['large_errors']} errors)"
    )
    print(f"  alone        p50 {a['p50_ms']:8.1f} ms  p99 {a['p99_ms']:8.1f} ms  errors {a['errors']}")
    print(
        f"  with large   p50 {c['p50_ms']:8.1f} ms  p99 {c['p99_ms']:8.1f} ms  errors {c['errors']}  "
        f"(p99 {c['p99_ms'] / a['p99_ms']:.1f}x alone)"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--passages", type=int, default=100_000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--queries", type=int, default=2000, help="queries for the search throughput runs")
    parser.add_argument("--requests", type=int, default=400, help="HTTP requests per server run")
    parser.add_argument("--per-request", type=int, default=1, help="queries per HTTP request")
    parser.add_argument(
        "--workers",
        type=int,
        default=0,
        help="worker processes of the multi-worker designs (default: the number of CPUs)",
    )
    parser.add_argument("--server-only", action="store_true", help="only the server designs (builds the index)")
    parser.add_argument("--dense-passages", type=int, default=0, help="also time dense retrieval on this many passages")
    parser.add_argument("--json", default=None, help="also write the numbers to this file")
    parser.add_argument(
        "--contention",
        action="store_true",
        help="also: p99 of small requests while 4 clients send the largest requests the server's default limits allow",
    )
    parser.add_argument("--contention-only", action="store_true", help="only the contention run (builds the index)")
    args = parser.parse_args()

    print(f"machine: {os.cpu_count()} CPUs, torch threads {__import__('torch').get_num_threads()}")
    (passages, queries, test_examples, description), corpus_s = timed(make_corpus, args.passages, args.seed)
    print(f"corpus: {len(passages)} passages, {description}, generated in {corpus_s:.1f} s; {len(queries)} queries")
    results: dict = {}
    with tempfile.TemporaryDirectory() as tmp:
        index_dir = Path(tmp) / "bm25"
        if args.contention_only:
            BM25Retriever.from_passages(passages).save(index_dir)
            report_contention(bench_contention(index_dir, queries, args.requests), results)
            if args.json:
                Path(args.json).write_text(json.dumps(results, indent=2))
            return
        if args.server_only:
            BM25Retriever.from_passages(passages).save(index_dir)
            workers = args.workers or os.cpu_count() or 2
            rows = bench_designs(index_dir, queries, args.requests, args.per_request, workers)
            results["server"] = rows
            report_designs(rows, args, workers)
            if args.json:
                Path(args.json).write_text(json.dumps(results, indent=2))
            return
        bm25 = bench_bm25(passages, queries, args.queries, index_dir)
        retriever = bm25.pop("retriever")
        results["bm25"] = bm25
        print("\nBM25 (k=3)                      stratarl     bm25s     ratio")
        print(
            f"  build (s)                    {bm25['build_s']:9.2f} {bm25['bm25s_build_s']:9.2f}   {bm25['bm25s_build_s'] / bm25['build_s']:5.1f}x faster"
        )
        print(
            f"  batched search (queries/s)   {bm25['batched_qps']:9.0f} {bm25['bm25s_batched_qps']:9.0f}   {bm25['batched_qps'] / bm25['bm25s_batched_qps']:5.1f}x"
        )
        print(f"  one query per call (q/s)     {bm25['single_qps']:9.0f}")
        print(f"  save {bm25['save_s']:.2f} s, load {bm25['load_s']:.2f} s")
        if test_examples:
            from stratarl.data.retrievability import hop_recall

            recall = hop_recall(test_examples[:1000], retriever, ks=(1, 3))["all"]
            results["hop_recall"] = recall
            print(
                f"  hop recall on {recall['hops']} synthetic test hops: top1 {recall['top1']:.3f}, top3 {recall['top3']:.3f}"
            )

        workers = args.workers or os.cpu_count() or 2
        rows = bench_designs(index_dir, queries, args.requests, args.per_request, workers)
        results["server"] = rows
        report_designs(rows, args, workers)
        if args.contention:
            report_contention(bench_contention(index_dir, queries, args.requests), results)

    if args.dense_passages:
        dense = bench_dense(passages, queries, args.dense_passages)
        results["dense"] = dense
        print(
            f"\ndense (all-MiniLM-L6-v2, CPU): {dense['passages']} passages encoded at {dense['encode_passages_per_s']:.0f}/s; "
            f"search {dense['batched_qps']:.0f} queries/s (batched, encoding included)"
        )
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
