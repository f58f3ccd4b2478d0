"""Several members' ``generate`` calls as one: each member's rows sampled exactly as its own
``KVCacheGenerator.generate`` samples them, with the forward passes of all members batched (``StackedDecoder``).

Per member everything is its own and happens in its generator's order: its row limits and stop rules
(``_Rows``), its prefix cache (entries looked up before, kept after, under its cache keys), its sampling RNG
(one uniform per live row per step, the same draws as alone), when its finished rows leave the batch
(``drop_finished``). Only the decoder's arithmetic is shared: one prefill and one decode step per token for all
members' rows, on stacked weights. A member whose generator cannot be stacked (``stack_reason``) generates alone.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from stratarl.infra.stacked import architecture, stack_reason, weights_version
from stratarl.rollout.generator import Generation, Generator, SamplingParams, left_pad, row_limits
from stratarl.rollout.kv_cache_generator import KVCacheGenerator, _Rows
from stratarl.rollout.prefix_cache import RowCollector, reusable_prefixes
from stratarl.rollout.stacked_decoder import MemberView, StackedDecoder


@dataclass
class GenerateCall:
    """One member's ``generate(prompts, params, max_new_tokens, cache_keys=...)`` on its own ``generator``."""

    generator: Generator
    prompts: Sequence[Sequence[int]]
    params: SamplingParams
    max_new_tokens: Sequence[int] | None = None
    cache_keys: Sequence | None = None


def generate_alone_reason(generator) -> str | None:
    """None when ``generator``'s calls can be stacked with others, else why it generates alone."""
    if not isinstance(generator, KVCacheGenerator) or generator.fast_decoder is None:
        return "not a KVCacheGenerator on the fast decoder"
    if generator.fast_decoder.dtype != torch.float32:
        return "the fast decoder runs in bf16"
    return stack_reason(generator.model)


def generate_together(calls: Sequence[GenerateCall]) -> list[list[Generation] | BaseException]:
    """Each call's generations (or the exception it raised), as its generator alone would give them up to float
    rounding; calls of generators of one architecture run as one stacked computation."""
    results: list = [None] * len(calls)
    groups: dict[tuple, list[int]] = {}
    for i, call in enumerate(calls):
        if generate_alone_reason(call.generator) is not None:
            results[i] = _alone(call)
        else:
            groups.setdefault(architecture(_stacked_generator(call).model), []).append(i)
    for members in groups.values():
        for i, out in zip(members, _together([calls[i] for i in members])):
            results[i] = out
    return results


def _stacked_generator(call: GenerateCall) -> KVCacheGenerator:
    """The generator of a call that ``alone_reason`` let through to the stacked path."""
    if not isinstance(call.generator, KVCacheGenerator):
        raise TypeError(f"a stacked call needs a KVCacheGenerator, got {type(call.generator).__name__}")
    return call.generator


def _alone(call: GenerateCall):
    try:
        keys: dict[str, Any] = {} if call.cache_keys is None else {"cache_keys": call.cache_keys}
        return call.generator.generate(call.prompts, call.params, call.max_new_tokens, **keys)
    except Exception as error:  # noqa: BLE001 - this member's failure only
        return error


