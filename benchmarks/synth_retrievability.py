"""Synthetic knowledge base: generation speed and BM25 retrievability of every hop.

    python benchmarks/synth_retrievability.py                 # medium (~10k passages)
    python benchmarks/synth_retrievability.py --size large    # ~100k passages

Prints (1) generation and write time, (2) BM25 recall@1/@3 of each hop's passage
with that hop's query (target: top-3 >= 0.90 for every group), and (3) the same
with the whole question as the query, the baseline a searcher gets without
decomposing a multi-hop question (later hops should be far lower: the benchmark
rewards multi-step search).
"""

from __future__ import annotations

import argparse
import dataclasses
import tempfile
import time

import stratarl.rollout.prompt  # noqa: F401  imported up front (pulls in torch) so "write" times the write alone
from stratarl.data.retrievability import format_recall_table, hop_recall
from stratarl.data.synth import generate_knowledge_base, write_synthetic_kb
from stratarl.retrieval.bm25 import BM25Retriever


def whole_question_queries(examples):
    """Each hop's query replaced by the full question (the no-decomposition baseline)."""
    out = []
    for example in examples:
        hops = [dict(hop, query=example.question) for hop in example.metadata["hops"]]
        out.append(dataclasses.replace(example, metadata={**example.metadata, "hops": hops}))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", default="medium")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    start = time.perf_counter()
    kb = generate_knowledge_base(seed=args.seed, size=args.size)
    generated = time.perf_counter() - start
    with tempfile.TemporaryDirectory() as tmp:
        start = time.perf_counter()
        write_synthetic_kb(kb, tmp)
        written = time.perf_counter() - start
    print(
        f"size={args.size} seed={args.seed}: {len(kb.passages)} passages, {len(kb.train)} train / "
        f"{len(kb.test)} test questions"
    )
    print(
        f"generate {generated:.2f}s, write {written:.2f}s "
        f"({len(kb.passages) / max(generated, 1e-9):,.0f} passages/s generated)"
    )

    start = time.perf_counter()
    retriever = BM25Retriever.from_passages(kb.passages)
    indexed = time.perf_counter() - start
    examples = kb.train + kb.test
    start = time.perf_counter()
    table = hop_recall(examples, retriever, ks=(1, 3))
    searched = time.perf_counter() - start
    print(f"BM25 index {indexed:.2f}s, {table['all']['hops']} hop searches {searched:.2f}s\n")
    print("Hop query (the query a good searcher writes for that hop):")
    print(format_recall_table(table))
    baseline = hop_recall(whole_question_queries(examples), retriever, ks=(1, 3))
    print("\nBaseline, whole question as the query:")
    print(format_recall_table(baseline))
    worst = min(row["top3"] for row in table.values())
    print(
        f"\nworst group top-3 recall with hop queries: {worst:.3f} (target >= 0.90); "
        f"all-hops top-3 ratio hop-query / whole-question = {table['all']['top3'] / baseline['all']['top3']:.2f}x"
    )


if __name__ == "__main__":
    main()
