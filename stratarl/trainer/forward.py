"""The policy's forward over one rollout batch, behind one interface: ``PolicyForward``.

The scoring pass and the update ask a ``PolicyForward`` for two things: how to cut rows into micro-batches
(``micro_batches``) and the log-probs / entropies / hidden states of a micro-batch (``response_logprobs``).
Two implementations, chosen once per batch by ``batch_forward``:

    ReferenceForward  every layer in every micro-batch (stratarl.trainer.logprobs.response_logprobs)
    PrefixForward     the frozen layers once per batch (a ``Prefix``: computed, or kept by the generator while
                      sampling), then only the trainable layers per micro-batch, whole prompt groups together
                      (stratarl.trainer.prefix)

Both give the same values up to float rounding, so the same gradients (tests/trainer/test_trainer_update_fast.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, cast

import torch

from stratarl.infra.precision import DevicePolicy
from stratarl.models import decoder_of
from stratarl.trainer.batch import TokenBatch, micro_batches
from stratarl.trainer.logprobs import response_logprobs
from stratarl.trainer.prefix import (
    Prefix,
    captured_prefix,
    frozen_prefix,
    group_micro_batches,
    lowest_trainable_layer,
    prefix_response_logprobs,
    unsupported_reason,
)

UPDATE_IMPLS = ("fast", "reference")


class PolicyForward(Protocol):
    """The policy's forward over the rows of one batch (or of a selection of them: ``select``)."""

    @property
    def prefix(self) -> Prefix | None:
        """The frozen layers' states this forward reuses; None: it runs every layer."""
        ...

    def micro_batches(self, batch: TokenBatch, token_budget: int) -> list[list[int]]:
        """``batch``'s rows (positions in it) cut into micro-batches of at most ``token_budget`` padded tokens."""
        ...

    def select(self, rows: list[int]) -> PolicyForward:
        """This forward for ``batch.select(rows)`` (``rows``: positions in the batch this forward covers)."""
        ...

    def response_logprobs(
        self,
        model: torch.nn.Module,
        mb: TokenBatch,
        *,
        chunk_tokens: int,
        temperature: float,
        with_entropy: bool = False,
        return_hidden: bool = False,
        with_logprobs: bool = True,
    ) -> dict[str, torch.Tensor]:
        """``logprobs`` and ``entropy`` [B, T] (0 off the response mask) of micro-batch ``mb`` (every row this
        forward covers), and ``hidden`` [B, T, H] with ``return_hidden``: ``logprobs.response_logprobs``'s
        outputs. ``with_logprobs=False``: only ``hidden`` is needed (an implementation may compute more)."""
        ...


@dataclass(frozen=True)
class ReferenceForward:
    """Every layer of ``model`` in every micro-batch (micro-batches by length: ``batch.micro_batches``)."""

    prefix: None = None

    def micro_batches(self, batch: TokenBatch, token_budget: int) -> list[list[int]]:
        return micro_batches(batch.row_lengths(), token_budget)

    def select(self, rows: list[int]) -> ReferenceForward:
        return self

    def response_logprobs(
        self,
        model: torch.nn.Module,
        mb: TokenBatch,
        *,
        chunk_tokens: int,
        temperature: float,
        with_entropy: bool = False,
        return_hidden: bool = False,
        with_logprobs: bool = True,
    ) -> dict[str, torch.Tensor]:
        return response_logprobs(
            model,
            mb.input_ids,
            mb.attention_mask,
            mb.prompt_lengths,
            mb.response_mask,
            chunk_tokens=chunk_tokens,
            temperature=temperature,
            with_entropy=with_entropy,
            return_hidden=return_hidden,
            with_logprobs=with_logprobs,
        )


REFERENCE = ReferenceForward()


@dataclass(frozen=True)
class PrefixForward:
    """Only the trainable layers, from ``prefix`` (the frozen layers' states of the whole batch); ``rows``: the
    covered rows' positions in the prefix's batch (None: all of them, in order). Micro-batches keep prompt groups
    together (``group_micro_batches``): each group's prompt runs once per micro-batch."""

    prefix: Prefix
    rows: tuple[int, ...] | None = None

    def _rows(self, local: list[int]) -> list[int]:
        return list(local) if self.rows is None else [self.rows[i] for i in local]

    def micro_batches(self, batch: TokenBatch, token_budget: int) -> list[list[int]]:
        groups = self.prefix.inverse if self.rows is None else self.prefix.inverse[torch.as_tensor(self.rows)]
        return group_micro_batches(batch.row_lengths(), groups, token_budget)

    def select(self, rows: list[int]) -> PrefixForward:
        return PrefixForward(self.prefix, tuple(self._rows(rows)))

    def response_logprobs(
        self,
        model: torch.nn.Module,
        mb: TokenBatch,
        *,
        chunk_tokens: int,
        temperature: float,
        with_entropy: bool = False,
        return_hidden: bool = False,
        with_logprobs: bool = True,
    ) -> dict[str, torch.Tensor]:
        # The log-probs come with the states at little cost: computed even when only ``hidden`` is asked for.
        return prefix_response_logprobs(
            model,
            self.prefix,
            self._rows(list(range(mb.size))),
            mb.input_ids,
            mb.prompt_lengths,
            mb.response_mask,
            chunk_tokens=chunk_tokens,
            temperature=temperature,
            with_entropy=with_entropy,
            return_hidden=return_hidden,
        )


def _check_impl(impl: str) -> None:
    if impl not in UPDATE_IMPLS:
        raise ValueError(
            f"update impl {impl!r} is not one of {UPDATE_IMPLS}; use 'fast' (or 'reference' as a baseline)"
        )


def capture_layer(model: torch.nn.Module, impl: str = "fast") -> int | None:
    """The decoder layer whose input states the training rollouts should keep for ``batch_forward``: the lowest
    trainable one, when the fast update runs and layers below it are frozen; else None (nothing kept)."""
    if impl != "fast" or unsupported_reason(model) is not None:
        return None
    decoder = decoder_of(model)
    k = lowest_trainable_layer(decoder)
    layers = cast(torch.nn.ModuleList, decoder.layers)  # a Llama-style decoder: unsupported_reason checked it
    return k if 0 < k < len(layers) else None


def batch_forward(
    model: torch.nn.Module,
    batch: TokenBatch,
    policy: DevicePolicy,
    *,
    impl: str = "fast",
    states: list | None = None,
) -> PolicyForward:
    """The forward the scoring pass and every optimizer step of ``batch`` share. `fast` on a model the frozen-prefix
    path covers: a ``PrefixForward`` on the states the generator kept while sampling (``captured_prefix``;
    ``states`` = each row's ``Rollout.frozen_states``; ``Prefix.source`` "rollouts") when they cover the batch's
    tokens exactly, else on ``frozen_prefix`` computed once, in ``policy``'s precision (source "computed").
    `reference`, or a model the fast path does not cover: ``REFERENCE``."""
    _check_impl(impl)
    if impl != "fast" or unsupported_reason(model) is not None:
        return REFERENCE
    if states is not None:
        prefix, _ = captured_prefix(model, batch.input_ids, batch.attention_mask, batch.prompt_lengths, states)
        if prefix is not None:
            return PrefixForward(prefix)
    with policy.autocast():
        return PrefixForward(frozen_prefix(model, batch.input_ids, batch.attention_mask, batch.prompt_lengths))
