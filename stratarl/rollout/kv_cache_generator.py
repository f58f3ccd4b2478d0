"""``KVCacheGenerator``, our batched sampler over any Hugging Face causal LM: one left-padded prefill, then
one-token decode steps over a KV cache, on ``FastDecoder`` for the models it covers and on the model's
own forward with a ``DynamicCache`` for the rest."""

from __future__ import annotations

import inspect

import torch

from stratarl.rollout.fast_forward import FastDecoder, fast_decode_unsupported_reason
from stratarl.rollout.generator import FinishReason, Generation, Generator, SamplingParams, left_pad, row_limits
from stratarl.rollout.prefix_cache import PrefixEntry, RowCollector, reusable_prefixes, shared_prompt_prefix
from stratarl.rollout.sampling import sample_tokens
from stratarl.rollout.stopping import StopMatcher, finish_of, special_token_ids, stop_candidates


class _Rows:
    """The rows of one ``generate`` call: each prompt's sampled tokens, their log-probs and why it ended,
    and which prompt each batch position holds (``batch``; finished rows leave it when dropped)."""

    def __init__(self, limits: list[int], eos_ids: set[int], matcher: StopMatcher, eos_after: tuple[str, ...]):
        self.limits = limits
        self.eos_ids = eos_ids
        self.matcher = matcher
        self.eos_after = eos_after
        self.outputs: list[list[int]] = [[] for _ in limits]
        self.logprobs: list[list[float]] = [[] for _ in limits]
        self.finish: list[tuple[FinishReason, str | None] | None] = [
            None if limit > 0 else ("length", None) for limit in limits
        ]
        self.batch = [i for i, limit in enumerate(limits) if limit > 0]  # batch position -> prompt index
        self.owed_eos: set[int] = set()  # prompts that stopped on an eos_after string: EOS is their next token

    def record(self, tokens: list[int], logprobs: list[float]) -> list[int]:
        """Append each batch row's sampled token and its log-prob; returns the batch positions that
        go on (a row owed its EOS included)."""
        going_on = []
        for b, row in enumerate(self.batch):
            if self.finish[row] is not None and row not in self.owed_eos:
                continue  # a finished row kept in the batch (drop_finished=False)
            self.outputs[row].append(tokens[b])
            self.logprobs[row].append(logprobs[b])
            if row in self.owed_eos:
                self.owed_eos.discard(row)
                continue
            finish = self.finish[row] = finish_of(self.outputs[row], self.limits[row], self.eos_ids, self.matcher)
            if finish is None:
                going_on.append(b)
            elif finish[0] == "stop" and finish[1] in self.eos_after and len(self.outputs[row]) < self.limits[row]:
                self.owed_eos.add(row)
                going_on.append(b)
        return going_on

    def keep_only(self, positions: list[int]) -> None:
        """Drop every batch position but ``positions`` (the decoder's cache rows are selected the same way)."""
        self.batch = [self.batch[b] for b in positions]

    def generations(self, captured: dict[int, tuple[list[int], torch.Tensor]]) -> list[Generation]:
        """One ``Generation`` per prompt, in order; ``captured``: prompt index -> its frozen_states."""
        return [
            Generation(self.outputs[i], self.logprobs[i], *self._finished(i), captured.get(i))
            for i in range(len(self.limits))
        ]

    def _finished(self, row: int) -> tuple[FinishReason, str | None]:
        finish = self.finish[row]
        if finish is None:
            raise RuntimeError(f"row {row} is still generating")  # generate() decodes until every row finishes
        return finish


class DynamicCacheDecoder:
    """Prefill and one-token decode steps with the model's own forward over a Hugging Face ``DynamicCache``
    (for the models ``FastDecoder`` does not cover), with ``FastDecoder``'s ``decode`` / ``select``.

    Positions follow the attention mask (``cumsum - 1``), so left padding changes nothing for real tokens."""

    def __init__(self, model, pad_id: int, device) -> None:
        self.model = model
        self.pad_id = pad_id
        self.device = device
        self._keep_last_only = "logits_to_keep" in inspect.signature(model.forward).parameters

    def _forward(self, ids, position_ids) -> torch.Tensor:
        kwargs = {"logits_to_keep": 1} if self._keep_last_only else {}
        out = self.model(
            input_ids=ids,
            attention_mask=self.attention,
            position_ids=position_ids,
            past_key_values=self.cache,
            use_cache=True,
            **kwargs,
        )
        return out.logits[:, -1, :].float()

    def prefill(self, prompts: list) -> torch.Tensor:
        """Run the prompts (left-padded) into a new cache; returns the last position's logits [B, V]."""
        from transformers import DynamicCache  # start-up cost: transformers loads when a model needs it

        ids, self.attention = left_pad(prompts, self.pad_id, self.device)
        self.cache = DynamicCache(config=self.model.config)
        positions = (self.attention.cumsum(-1) - 1).clamp(min=0)
        logits = self._forward(ids, positions)
        self.next_position = positions[:, -1] + 1
        return logits

    def decode(self, tokens: torch.Tensor) -> torch.Tensor:
        """Append one token per row (``tokens`` [B]) and return the next logits [B, V]."""
        self.attention = torch.cat([self.attention, self.attention.new_ones((self.attention.shape[0], 1))], dim=-1)
        logits = self._forward(tokens[:, None], self.next_position[:, None])
        self.next_position = self.next_position + 1
        return logits

    def select(self, index: torch.Tensor) -> None:
        """Keep only batch rows ``index`` of the cache, the mask and the positions."""
        self.cache.batch_select_indices(index)
        self.attention = self.attention[index]
        self.next_position = self.next_position[index]


