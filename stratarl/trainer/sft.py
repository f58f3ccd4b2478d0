"""Warm-start stage: supervised fine-tuning on demonstration trajectories.

A demonstration is a full agent trajectory in the exact token layout the rollout
engine produces (prompt ids, response ids, response mask with 0 on observation
tokens). The loss is the token-mean negative log-likelihood of policy tokens only:

    L = - (1 / N) sum_{b, t : mask[b, t] = 1} log pi(y_{b, t} | y_{b, <t}, x_b),   N = number of policy tokens

Observation tokens (retrieved passages) are context, never targets.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch

from stratarl.trainer.batch import collate_sequences, micro_batches
from stratarl.trainer.logprobs import response_logprobs
from stratarl.trainer.update import lr_multiplier


@dataclass(frozen=True)
class Demonstration:
    """One rendered trajectory; ``kind`` says whether it is a correct or an imperfect demo."""

    prompt_ids: list[int]
    response_ids: list[int]
    response_mask: list[int]
    kind: str = "correct"
    example_id: str = ""
    text: str = ""
    meta: dict = field(default_factory=dict, compare=False)


def sft_step(model: torch.nn.Module, demos: Sequence[Demonstration], pad_id: int, *, micro_batch_tokens: int,
             chunk_tokens: int) -> dict[str, float]:
    """Accumulate the gradient of the token-mean NLL over ``demos`` (one optimizer step's worth).

    Each micro-batch's summed NLL is divided by the policy-token count of the whole step, so
    the accumulated gradient equals that of one big batch. Returns loss and token counts.
    """
    batch = collate_sequences([d.prompt_ids for d in demos], [d.response_ids for d in demos],
                              [d.response_mask for d in demos], pad_id).to(next(model.parameters()).device)
    total = batch.num_policy_tokens
    if total == 0:
        return {"loss": 0.0, "policy_tokens": 0, "tokens": 0}
    loss_sum = 0.0
    for rows in micro_batches(batch.row_lengths(), micro_batch_tokens):
        mb = batch.select(rows)
        out = response_logprobs(model, mb.input_ids, mb.attention_mask, mb.prompt_lengths, mb.response_mask,
                                chunk_tokens=chunk_tokens)
        nll = -(out["logprobs"] * mb.response_mask).sum() / total
        nll.backward()
        loss_sum += float(nll.detach())
    return {"loss": loss_sum, "policy_tokens": total, "tokens": int(batch.attention_mask.sum())}


def lr_factor(step: int, total_steps: int, warmup_steps: int, schedule: str) -> float:
    """Multiplier of the base lr at optimizer step ``step`` (0-based).

    Warm-up: (step + 1) / warmup_steps for the first ``warmup_steps`` steps. Then
    ``constant``: 1; ``cosine``: 0.1 + 0.9 * (1 + cos(pi * p)) / 2 with p going 0 -> 1 from the end of
    warm-up to the last step (step total_steps - 1), so the last step runs at 10% of the lr.
    """
    if schedule not in ("constant", "cosine"):
        raise ValueError(f"unknown SFT lr schedule {schedule!r}; use constant or cosine")
    return lr_multiplier(step, warmup_steps, total_steps - 1 - warmup_steps, schedule)


def run_sft(model: torch.nn.Module, demos: Sequence[Demonstration], pad_id: int, *, lr: float, epochs: int,
            batch_size: int, seed: int, micro_batch_tokens: int, chunk_tokens: int, grad_clip: float = 1.0,
            warmup_fraction: float = 0.05, schedule: str = "constant",
            on_step: Callable[[int, int, dict], None] | None = None) -> dict[str, float]:
    """Fine-tune ``model`` in place on ``demos``: AdamW, linear warm-up, then a constant lr or a
    cosine decay to 10% of it at the last step (``lr_factor``).

    ``on_step(step, total_steps, metrics)`` is called after each optimizer step
    (metrics keys ``sft/loss``, ``sft/lr``, ``sft/grad_norm``, ``sft/tokens_per_s``).
    Returns the mean loss of the first and the last epoch, and of the first and last 3 steps.
    """
    if not demos:
        raise ValueError("no demonstrations to fine-tune on (sft.num_demos is 0 or the training set is empty)")
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
    steps_per_epoch = math.ceil(len(demos) / batch_size)
    total_steps = steps_per_epoch * epochs
    warmup = max(1, int(warmup_fraction * total_steps))
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: lr_factor(s, total_steps, warmup, schedule))
    generator = torch.Generator().manual_seed(seed)
    model.train()
    step, epoch_losses, step_losses = 0, [], []
    for _ in range(epochs):
        order = torch.randperm(len(demos), generator=generator).tolist()
        losses = []
        for start in range(0, len(order), batch_size):
            t0 = time.perf_counter()
            chunk = [demos[i] for i in order[start:start + batch_size]]
            stats = sft_step(model, chunk, pad_id, micro_batch_tokens=micro_batch_tokens, chunk_tokens=chunk_tokens)
            grad_norm = torch.nn.utils.clip_grad_norm_(params, grad_clip if grad_clip > 0 else float("inf"))
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            step += 1
            losses.append(stats["loss"])
            step_losses.append(stats["loss"])
            dt = time.perf_counter() - t0
            if on_step is not None:
                on_step(step, total_steps, {"sft/loss": stats["loss"], "sft/lr": scheduler.get_last_lr()[0],
                                            "sft/grad_norm": float(grad_norm), "sft/policy_tokens": stats["policy_tokens"],
                                            "sft/tokens_per_s": stats["tokens"] / max(dt, 1e-9), "time/sft_step": dt})
        epoch_losses.append(sum(losses) / len(losses))
    model.eval()
    head, tail = step_losses[:3], step_losses[-3:]
    return {"first_epoch_loss": epoch_losses[0], "last_epoch_loss": epoch_losses[-1], "steps": step,
            "first_steps_loss": sum(head) / len(head), "last_steps_loss": sum(tail) / len(tail)}


def demo_shortfall(requested: int, rendered: int, num_questions: int) -> str | None:
    """A warning when fewer demonstrations were rendered than ``sft.num_demos`` asked for, else None.

    render_demonstrations makes at most one per training question (and drops correct ones whose
    gold passage the retriever missed), so a small KB silently caps the warm start.
    """
    if rendered >= requested:
        return None
    return (f"warning: sft.num_demos={requested} but only {rendered} demonstrations were rendered from "
            f"{num_questions} training questions (at most one each). Fix: raise data.synthetic.options.num_train "
            "(and size: a small KB holds a few hundred questions), or lower sft.num_demos and raise sft.epochs")


def warm_start(cfg, out_dir, *, progress: bool = True) -> dict:
    """`stratarl sft`: render demonstrations from the training questions, fine-tune, save ``<out_dir>/model``.

    Uses the run config's model, data, retrieval (for observations), rollout caps and
    ``sft`` section. Writes ``sft_metrics.jsonl`` and ``demos_sample.jsonl`` next to the model.
    Returns a summary with the loss of the first and last epoch and the demo mix.
    """
    import json
    from collections import Counter
    from pathlib import Path

    from stratarl.trainer.demos import render_demonstrations
    from stratarl.trainer.metrics import MetricsLogger
    from stratarl.trainer.setup import build_task_retriever, load_policy, load_task, save_pretrained_model

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    torch.manual_seed(cfg.trainer.seed)
    task = load_task(cfg)
    retriever = build_task_retriever(cfg, task)
    model, tokenizer = load_policy(cfg.model, seed=cfg.trainer.seed, device=cfg.trainer.device, task=task)
    s = cfg.sft
    demos = render_demonstrations(task.train, tokenizer, retriever, num_demos=s.num_demos, topk=cfg.retrieval.topk,
                                  max_obs_tokens=cfg.rollout.max_obs_tokens, no_search_fraction=s.no_search_fraction,
                                  wrong_hop_fraction=s.wrong_hop_fraction, seed=s.seed)
    shortfall = demo_shortfall(s.num_demos, len(demos), len(task.train))
    if shortfall:
        print(shortfall, flush=True)
    with open(out_dir / "demos_sample.jsonl", "w") as f:
        for d in demos[:5]:
            f.write(json.dumps({"kind": d.kind, "example_id": d.example_id, **d.meta,
                                "text": tokenizer.decode(d.response_ids)}) + "\n")
    logger = MetricsLogger(out_dir, tensorboard=cfg.logging.tensorboard, filename="sft_metrics.jsonl")
    bar = None
    if progress and cfg.logging.progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=math.ceil(len(demos) / s.batch_size) * s.epochs, desc="sft", unit="step", dynamic_ncols=True)

    def on_step(step: int, total: int, metrics: dict) -> None:
        logger.log(step, metrics)
        if bar is not None:
            bar.update(1)
            bar.set_postfix(loss=f"{metrics['sft/loss']:.3f}")

    result = run_sft(model, demos, tokenizer.pad_token_id, lr=s.lr, epochs=s.epochs, batch_size=s.batch_size,
                     seed=s.seed, micro_batch_tokens=cfg.trainer.micro_batch_tokens,
                     chunk_tokens=cfg.trainer.logprob_chunk_tokens, grad_clip=cfg.optim.grad_clip, schedule=s.schedule,
                     on_step=on_step)
    if bar is not None:
        bar.close()
    logger.close()
    path = save_pretrained_model(model, tokenizer, out_dir / "model")
    summary = {**result, "model": str(path), "num_demos": len(demos), "demo_kinds": dict(Counter(d.kind for d in demos)),
               "policy_tokens": sum(sum(d.response_mask) for d in demos), "seconds": time.perf_counter() - started}
    (out_dir / "sft_summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    return summary
