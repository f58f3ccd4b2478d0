"""The generation contract: ``Generator``, what it is asked (``SamplingParams``) and what it returns
(``Generation``), and the row caps and left padding every backend shares.

Every backend (``stratarl.rollout.kv_cache_generator``, ``stratarl.rollout.hf_generator``) follows one
stop rule and one log-prob convention, so greedy runs give identical tokens
(tests/rollout/test_rollout_generation.py checks it):

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

from collections.abc import Sequence
from dataclasses import dataclass, field
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

    Two optional capabilities, declared by the attributes below (a class that subclasses this Protocol
    inherits "neither"):

    - ``supports_cache_keys``: ``generate`` also takes ``cache_keys`` (one hashable key per row) and may reuse
      a row's KV from its previous call when the stored tokens prefix the new prompt; results equal a call
      without keys up to float rounding. The engine passes one key per rollout.
    - ``supports_capture``: ``generate`` also takes ``capture_layer=k`` (with cache keys) and fills each
      ``Generation.frozen_states`` with the hidden states entering decoder layer k of every token it read.

    ``rng`` is the sampling RNG a checkpoint saves and restores (None: the generator keeps no RNG of its own).
    """

    supports_cache_keys: bool = False
    supports_capture: bool = False
    rng: torch.Generator | None = None

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        params: SamplingParams,
        max_new_tokens: Sequence[int] | None = None,
    ) -> list[Generation]: ...


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
        ids[row, width - len(prompt) :] = torch.tensor(list(prompt), dtype=torch.long)
        mask[row, width - len(prompt) :] = 1
    return ids.to(device), mask.to(device)