class KVCacheGenerator(Generator):
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

    Multi-turn prefix cache (fast path only; ``stratarl.rollout.prefix_cache``):
    ``generate(..., cache_keys=keys)`` keeps each row's KV under its key until the next
    call, at most ``prefix_cache_bytes`` in all, and a row of the next call whose prompt
    starts with its stored tokens computes only its new tokens. Results equal a full
    prefill up to float rounding.

    ``generate(..., capture_layer=k)`` (fast path, with cache keys) also returns, per row, the hidden
    states entering decoder layer k of every token read (``Generation.frozen_states``); the prefix
    cache keeps them with the K/V so a multi-turn rollout's states cover its whole history. With
    layers 0..k-1 frozen these are the trainer's frozen prefix, which it then need not recompute.

    ``share_prompts`` (fast path, without a capture layer): the rows of a call that reuse no stored prefix
    and start with the same tokens (a prompt template) have that common prefix computed once, at batch 1,
    and read as a stored prefix (``shared_prompt_prefix``): only each row's own tail is prefilled.
    ``prefill_chunk_rows`` (fast path): prefill that many rows at a time (``FastDecoder.prefill_chunk_rows``).
    """

    def __init__(
        self,
        model,
        tokenizer,
        *,
        seed: int = 0,
        drop_finished: bool = True,
        fast: bool | None = None,
        prefix_cache_bytes: int = 2 * 2**30,
        dtype: torch.dtype = torch.float32,
        share_prompts: bool = False,
        prefill_chunk_rows: int | None = None,
    ):
        self.model = model
        self.tokenizer = tokenizer
        self.drop_finished = drop_finished
        reason = fast_decode_unsupported_reason(model)
        if fast and reason is not None:
            raise ValueError(f"fast=True but the fast decode path does not support this model: {reason}")
        self.fast_decoder = FastDecoder(model, dtype=dtype) if fast is not False and reason is None else None
        self._matchers: dict[tuple[str, ...], StopMatcher] = {}
        self.supports_cache_keys = self.fast_decoder is not None
        self.supports_capture = self.fast_decoder is not None  # generate(..., capture_layer=k)
        self.prefix_cache_bytes = prefix_cache_bytes
        self.share_prompts = share_prompts and self.fast_decoder is not None
        if self.fast_decoder is not None:
            self.fast_decoder.prefill_chunk_rows = prefill_chunk_rows
        self._prefix_store: dict = {}  # cache key -> PrefixEntry: each row's KV after the last call
        self.last_reused_tokens = 0  # prompt tokens the last call took from the prefix cache
        self.device = next(model.parameters()).device
        self.rng = torch.Generator(device=self.device)
        self.rng.manual_seed(seed)
        self.eos_ids, self.eos_id, self.pad_id = special_token_ids(model, tokenizer)

    def _matcher(self, stop_strings: tuple[str, ...]) -> StopMatcher:
        """The matcher of ``stop_strings``, built once (its candidate tokens cost a decode of the vocabulary)."""
        if stop_strings not in self._matchers:
            self._matchers[stop_strings] = StopMatcher(
                self.tokenizer, stop_strings, stop_candidates(self.tokenizer, stop_strings)
            )
        return self._matchers[stop_strings]

    @torch.inference_mode()
    def generate(
        self, prompts, params: SamplingParams, max_new_tokens=None, cache_keys=None, capture_layer: int | None = None
    ) -> list[Generation]:
        """One ``Generation`` per prompt, in order (see ``Generator``); ``cache_keys`` and ``capture_layer``
        (fast path only): see the class docstring."""
        limits = row_limits(len(prompts), params, max_new_tokens)
        if cache_keys is not None and len(cache_keys) != len(prompts):
            raise ValueError(f"cache_keys has {len(cache_keys)} entries for {len(prompts)} prompts")
        keys = list(cache_keys) if cache_keys is not None and self.fast_decoder is not None else None
        rows = _Rows(limits, self.eos_ids, self._matcher(tuple(params.stop_strings)), params.eos_after)
        if not rows.batch:
            return [Generation([], [], "length") for _ in prompts]
        decoder, logits, collector = self._prefill(prompts, rows.batch, keys, max(limits), capture_layer)
        self._decode(decoder, logits, params, rows, collector)
        # The next call's prefix cache holds this call's rows only: rows not in it belong to rollouts that ended.
        self._prefix_store = collector.store if collector is not None else {}
        if self.fast_decoder is not None:
            self.fast_decoder.capture_layer, self.fast_decoder.h_cache = None, None  # free the states' memory
        return rows.generations(collector.captured if collector is not None else {})

    def _prefill(self, prompts, live: list[int], keys: list | None, max_limit: int, capture_layer: int | None):
        """Prefill the prompts at indices ``live``; returns the decoder, the logits [len(live), V], and (fast
        path, with cache keys or a capture layer) the ``RowCollector`` that keeps the rows' KV and states, else
        None."""
        live_prompts = [prompts[i] for i in live]
        if self.fast_decoder is None:
            logits, decoder = self._start_generic(live_prompts)
            return decoder, logits, None
        live_keys = [keys[i] for i in live] if keys is not None else None
        logits, live_entries = self._start_fast(live_prompts, live_keys, max_limit, capture_layer)
        if keys is None and capture_layer is None:
            return self.fast_decoder, logits, None
        entries: list[PrefixEntry | None] = [None] * len(prompts)
        for i, entry in zip(live, live_entries):
            entries[i] = entry
        collector = RowCollector(self.fast_decoder, self.prefix_cache_bytes, prompts, keys, entries)
        return self.fast_decoder, logits, collector

    def _start_fast(
        self, prompts: list, keys: list | None, max_limit: int, capture_layer: int | None = None
    ) -> tuple[torch.Tensor, list[PrefixEntry | None]]:
        """Prefill on the fast path (reusing cached prefixes); returns the logits and the prefix-store
        entry each row reused (or None)."""
        decoder = self.fast_decoder
        if decoder is None:
            raise RuntimeError("the fast path needs a FastDecoder")  # _prefill calls this only when there is one
        entries: list[PrefixEntry | None] = (
            reusable_prefixes(self._prefix_store, decoder, prompts, keys) if keys is not None else [None] * len(prompts)
        )
        if capture_layer is not None:  # a reused prefix must bring its captured states along
            entries = [e if e is not None and e.states is not None else None for e in entries]
        elif self.share_prompts:
            entries = shared_prompt_prefix(decoder, prompts, entries)
        decoder.capture_layer = capture_layer
        suffixes = [list(p[len(e.tokens) :]) if e is not None else list(p) for p, e in zip(prompts, entries)]
        ids, attention = left_pad(suffixes, self.pad_id, self.device)
        prefixes = [(e.keys, e.values) if e is not None else None for e in entries]
        prefix_width = max((len(e.tokens) for e in entries if e is not None), default=0)
        logits = decoder.prefill(ids, attention, prefix_width + ids.shape[1] + max_limit, prefixes)
        self.last_reused_tokens = sum(len(e.tokens) for e in entries if e is not None)
        return logits, entries

    def _start_generic(self, prompts: list) -> tuple[torch.Tensor, DynamicCacheDecoder]:
        """Prefill with the model's own forward and a ``DynamicCache``; returns the logits and the decoder."""
        decoder = DynamicCacheDecoder(self.model, self.pad_id, self.device)
        return decoder.prefill(prompts), decoder

    def _decode(
        self, decoder, logits: torch.Tensor, params: SamplingParams, rows: _Rows, collector: RowCollector | None
    ) -> None:
        """Sample and decode until every row has ended. Finished rows leave the batch once they are a quarter
        of it (``drop_finished``; a selection copies the whole cache, so it is batched); ``collector`` keeps
        their KV and states as they leave, and the remaining rows' at the end."""
        while True:
            tokens, logprobs = self._sample(logits, params, rows)
            going_on = rows.record(tokens.tolist(), logprobs)
            if not going_on:
                break
            finished_in_batch = len(rows.batch) - len(going_on)  # finished rows not dropped yet
            if self.drop_finished and finished_in_batch and finished_in_batch * 4 >= len(rows.batch):
                if collector is not None:
                    kept = set(going_on)
                    collector.keep([(b, row) for b, row in enumerate(rows.batch) if b not in kept], rows.outputs)
                index = torch.tensor(going_on, device=self.device)
                decoder.select(index)
                tokens = tokens[index]
                rows.keep_only(going_on)
            logits = decoder.decode(tokens)
        if collector is not None:
            collector.keep(list(enumerate(rows.batch)), rows.outputs)

    def _sample(self, logits: torch.Tensor, params: SamplingParams, rows: _Rows) -> tuple[torch.Tensor, list[float]]:
        """Each batch row's next token (EOS for a row owed one) and its log-prob under the policy."""
        logp = torch.log_softmax(logits / params.temperature if params.temperature != 1.0 else logits, dim=-1)
        tokens = sample_tokens(logits, params, self.rng, logp)
        if rows.owed_eos:
            forced = torch.tensor([row in rows.owed_eos for row in rows.batch], device=self.device)
            tokens = torch.where(forced, torch.full_like(tokens, self.eos_id), tokens)
        return tokens, logp.gather(-1, tokens[:, None]).squeeze(-1).tolist()
