"""Word-level tokenizer + tiny model vs the SmolLM2 tokenizer + tiny model, on the synthetic task.

Measures, on one seeded synthetic KB:
- vocabulary size of ``word_tokenizer_for_kb`` (small and medium KBs; ``--large`` adds large);
- tokens per passage and per prompt (chat template applied) for both tokenizers;
- forward+backward time of one training step over the same trajectories (prompt, one
  search turn + 3-passage observation per hop, answer), tokenized by each tokenizer:
  the word-level model (default sizes of ``build_word_model``: 128 wide, 4 layers), the
  word-level model at the tiny sizes (64 wide, 2 layers), and ``build_tiny_model`` over
  the SmolLM2 vocabulary (64 wide, 2 layers; the baseline, measured in the same run).

    python benchmarks/bench_wordlevel.py [--batch 8] [--repeats 5] [--threads 1] [--large]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from stratarl.data.synth import generate_knowledge_base
from stratarl.data.wordlevel import build_word_model, unknown_words, word_tokenizer_for_kb
from stratarl.models import build_tiny_model, load_tokenizer
from stratarl.rollout.parsing import information_observation
from stratarl.rollout.prompt import encode_prompt


def trajectories(kb, count: int) -> list[tuple[str, str]]:
    """(question, response text) pairs shaped like a correct demonstration."""
    by_id = {p.id: p for p in kb.passages}
    out = []
    for i, example in enumerate(kb.train[:count]):
        response = ""
        for j, hop in enumerate(example.metadata["hops"]):
            hits = [
                by_id[hop["passage_id"]],
                kb.passages[(i * 7 + j) % len(kb.passages)],
                kb.passages[(i * 13 + j + 1) % len(kb.passages)],
            ]
            response += f"<think> I need to look this up. </think>\n<search> {hop['query']} </search>"
            response += information_observation(hits)
        response += f"<think> I have the answer. </think>\n<answer> {example.golden_answers[0]} </answer>"
        out.append((example.question, response))
    return out


def batch_ids(tokenizer, pairs) -> torch.Tensor:
    rows = [
        encode_prompt(tokenizer, q) + tokenizer(r, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        for q, r in pairs
    ]
    width = max(len(r) for r in rows)
    return torch.tensor([r + [tokenizer.pad_token_id] * (width - len(r)) for r in rows])


def step_time(model, ids: torch.Tensor, repeats: int) -> float:
    """Median seconds of one forward (loss on every token) + backward."""
    model.train()
    times = []
    for _ in range(repeats + 1):  # the first call warms up
        model.zero_grad(set_to_none=True)
        start = time.perf_counter()
        model(input_ids=ids, labels=ids).loss.backward()
        times.append(time.perf_counter() - start)
    return statistics.median(times[1:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--large", action="store_true", help="also build the vocabulary of a large KB (slow)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    print("vocabulary of word_tokenizer_for_kb (seed 0):")
    for size in ["small", "medium"] + (["large"] if args.large else []):
        kb = generate_knowledge_base(seed=0, size=size)
        start = time.perf_counter()
        tok = word_tokenizer_for_kb(kb)
        built = time.perf_counter() - start
        lower = len(word_tokenizer_for_kb(kb, lowercase=True))
        print(
            f"  {size:6s} {len(kb.passages):6d} passages: {len(tok):6d} tokens ({lower} lower-cased), "
            f"built in {built:.1f} s"
        )

    kb = generate_knowledge_base(seed=0, size="small")
    word, smol = word_tokenizer_for_kb(kb), load_tokenizer()
    assert not any(unknown_words(word, p.contents) for p in kb.passages)
    print(f"\ntokens per text, small KB (word-level vocab {len(word)}, SmolLM2 vocab {len(smol)}):")
    print(f"  {'':28s} {'word':>7s} {'smollm2':>8s} {'ratio':>6s}")
    samples = {
        "passage (mean)": [p.contents for p in kb.passages],
        "question (mean)": [e.question for e in kb.train],
    }
    for name, texts in samples.items():
        w = statistics.mean(len(word(t, add_special_tokens=False)["input_ids"]) for t in texts)
        s = statistics.mean(len(smol(t, add_special_tokens=False)["input_ids"]) for t in texts)
        print(f"  {name:28s} {w:7.1f} {s:8.1f} {s / w:6.2f}")
    w = statistics.mean(len(encode_prompt(word, e.question)) for e in kb.train)
    s = statistics.mean(len(encode_prompt(smol, e.question)) for e in kb.train)
    print(f"  {'prompt, chat template (mean)':28s} {w:7.1f} {s:8.1f} {s / w:6.2f}")

    pairs = trajectories(kb, args.batch)
    word_ids, smol_ids = batch_ids(word, pairs), batch_ids(smol, pairs)
    models = [
        ("word-level 128x4 (default)", build_word_model(word), word_ids),
        ("word-level 64x2", build_word_model(word, hidden_size=64, num_layers=2, intermediate_size=128), word_ids),
        ("smollm2-vocab tiny 64x2", build_tiny_model(smol), smol_ids),
    ]
    print(f"\nforward+backward, batch {args.batch} trajectories, {args.threads} thread(s), median of {args.repeats}:")
    results = []
    for name, model, ids in models:
        params = sum(p.numel() for p in model.parameters()) / 1e6
        seconds = step_time(model, ids, args.repeats)
        results.append(seconds)
        print(f"  {name:28s} {params:6.2f} M params, {ids.shape[1]:5d} tokens/row: {seconds * 1e3:8.1f} ms")
    baseline = results[-1]
    for (name, _, _), seconds in zip(models[:-1], results[:-1]):
        print(f"  speed-up of {name} over the smollm2-vocab tiny model: {baseline / seconds:.2f}x")


if __name__ == "__main__":
    main()
