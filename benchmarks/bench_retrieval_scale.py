"""Wikipedia-scale retrieval on one machine: BM25 and approximate dense search, measured and projected to 21M.

Search-R1 retrieves from the 2018 Wikipedia dump: 21,015,324 passages of 100 words. This benchmark
generates seeded synthetic passages of that shape (a Zipfian vocabulary of ~1.5M word types, exponent
1.07, whose top ranks are the English stop words, so posting-list lengths resemble real text), streams
them to a Search-R1 corpus jsonl, and measures:

BM25 (`build_bm25_index`, served with ``load(mmap=True, mmap_corpus=True)``), per corpus size:
  build time, index size on disk, peak RSS of the build, RSS after load and after the queries
  (anonymous = RAM the process owns; file = mapped pages the OS may drop), q/s single and batched.
  Each step runs in its own process, so peak RSS is that step's. Then a fit: size on disk and memory
  linear in passages (a + b·N, least squares), build time a power law (c·N^p, log-log fit), and the
  projection to 21M with whether it fits in 24 GB.

Dense (faiss IVF / HNSW vs exact search, synthetic embeddings, stated as such): a clustered Gaussian
mixture in 384 dimensions (MiniLM's), L2-normalised; queries are passages plus noise. recall@3 against
exact inner-product search and q/s. Plus the real MiniLM encoder's passages/s on a few hundred synthetic
passages, to project the time to embed 21M passages.

    python benchmarks/bench_retrieval_scale.py                                  # BM25 100k..1M, dense 1M
    python benchmarks/bench_retrieval_scale.py --bm25-sizes 100000,300000,1000000,5000000
    python benchmarks/bench_retrieval_scale.py --skip-bm25 --dense-passages 1000000

Large files go under --workdir (default /tmp/scale-bench); pass --keep to keep them. A build stops when
the machine's available memory falls below --min-free-gib (default 4).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import resource
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np

WIKI_PASSAGES = 21_015_324  # Search-R1's wiki-18 corpus (DPR's 100-word splits)
BUDGET_GB = 24.0
ROOT = Path(__file__).resolve().parents[1]


# ----------------------------------------------------------------------------- synthetic corpus
def make_vocabulary(num_types: int, seed: int) -> list[str]:
    """Rank-ordered word types: the English stop words first (the most frequent words of real text), then
    distinct random lower-case words of 2-14 letters (mean ~7)."""
    from bm25s.stopwords import STOPWORDS_EN

    rng = np.random.default_rng(seed)
    words = list(dict.fromkeys(w for w in STOPWORDS_EN if w.isalpha()))
    seen = set(words)
    letters = np.frombuffer(b"abcdefghijklmnopqrstuvwxyz", dtype=np.uint8)
    # English letter frequencies, so stems and suffixes look like English (the stemmer strips -s, -ing, ...).
    freq = np.array(
        [
            8.2,
            1.5,
            2.8,
            4.3,
            12.7,
            2.2,
            2.0,
            6.1,
            7.0,
            0.15,
            0.77,
            4.0,
            2.4,
            6.7,
            7.5,
            1.9,
            0.1,
            6.0,
            6.3,
            9.1,
            2.8,
            1.0,
            2.4,
            0.15,
            2.0,
            0.07,
        ]
    )
    freq /= freq.sum()
    while len(words) < num_types:
        need = num_types - len(words)
        lengths = np.clip(rng.poisson(6.5, size=need + need // 10), 2, 14)
        flat = letters[rng.choice(26, size=int(lengths.sum()), p=freq)].tobytes().decode("ascii")
        position = 0
        for length in lengths.tolist():
            word = flat[position : position + length]
            position += length
            if word not in seen:
                seen.add(word)
                words.append(word)
    return words[:num_types]


def generate_corpus(
    path: Path, num_passages: int, *, num_types: int, zipf: float, words_per_passage: int, seed: int
) -> dict:
    """Write ``num_passages`` Search-R1 lines to ``path``: title (1-3 content words) + ~100 Zipfian words."""
    rng = np.random.default_rng(seed + 1)
    vocab = make_vocabulary(num_types, seed)
    num_stop = 150
    cdf = np.cumsum(1.0 / np.arange(1, num_types + 1, dtype=np.float64) ** zipf)
    cdf /= cdf[-1]
    encoded = [(w + " ").encode("ascii") for w in vocab]
    word_len = np.fromiter((len(w) for w in encoded), dtype=np.int64, count=num_types)
    word_start = np.zeros(num_types, dtype=np.int64)
    np.cumsum(word_len[:-1], out=word_start[1:])
    word_bytes = np.frombuffer(b"".join(encoded), dtype=np.uint8)
    chunk = 100_000
    tokens = 0
    with open(path, "w", encoding="ascii") as out:
        for start in range(0, num_passages, chunk):
            n = min(chunk, num_passages - start)
            lengths = np.clip(np.rint(rng.normal(words_per_passage, 4, size=n)), 50, 150).astype(np.int64)
            ids = np.searchsorted(cdf, rng.random(int(lengths.sum())), side="right").clip(max=num_types - 1)
            tokens += len(ids)
            # Gather every word's bytes ("word ") for the whole chunk at once.
            lens = word_len[ids]
            ends = np.cumsum(lens)
            src = np.arange(int(ends[-1]), dtype=np.int64) - np.repeat(ends - lens - word_start[ids], lens)
            text = word_bytes[src].tobytes().decode("ascii")
            passage_end = np.cumsum(lens)[np.cumsum(lengths) - 1].tolist()
            title_ids = np.searchsorted(cdf, rng.uniform(cdf[num_stop], 1.0, size=(n, 3)), side="right").clip(
                max=num_types - 1
            )
            title_words = rng.integers(1, 4, size=n).tolist()
            lines, begin = [], 0
            for i in range(n):
                end = passage_end[i]
                title = " ".join(vocab[t] for t in title_ids[i, : title_words[i]].tolist()).capitalize()
                lines.append(f'{{"id": "{start + i}", "contents": "\\"{title}\\"\\n{text[begin : end - 1]}"}}\n')
                begin = end
            out.write("".join(lines))
    return {"passages": num_passages, "tokens": tokens, "word_types": num_types, "zipf": zipf}


# ----------------------------------------------------------------------------- measuring helpers
def rss_gib() -> dict:
    """Current and peak resident memory of this process, GiB: anonymous (owned) and file-backed (mapped)."""
    fields = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "VmHWM", "RssAnon", "RssFile"):
            fields[key] = int(value.split()[0]) / 2**20
    return {"rss": fields["VmRSS"], "peak": fields["VmHWM"], "anon": fields["RssAnon"], "file": fields["RssFile"]}


def cpu_s() -> float:
    """CPU seconds (user + system) this process has used: unlike wall time, barely affected by other load."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def available_gib() -> float:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) / 2**20
    return float("inf")


