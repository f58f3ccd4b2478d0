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
from dataclasses import dataclass, field
from typing import Literal, Protocol

import torch

from stratarl.rollout.fast_forward import FastDecoder, unsupported_reason
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
    """One row's output: generated ids, their sampling log-probs, why it ended.

    ``frozen_states`` (only when asked for with ``capture_layer``): (tokens, states [len(tokens), H]), the
    hidden states entering that layer of every token the model read for this row: its whole prompt
    (a reused prefix included) and the generated tokens but the last, which was never fed back."""

    token_ids: list[int]
    logprobs: list[float]
    finish_reason: FinishReason
    stop_string: str | None = None
    frozen_states: tuple[list[int], torch.Tensor] | None = field(default=None, compare=False, repr=False)


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

    def __init__(self, tokenizer, stop_strings: Sequence[str], candidates: frozenset[int] | None = None):
        self.tokenizer = tokenizer
        self.stop_strings = tuple(stop_strings)
        self.window = max((len(s) for s in self.stop_strings), default=0) + 1
        self.candidates = candidates

    def check(self, token_ids: Sequence[int]) -> str | None:
        """The stop string completed by the last token, if any."""
        if not self.stop_strings:
            return None
        if self.candidates is not None and token_ids[-1] not in self.candidates:
            return None  # this token cannot complete a stop string: skip the decode
        text = self.tokenizer.decode(
            list(token_ids[-self.window:]), skip_special_tokens=False, clean_up_tokenization_spaces=False
        )
        found = [(text.find(s) + len(s), s) for s in self.stop_strings if s in text]
        return min(found)[1] if found else None


def stop_candidates(tokenizer, stop_strings: Sequence[str]) -> frozenset[int] | None:
    """Ids of the tokens that can complete one of ``stop_strings``, or None (check every token).

    A token completes a stop string only if its own text holds the string's last
    character. When every last character is ASCII this holds for a token decoded on
    its own too (an ASCII byte always decodes to itself, in byte-level BPE,
    SentencePiece byte fallback and word-level vocabularies alike), so one decode of
    the vocabulary up front lets the generator skip the per-row tail decode for
    almost every token (48 of SmolLM2's 49,152 tokens hold a ``>``).
    """
    last_chars = {s[-1] for s in stop_strings}
    if not last_chars or any(not c.isascii() for c in last_chars):
        return None
    texts = tokenizer.batch_decode([[i] for i in range(len(tokenizer))], skip_special_tokens=False,
                                   clean_up_tokenization_spaces=False)
    return frozenset(i for i, text in enumerate(texts) if any(c in text for c in last_chars))


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


def sample_categorical(probs: torch.Tensor, rng: torch.Generator | None) -> torch.Tensor:
    """One draw per row of the (unnormalised, non-negative) weights ``probs`` [b, V] by inverting the CDF.

    Row b gets the first index i with cdf_b[i] >= u_b * cdf_b[V-1], u_b ~ U(0, 1]: index i is drawn
    with probability probs[b, i] / sum(probs[b]) (up to the rounding of an fp32 cumulative sum, ~1e-7
    relative), and a zero-weight index is never drawn (its cdf equals its predecessor's). One uniform
    per row and one cumulative sum: on a CPU this is ~30x faster than ``torch.multinomial``, which
    draws an exponential per vocabulary entry (2.5 ms for 32 x 4.6k on one core).
    """
    cdf = probs.float().cumsum(dim=-1)
    total = cdf[:, -1:]
    if not bool(((total > 0) & torch.isfinite(total)).all()):  # what torch.multinomial refuses too
        raise ValueError("sampling weights must be finite and non-negative with a positive sum in every row "
                         "(NaN / inf logits?)")
    u = 1.0 - torch.rand(probs.shape[0], 1, dtype=cdf.dtype, device=probs.device, generator=rng)  # (0, 1]
    index = torch.searchsorted(cdf, u * total)
    return index.squeeze(-1).clamp_(max=probs.shape[-1] - 1)  # the clamp only guards float edge cases


