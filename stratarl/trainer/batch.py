"""The step's batch in three stages, each returned new (never filled in place), and its micro-batches.

    TokenBatch   collected: padded tokens and the response mask        (collate_rollouts)
    ScoredBatch  + behaviour / reference log-probs, critic values       (stratarl.trainer.update.score_batch)
    TrainBatch   + advantages and returns                               (ScoredBatch.with_advantages)

Row b of a batch is ``prompt_b + response_b`` right-padded to L. Response-aligned
tensors are [B, T] with T = the longest response: column j of row b is response
token j (policy or observation), whatever the prompt length. This is the layout
the ``stratarl.algos`` functions take ([B, T] with a response mask).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch


def _ids(x) -> list[int]:
    return x.tolist() if isinstance(x, torch.Tensor) else list(x)


def _select(batch, rows: Sequence[int] | torch.Tensor):
    """``batch`` (any stage) restricted to ``rows``, padding trimmed to the selection's longest row: [B, L]
    tensors to L columns, [B, T] tensors to T, [B] tensors by row; other fields as they are."""
    idx = torch.as_tensor(rows, dtype=torch.long)
    L = int(batch.row_lengths()[idx].max().item()) if idx.numel() else 0
    T = int(batch.response_lengths[idx].max().item()) if idx.numel() else 0
    out = {}
    for f in dataclasses.fields(batch):
        value = getattr(batch, f.name)
        if not isinstance(value, torch.Tensor):
            out[f.name] = value
        elif f.name in ("input_ids", "attention_mask"):
            out[f.name] = value[idx, :L]
        elif value.dim() == 2:
            out[f.name] = value[idx, :T]
        else:
            out[f.name] = value[idx]
    return type(batch)(**out)


def _to(batch, device: str | torch.device):
    return type(batch)(
        **{
            f.name: (v.to(device) if isinstance(v := getattr(batch, f.name), torch.Tensor) else v)
            for f in dataclasses.fields(batch)
        }
    )


@dataclass(frozen=True)
class TokenBatch:
    """Stage 1, collected: the padded tokens of B rollouts (or demonstrations).

    input_ids, attention_mask [B, L]; prompt_lengths, response_lengths [B]; response_mask [B, T].
    """

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    prompt_lengths: torch.Tensor
    response_lengths: torch.Tensor
    response_mask: torch.Tensor

    @property
    def size(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def num_policy_tokens(self) -> int:
        return int(self.response_mask.sum().item())

    def row_lengths(self) -> torch.Tensor:
        return self.prompt_lengths + self.response_lengths

    def select(self, rows: Sequence[int] | torch.Tensor):
        """Rows ``rows`` as a new batch of the same stage, padding trimmed to the selection's longest row."""
        return _select(self, rows)

    def to(self, device: str | torch.device):
        """A copy of the same stage on ``device``."""
        return _to(self, device)

    def tokens(self) -> TokenBatch:
        """The token fields alone (a later stage without its scores)."""
        return TokenBatch(
            self.input_ids, self.attention_mask, self.prompt_lengths, self.response_lengths, self.response_mask
        )


@dataclass(frozen=True)
class ScoredBatch(TokenBatch):
    """Stage 2, scored: the tokens with what the no-grad scoring pass computed (stratarl.trainer.update).

    old_logprobs [B, T]: the behaviour policy's log-probs (the sampler's, or recomputed by the trainer).
    on_policy: the update takes its own forward pass, detached, as the behaviour log-probs (one optimizer step
    per batch with recomputed log-probs: every ratio is exactly 1); ``old_logprobs`` are then the sampler's.
    ref_logprobs [B, T]: the reference model's, or None when the algorithm has no KL term (algo.kl_coef 0).
    old_values [B, T]: the critic's, or None when the algorithm has no critic.
    behaviour_logprobs [B, T]: the sampler's own log-probs (pi_behav, what the behaviour corrections weigh
    against), or None when the batch was not sampled (demonstrations).
    learner_logprobs [B, T]: the learner's log-probs before the update (the recomputed pi_old), when the
    scoring pass computed them; None otherwise (the on-policy step of a run without an off-policy source).
    """

    old_logprobs: torch.Tensor
    on_policy: bool
    ref_logprobs: torch.Tensor | None
    old_values: torch.Tensor | None
    behaviour_logprobs: torch.Tensor | None = field(default=None, kw_only=True)
    learner_logprobs: torch.Tensor | None = field(default=None, kw_only=True)

    def with_advantages(self, advantages: torch.Tensor, returns: torch.Tensor) -> TrainBatch:
        """Stage 3: this batch with the estimator's advantages and returns [B, T]."""
        fields = {f.name: getattr(self, f.name) for f in dataclasses.fields(ScoredBatch)}
        return TrainBatch(**fields, advantages=advantages, returns=returns)


