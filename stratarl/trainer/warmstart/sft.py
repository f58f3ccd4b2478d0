"""Supervised fine-tuning on demonstration trajectories (the warm start's optimizer loop).

A demonstration is a full agent trajectory in the exact token layout the rollout
engine produces (prompt ids, response ids, response mask with 0 on observation
tokens). The loss is the token-mean negative log-likelihood of policy tokens only:

    L = - (1 / N) sum_{b, t : mask[b, t] = 1} log pi(y_{b, t} | y_{b, <t}, x_b),   N = number of policy tokens

Observation tokens (retrieved passages) are context, never targets. stratarl.trainer.warmstart.stages builds the
demonstrations and runs the stages; stratarl.trainer.warmstart.worlds streams the fresh worlds they come from.
"""

from __future__ import annotations

import itertools
import math
import time
from collections.abc import Callable, Iterable, Iterator, Sequence

import torch

from stratarl.infra.precision import DevicePolicy
from stratarl.infra.schedules import sft_lr_factor
from stratarl.infra.threads import step_threads
from stratarl.trainer.batch import collate_sequences, micro_batches
from stratarl.trainer.logprobs import response_logprobs
from stratarl.trainer.warmstart.demos import Demonstration

FP32_CPU = DevicePolicy(torch.device("cpu"), "fp32")


def sft_step(
    model: torch.nn.Module,
    demos: Sequence[Demonstration],
    pad_id: int,
    *,
    micro_batch_tokens: int,
    chunk_tokens: int,
    observation_weight: float = 0.0,
    policy: DevicePolicy = FP32_CPU,
) -> dict[str, float]:
    """Accumulate the gradient of the token-mean NLL over ``demos`` (one optimizer step's worth).

    Each micro-batch's summed NLL is divided by the policy-token count of the whole step, so
    the accumulated gradient equals that of one big batch. With ``observation_weight`` w > 0
    observation tokens are targets too, with weight w:

        L = - sum_t m_t log pi(y_t | y_<t) / sum_t m_t,   m_t = 1 on policy tokens, w on observation tokens

    Returns the loss (policy tokens only, comparable across w), the weighted loss and token counts.
    ``policy`` (the run's ``Config.device_policy``): the forward passes run under its autocast
    (stratarl.infra.precision).
    """
    autocast = policy.autocast
    batch = collate_sequences(
        [d.prompt_ids for d in demos], [d.response_ids for d in demos], [d.response_mask for d in demos], pad_id
    ).to(next(model.parameters()).device)
    total = batch.num_policy_tokens
    if total == 0:
        return {"loss": 0.0, "weighted_loss": 0.0, "policy_tokens": 0, "tokens": 0}

    def token_weights(b) -> torch.Tensor:
        in_response = (
            torch.arange(b.response_mask.shape[1], device=b.response_mask.device).view(1, -1)
            < b.response_lengths.view(-1, 1).to(b.response_mask.device)
        ).float()
        return b.response_mask + observation_weight * (in_response - b.response_mask)

    weight_total = float(token_weights(batch).sum())
    loss_sum, weighted_sum = 0.0, 0.0
    for rows in micro_batches(batch.row_lengths(), micro_batch_tokens):
        mb = batch.select(rows)
        weights = token_weights(mb)
        with autocast():
            out = response_logprobs(
                model,
                mb.input_ids,
                mb.attention_mask,
                mb.prompt_lengths,
                (weights > 0).float(),
                chunk_tokens=chunk_tokens,
            )
        nll = -(out["logprobs"] * weights).sum() / weight_total
        nll.backward()
        weighted_sum += float(nll.detach())
        loss_sum += float(-(out["logprobs"].detach() * mb.response_mask).sum()) / total
    return {
        "loss": loss_sum,
        "weighted_loss": weighted_sum,
        "policy_tokens": total,
        "tokens": int(batch.attention_mask.sum()),
    }


def epoch_batches(
    demos: Sequence[Demonstration], *, epochs: int, batch_size: int, seed: int
) -> Iterator[list[Demonstration]]:
    """``epochs`` seeded shuffles of ``demos``, cut into batches of ``batch_size`` (the last one may be short)."""
    generator = torch.Generator().manual_seed(seed)
    for _ in range(epochs):
        order = torch.randperm(len(demos), generator=generator).tolist()
        for start in range(0, len(order), batch_size):
            yield [demos[i] for i in order[start : start + batch_size]]


