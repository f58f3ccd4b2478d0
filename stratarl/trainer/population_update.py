"""Several learners' policy updates as one computation: each member's K epochs x M mini-batches of optimizer
steps, exactly as ``update_policy`` takes them alone, with the members' forward and backward passes stacked.

Per member everything is its own: its mini-batch draws (its shuffle generator), micro-batches and their weights
(``micro_batch_plan``), loss terms (``micro_batch_terms``: its algorithm's policy loss, KL, entropy, critic,
behaviour correction), its SORL clip-bias buffers, and the end of each optimizer step (``apply_gradients``:
normaliser, clipping, its optimizer and scheduler). What is shared is arithmetic: micro-batch i of every member
that has one runs through one stacked forward (stratarl.infra.stacked: member k's rows on member k's weights,
stacked as autograd leaves), and one backward of the sum of the members' weighted losses gives each member's
gradient in its own slice (no term mixes members, so the sum's gradient in slice k is member k's loss's).

The stacked forward runs each row's whole sequence with causal attention (``causal_hidden``), in passes of rows
of similar length (``CHUNK_ROWS`` of each member's rows, longest first): the same values as the solo update's
forward (``response_logprobs``, which shares each prompt once) up to float rounding. Members the stacked path
does not cover (a frozen prefix, another precision, a model ``stack_reason`` refuses) update alone with
``update_policy``.
"""

from __future__ import annotations

import types
from collections import defaultdict
from dataclasses import dataclass

import torch

from stratarl.algos.sorl import ClipBiasNormalizer
from stratarl.infra.stacked import StackedParams, architecture, causal_hidden, parameter_table, stack_reason
from stratarl.trainer.batch import TrainBatch, mini_batch_rows
from stratarl.trainer.forward import PolicyForward
from stratarl.trainer.learner import Learner
from stratarl.trainer.logprobs import response_head_outputs
from stratarl.trainer.settings import UpdateSettings
from stratarl.trainer.update import (
    apply_gradients,
    micro_batch_plan,
    micro_batch_terms,
    update_metrics,
    update_policy,
)

CHUNK_ROWS = 8
"""Rows of each member per stacked pass (longest first): little padding, few passes."""


@dataclass
class UpdateCall:
    """One member's ``update_policy(learner, batch, settings, generator, forward=...)``."""

    learner: Learner
    batch: TrainBatch
    settings: UpdateSettings
    generator: torch.Generator
    forward: PolicyForward | None = None

    def alone(self) -> dict[str, float]:
        """This call's ``update_policy``, on its own."""
        return update_policy(self.learner, self.batch, self.settings, self.generator, forward=self.forward)


def update_alone_reason(call: UpdateCall) -> str | None:
    """None when ``call`` can be stacked with others, else why it updates alone."""
    if call.forward is not None and call.forward.prefix is not None:
        return "a frozen prefix (model.trainable_layers): the solo fast update"
    if call.settings.policy.autocast_dtype is not None:
        return f"precision {call.settings.policy.autocast_dtype}"
    return stack_reason(call.learner.model)


def update_together(calls: list[UpdateCall]) -> list[dict | BaseException]:
    """Each call's update metrics (or the exception that failed it), as ``update_policy`` alone gives them up to
    float rounding; calls whose models share an architecture are stacked."""
    results: list = [None] * len(calls)
    groups: dict[tuple, list[int]] = {}
    for i, call in enumerate(calls):
        if update_alone_reason(call) is not None:
            try:
                results[i] = call.alone()
            except Exception as error:  # noqa: BLE001 - this member's failure only
                results[i] = error
        else:
            groups.setdefault(architecture(call.learner.model), []).append(i)
    for members in groups.values():
        for i, out in zip(members, _update_group([calls[i] for i in members])):
            results[i] = out
    return results


def _update_group(calls: list[UpdateCall]) -> list:
    """``update_policy`` of each call, optimizer step j of every member together."""
    results: list = [None] * len(calls)
    plans: dict[int, list[list[int]]] = {}
    for i, call in enumerate(calls):
        try:  # every epoch's mini-batches drawn up front: the same draws, in the same order, as alone
            epochs, minis = call.settings.epochs, call.settings.mini_batches
            plans[i] = [rows for _ in range(epochs) for rows in mini_batch_rows(call.batch.size, minis, call.generator)]
        except Exception as error:  # noqa: BLE001
            results[i] = error
    per_step: dict[int, list[dict]] = {i: [] for i in plans}
    for call in calls:
        call.learner.model.train()
    try:
        for j in range(max((len(p) for p in plans.values()), default=0)):
            active = [i for i in plans if j < len(plans[i]) and results[i] is None]
            sums = _accumulate([calls[i] for i in active], [plans[i][j] for i in active], results, active)
            for i in active:
                if results[i] is None:
                    try:
                        per_step[i].append(apply_gradients(calls[i].learner, calls[i].settings, sums[i]))
                    except Exception as error:  # noqa: BLE001
                        results[i] = error
    finally:
        for call in calls:
            call.learner.model.eval()
    for i in plans:
        if results[i] is None:
            results[i] = update_metrics(per_step[i])
    return results


