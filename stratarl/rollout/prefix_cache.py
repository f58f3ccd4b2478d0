"""The multi-turn prefix cache of ``KVCacheGenerator``'s fast path.

A call keeps each row's KV (prompt + generated tokens, rope applied) under the row's cache key until the
next call, at most a byte budget in all. A row of the next call whose key was seen and whose prompt
*starts with* the stored tokens (checked token by token, with the same weights) then computes only its
new tokens: a rollout's next turn reads only the observation, not the whole history again. With a
capture layer an entry also holds the row's captured hidden states, so a multi-turn rollout's states
cover its whole history.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch

from stratarl.rollout.fast_forward import FastDecoder


class PrefixEntry(NamedTuple):
    """One row's stored prefix."""

    version: tuple | None  # the decoder's weights version the KV was computed with (None: untracked)
    tokens: list[int]
    keys: torch.Tensor  # [layers, kv_heads, len(tokens), head_dim], as FastDecoder.row_cache returns
    values: torch.Tensor
    states: torch.Tensor | None  # [len(tokens), H] captured hidden states, or None


def reusable_prefixes(
    store: dict, decoder: FastDecoder, prompts: Sequence[Sequence[int]], keys: Sequence
) -> list[PrefixEntry | None]:
    """Per row: the entry of ``store`` under its key whose tokens start its prompt and were computed with
    the decoder's current weights, or None."""
    decoder.refresh()
    found = []
    for prompt, key in zip(prompts, keys):
        entry = store.get(key) if key is not None else None
        if entry is not None:
            usable = (
                entry.version is not None
                and entry.version == decoder.weights_version
                and len(entry.tokens) < len(prompt)
                and list(prompt[: len(entry.tokens)]) == entry.tokens
            )
            entry = entry if usable else None
        found.append(entry)
    return found


SHARED_PREFIX_MIN_TOKENS = 8
"""The shortest common prompt prefix worth computing once for several rows (``shared_prompt_prefix``)."""


def common_prefix_length(prompts: Sequence[Sequence[int]]) -> int:
    """The number of leading tokens every prompt has in common, at most the shortest prompt's length − 1 (a row
    keeps at least one token of its own, whose logits start its generation)."""
    if not prompts:
        return 0
    first, limit = prompts[0], min(len(p) for p in prompts) - 1
    n = 0
    while n < limit and all(p[n] == first[n] for p in prompts):
        n += 1
    return n


def sequence_cache(decoder: FastDecoder, tokens: list[int], rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The keys and values of one token sequence, each ``[layers, kv_heads, len(tokens), head_dim]`` as
    ``FastDecoder.row_cache`` returns them: a prefix that many rows of a later prefill share. ``rows``: the batch
    that prefill will decode; the weights are fused for it first, so this batch-1 prefill keeps their packing
    (``FastDecoder.refresh`` rebuilds only stale weights). The decoder's cache is replaced."""
    decoder.refresh(rows=rows)
    ids = torch.tensor([list(tokens)], dtype=torch.long, device=decoder.inner.embed_tokens.weight.device)
    decoder.prefill(ids, torch.ones_like(ids), len(tokens))
    return decoder.row_cache(0, len(tokens))


def shared_prompt_prefix(
    decoder: FastDecoder, prompts: Sequence[Sequence[int]], entries: list[PrefixEntry | None]
) -> list[PrefixEntry | None]:
    """``entries`` with every row that reuses nothing given the prompts' common prefix as its stored prefix,
    computed once at batch 1 (``sequence_cache``), when at least two such rows share
    ``SHARED_PREFIX_MIN_TOKENS`` tokens. The entry has no version, so it is never kept for a later call."""
    fresh = [i for i, e in enumerate(entries) if e is None]
    n = common_prefix_length([prompts[i] for i in fresh]) if len(fresh) > 1 else 0
    if n < SHARED_PREFIX_MIN_TOKENS:
        return entries
    tokens = list(prompts[fresh[0]][:n])
    keys, values = sequence_cache(decoder, tokens, rows=len(prompts))
    shared = PrefixEntry(None, tokens, keys, values, None)
    return [shared if e is None else e for e in entries]


class RowCollector:
    """What one ``generate`` call keeps of its rows as they leave the batch: each row's KV under its cache
    key (``store``, the next call's prefix cache) while the store stays within ``max_bytes``, and with a
    capture layer each row's captured hidden states (``captured``: prompt index -> frozen_states).

    ``entries``: per prompt, the stored prefix its prefill reused (its states are spliced in), or None."""

    def __init__(
        self,
        decoder: FastDecoder,
        max_bytes: int,
        prompts: Sequence[Sequence[int]],
        keys: list | None,
        entries: list[PrefixEntry | None],
    ) -> None:
        self.decoder = decoder
        self.max_bytes = max_bytes
        self.prompts = prompts
        self.keys = keys
        self.entries = entries
        self.store: dict = {}
        self.used_bytes = 0
        self.captured: dict[int, tuple[list[int], torch.Tensor]] = {}

    def keep(self, batch_rows: list[tuple[int, int]], outputs: list[list[int]]) -> None:
        """Keep the (batch position, prompt index) rows; ``outputs``: each prompt's generated tokens."""
        decoder = self.decoder
        cache = decoder.k_cache  # [layers, B, kv_heads, T, head_dim]; values are the same size
        per_token = 2 * cache.shape[0] * cache.shape[2] * cache.shape[4] * cache.element_size()
        if decoder.h_cache is not None:
            per_token += decoder.h_cache.shape[-1] * decoder.h_cache.element_size()
        for b, row in batch_rows:
            if not outputs[row]:
                continue
            tokens = list(self.prompts[row]) + outputs[row][:-1]  # the last sampled token was never fed
            states = self._row_states(b, tokens, self.entries[row]) if decoder.h_cache is not None else None
            if states is not None:
                self.captured[row] = (tokens, states)
            key = self.keys[row] if self.keys is not None else None
            if key is None or self.used_bytes + per_token * len(tokens) > self.max_bytes:
                continue
            self.used_bytes += per_token * len(tokens)
            k, v = decoder.row_cache(b, len(tokens))
            self.store[key] = PrefixEntry(decoder.weights_version, tokens, k, v, states)

    def _row_states(self, b: int, tokens: list[int], entry: PrefixEntry | None) -> torch.Tensor:
        """Batch row ``b``'s captured states of ``tokens``, its reused prefix's (``entry``) spliced in."""
        states = self.decoder.row_hidden(b, len(tokens))
        if entry is not None and entry.states is not None:  # a reused entry has states when capturing
            states[: len(entry.tokens)] = entry.states
        return states
