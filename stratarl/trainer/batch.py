"""Collate rollouts into padded tensors, and split them into token-budgeted micro-batches.

Row b of a batch is ``prompt_b + response_b`` right-padded to L. Response-aligned
tensors are [B, T] with T = the longest response: column j of row b is response
token j (policy or observation), whatever the prompt length. This is the layout
the ``stratarl.algos`` functions take ([B, T] with a response mask).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Sequence

import torch


def _ids(x) -> list[int]:
    return x.tolist() if isinstance(x, torch.Tensor) else list(x)


@dataclass
class RolloutBatch:
    """Padded tensors of B rollouts. Optional fields are None until computed.

    input_ids, attention_mask [B, L]; prompt_lengths, response_lengths [B];
    response_mask, advantages, returns, old_logprobs, ref_logprobs, old_values [B, T].
    """

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    prompt_lengths: torch.Tensor
    response_lengths: torch.Tensor
    response_mask: torch.Tensor
    old_logprobs: torch.Tensor | None = None
    ref_logprobs: torch.Tensor | None = None
    old_values: torch.Tensor | None = None
    advantages: torch.Tensor | None = None
    returns: torch.Tensor | None = None

    @property
    def size(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def num_policy_tokens(self) -> int:
        return int(self.response_mask.sum().item())

    def row_lengths(self) -> torch.Tensor:
        return self.prompt_lengths + self.response_lengths

    def select(self, rows: Sequence[int] | torch.Tensor) -> RolloutBatch:
        """Rows ``rows`` as a new batch, padding trimmed to the selection's longest row."""
        idx = torch.as_tensor(rows, dtype=torch.long)
        L = int(self.row_lengths()[idx].max().item()) if idx.numel() else 0
        T = int(self.response_lengths[idx].max().item()) if idx.numel() else 0
        out = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if value is None:
                out[f.name] = None
            elif f.name in ("input_ids", "attention_mask"):
                out[f.name] = value[idx, :L]
            elif value.dim() == 2:
                out[f.name] = value[idx, :T]
            else:
                out[f.name] = value[idx]
        return RolloutBatch(**out)

    def to(self, device: str | torch.device) -> RolloutBatch:
        return RolloutBatch(**{f.name: (None if getattr(self, f.name) is None else getattr(self, f.name).to(device))
                               for f in dataclasses.fields(self)})


def collate_sequences(prompts: Sequence[Sequence[int]], responses: Sequence[Sequence[int]],
                      response_masks: Sequence[Sequence[int]], pad_id: int) -> RolloutBatch:
    """Pad token lists into a RolloutBatch (``response_masks[b]`` has one 0/1 per response token)."""
    if not (len(prompts) == len(responses) == len(response_masks)):
        raise ValueError(f"got {len(prompts)} prompts, {len(responses)} responses, {len(response_masks)} masks")
    B = len(prompts)
    plen = [len(p) for p in prompts]
    rlen = [len(r) for r in responses]
    for b, (r, m) in enumerate(zip(responses, response_masks)):
        if len(r) != len(m):
            raise ValueError(f"row {b}: {len(r)} response tokens but {len(m)} mask entries")
        if plen[b] == 0:
            raise ValueError(f"row {b}: empty prompt (the first response token needs a state to be predicted from)")
    L = max((p + r for p, r in zip(plen, rlen)), default=0)
    T = max(rlen, default=0)
    input_ids = torch.full((B, L), pad_id, dtype=torch.long)
    attention_mask = torch.zeros(B, L, dtype=torch.long)
    response_mask = torch.zeros(B, T, dtype=torch.float32)
    for b in range(B):
        row = list(prompts[b]) + list(responses[b])
        input_ids[b, :len(row)] = torch.tensor(row, dtype=torch.long)
        attention_mask[b, :len(row)] = 1
        if rlen[b]:
            response_mask[b, :rlen[b]] = torch.tensor(list(response_masks[b]), dtype=torch.float32)
    return RolloutBatch(input_ids, attention_mask, torch.tensor(plen), torch.tensor(rlen), response_mask)


def collate_rollouts(rollouts: Sequence, pad_id: int) -> RolloutBatch:
    """RolloutBatch from engine ``Rollout`` objects (prompt_ids, response_ids, response_mask)."""
    return collate_sequences([_ids(r.prompt_ids) for r in rollouts], [_ids(r.response_ids) for r in rollouts],
                             [_ids(r.response_mask) for r in rollouts], pad_id)


def scatter_response_values(values: Sequence[Sequence[float]], response_lengths: torch.Tensor) -> torch.Tensor:
    """Per-response-token lists (e.g. sampling log-probs) -> [B, T] zero-padded float tensor."""
    B, T = len(values), int(response_lengths.max().item()) if len(values) else 0
    out = torch.zeros(B, T, dtype=torch.float32)
    for b, v in enumerate(values):
        v = _ids(v) if isinstance(v, torch.Tensor) else list(v)
        out[b, :len(v)] = torch.tensor(v, dtype=torch.float32)
    return out


def micro_batches(row_lengths: torch.Tensor, token_budget: int, rows: Sequence[int] | None = None) -> list[list[int]]:
    """Split ``rows`` into micro-batches whose padded size (rows x longest row) fits ``token_budget``.

    Rows are sorted by length (longest first) so rows of similar length share a
    micro-batch: little padding. A row longer than the budget gets a micro-batch alone.
    """
    rows = list(range(row_lengths.shape[0])) if rows is None else list(rows)
    order = sorted(rows, key=lambda r: -int(row_lengths[r]))
    out: list[list[int]] = []
    current: list[int] = []
    for r in order:
        longest = int(row_lengths[current[0]]) if current else int(row_lengths[r])
        if current and (len(current) + 1) * longest > token_budget:
            out.append(current)
            current = []
        current.append(r)
    if current:
        out.append(current)
    return out


def mini_batch_rows(num_rows: int, num_mini_batches: int, generator: torch.Generator) -> list[list[int]]:
    """Shuffle rows with ``generator`` and cut them into ``num_mini_batches`` near-equal parts."""
    if num_mini_batches > num_rows:
        raise ValueError(f"trainer.mini_batches={num_mini_batches} exceeds the {num_rows} rollouts per step; "
                         "lower trainer.mini_batches or raise trainer.prompts_per_step / rollout.group_size")
    perm = torch.randperm(num_rows, generator=generator).tolist()
    return [perm[i::num_mini_batches] for i in range(num_mini_batches)]