def _accumulate(calls: list[UpdateCall], rows: list[list[int]], results: list, index: list[int]) -> dict[int, dict]:
    """``accumulate_gradients`` of each member's mini-batch ``rows``, micro-batch m of every member stacked.
    A member whose loss terms raise gets its exception in ``results`` and leaves the group."""
    sums: dict[int, defaultdict[str, float]] = {i: defaultdict(float) for i in index}
    tokens = dict.fromkeys(index, 0)
    plans = {i: micro_batch_plan(call.batch.select(r), call.settings) for i, call, r in zip(index, calls, rows)}
    by_index = dict(zip(index, calls))
    for m in range(max((len(p) for p in plans.values()), default=0)):
        part = [i for i in index if m < len(plans[i]) and results[i] is None]
        if not part:
            continue
        stack = StackedParams([by_index[i].learner.model for i in part], grad=True)
        fused = stack.fused()
        outs = stacked_outputs(
            stack,
            fused,
            [plans[i][m][1] for i in part],
            [by_index[i].settings for i in part],
            [by_index[i].learner.value_head is not None for i in part],
        )
        total = None
        for slot, i in enumerate(part):
            call, (_, mb, weight) = by_index[i], plans[i][m]
            try:
                loss, clip_bias, metrics = micro_batch_terms(call.learner, mb, call.settings, outs[slot])
                if call.learner.normalizer is not None:
                    _clip_bias_grads(
                        call.learner,
                        stack,
                        slot,
                        None if clip_bias is None else clip_bias * weight,
                        skip=float(metrics["loss/clip_frac"]) == 0.0,
                    )
            except Exception as error:  # noqa: BLE001 - this member leaves the group
                results[i] = error
                continue
            total = loss * weight if total is None else total + loss * weight
            for key, value in metrics.items():
                sums[i][key] += float(value) * weight
            tokens[i] += int(mb.response_mask.sum())
        if total is not None:
            total.backward()
            stack.grads_into([slot for slot, i in enumerate(part) if results[i] is None])
    for i in index:
        sums[i]["perf/update_policy_tokens"] = float(tokens[i])
    return {i: dict(s) for i, s in sums.items()}


def _clip_bias_grads(
    learner: Learner, stack: StackedParams, slot: int, clip_bias: torch.Tensor | None, *, skip: bool
) -> None:
    """SORL's ``normalizer.backward`` first half for a stacked member: the clip-bias objective's gradient (its
    slice of the stacked leaves) into the member's C buffers."""
    normalizer = learner.normalizer
    if clip_bias is None or skip or not clip_bias.requires_grad:
        return
    if not isinstance(normalizer, ClipBiasNormalizer):
        raise TypeError(f"a stacked member's normaliser needs C buffers (ClipBiasNormalizer), got {normalizer!r}")
    keys = {id(p): key for key, p in parameter_table(learner.model).items()}
    leaves = [stack.leaves[keys[id(p)]] for p in normalizer.parameters]
    grads = torch.autograd.grad(clip_bias, leaves, retain_graph=True, allow_unused=True)
    for buffer, grad in zip(normalizer.c_buffers, grads):
        if grad is not None:
            buffer.add_(grad[slot])


def stacked_outputs(
    stack: StackedParams, fused, mbs: list[TrainBatch], settings: list[UpdateSettings], need_hidden: list[bool]
) -> list[dict[str, torch.Tensor]]:
    """Per member, what ``response_logprobs(..., with_entropy=True)`` returns for its micro-batch ``mbs[k]``:
    ``logprobs`` and ``entropy`` [B, T] (0 off the response mask), and ``hidden`` [B, T, H] when
    ``need_hidden[k]`` (a critic reads it)."""
    K = len(mbs)
    device = fused.embed.device
    lengths = [mb.row_lengths().tolist() for mb in mbs]
    orders = [sorted(range(len(lens)), key=lens.__getitem__, reverse=True) for lens in lengths]  # longest first
    H = fused.embed.shape[-1]
    pieces: list[list[torch.Tensor]] = [[] for _ in mbs]
    for start in range(0, max(len(o) for o in orders), CHUNK_ROWS):
        chosen = [o[start : start + CHUNK_ROWS] for o in orders]
        width = max((lengths[k][b] for k in range(K) for b in chosen[k]), default=1)
        rows = max(len(c) for c in chosen)
        ids = torch.zeros((K, rows, width), dtype=torch.long, device=device)
        for k, (mb, c) in enumerate(zip(mbs, chosen)):
            if c:
                part = mb.input_ids[c, :width]
                ids[k, : len(c), : part.shape[1]] = part
        hidden = causal_hidden(stack, fused, ids)  # [K, rows, width, H]
        for k, (mb, c) in enumerate(zip(mbs, chosen)):
            if not c:
                continue
            T = mb.response_mask.shape[1]
            columns = torch.arange(T, device=device).view(1, T)
            index = (mb.prompt_lengths[c].view(-1, 1) - 1 + columns).clamp(max=width - 1)
            pieces[k].append(hidden[k, : len(c)].gather(1, index.unsqueeze(-1).expand(len(c), T, H)))
    outs = []
    for k, (mb, member) in enumerate(zip(mbs, settings)):
        order = orders[k]
        states = torch.cat(pieces[k]) if len(pieces[k]) > 1 else pieces[k][0]
        position = torch.empty(len(order), dtype=torch.long)
        position[torch.tensor(order)] = torch.arange(len(order))
        states = states[position.to(device)]  # back in the micro-batch's row order
        outs.append(_head(states, mb, fused.head[k], member, need_hidden[k]))
    return outs


def _head(
    hidden: torch.Tensor, mb: TrainBatch, weight: torch.Tensor, settings: UpdateSettings, need_hidden: bool
) -> dict:
    """The LM head on the states predicting policy tokens (``response_logprobs``'s second half)."""
    head = types.SimpleNamespace(weight=weight, bias=None)
    return response_head_outputs(
        hidden,
        head,  # type: ignore[arg-type]  # a stand-in LM head: the member's stacked weight, no bias
        mb.input_ids,
        mb.prompt_lengths,
        mb.response_mask,
        chunk_tokens=settings.logprob_chunk_tokens,
        temperature=settings.temperature,
        with_entropy=True,
        return_hidden=need_hidden,
    )
