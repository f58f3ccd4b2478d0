"""Generation backends over token ids: Hugging Face ``generate`` (the reference) and
our batched KV-cache sampling loop for any Hugging Face causal LM.

Both backends share one contract (``Generator``) and one stop rule, so greedy runs
give identical tokens (a test checks it):

- A row ends at EOS (kept, mask 1: the policy wrote it), at the first stop string,
  or at its token budget, whichever comes first.
- Stop strings are matched on text, not tokens: after each new token the row's
  last few generated tokens are decoded and searched. A stop string may span
  several tokens or end inside one; the row keeps every token up to and including
  the one that completes it (the policy sampled those tokens, so they are what it
  is trained on). Text after the stop inside that last token stays in the response.
- ``eos_after``: after these stop strings (the engine passes ``</answer>``) the
  generator appends the EOS token with its log-probability under the policy, so
  the trainer teaches the policy to stop after answering. This costs one decode
  step for those rows and is skipped when the row's budget is spent.
- Log-probabilities are ``log_softmax(logits / temperature)`` of the chosen token,
  *without* top-p truncation (and at the same temperature for greedy runs). This is
  what a fresh forward pass of the trainer computes with the same temperature
  scaling, so the first PPO step is exactly on-policy.
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal, Protocol

import torch

from stratarl.rollout.parsing import STOP_STRINGS

FinishReason = Literal["stop", "eos", "length"]


@dataclass(frozen=True)
class SamplingParams:
    """How to sample one generation call.

    max_new_tokens: per-row cap (the engine may pass smaller per-row caps).
    temperature: logits are divided by it before sampling and before log-probs.
    top_p: nucleus sampling mass (1.0 = off); does not change the returned log-probs.
    greedy: argmax instead of sampling (log-probs still use ``temperature``).
    stop_strings: a row stops after the token that completes any of them.
    eos_after: stop strings after which EOS is appended with its log-prob.
    """

    max_new_tokens: int = 500
    temperature: float = 1.0
    top_p: float = 1.0
    greedy: bool = False
    stop_strings: tuple[str, ...] = STOP_STRINGS
    eos_after: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if not self.temperature > 0:
            raise ValueError(f"temperature must be > 0 (use greedy=True for argmax), got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if any(not s for s in self.stop_strings):
            raise ValueError("stop_strings must not contain an empty string")
        missing = set(self.eos_after) - set(self.stop_strings)
        if missing:
            raise ValueError(f"eos_after {sorted(missing)} must also be in stop_strings {list(self.stop_strings)}")


@dataclass(frozen=True)
class Generation:
    """One row's output: generated ids, their sampling log-probs, why it ended."""

    token_ids: list[int]
    logprobs: list[float]
    finish_reason: FinishReason
    stop_string: str | None = None


class Generator(Protocol):
    """Generates continuations of token-id prompts, one ``Generation`` per prompt, in order.

    ``max_new_tokens`` (optional) gives per-row caps, clipped to ``params.max_new_tokens``;
    a cap of 0 returns an empty generation with reason "length". Implementations
    follow the stop rule and log-prob convention in this module's docstring.
    """

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        params: SamplingParams,
        max_new_tokens: Sequence[int] | None = None,
    ) -> list[Generation]: ...


class StopMatcher:
    """Detects stop strings in a row's generated tokens by decoding only its tail.

    Each stop string of L characters spans at most L tokens (byte-level BPE tokens
    decode to at least one character of ASCII text), so decoding the last
    ``max L + 1`` tokens sees any stop completed by the newest token. Earlier
    stops cannot be in the window: the row would already have stopped.
    """

    def __init__(self, tokenizer, stop_strings: Sequence[str]):
        self.tokenizer = tokenizer
        self.stop_strings = tuple(stop_strings)
        self.window = max((len(s) for s in self.stop_strings), default=0) + 1

    def check(self, token_ids: Sequence[int]) -> str | None:
        """The stop string completed by the last token, if any."""
        if not self.stop_strings:
            return None
        text = self.tokenizer.decode(
            list(token_ids[-self.window:]), skip_special_tokens=False, clean_up_tokenization_spaces=False
        )
        found = [(text.find(s) + len(s), s) for s in self.stop_strings if s in text]
        return min(found)[1] if found else None


