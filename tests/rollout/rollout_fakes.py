"""Test doubles for the rollout engine: a deterministic in-memory retriever, a failing
one, and a scripted generator. Imported by the tests of this folder (rootdir on sys.path)."""

from __future__ import annotations

from collections.abc import Sequence

from stratarl.retrieval.base import Passage
from stratarl.rollout.generation import Generation, Generator, SamplingParams, StopMatcher


class DictRetriever:
    """Deterministic: passage i of query q has id f"{q}#{i}"; records every call."""

    def __init__(self, text_words: int = 5):
        self.calls: list[tuple[list[str], int]] = []
        self.text_words = text_words

    def search(self, queries: list[str], k: int) -> list[list[Passage]]:
        self.calls.append((list(queries), k))
        body = " ".join(["fact"] * self.text_words)
        return [[Passage(f"{q}#{i}", f'"Title {i} of {q}"\n{body} {i}.') for i in range(k)] for q in queries]


class FailingRetriever:
    def __init__(self, error: Exception):
        self.error = error

    def search(self, queries, k):
        raise self.error


class ScriptedGenerator(Generator):
    """Plays a fixed list of turn texts per prompt, honouring per-row budgets and stop strings.

    Rows are matched to scripts by their prompt prefix; turn n of a row plays
    ``scripts[prompt][n]``. A text ending in EOS_MARK ends with the EOS token. The
    log-prob of the j-th token of a turn is -(j + 1) / 100, so tests can check where
    each log-prob landed.
    """

    EOS_MARK = "<EOS>"

    def __init__(self, tokenizer, scripts: dict[tuple[int, ...], list[str]]):
        self.tokenizer = tokenizer
        self.scripts = scripts
        self.turns: dict[tuple[int, ...], int] = dict.fromkeys(scripts, 0)
        self.calls: list[dict] = []

    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams, max_new_tokens=None):
        budgets = list(max_new_tokens) if max_new_tokens is not None else [params.max_new_tokens] * len(prompts)
        self.calls.append({"batch": len(prompts), "budgets": budgets, "inputs": [list(p) for p in prompts]})
        matcher = StopMatcher(self.tokenizer, params.stop_strings)
        results = []
        for prompt, budget in zip(prompts, budgets):
            key = next(k for k in self.scripts if tuple(prompt[: len(k)]) == k)
            text = self.scripts[key][self.turns[key]]
            self.turns[key] += 1
            eos = text.endswith(self.EOS_MARK)
            ids = self.tokenizer(text.removesuffix(self.EOS_MARK), add_special_tokens=False)["input_ids"]
            ids = list(ids) + ([self.tokenizer.eos_token_id] if eos else [])
            out, reason, stop = [], "length", None
            for token in ids[:budget]:
                out.append(token)
                if token == self.tokenizer.eos_token_id:
                    reason = "eos"
                    break
                stop = matcher.check(out)
                if stop is not None:
                    reason = "stop"
                    break
            if reason == "stop" and stop in params.eos_after and len(out) < budget:
                out.append(self.tokenizer.eos_token_id)
            results.append(Generation(out, [-(j + 1) / 100 for j in range(len(out))], reason, stop))
        return results