@dataclass(frozen=True)
class TrainBatch(ScoredBatch):
    """Stage 3, ready to train: a scored batch with advantages and returns [B, T] (the update's input)."""

    advantages: torch.Tensor
    returns: torch.Tensor


def without_loss(batch: TrainBatch, rows: Sequence[bool]) -> TrainBatch:
    """``batch`` with the rows where ``rows`` is true out of the loss: their response mask and advantages zeroed
    (every loss term, KL and entropy included, reads the mask; a token-sum aggregation still counts the row in B,
    stratarl.algos.losses.aggregate_loss). The advantages were computed before, so the group baselines count them."""
    drop = torch.tensor([bool(r) for r in rows], dtype=torch.bool, device=batch.response_mask.device)
    if drop.numel() != batch.size:
        raise ValueError(f"{drop.numel()} row flags for a batch of {batch.size} rows")
    if not bool(drop.any()):
        return batch
    keep = (~drop).to(batch.response_mask.dtype)[:, None]
    return dataclasses.replace(
        batch, response_mask=batch.response_mask * keep, advantages=batch.advantages * keep.to(batch.advantages.dtype)
    )


def collate_sequences(
    prompts: Sequence[Sequence[int]],
    responses: Sequence[Sequence[int]],
    response_masks: Sequence[Sequence[int]],
    pad_id: int,
) -> TokenBatch:
    """Pad token lists into a TokenBatch (``response_masks[b]`` has one 0/1 per response token)."""
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
        input_ids[b, : len(row)] = torch.tensor(row, dtype=torch.long)
        attention_mask[b, : len(row)] = 1
        if rlen[b]:
            response_mask[b, : rlen[b]] = torch.tensor(list(response_masks[b]), dtype=torch.float32)
    return TokenBatch(input_ids, attention_mask, torch.tensor(plen), torch.tensor(rlen), response_mask)


def collate_rollouts(rollouts: Sequence, pad_id: int) -> TokenBatch:
    """TokenBatch from engine ``Rollout`` objects (prompt_ids, response_ids, response_mask)."""
    return collate_sequences(
        [_ids(r.prompt_ids) for r in rollouts],
        [_ids(r.response_ids) for r in rollouts],
        [_ids(r.response_mask) for r in rollouts],
        pad_id,
    )


def scatter_response_values(values: Sequence[Sequence[float]], response_lengths: torch.Tensor) -> torch.Tensor:
    """Per-response-token lists (e.g. sampling log-probs) -> [B, T] zero-padded float tensor."""
    B, T = len(values), int(response_lengths.max().item()) if len(values) else 0
    out = torch.zeros(B, T, dtype=torch.float32)
    for b, v in enumerate(values):
        v = _ids(v) if isinstance(v, torch.Tensor) else list(v)
        out[b, : len(v)] = torch.tensor(v, dtype=torch.float32)
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
        raise ValueError(
            f"trainer.mini_batches={num_mini_batches} exceeds the {num_rows} rollouts per step; "
            "lower trainer.mini_batches or raise trainer.prompts_per_step / rollout.group_size"
        )
    perm = torch.randperm(num_rows, generator=generator).tolist()
    return [perm[i::num_mini_batches] for i in range(num_mini_batches)]