def eos_token_ids(model, tokenizer) -> set[int]:
    """Every id that ends a sequence: the tokenizer's EOS and the model's generation config EOS."""
    ids: set[int] = set()
    candidates = [getattr(tokenizer, "eos_token_id", None)]
    generation_config = getattr(model, "generation_config", None)
    if generation_config is not None:
        candidates.append(generation_config.eos_token_id)
    for value in candidates:
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, (list, tuple)):
            ids.update(int(v) for v in value)
    if not ids:
        raise ValueError("the tokenizer has no eos_token_id; set tokenizer.eos_token before generating")
    return ids


def row_limits(num_rows: int, params: SamplingParams, max_new_tokens: Sequence[int] | None) -> list[int]:
    """Per-row token caps: ``max_new_tokens`` when given (clipped to params), else params'."""
    if max_new_tokens is None:
        return [params.max_new_tokens] * num_rows
    if len(max_new_tokens) != num_rows:
        raise ValueError(f"max_new_tokens has {len(max_new_tokens)} entries for {num_rows} prompts")
    return [max(0, min(int(m), params.max_new_tokens)) for m in max_new_tokens]


def left_pad(prompts: Sequence[Sequence[int]], pad_id: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-padded ids [B, L] and attention mask [B, L] (1 on real tokens)."""
    if not prompts:
        raise ValueError("no prompts to generate from")
    lengths = [len(p) for p in prompts]
    if min(lengths) == 0:
        raise ValueError(f"prompt {lengths.index(0)} is empty: every prompt needs at least one token")
    width = max(lengths)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for row, prompt in enumerate(prompts):
        ids[row, width - len(prompt):] = torch.tensor(list(prompt), dtype=torch.long)
        mask[row, width - len(prompt):] = 1
    return ids.to(device), mask.to(device)


def finish_of(token_ids: list[int], limit: int, eos_ids: set[int], matcher: StopMatcher) -> tuple[FinishReason, str | None] | None:
    """Why a row ends after its newest token (EOS, then stop string, then budget), or None."""
    if token_ids[-1] in eos_ids:
        return "eos", None
    stop = matcher.check(token_ids)
    if stop is not None:
        return "stop", stop
    if len(token_ids) >= limit:
        return "length", None
    return None


def sample_tokens(logits: torch.Tensor, params: SamplingParams, rng: torch.Generator | None) -> torch.Tensor:
    """Next token per row from logits [b, V]: argmax, or a sample of softmax(logits / T)
    restricted to the top-p nucleus (the smallest set whose mass reaches top_p)."""
    if params.greedy:
        return logits.argmax(dim=-1)
    probs = torch.softmax(logits / params.temperature, dim=-1)
    if params.top_p < 1.0:
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        # Keep a token if the mass before it is < top_p (so the top token is always kept).
        keep = (sorted_probs.cumsum(dim=-1) - sorted_probs) < params.top_p
        sorted_probs = sorted_probs * keep
        probs = torch.zeros_like(probs).scatter_(-1, order, sorted_probs)
    return torch.multinomial(probs, 1, generator=rng).squeeze(-1)


class KVCacheGenerator:
    """Our batched sampler: one left-padded prefill, then one-token decode steps that
    reuse ``past_key_values`` (a ``DynamicCache``).

    Positions follow the attention mask (``cumsum - 1``), so left padding changes
    nothing for real tokens. Rows that finish are dropped from the batch (cache rows
    selected away) when ``drop_finished`` is True, else kept and ignored; see
    benchmarks/bench_generation.py for which is faster. ``seed`` seeds a private
    ``torch.Generator``: the same seed and calls give the same samples.
    """

    def __init__(self, model, tokenizer, *, seed: int = 0, drop_finished: bool = True):
        self.model = model
        self.tokenizer = tokenizer
        self.drop_finished = drop_finished
        self.device = next(model.parameters()).device
        self.rng = torch.Generator(device=self.device)
        self.rng.manual_seed(seed)
        self.eos_ids = eos_token_ids(model, tokenizer)
        self.eos_id = tokenizer.eos_token_id if tokenizer.eos_token_id is not None else min(self.eos_ids)
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else self.eos_id
        self._keep_last_only = "logits_to_keep" in inspect.signature(model.forward).parameters

    def _forward(self, ids, attention_mask, position_ids, cache) -> torch.Tensor:
        kwargs = {"logits_to_keep": 1} if self._keep_last_only else {}
        out = self.model(input_ids=ids, attention_mask=attention_mask, position_ids=position_ids,
                         past_key_values=cache, use_cache=True, **kwargs)
        return out.logits[:, -1, :].float()

    @torch.inference_mode()
    def generate(self, prompts, params: SamplingParams, max_new_tokens=None) -> list[Generation]:
        from transformers import DynamicCache

        limits = row_limits(len(prompts), params, max_new_tokens)
        matcher = StopMatcher(self.tokenizer, params.stop_strings)
        outputs: list[list[int]] = [[] for _ in prompts]
        logprobs: list[list[float]] = [[] for _ in prompts]
        finish: list[tuple[FinishReason, str | None] | None] = [None] * len(prompts)
        live = [i for i, limit in enumerate(limits) if limit > 0]
        for i in range(len(prompts)):
            if limits[i] == 0:
                finish[i] = ("length", None)
        if not live:
            return [Generation([], [], "length") for _ in prompts]

        ids, attention = left_pad([prompts[i] for i in live], self.pad_id, self.device)
        positions = (attention.cumsum(-1) - 1).clamp(min=0)
        cache = DynamicCache(config=self.model.config)
        logits = self._forward(ids, attention, positions, cache)
        next_position = positions[:, -1] + 1
        rows = list(live)  # batch position -> prompt index
        pending_eos: set[int] = set()  # rows that stopped on an eos_after string
        while True:
            logp = torch.log_softmax(logits / params.temperature, dim=-1)
            tokens = sample_tokens(logits, params, self.rng)
            if pending_eos:
                forced = torch.tensor([r in pending_eos for r in rows], device=self.device)
                tokens = torch.where(forced, torch.full_like(tokens, self.eos_id), tokens)
            chosen_logp = logp.gather(-1, tokens[:, None]).squeeze(-1).tolist()
            token_list = tokens.tolist()
            keep = []
            for b, row in enumerate(rows):
                if finish[row] is not None and row not in pending_eos:
                    continue  # a finished row kept in the batch (drop_finished=False)
                outputs[row].append(token_list[b])
                logprobs[row].append(chosen_logp[b])
                if row in pending_eos:
                    pending_eos.discard(row)
                    continue
                finish[row] = finish_of(outputs[row], limits[row], self.eos_ids, matcher)
                if finish[row] is None:
                    keep.append(b)
                elif finish[row][0] == "stop" and finish[row][1] in params.eos_after and len(outputs[row]) < limits[row]:
                    pending_eos.add(row)
                    keep.append(b)
            if not keep:
                break
            if self.drop_finished and len(keep) < len(rows):
                index = torch.tensor(keep, device=self.device)
                cache.batch_select_indices(index)
                attention, next_position, tokens = attention[index], next_position[index], tokens[index]
                rows = [rows[b] for b in keep]
            attention = torch.cat([attention, attention.new_ones((attention.shape[0], 1))], dim=-1)
            logits = self._forward(tokens[:, None], attention, next_position[:, None], cache)
            next_position = next_position + 1
        return [
            Generation(outputs[i], logprobs[i], finish[i][0], finish[i][1])  # type: ignore[index]
            for i in range(len(prompts))
        ]


class _RowStopCriteria:
    """HF ``StoppingCriteria`` applying our per-row rule (EOS, stop string, row budget)."""

    def __init__(self, prompt_width: int, limits: list[int], eos_ids: set[int], matcher: StopMatcher):
        self.prompt_width = prompt_width
        self.limits = limits
        self.eos_ids = eos_ids
        self.matcher = matcher

    def __call__(self, input_ids: torch.Tensor, scores=None, **kwargs) -> torch.Tensor:
        generated = input_ids[:, self.prompt_width:].tolist()
        done = [finish_of(row, limit, self.eos_ids, self.matcher) is not None if row else False
                for row, limit in zip(generated, self.limits)]
        return torch.tensor(done, dtype=torch.bool, device=input_ids.device)


class HFGenerator:
    """The reference backend: Hugging Face ``model.generate`` with our stop rule as a
    ``StoppingCriteria`` and raw logits returned, then the same per-row cut.

    Sampling uses the global torch RNG (seeded per call from ``seed``), so sampled
    tokens differ from ``KVCacheGenerator``'s; greedy tokens are identical.
    """

    def __init__(self, model, tokenizer, *, seed: int = 0):
        self.model = model
        self.tokenizer = tokenizer
        self.device = next(model.parameters()).device
        self.eos_ids = eos_token_ids(model, tokenizer)
        self.eos_id = tokenizer.eos_token_id if tokenizer.eos_token_id is not None else min(self.eos_ids)
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else self.eos_id
        self._seed = seed
        self._calls = 0

    def _config(self, params: SamplingParams, max_new: int):
        from transformers import GenerationConfig

        sampling = {} if params.greedy else {"temperature": params.temperature, "top_p": params.top_p, "top_k": 0}
        return GenerationConfig(
            max_new_tokens=max_new, do_sample=not params.greedy, pad_token_id=self.pad_id,
            eos_token_id=sorted(self.eos_ids), output_logits=True, return_dict_in_generate=True, **sampling,
        )

    @torch.inference_mode()
    def generate(self, prompts, params: SamplingParams, max_new_tokens=None) -> list[Generation]:
        from transformers import StoppingCriteriaList

        limits = row_limits(len(prompts), params, max_new_tokens)
        if max(limits) == 0:
            return [Generation([], [], "length") for _ in prompts]
        matcher = StopMatcher(self.tokenizer, params.stop_strings)
        ids, attention = left_pad(prompts, self.pad_id, self.device)
        criteria = _RowStopCriteria(ids.shape[1], limits, self.eos_ids, matcher)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(self._seed + self._calls)
            self._calls += 1
            out = self.model.generate(input_ids=ids, attention_mask=attention,
                                      generation_config=self._config(params, max(limits)),
                                      stopping_criteria=StoppingCriteriaList([criteria]))
        new_ids = out.sequences[:, ids.shape[1]:].tolist()
        logp = torch.log_softmax(torch.stack(out.logits, dim=1).float() / params.temperature, dim=-1)
        results = []
        for row, limit in enumerate(limits):
            tokens: list[int] = []
            reason: tuple[FinishReason, str | None] = ("length", None)
            for token in new_ids[row][:limit]:
                tokens.append(token)
                ended = finish_of(tokens, limit, self.eos_ids, matcher)
                if ended is not None:
                    reason = ended
                    break
            row_logp = [logp[row, t, token].item() for t, token in enumerate(tokens)]
            if reason[0] == "stop" and reason[1] in params.eos_after and len(tokens) < limit:
                row_logp.append(self._next_logprob(prompts[row], tokens, params.temperature))
                tokens.append(self.eos_id)
            results.append(Generation(tokens, row_logp, reason[0], reason[1]))
        return results

    def _next_logprob(self, prompt, tokens, temperature: float) -> float:
        # One unpadded forward pass over prompt + generated tokens: log p(EOS | all of it).
        full = torch.tensor([list(prompt) + tokens], device=self.device)
        logits = self.model(input_ids=full).logits[0, -1].float()
        return torch.log_softmax(logits / temperature, dim=-1)[self.eos_id].item()