def sample_tokens(logits: torch.Tensor, params: SamplingParams, rng: torch.Generator | None,
                  logp: torch.Tensor | None = None) -> torch.Tensor:
    """Next token per row from logits [b, V]: argmax, or a sample of softmax(logits / T)
    restricted to the top-p nucleus (the smallest set whose mass reaches top_p).
    ``logp``: ``log_softmax(logits / T)`` when the caller has it (saves a softmax)."""
    if params.greedy:
        return logits.argmax(dim=-1)
    probs = logp.exp() if logp is not None else torch.softmax(logits / params.temperature, dim=-1)
    if params.top_p < 1.0:
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        # Keep a token if the mass before it is < top_p (so the top token is always kept).
        keep = (sorted_probs.cumsum(dim=-1) - sorted_probs) < params.top_p
        sorted_probs = sorted_probs * keep
        probs = torch.zeros_like(probs).scatter_(-1, order, sorted_probs)
    return sample_categorical(probs, rng)


class KVCacheGenerator:
    """Our batched sampler: one left-padded prefill, then one-token decode steps over a KV cache.

    The forward pass: for Llama-family models (Llama, Qwen2, Mistral, SmolLM2) our
    plain-PyTorch ``FastDecoder`` (preallocated cache, fused projections; see
    ``stratarl.rollout.fast_forward``), else the model's own forward with a
    ``DynamicCache``. ``fast``: None picks the fast path when the model supports it,
    True requires it, False always uses the model's forward. The fast path reads
    the model's current weights at every call, so it follows training updates.
    ``dtype`` bfloat16 runs the fast path on bf16 copies of the weights (``FastDecoder``).

    Positions follow the attention mask (``cumsum - 1``), so left padding changes
    nothing for real tokens. Finished rows are dropped from the batch (cache rows
    selected away) once they are a quarter of it when ``drop_finished`` is True (a
    selection copies the whole cache, so it is batched), else kept and ignored; see
    benchmarks/bench_generation.py. ``seed`` seeds a private ``torch.Generator``:
    the same seed and calls give the same samples.

    Multi-turn prefix cache (fast path only): ``generate(..., cache_keys=keys)`` keeps
    each row's KV (prompt + generated tokens) under its key until the next call, at
    most ``prefix_cache_bytes`` in all. A row of the next call whose key was seen and
    whose prompt *starts with* the stored tokens (checked token by token, with the
    same weights) computes only its new tokens: a rollout's next turn reads only the
    observation, not the whole history again. Results equal a full prefill up to
    float rounding.

    ``generate(..., capture_layer=k)`` (fast path, with cache keys) also returns, per row, the hidden
    states entering decoder layer k of every token read (``Generation.frozen_states``); the prefix
    cache keeps them with the K/V so a multi-turn rollout's states cover its whole history. With
    layers 0..k-1 frozen these are the trainer's frozen prefix, which it then need not recompute.
    """

    def __init__(self, model, tokenizer, *, seed: int = 0, drop_finished: bool = True, fast: bool | None = None,
                 prefix_cache_bytes: int = 2 * 2**30, dtype: torch.dtype = torch.float32):
        self.model = model
        self.tokenizer = tokenizer
        self.drop_finished = drop_finished
        reason = unsupported_reason(model)
        if fast and reason is not None:
            raise ValueError(f"fast=True but the fast decode path does not support this model: {reason}")
        self.fast_decoder = FastDecoder(model, dtype=dtype) if fast is not False and reason is None else None
        self._matchers: dict[tuple[str, ...], StopMatcher] = {}
        # Prefix cache (fast path): each row's KV after the last call, under its cache key.
        self.supports_cache_keys = self.fast_decoder is not None
        self.supports_capture = self.fast_decoder is not None  # generate(..., capture_layer=k)
        self.prefix_cache_bytes = prefix_cache_bytes
        self._prefix_store: dict = {}
        self.last_reused_tokens = 0  # prompt tokens the last call took from the prefix cache
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

    def _matcher(self, stop_strings: tuple[str, ...]) -> StopMatcher:
        if stop_strings not in self._matchers:
            self._matchers[stop_strings] = StopMatcher(self.tokenizer, stop_strings,
                                                       stop_candidates(self.tokenizer, stop_strings))
        return self._matchers[stop_strings]

    def _cached_prefixes(self, prompts: list, keys: list) -> list:
        """Per row: the stored (tokens, keys, values) whose tokens start its prompt, or None."""
        decoder = self.fast_decoder
        decoder.refresh()
        found = []
        for prompt, key in zip(prompts, keys):
            entry = self._prefix_store.get(key) if key is not None else None
            if entry is not None:
                version, tokens = entry[0], entry[1]
                usable = (version is not None and version == decoder._version and len(tokens) < len(prompt)
                          and list(prompt[:len(tokens)]) == tokens)
                entry = entry if usable else None
            found.append(entry)
        return found

    def _start_fast(self, prompts: list, keys: list | None, max_limit: int, capture_layer: int | None = None):
        """Prefill on the fast path (reusing cached prefixes); returns logits, decode, select, and the
        prefix-store entry each row reused (or None)."""
        decoder = self.fast_decoder
        entries = self._cached_prefixes(prompts, keys) if keys is not None else [None] * len(prompts)
        if capture_layer is not None:  # a reused prefix must bring its captured states along
            entries = [e if e is not None and e[4] is not None else None for e in entries]
        decoder.capture_layer = capture_layer
        suffixes = [list(p[len(e[1]):]) if e is not None else list(p) for p, e in zip(prompts, entries)]
        ids, attention = left_pad(suffixes, self.pad_id, self.device)
        prefixes = [(e[2], e[3]) if e is not None else None for e in entries]
        prefix_width = max((len(e[1]) for e in entries if e is not None), default=0)
        logits = decoder.prefill(ids, attention, prefix_width + ids.shape[1] + max_limit, prefixes)
        self.last_reused_tokens = sum(len(e[1]) for e in entries if e is not None)
        return logits, decoder.decode, decoder.select, entries

    def _row_states(self, b: int, tokens: list[int], entry) -> torch.Tensor:
        """Batch row ``b``'s captured states of ``tokens``, its reused prefix's (``entry``) spliced in."""
        states = self.fast_decoder.row_hidden(b, len(tokens))
        if entry is not None:
            states[:len(entry[1])] = entry[4]
        return states

    def _store_rows(self, store: dict, used_bytes: int, batch_rows: list[tuple[int, int]], prompts, outputs,
                    keys, entries: list, captured: dict) -> int:
        """Keep (batch position, prompt index) rows' KV (and captured states) in ``store`` under their keys
        while the store's size stays within the byte budget; returns the store's new size in bytes.
        With a capture layer, every finished row's states go to ``captured`` (prompt index -> states)."""
        decoder = self.fast_decoder
        cache = decoder.k_cache  # [layers, B, kv_heads, T, head_dim]; values are the same size
        per_token = 2 * cache.shape[0] * cache.shape[2] * cache.shape[4] * cache.element_size()
        if decoder.h_cache is not None:
            per_token += decoder.h_cache.shape[-1] * decoder.h_cache.element_size()
        for b, row in batch_rows:
            if not outputs[row]:
                continue
            tokens = list(prompts[row]) + outputs[row][:-1]  # the last sampled token was never fed
            states = self._row_states(b, tokens, entries[row]) if decoder.h_cache is not None else None
            if states is not None:
                captured[row] = (tokens, states)
            key = keys[row] if keys is not None else None
            if key is None or used_bytes + per_token * len(tokens) > self.prefix_cache_bytes:
                continue
            used_bytes += per_token * len(tokens)
            k, v = decoder.row_cache(b, len(tokens))
            store[key] = (decoder._version, tokens, k, v, states)
        return used_bytes

    def _start_generic(self, prompts: list):
        """Prefill with the model's own forward and a ``DynamicCache``; returns logits, decode, select."""
        from transformers import DynamicCache

        ids, attention = left_pad(prompts, self.pad_id, self.device)
        cache = DynamicCache(config=self.model.config)
        positions = (attention.cumsum(-1) - 1).clamp(min=0)
        logits = self._forward(ids, attention, positions, cache)
        state = {"attention": attention, "next_position": positions[:, -1] + 1}

        def step(tokens):
            attention = state["attention"]
            state["attention"] = torch.cat([attention, attention.new_ones((attention.shape[0], 1))], dim=-1)
            out = self._forward(tokens[:, None], state["attention"], state["next_position"][:, None], cache)
            state["next_position"] = state["next_position"] + 1
            return out

        def select(index):
            cache.batch_select_indices(index)
            state["attention"] = state["attention"][index]
            state["next_position"] = state["next_position"][index]

        return logits, step, select

    @torch.inference_mode()
    def generate(self, prompts, params: SamplingParams, max_new_tokens=None, cache_keys=None,
                 capture_layer: int | None = None) -> list[Generation]:
        limits = row_limits(len(prompts), params, max_new_tokens)
        if cache_keys is not None and len(cache_keys) != len(prompts):
            raise ValueError(f"cache_keys has {len(cache_keys)} entries for {len(prompts)} prompts")
        keys = list(cache_keys) if cache_keys is not None and self.fast_decoder is not None else None
        store: dict = {}
        store_bytes = 0
        captured: dict[int, tuple[list[int], torch.Tensor]] = {}  # prompt index -> frozen_states
        matcher = self._matcher(tuple(params.stop_strings))
        outputs: list[list[int]] = [[] for _ in prompts]
        logprobs: list[list[float]] = [[] for _ in prompts]
        finish: list[tuple[FinishReason, str | None] | None] = [None] * len(prompts)
        live = [i for i, limit in enumerate(limits) if limit > 0]
        for i in range(len(prompts)):
            if limits[i] == 0:
                finish[i] = ("length", None)
        if not live:
            return [Generation([], [], "length") for _ in prompts]

        live_prompts = [prompts[i] for i in live]
        if self.fast_decoder is not None:
            live_keys = [keys[i] for i in live] if keys is not None else None
            logits, decode_step, select_rows, live_entries = self._start_fast(live_prompts, live_keys, max(limits),
                                                                             capture_layer)
            entries = [None] * len(prompts)
            for i, entry in zip(live, live_entries):
                entries[i] = entry
            finish_rows = keys is not None or capture_layer is not None
        else:
            logits, decode_step, select_rows = self._start_generic(live_prompts)
            finish_rows = False
        rows = list(live)  # batch position -> prompt index
        pending_eos: set[int] = set()  # rows that stopped on an eos_after string
        while True:
            logp = torch.log_softmax(logits / params.temperature if params.temperature != 1.0 else logits, dim=-1)
            tokens = sample_tokens(logits, params, self.rng, logp)
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
            finished_in_batch = len(rows) - len(keep)  # finished rows not dropped yet
            if self.drop_finished and finished_in_batch and finished_in_batch * 4 >= len(rows):
                if finish_rows:
                    kept = set(keep)
                    store_bytes = self._store_rows(store, store_bytes, [(b, r) for b, r in enumerate(rows) if b not in kept],
                                                   prompts, outputs, keys, entries, captured)
                index = torch.tensor(keep, device=self.device)
                select_rows(index)
                tokens = tokens[index]
                rows = [rows[b] for b in keep]
            logits = decode_step(tokens)
        if finish_rows:
            self._store_rows(store, store_bytes, list(enumerate(rows)), prompts, outputs, keys, entries, captured)
        self._prefix_store = store  # rows not in this call are gone: their rollouts ended
        if self.fast_decoder is not None:
            self.fast_decoder.capture_layer, self.fast_decoder.h_cache = None, None  # free the states' memory
        return [
            Generation(outputs[i], logprobs[i], finish[i][0], finish[i][1], captured.get(i))  # type: ignore[index]
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