def _run_sft(
    model: torch.nn.Module,
    demos: Sequence[Demonstration] | None,
    pad_id: int,
    *,
    lr: float,
    epochs: int,
    batch_size: int,
    seed: int,
    micro_batch_tokens: int,
    chunk_tokens: int,
    grad_clip: float = 1.0,
    warmup_fraction: float = 0.05,
    schedule: str = "constant",
    observation_weight: float = 0.0,
    batches: Iterable[list[Demonstration]] | None = None,
    total_steps: int | None = None,
    on_step: Callable[[int, int, dict], None] | None = None,
    policy: DevicePolicy = FP32_CPU,
    done: Callable[[int], bool] | None = None,
    max_steps: int | None = None,
) -> dict[str, float]:
    """Fine-tune ``model`` in place: AdamW, linear warm-up, then a constant lr or a cosine decay to
    10% of it at the last step (``stratarl.infra.schedules.sft_lr_factor``).

    Batches are ``epochs`` shuffled passes over ``demos``, or, for a stream of fresh demonstrations,
    the first ``total_steps`` items of ``batches`` (then ``demos`` is None; "epoch" losses are the
    first and last 10% of the steps).
    ``on_step(step, total_steps, metrics)`` is called after each optimizer step
    (metrics keys ``sft/loss``, ``sft/lr``, ``sft/grad_norm``, ``sft/tokens_per_s``).
    ``policy``: where and in what precision the forward passes run (``sft_step``).
    ``done(step)``: with a stream, called after every step from ``total_steps`` on; the stream goes on past
    ``total_steps`` (up to ``max_steps``, the lr schedule held at its last value) until it returns True.
    Returns the mean loss of the first and the last epoch, and of the first and last 3 steps.
    """
    if batches is None:
        if not demos:
            raise ValueError("no demonstrations to fine-tune on (sft.num_demos is 0 or the training set is empty)")
        total_steps = math.ceil(len(demos) / batch_size) * epochs
        batches = epoch_batches(demos, epochs=epochs, batch_size=batch_size, seed=seed)
        epoch_steps = math.ceil(len(demos) / batch_size)
    else:
        if not total_steps or total_steps < 1:
            raise ValueError("a stream of demonstration batches needs total_steps >= 1 (sft.steps)")
        epoch_steps = max(1, total_steps // 10)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
    warmup = max(1, int(warmup_fraction * total_steps))
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: sft_lr_factor(s, total_steps, warmup, schedule))
    model.train()
    step, step_losses = 0, []
    limit = max(total_steps, max_steps or 0) if done is not None else total_steps
    for chunk in itertools.islice(batches, limit):
        t0 = time.perf_counter()
        stats = sft_step(
            model,
            chunk,
            pad_id,
            micro_batch_tokens=micro_batch_tokens,
            chunk_tokens=chunk_tokens,
            observation_weight=observation_weight,
            policy=policy,
        )
        grad_norm = torch.nn.utils.clip_grad_norm_(params, grad_clip if grad_clip > 0 else float("inf"))
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        step += 1
        step_losses.append(stats["loss"])
        dt = time.perf_counter() - t0
        if on_step is not None:
            on_step(
                step,
                total_steps,
                {
                    "sft/loss": stats["loss"],
                    "sft/weighted_loss": stats["weighted_loss"],
                    "sft/lr": scheduler.get_last_lr()[0],
                    "sft/grad_norm": float(grad_norm),
                    "sft/policy_tokens": stats["policy_tokens"],
                    "sft/tokens_per_s": stats["tokens"] / max(dt, 1e-9),
                    "time/sft_step": dt,
                },
            )
        if done is not None and step >= total_steps and done(step):
            break
    model.eval()
    if not step_losses:
        raise ValueError("the demonstration stream ended before the first step")
    first, last = step_losses[:epoch_steps], step_losses[-epoch_steps:]
    head, tail = step_losses[:3], step_losses[-3:]
    return {
        "first_epoch_loss": sum(first) / len(first),
        "last_epoch_loss": sum(last) / len(last),
        "steps": step,
        "first_steps_loss": sum(head) / len(head),
        "last_steps_loss": sum(tail) / len(tail),
    }


def run_sft(model: torch.nn.Module, demos: Sequence[Demonstration] | None, pad_id: int, **kwargs) -> dict[str, float]:
    """Fine-tune ``model`` in place (see ``_run_sft`` for the arguments), on one thread for a small model
    (``stratarl.infra.threads.step_threads``)."""
    with step_threads(model):
        return _run_sft(model, demos, pad_id, **kwargs)


def demo_shortfall(requested: int, rendered: int, num_questions: int) -> str | None:
    """A warning when fewer demonstrations were rendered than ``sft.num_demos`` asked for, else None.

    render_demonstrations makes at most one per training question (and drops correct ones whose
    gold passage the retriever missed), so a small KB silently caps the warm start.
    """
    if rendered >= requested:
        return None
    return (
        f"warning: sft.num_demos={requested} but only {rendered} demonstrations were rendered from "
        f"{num_questions} training questions (at most one each). Fix: raise data.synthetic.options.num_train "
        "(and size: a small KB holds a few hundred questions), or lower sft.num_demos and raise sft.epochs"
    )