class _Member:
    """One call's state through the stacked prefill and decode (``KVCacheGenerator.generate``'s locals)."""

    def __init__(self, call: GenerateCall) -> None:
        gen = _stacked_generator(call)
        self.call, self.gen, self.params = call, gen, call.params
        prompts = call.prompts
        limits = row_limits(len(prompts), call.params, call.max_new_tokens)
        if call.cache_keys is not None and len(call.cache_keys) != len(prompts):
            raise ValueError(f"cache_keys has {len(call.cache_keys)} entries for {len(prompts)} prompts")
        self.keys = list(call.cache_keys) if call.cache_keys is not None else None
        self.rows = _Rows(limits, gen.eos_ids, gen._matcher(tuple(call.params.stop_strings)), call.params.eos_after)
        self.max_limit = max(limits) if limits else 0
        self.collector: RowCollector | None = None
        self.entries: list = []

    def prefill_inputs(self) -> tuple[torch.Tensor, torch.Tensor, list]:
        """(ids, attention, prefixes) of the live rows, reusing the generator's stored prefixes
        (``KVCacheGenerator._start_fast``)."""
        gen, live = self.gen, self.rows.batch
        prompts = [self.call.prompts[i] for i in live]
        keys = [self.keys[i] for i in live] if self.keys is not None else None
        view = MemberView(None, 0, weights_version(gen.model))
        # A MemberView has every part of a FastDecoder the prefix cache reads when it captures no states.
        entries = (
            reusable_prefixes(gen._prefix_store, view, prompts, keys)  # type: ignore[arg-type]
            if keys is not None
            else [None] * len(live)
        )
        suffixes = [list(p[len(e.tokens) :]) if e is not None else list(p) for p, e in zip(prompts, entries)]
        ids, attention = left_pad(suffixes, gen.pad_id, gen.device)
        gen.last_reused_tokens = sum(len(e.tokens) for e in entries if e is not None)
        self.entries = [None] * len(self.call.prompts)
        for i, entry in zip(live, entries):
            self.entries[i] = entry
        return ids, attention, [(e.keys, e.values) if e is not None else None for e in entries]

    def sample(self, logits: torch.Tensor) -> torch.Tensor | None:
        """Sample and record the batch rows' next tokens (``KVCacheGenerator._decode``'s body); returns the tokens
        of the rows that go on, None when every row has ended. Rows that leave are handed to the collector and
        ``self.keep`` says which batch positions stay (None: all)."""
        rows = self.rows
        tokens, logprobs = self.gen._sample(logits, self.params, rows)
        going_on = rows.record(tokens.tolist(), logprobs)
        self.keep = None
        if not going_on:
            return None
        finished_in_batch = len(rows.batch) - len(going_on)
        if self.gen.drop_finished and finished_in_batch and finished_in_batch * 4 >= len(rows.batch):
            if self.collector is not None:
                kept = set(going_on)
                self.collector.keep([(b, row) for b, row in enumerate(rows.batch) if b not in kept], rows.outputs)
            self.keep = torch.tensor(going_on, device=tokens.device)
            tokens = tokens[self.keep]
            rows.keep_only(going_on)
        return tokens

    def finish(self) -> list[Generation]:
        if self.collector is not None:
            self.collector.keep(list(enumerate(self.rows.batch)), self.rows.outputs)
        self.gen._prefix_store = self.collector.store if self.collector is not None else {}
        return self.rows.generations({})


@torch.inference_mode()
def _together(calls: Sequence[GenerateCall]) -> list:
    results: list = [None] * len(calls)
    members: dict[int, _Member] = {}
    inputs = {}
    for i, call in enumerate(calls):
        try:
            member = _Member(call)
            if not member.rows.batch:
                results[i] = [Generation([], [], "length") for _ in call.prompts]
                continue
            inputs[i] = member.prefill_inputs()
            members[i] = member
        except Exception as error:  # noqa: BLE001 - this member's failure only
            results[i] = error
    if not members:
        return results
    order = list(members)
    decoder = StackedDecoder([_stacked_generator(calls[i]).model for i in order])
    logits = decoder.prefill(
        [inputs[i][0] for i in order],
        [inputs[i][1] for i in order],
        [inputs[i][2] for i in order],
        [members[i].max_limit for i in order],
    )
    current = {}
    for slot, i in enumerate(order):
        member = members[i]
        if member.keys is not None:
            member.collector = RowCollector(
                decoder.member_view(slot),  # type: ignore[arg-type]  # as in reusable_prefixes above
                member.gen.prefix_cache_bytes,
                member.call.prompts,
                member.keys,
                member.entries,
            )
        current[slot] = logits[slot]
    live = dict(enumerate(order))  # slot -> call index
    while live:
        tokens, keep = {}, {}
        for slot, i in list(live.items()):
            member = members[i]
            try:
                next_tokens = member.sample(current[slot])
                if next_tokens is None:
                    results[i] = member.finish()
            except Exception as error:  # noqa: BLE001 - this member's failure only (e.g. NaN logits)
                results[i], next_tokens = error, None
            if next_tokens is None:
                del live[slot]
            else:
                tokens[slot], keep[slot] = next_tokens, member.keep
        if not live:
            break
        decoder.select(keep)
        current = decoder.decode(tokens)
    return results