PEAK_ANON_GIB = [0.0]  # highest anonymous RSS seen by the guard (sampled every 0.2 s)


def start_memory_guard(min_free_gib: float) -> None:
    """Kill this process (exit 3) if the machine's available memory falls below min_free_gib; track peak RssAnon.

    (VmHWM also counts the pages of memory-mapped files the build writes, which the OS can drop; the
    anonymous peak is the memory the build really needs.)"""

    def watch() -> None:
        while True:
            if available_gib() < min_free_gib:
                print(f"ABORT: available memory below {min_free_gib} GiB", file=sys.stderr, flush=True)
                os._exit(3)
            PEAK_ANON_GIB[0] = max(PEAK_ANON_GIB[0], rss_gib()["anon"])
            time.sleep(0.2)

    threading.Thread(target=watch, daemon=True).start()


def dir_size_gib(path: Path) -> float:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file()) / 2**30


def child(mode: str, *args: str, min_free_gib: float = 4.0) -> dict:
    """Run one measured step in a fresh process; returns the JSON it prints last."""
    command = [sys.executable, __file__, "--min-free-gib", str(min_free_gib), "--_child", mode, *args]
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.run(command, capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        raise RuntimeError(f"{mode} {args} failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def child_main(mode: str, args: list[str], min_free_gib: float) -> dict:
    start_memory_guard(min_free_gib)
    if mode == "generate":
        path, n, types, zipf, words, seed = args
        t0 = time.perf_counter()
        info = generate_corpus(
            Path(path), int(n), num_types=int(types), zipf=float(zipf), words_per_passage=int(words), seed=int(seed)
        )
        return {**info, "seconds": time.perf_counter() - t0, "corpus_gib": Path(path).stat().st_size / 2**30}
    if mode == "build":
        from stratarl.retrieval.bm25_build import build_bm25_index

        corpus, out = args
        t0, c0 = time.perf_counter(), cpu_s()
        build_bm25_index(corpus, out)
        seconds = time.perf_counter() - t0
        return {
            "seconds": seconds,
            "cpu_s": cpu_s() - c0,
            "peak_rss_gib": rss_gib()["peak"],
            "peak_anon_gib": PEAK_ANON_GIB[0],
            "index_gib": dir_size_gib(Path(out)),
            "matrix_gib": sum(
                (Path(out) / f).stat().st_size
                for f in ("data.csc.index.npy", "indices.csc.index.npy", "indptr.csc.index.npy")
            )
            / 2**30,
        }
    if mode == "build_in_memory":
        from stratarl.retrieval.bm25 import BM25Retriever

        corpus, out = args
        t0 = time.perf_counter()
        BM25Retriever.from_corpus(corpus).save(out)
        return {
            "seconds": time.perf_counter() - t0,
            "peak_rss_gib": rss_gib()["peak"],
            "peak_anon_gib": PEAK_ANON_GIB[0],
        }
    if mode == "serve":
        from stratarl.retrieval.bm25 import BM25Retriever

        index, num_queries, seed = args
        t0 = time.perf_counter()
        retriever = BM25Retriever.load(index, mmap=True, mmap_corpus=True)
        load_s = time.perf_counter() - t0
        after_load = rss_gib()
        rng = np.random.default_rng(int(seed))
        queries = []
        for i in rng.integers(0, len(retriever), size=int(num_queries)).tolist():  # 3-5 words of a passage
            words = retriever.passages[i].text.split()
            queries.append(" ".join(rng.choice(words, size=int(rng.integers(3, 6)), replace=False)))
        single = queries[: max(10, len(queries) // 4)]
        t0, c0 = time.perf_counter(), cpu_s()
        for q in single:
            retriever.search([q], 3)
        single_qps, single_cpu_qps = len(single) / (time.perf_counter() - t0), len(single) / (cpu_s() - c0)
        t0, c0 = time.perf_counter(), cpu_s()
        for start in range(0, len(queries), 64):
            retriever.search(queries[start : start + 64], 3)
        batched_qps, batched_cpu_qps = len(queries) / (time.perf_counter() - t0), len(queries) / (cpu_s() - c0)
        after = rss_gib()
        return {
            "load_s": load_s,
            "anon_after_load_gib": after_load["anon"],
            "file_after_load_gib": after_load["file"],
            "anon_after_queries_gib": after["anon"],
            "file_after_queries_gib": after["file"],
            "peak_gib": after["peak"],
            "single_qps": single_qps,
            "batched_qps": batched_qps,
            "single_qps_per_cpu_s": single_cpu_qps,
            "batched_qps_per_cpu_s": batched_cpu_qps,
        }
    if mode == "encode":
        import torch

        from stratarl.retrieval.corpus import iter_corpus
        from stratarl.retrieval.encoder import TextEncoder, read_encoder_settings

        corpus, n = args
        torch.set_num_threads(max(1, os.cpu_count() or 1))
        texts = [p.contents for _, p in zip(range(int(n)), iter_corpus(corpus))]
        encoder = TextEncoder(read_encoder_settings(None), device="cpu", batch_size=64)
        encoder.encode(texts[:64])  # warm-up
        t0 = time.perf_counter()
        encoder.encode(texts)
        seconds = time.perf_counter() - t0
        return {"passages": len(texts), "seconds": seconds, "passages_per_s": len(texts) / seconds}
    if mode == "dense":
        return dense_child(*args)
    raise SystemExit(f"unknown child mode {mode}")


# ----------------------------------------------------------------------------- dense (synthetic embeddings)
def synthetic_embeddings(n: int, dim: int, clusters: int, seed: int) -> np.ndarray:
    """A clustered Gaussian mixture on the unit sphere (float32 [n, dim]): point = centre + N(0, I/dim)
    (noise of norm ~1 around a unit centre: cosine ~0.7 to it, as neighbours of a real encoder), normalised;
    cluster sizes fall off as 1/rank^0.8, as topics do."""
    rng = np.random.default_rng(seed)
    centres = rng.standard_normal((clusters, dim)).astype(np.float32)
    centres /= np.linalg.norm(centres, axis=1, keepdims=True)
    weights = 1.0 / np.arange(1, clusters + 1) ** 0.8
    assignment = rng.choice(clusters, size=n, p=weights / weights.sum())
    out = np.empty((n, dim), dtype=np.float32)
    for start in range(0, n, 100_000):
        stop = min(n, start + 100_000)
        block = centres[assignment[start:stop]] + rng.standard_normal((stop - start, dim)).astype(
            np.float32
        ) / math.sqrt(dim)
        out[start:stop] = block / np.linalg.norm(block, axis=1, keepdims=True)
    return out


def dense_child(n: str, num_queries: str, seed: str, configs: str, threads: str) -> dict:
    import faiss
    import torch

    from stratarl.retrieval.ann import DenseIndexSettings, build_faiss_index, set_search_params

    n, num_queries, seed, threads = int(n), int(num_queries), int(seed), int(threads)
    faiss.omp_set_num_threads(threads)
    torch.set_num_threads(threads)
    dim = 384
    t0 = time.perf_counter()
    emb = synthetic_embeddings(n, dim, clusters=max(16, n // 500), seed=seed)
    gen_s = time.perf_counter() - t0
    rng = np.random.default_rng(seed + 7)
    picks = rng.integers(0, n, size=num_queries)
    queries = emb[picks] + 0.6 * rng.standard_normal((num_queries, dim)).astype(np.float32) / math.sqrt(dim)
    queries /= np.linalg.norm(queries, axis=1, keepdims=True)
    # Exact top-3 (the reference) with torch, chunked as DenseRetriever does.
    e, q = torch.from_numpy(emb), torch.from_numpy(queries)
    t0 = time.perf_counter()
    best = None
    for start in range(0, n, 1 << 18):
        s, i = torch.topk(q @ e[start : start + (1 << 18)].T, 3, dim=1)
        i = i + start
        if best is not None:
            s, pick = torch.topk(torch.cat([best[0], s], 1), 3, dim=1)
            i = torch.gather(torch.cat([best[1], i], 1), 1, pick)
        best = (s, i)
    exact_s = time.perf_counter() - t0
    exact = best[1].numpy()
    results = {
        "passages": n,
        "queries": num_queries,
        "generate_s": gen_s,
        "exact_qps": num_queries / exact_s,
        "exact_memory_gib": emb.nbytes / 2**30,
        "indexes": [],
    }
    built = {}  # configs that differ only in nprobe / ef_search share one index
    for config in json.loads(configs):
        settings = DenseIndexSettings(**config)
        key = tuple(sorted((k, v) for k, v in config.items() if k not in ("nprobe", "ef_search")))
        if key not in built:
            t0 = time.perf_counter()
            built = {key: (build_faiss_index(emb, settings), time.perf_counter() - t0)}
        index, build_s = built[key]
        set_search_params(index, settings)
        t0 = time.perf_counter()
        _, found = index.search(queries, 3)
        qps = num_queries / (time.perf_counter() - t0)
        recall = float(np.mean([len(set(a) & set(b)) / 3 for a, b in zip(found.tolist(), exact.tolist())]))
        size = faiss.serialize_index(index).nbytes / 2**30
        results["indexes"].append(
            {
                **config,
                "build_s": build_s,
                "qps": qps,
                "recall_at_3": recall,
                "index_gib": size,
                "bytes_per_vector": size * 2**30 / n,
            }
        )
    return results


# ----------------------------------------------------------------------------- fits and report
def fit_linear(n: np.ndarray, y: np.ndarray) -> tuple[float, float]:
    """Least-squares y = a + b·n."""
    b, a = np.polyfit(n, y, 1)
    return float(a), float(b)


def fit_power(n: np.ndarray, y: np.ndarray) -> tuple[float, float]:
    """Least-squares on logs: y = c·n^p."""
    p, log_c = np.polyfit(np.log(n), np.log(y), 1)
    return float(math.exp(log_c)), float(p)


def run_bm25(args: argparse.Namespace, work: Path) -> list[dict]:
    rows = []
    for n in args.bm25_sizes:
        corpus, index = work / f"corpus-{n}.jsonl", work / f"bm25-{n}"
        print(f"[bm25 {n:,}] generating corpus ...", flush=True)
        gen = child(
            "generate",
            str(corpus),
            str(n),
            str(args.word_types),
            str(args.zipf),
            str(args.words),
            str(args.seed),
            min_free_gib=args.min_free_gib,
        )
        print(
            f"[bm25 {n:,}] generated {gen['tokens']:,} words in {gen['seconds']:.0f} s ({gen['corpus_gib']:.2f} GiB); building ...",
            flush=True,
        )
        build = child("build", str(corpus), str(index), min_free_gib=args.min_free_gib)
        row = {"passages": n, "gen": gen, "build": build}
        if n <= args.compare_in_memory_up_to:
            row["in_memory"] = child(
                "build_in_memory", str(corpus), str(work / f"bm25-mem-{n}"), min_free_gib=args.min_free_gib
            )
            row["in_memory"].update(streamed_seconds=build["seconds"], streamed_peak_rss_gib=build["peak_rss_gib"])
            shutil.rmtree(work / f"bm25-mem-{n}", ignore_errors=True)
        print(
            f"[bm25 {n:,}] built in {build['seconds']:.0f} s, peak RSS {build['peak_rss_gib']:.2f} GiB; serving ...",
            flush=True,
        )
        row["serve"] = child("serve", str(index), str(args.queries), str(args.seed), min_free_gib=args.min_free_gib)
        rows.append(row)
        print(json.dumps(row), flush=True)
        if not args.keep:
            corpus.unlink(missing_ok=True)
            shutil.rmtree(index, ignore_errors=True)
    return rows


def report_bm25(rows: list[dict]) -> None:
    print("\n## BM25 (build_bm25_index; served with load(mmap=True, mmap_corpus=True))")
    print(
        "| passages | corpus GiB | build s wall (CPU) | build peak anon RSS GiB (VmHWM) | index GiB (matrix) | load s |"
        " anon RSS load / after q GiB | mapped RSS after q GiB | q/s single wall (per CPU-s) | q/s batched 64 wall (per CPU-s) |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        b, s = r["build"], r["serve"]
        anon = f"{b['peak_anon_gib']:.2f}" if "peak_anon_gib" in b else "-"
        cpu = f"{b['cpu_s']:.0f}" if "cpu_s" in b else "-"
        per_cpu = {
            key: f"{s[key + '_per_cpu_s']:.1f}" if key + "_per_cpu_s" in s else "-"
            for key in ("single_qps", "batched_qps")
        }
        print(
            f"| {r['passages']:,} | {r['gen']['corpus_gib']:.2f} | {b['seconds']:.0f} ({cpu}) | {anon} ({b['peak_rss_gib']:.2f}) | "
            f"{b['index_gib']:.2f} ({b['matrix_gib']:.2f}) | {s['load_s']:.1f} | {s['anon_after_load_gib']:.2f} / "
            f"{s['anon_after_queries_gib']:.2f} | {s['file_after_queries_gib']:.2f} | {s['single_qps']:.1f} ({per_cpu['single_qps']}) | "
            f"{s['batched_qps']:.1f} ({per_cpu['batched_qps']}) |"
        )
    for r in rows:
        if "in_memory" in r:
            m = r["in_memory"]
            print(
                f"in-memory build (BM25Retriever.from_corpus + save) at {r['passages']:,}: {m['seconds']:.0f} s, "
                f"peak RSS {m['peak_rss_gib']:.2f} GiB; streamed build_bm25_index in the same run: "
                f"{m.get('streamed_seconds', r['build']['seconds']):.0f} s, {m.get('streamed_peak_rss_gib', r['build']['peak_rss_gib']):.2f} GiB"
            )
    if len(rows) < 2:
        return
    # Below one build chunk (250k passages) memory grows with the chunk, and the vocabulary saturates (Heaps'
    # law) by about a million passages: each measure is fitted over the three largest sizes that have it, where
    # costs grow with the passages; counting the vocabulary's growth as linear makes the memory fit conservative.
    big = WIKI_PASSAGES
    print(f"\n## Projection to {big:,} passages (each measure fitted over the three largest sizes that have it)")
    lines = []
    for label, values, kind in (
        ("index on disk GiB", [r["build"]["index_gib"] for r in rows], "linear"),
        ("score matrix GiB (mapped when serving)", [r["build"]["matrix_gib"] for r in rows], "linear"),
        (
            "build peak RSS GiB (VmHWM, counts written index pages)",
            [r["build"]["peak_rss_gib"] for r in rows],
            "linear",
        ),
        ("build peak anon RSS GiB", [r["build"].get("peak_anon_gib") for r in rows], "linear"),
        ("serving anon RSS after queries GiB", [r["serve"]["anon_after_queries_gib"] for r in rows], "linear"),
        ("build seconds (wall)", [r["build"]["seconds"] for r in rows], "power"),
        ("build CPU seconds", [r["build"].get("cpu_s") for r in rows], "power"),
        ("single-query q/s (wall)", [r["serve"]["single_qps"] for r in rows], "power"),
        ("single-query q/s per CPU-second", [r["serve"].get("single_qps_per_cpu_s") for r in rows], "power"),
        ("batched q/s (wall)", [r["serve"]["batched_qps"] for r in rows], "power"),
        ("batched q/s per CPU-second", [r["serve"].get("batched_qps_per_cpu_s") for r in rows], "power"),
    ):
        have = [(r["passages"], v) for r, v in zip(rows, values) if v is not None][-3:]
        if len(have) < 2:
            continue  # too few rows measured it
        n = np.array([x for x, _ in have], dtype=np.float64)
        y = np.array([v for _, v in have], dtype=np.float64)
        label = f"{label} [{', '.join(f'{int(x) // 1000}k' for x in n)}]"
        if kind == "linear":
            a, b = fit_linear(n, y)
            value = a + b * big
            lines.append((label, value, f"linear a + b·N: a={a:.3g}, b={b * 1e6:.3g} per 1M passages"))
        else:
            c, p = fit_power(n, y)
            value = c * big**p
            lines.append((label, value, f"power law c·N^p: p={p:.2f}"))
        print(f"  {label:68s} {value:10.1f}   ({lines[-1][2]})")
    projected = {label.split(" [")[0]: value for label, value, _ in lines}
    serve = projected["serving anon RSS after queries GiB"]
    build = projected["build peak anon RSS GiB"]
    mapped = projected["score matrix GiB (mapped when serving)"]
    print(
        f"  serving: {serve:.1f} GiB owned + up to {mapped:.1f} GiB of mapped index pages (cached by the OS, "
        f"dropped under pressure): {'fits' if serve + mapped < BUDGET_GB else 'owned memory fits; the page cache will thrash' if serve < BUDGET_GB else 'does NOT fit'} in {BUDGET_GB:.0f} GB"
    )
    hours = projected.get("build CPU seconds", projected["build seconds (wall)"]) / 3600
    print(
        f"  build: peak {build:.1f} GiB: {'fits' if build < BUDGET_GB else 'does NOT fit'} in {BUDGET_GB:.0f} GB; "
        f"about {hours:.1f} h of one core (the build is single-threaded)"
    )


def run_dense(args: argparse.Namespace) -> dict:
    configs = [
        {"kind": "ivf", "nlist": args.nlist, "nprobe": 16, "codes": "flat"},
        {"kind": "ivf", "nlist": args.nlist, "nprobe": 64, "codes": "flat"},
        {"kind": "ivf", "nlist": args.nlist, "nprobe": 64, "codes": "sq8"},
        {"kind": "ivf", "nlist": args.nlist, "nprobe": 64, "codes": "pq", "pq_m": 48},
    ]
    print(f"[dense {args.dense_passages:,}] synthetic embeddings, exact vs IVF ...", flush=True)
    out = child(
        "dense",
        str(args.dense_passages),
        str(args.dense_queries),
        str(args.seed),
        json.dumps(configs),
        str(args.threads),
        min_free_gib=args.min_free_gib,
    )
    if args.hnsw_passages:
        print(f"[dense {args.hnsw_passages:,}] HNSW ...", flush=True)
        hnsw = child(
            "dense",
            str(args.hnsw_passages),
            str(args.dense_queries),
            str(args.seed),
            json.dumps(
                [{"kind": "hnsw", "hnsw_m": 32, "ef_search": 64}, {"kind": "hnsw", "hnsw_m": 32, "ef_search": 128}]
            ),
            str(args.threads),
            min_free_gib=args.min_free_gib,
        )
        out["hnsw"] = hnsw
    return out


def report_dense(out: dict, encode: dict | None) -> None:
    print("\n## Dense, SYNTHETIC embeddings (clustered Gaussian mixture, 384-d, normalised; queries near passages)")
    print(
        f"exact (torch matmul + topk): {out['exact_qps']:.0f} q/s over {out['passages']:,} passages, "
        f"{out['exact_memory_gib']:.2f} GiB of float32 embeddings"
    )
    print(
        "| passages | index | params | build s | recall@3 vs exact | q/s (batch of queries) | index GiB | bytes/vector | 21M projected GiB |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for block in [out] + ([out["hnsw"]] if "hnsw" in out else []):
        for r in block["indexes"]:
            params = ", ".join(
                f"{k}={v}" for k, v in r.items() if k in ("nlist", "nprobe", "codes", "pq_m", "hnsw_m", "ef_search")
            )
            print(
                f"| {block['passages']:,} | {r['kind']} | {params} | {r['build_s']:.0f} | {r['recall_at_3']:.3f} | {r['qps']:.0f} | "
                f"{r['index_gib']:.2f} | {r['bytes_per_vector']:.0f} | {r['bytes_per_vector'] * WIKI_PASSAGES / 2**30:.1f} |"
            )
    print(
        f"exact float32 at 21M: {WIKI_PASSAGES * 384 * 4 / 2**30:.1f} GiB (does NOT fit in {BUDGET_GB:.0f} GB); "
        f"float16: {WIKI_PASSAGES * 384 * 2 / 2**30:.1f} GiB"
    )
    if encode:
        rate = encode["passages_per_s"]
        print(
            f"real MiniLM encoder (CPU, this machine): {rate:.1f} passages/s over {encode['passages']} passages -> "
            f"{WIKI_PASSAGES / rate / 3600:.0f} h for 21M passages (use a GPU: stratarl index build --kind dense --device cuda)"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--bm25-sizes", default="100000,300000,1000000", help="comma-separated passage counts")
    parser.add_argument("--word-types", type=int, default=1_500_000)
    parser.add_argument("--zipf", type=float, default=1.07)
    parser.add_argument("--words", type=int, default=100, help="mean words per passage")
    parser.add_argument("--queries", type=int, default=256)
    parser.add_argument(
        "--compare-in-memory-up-to",
        type=int,
        default=300_000,
        help="also time the in-memory build (from_corpus + save) up to this size",
    )
    parser.add_argument("--dense-passages", type=int, default=1_000_000)
    parser.add_argument("--dense-queries", type=int, default=1000)
    parser.add_argument("--nlist", type=int, default=1024)
    parser.add_argument(
        "--hnsw-passages", type=int, default=100_000, help="HNSW builds slowly on few cores; 0 skips it"
    )
    parser.add_argument(
        "--encoder-passages", type=int, default=256, help="real MiniLM speed on this many passages; 0 skips"
    )
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--skip-bm25", action="store_true")
    parser.add_argument("--skip-dense", action="store_true")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--workdir", default="/tmp/scale-bench")
    parser.add_argument("--keep", action="store_true", help="keep the generated corpora and indexes")
    parser.add_argument("--min-free-gib", type=float, default=4.0)
    parser.add_argument(
        "--report-json",
        nargs="+",
        metavar="LOG",
        help="only print the BM25 report from the row lines of earlier runs' output (last row per size wins)",
    )
    parser.add_argument("--_child", nargs="+", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args._child:
        print(json.dumps(child_main(args._child[0], args._child[1:], args.min_free_gib)))
        return
    if args.report_json:
        by_size = {}
        for log in args.report_json:
            for line in Path(log).read_text().splitlines():
                if line.startswith('{"passages"'):
                    row = json.loads(line)
                    by_size[row["passages"]] = {**by_size.get(row["passages"], {}), **row}  # keep older extra fields
        report_bm25([by_size[n] for n in sorted(by_size)])
        return
    args.bm25_sizes = [int(x) for x in args.bm25_sizes.split(",") if x]
    work = Path(args.workdir)
    work.mkdir(parents=True, exist_ok=True)
    print(f"CPU cores: {os.cpu_count()}, available memory {available_gib():.1f} GiB")
    rows = [] if args.skip_bm25 else run_bm25(args, work)
    dense = None if args.skip_dense else run_dense(args)
    encode = None
    if not args.skip_dense and args.encoder_passages:
        corpus = work / "corpus-encode.jsonl"
        child(
            "generate",
            str(corpus),
            str(args.encoder_passages),
            "200000",
            str(args.zipf),
            str(args.words),
            str(args.seed),
        )
        encode = child("encode", str(corpus), str(args.encoder_passages), min_free_gib=args.min_free_gib)
        corpus.unlink(missing_ok=True)
    if rows:
        report_bm25(rows)
    if dense:
        report_dense(dense, encode)


if __name__ == "__main__":
    main()
