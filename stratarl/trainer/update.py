"""The policy update: K epochs x M mini-batches of optimizer steps over one rollout batch.

Per optimizer step (one mini-batch), gradients accumulate over micro-batches
sized by a token budget. Each micro-batch's loss is weighted so the accumulated
gradient equals the gradient of the mini-batch loss under the chosen aggregation
(token-mean: policy tokens of the micro-batch / policy tokens of the mini-batch).

    loss = policy loss (``cfg.algorithm.policy_loss`` at its ratio level)  +  kl_coef * KL(pi || pi_ref)
           -  entropy_coef * H  [+ value loss when the spec has a critic]

With a gradient normaliser (``cfg.algorithm.normalizer``; ``sorl`` for so_ppo / so_grpo, or
``algo.normalizer: sorl`` on any preset), SORL's clipping-bias gradient C is accumulated beside the gradient (``stratarl.algos.ClipBiasNormalizer``) and the policy gradient is
scaled by 1 / max(||C||, delta) (``algo.sorl_delta_rule``: fixed delta, or a scale-free floor relative to the
running policy-gradient norm) before gradient-norm clipping (``algo.sorl_order: before_clip``, the default) or
after it (``after_clip``), then the optimizer steps (``optim.name``: AdamW, or SGD as a control).
Observation tokens have response_mask 0 and never enter any term.
"""

from __future__ import annotations

import copy
import functools
from collections import defaultdict
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass

import torch

from stratarl.algos.losses import PolicyLossOutput, aggregate_loss, clipped_value_loss, kl_penalty
from stratarl.algos.registry import GradNormalizer, get_behaviour_correction, get_grad_normalizer, get_policy_loss
from stratarl.infra.schedules import lr_lambda
from stratarl.models import decoder_of
from stratarl.trainer.batch import ScoredBatch, TokenBatch, TrainBatch, micro_batches, mini_batch_rows
from stratarl.trainer.config import Config
from stratarl.trainer.critic import ValueHead, hidden_size_of, response_values
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


@dataclass
class Learner:
    """Everything the update mutates: policy, optional reference / critic, optimizer, scheduler."""

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    policy_loss: Callable[..., PolicyLossOutput]
    """The algorithm's registered policy loss (``cfg.algorithm.policy_loss``), looked up once."""
    ref_model: torch.nn.Module | None = None
    value_head: ValueHead | None = None
    normalizer: GradNormalizer | None = None
    use_adapter_as_ref: bool = False
    correction: Callable | None = None
    """The behaviour correction with its parameters bound (``cfg.algorithm.correction``), or None:
    ``correction(old_logprobs, behaviour_logprobs, response_mask) -> CorrectionOutput``."""

    def policy_parameters(self) -> list[torch.nn.Parameter]:
        return [p for p in self.model.parameters() if p.requires_grad]


def make_optimizer(groups: list[dict], cfg: Config) -> torch.optim.Optimizer:
    """``optim.name``: AdamW (default) or SGD (the control for SORL's scale, which Adam largely cancels)."""
    if cfg.optim.name == "sgd":
        return torch.optim.SGD(
            groups, lr=cfg.optim.lr, momentum=cfg.optim.momentum, weight_decay=cfg.optim.weight_decay
        )
    return torch.optim.AdamW(groups, lr=cfg.optim.lr, betas=tuple(cfg.optim.betas), weight_decay=cfg.optim.weight_decay)


def build_learner(model: torch.nn.Module, cfg: Config, total_optimizer_steps: int) -> Learner:
    """Optimizer (``optim.name``; the value head gets ``algo.critic_lr``), scheduler, reference model, and the
    spec's critic and gradient normaliser."""
    spec = cfg.algorithm
    value_head = ValueHead(hidden_size_of(model)).to(next(model.parameters()).device) if spec.uses_critic else None
    policy_params = [p for p in model.parameters() if p.requires_grad]
    groups = [{"params": policy_params, "lr": cfg.optim.lr}]
    if value_head is not None:
        groups.append({"params": list(value_head.parameters()), "lr": cfg.algo.critic_lr})
    optimizer = make_optimizer(groups, cfg)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lr_lambda(cfg.optim.warmup_steps, total_optimizer_steps, cfg.optim.schedule)
    )
    ref_model, adapter_ref = None, False
    if cfg.algo.kl_coef > 0:
        if hasattr(model, "disable_adapter"):
            adapter_ref = True  # LoRA: the frozen base model *is* the reference; no copy needed
        else:
            ref_model = copy.deepcopy(model).eval()
            for p in ref_model.parameters():
                p.requires_grad_(False)
    # The normaliser is its own part, independent of the ratio level: the two SORL ablations switch one off.
    normalizer = (
        get_grad_normalizer(spec.normalizer)(policy_params, **spec.normalizer_params) if spec.uses_normalizer else None
    )
    correction = (
        functools.partial(get_behaviour_correction(spec.correction), **spec.correction_params)
        if spec.uses_correction
        else None
    )
    return Learner(
        model,
        optimizer,
        scheduler,
        get_policy_loss(spec.policy_loss),
        ref_model,
        value_head,
        normalizer,
        adapter_ref,
        correction,
    )


def _check_impl(impl: str) -> None:
    if impl not in UPDATE_IMPLS:
        raise ValueError(
            f"update impl {impl!r} is not one of {UPDATE_IMPLS}; use 'fast' (or 'reference' as a baseline)"
        )


def capture_layer(learner: Learner, impl: str = "fast") -> int | None:
    """The decoder layer whose input states the training rollouts should keep for ``batch_prefix``: the lowest
    trainable one, when the fast update runs and layers below it are frozen; else None (nothing kept)."""
    if impl != "fast" or unsupported_reason(learner.model) is not None:
        return None
    decoder = decoder_of(learner.model)
    k = lowest_trainable_layer(decoder)
    return k if 0 < k < len(decoder.layers) else None


def batch_prefix(
    learner: Learner, batch: TokenBatch, cfg: Config, impl: str = "fast", states: list | None = None
) -> Prefix | None:
    """The frozen layers' hidden states for the whole rollout batch, shared by the scoring pass and every
    optimizer step: the states the generator kept while sampling (``prefix.captured_prefix``; ``states`` =
    each row's ``Rollout.frozen_states``; ``Prefix.source`` "rollouts") when they cover the batch's tokens
    exactly, else ``prefix.frozen_prefix`` once, in the run's precision (source "computed"); None with the
    `reference` impl or a model the fast path does not cover."""
    _check_impl(impl)
    if impl != "fast" or unsupported_reason(learner.model) is not None:
        return None
    if states is not None:
        prefix, _ = captured_prefix(learner.model, batch.input_ids, batch.attention_mask, batch.prompt_lengths, states)
        if prefix is not None:
            return prefix
    with cfg.device_policy.autocast():
        return frozen_prefix(learner.model, batch.input_ids, batch.attention_mask, batch.prompt_lengths)


def on_policy_shortcut(cfg: Config) -> bool:
    """Whether the old log-probs are the update's own forward, detached: `recompute` with one optimizer step
    per rollout batch (``trainer.epochs`` x ``trainer.mini_batches`` = 1). Recomputing them in a separate
    pass would give the same numbers up to float rounding (the same weights on the same tokens), so that
    pass is skipped and every ratio of the step is exactly 1, in any precision."""
    return cfg.algo.old_logprobs == "recompute" and cfg.trainer.epochs * cfg.trainer.mini_batches == 1


@torch.no_grad()
def score_batch(
    learner: Learner,
    batch: TokenBatch,
    cfg: Config,
    sampling_logprobs: torch.Tensor | None = None,
    prefix: Prefix | None = None,
    *,
    shortcut: bool = False,
    measure_learner: bool = False,
) -> ScoredBatch:
    """The scored stage of ``batch``: behaviour log-probs (recomputed by the trainer's forward pass, or with
    ``algo.old_logprobs: rollout`` the sampler's ``sampling_logprobs`` [B, T]), reference log-probs (with a
    KL term) and the critic's values (with a critic). ``sampling_logprobs`` may be None only when the run
    recomputes them (``algo.old_logprobs: recompute``).

    With ``prefix`` (``batch_prefix`` of this batch) the policy's scoring runs only the trainable layers,
    in the prompt-grouped micro-batches the update uses, so it shares the update's frozen-layer pass.
    With ``shortcut`` (the trainer's step) and ``on_policy_shortcut(cfg)`` no old log-probs are computed:
    the scored batch is ``on_policy`` and the update uses its own detached ones.

    ``measure_learner`` (a run with an off-policy source): the learner's log-probs are computed even when the
    update would not need them (``learner_logprobs``), to measure the sampler/learner mismatch; training is
    unchanged by it. ``behaviour_logprobs`` are always the sampler's, when given."""
    on_policy = shortcut and on_policy_shortcut(cfg)
    need_old = not on_policy and cfg.algo.old_logprobs == "recompute"
    need_learner = need_old or measure_learner
    if sampling_logprobs is None and cfg.algo.old_logprobs != "recompute":
        raise ValueError("algo.old_logprobs=rollout scores with the sampler's log-probs: pass sampling_logprobs")
    need_ref = cfg.algo.kl_coef > 0
    need_values = learner.value_head is not None
    B, T = batch.response_mask.shape
    device = batch.response_mask.device
    behaviour = sampling_logprobs.to(device) if sampling_logprobs is not None else None
    old = torch.zeros(B, T, device=device) if need_old or behaviour is None else behaviour
    learner_lp = old if need_old else (torch.zeros(B, T, device=device) if need_learner else None)
    ref = torch.zeros(B, T, device=device) if need_ref else None
    values = torch.zeros(B, T, device=device) if need_values else None
    temperature = cfg.rollout.temperature
    autocast = cfg.device_policy.autocast
    budget = cfg.trainer.micro_batch_tokens
    parts = (
        group_micro_batches(batch.row_lengths(), prefix.inverse, budget)
        if prefix is not None
        else micro_batches(batch.row_lengths(), budget)
    )
    for rows in parts if (need_learner or need_ref or need_values) else []:
        mb = batch.select(rows)
        args = (mb.input_ids, mb.attention_mask, mb.prompt_lengths, mb.response_mask)
        t = mb.response_mask.shape[1]
        if need_learner or need_values:
            with autocast():
                if prefix is not None:
                    out = prefix_response_logprobs(
                        learner.model,
                        prefix,
                        rows,
                        mb.input_ids,
                        mb.prompt_lengths,
                        mb.response_mask,
                        chunk_tokens=cfg.trainer.logprob_chunk_tokens,
                        temperature=temperature,
                        return_hidden=need_values,
                    )
                else:
                    out = response_logprobs(
                        learner.model,
                        *args,
                        chunk_tokens=cfg.trainer.logprob_chunk_tokens,
                        temperature=temperature,
                        return_hidden=need_values,
                        with_logprobs=need_learner,
                    )
            if need_learner:
                learner_lp[rows, :t] = out["logprobs"]
            if need_values:
                values[rows, :t] = response_values(learner.value_head, out["hidden"], mb.response_mask)
        if need_ref:
            ctx = learner.model.disable_adapter() if learner.use_adapter_as_ref else nullcontext()
            ref_model = learner.model if learner.use_adapter_as_ref else learner.ref_model
            with ctx, autocast():
                ref[rows, :t] = response_logprobs(
                    ref_model, *args, chunk_tokens=cfg.trainer.logprob_chunk_tokens, temperature=temperature
                )["logprobs"]
    return ScoredBatch(
        **{
            f: getattr(batch, f)
            for f in ("input_ids", "attention_mask", "prompt_lengths", "response_lengths", "response_mask")
        },
        old_logprobs=old,
        on_policy=on_policy,
        ref_logprobs=ref,
        old_values=values,
        behaviour_logprobs=behaviour,
        learner_logprobs=learner_lp,
    )


def norm_length(cfg: Config) -> int | None:
    """The constant L of ``seq-mean-token-sum-norm``: ``rollout.max_total_tokens``, the same for every micro-batch
    (so micro-batching cannot change the loss); None for the other aggregations."""
    return cfg.rollout.max_total_tokens if cfg.algo.loss_agg == "seq-mean-token-sum-norm" else None


def _agg_units(mask: torch.Tensor, agg: str) -> float:
    """How much of an aggregate a set of rows accounts for (tokens for token-mean, rows otherwise)."""
    if agg == "token-mean":
        return float(mask.sum())
    if agg == "seq-mean-token-mean":
        return float((mask.sum(1) > 0).sum())
    return float(mask.shape[0])


def micro_batch_loss(
    learner: Learner, mb: TrainBatch, cfg: Config, prefix: Prefix | None = None, rows: list[int] | None = None
) -> tuple[torch.Tensor, torch.Tensor | None, dict]:
    """Loss terms of one micro-batch: (policy loss incl. KL / entropy / value, clip-bias objective, metrics).

    With a ``prefix`` (the fast update), ``rows`` are the micro-batch's rows in the prefix's batch and
    only the trainable layers run here."""
    need_hidden = learner.value_head is not None
    if prefix is not None:
        out = prefix_response_logprobs(
            learner.model,
            prefix,
            rows,
            mb.input_ids,
            mb.prompt_lengths,
            mb.response_mask,
            chunk_tokens=cfg.trainer.logprob_chunk_tokens,
            temperature=cfg.rollout.temperature,
            with_entropy=True,
            return_hidden=need_hidden,
        )
    else:
        out = response_logprobs(
            learner.model,
            mb.input_ids,
            mb.attention_mask,
            mb.prompt_lengths,
            mb.response_mask,
            chunk_tokens=cfg.trainer.logprob_chunk_tokens,
            temperature=cfg.rollout.temperature,
            with_entropy=True,
            return_hidden=need_hidden,
        )
    return micro_batch_terms(learner, mb, cfg, out)


def micro_batch_terms(
    learner: Learner, mb: TrainBatch, cfg: Config, out: dict[str, torch.Tensor]
) -> tuple[torch.Tensor, torch.Tensor | None, dict]:
    """(loss, clip-bias objective, metrics) of a micro-batch from its forward ``out``: ``logprobs`` and
    ``entropy`` [B, T] (and ``hidden`` [B, T, H] with a critic), whichever forward computed them (a
    population's update computes several learners' forwards at once: stratarl.trainer.population_update)."""
    algo, spec = cfg.algo, cfg.algorithm
    logprobs, mask = out["logprobs"], mb.response_mask
    # The on-policy step: the behaviour log-probs are this very forward, detached (on_policy_shortcut).
    old_logprobs = logprobs.detach() if mb.on_policy else mb.old_logprobs
    length = norm_length(cfg)
    extra: dict = {} if length is None else {"norm_length": length}
    corrected = _behaviour_weights(learner, mb, old_logprobs)
    if corrected is not None:  # after the clip, before SORL's normalisation (the loss multiplies each token's term)
        extra["token_weights"] = corrected.weights
    pl = learner.policy_loss(logprobs, old_logprobs, mb.advantages, mask, **spec.policy_loss_params, **extra)
    loss = pl.loss
    metrics = {"loss/policy": pl.loss.detach(), **{k: v for k, v in pl.metrics.items() if k != "loss/pg_loss"}}
    if corrected is not None:
        metrics.update(corrected.metrics)
    entropy = aggregate_loss(out["entropy"], mask, algo.loss_agg, norm_length=length)
    metrics["loss/entropy"] = entropy.detach()
    if algo.entropy_coef:
        loss = loss - algo.entropy_coef * entropy
    if mb.ref_logprobs is not None:
        kl = aggregate_loss(
            kl_penalty(logprobs, mb.ref_logprobs, mask, algo.kl_estimator), mask, algo.loss_agg, norm_length=length
        )
        metrics["loss/kl"] = kl.detach()
        loss = loss + algo.kl_coef * kl
    if learner.value_head is not None:
        values = response_values(learner.value_head, out["hidden"], mask, detach=algo.critic_detach)
        vloss, vmetrics = clipped_value_loss(
            values, mb.old_values, mb.returns, mask, clip=algo.value_clip, agg=algo.loss_agg, norm_length=length
        )
        metrics.update(vmetrics)
        metrics["loss/value"] = vloss.detach()
        loss = loss + vloss
    return loss, pl.clip_bias, metrics


def _behaviour_weights(learner: Learner, mb: TrainBatch, old_logprobs: torch.Tensor):
    """The behaviour correction's output on ``mb`` (pi_old = ``old_logprobs``, pi_behav = the sampler's), or None
    without a correction."""
    if learner.correction is None:
        return None
    if mb.behaviour_logprobs is None:
        raise ValueError(
            "algo.behaviour_correction needs the sampler's log-probs (ScoredBatch.behaviour_logprobs): "
            "score the batch with score_batch(..., sampling_logprobs)"
        )
    return learner.correction(old_logprobs.detach(), mb.behaviour_logprobs, mb.response_mask)


def micro_batch_plan(
    mini: TrainBatch, cfg: Config, prefix: Prefix | None = None, rows: list[int] | None = None
) -> list[tuple[list[int], TrainBatch, float]]:
    """The micro-batches of ``mini`` as (rows in ``mini``, the micro-batch, its weight in the mini-batch loss);
    those without policy tokens are left out (they contribute nothing to any term)."""
    agg = cfg.algo.loss_agg
    total_units = _agg_units(mini.response_mask, agg)
    if prefix is not None:
        parts = group_micro_batches(
            mini.row_lengths(), prefix.inverse[torch.as_tensor(rows)], cfg.trainer.micro_batch_tokens
        )
    else:
        parts = micro_batches(mini.row_lengths(), cfg.trainer.micro_batch_tokens)
    plan = []
    for local in parts:
        mb = mini.select(local)
        weight = _agg_units(mb.response_mask, agg) / total_units if total_units else 0.0
        if weight != 0.0:
            plan.append((local, mb, weight))
    return plan


def accumulate_gradients(
    learner: Learner, mini: TrainBatch, cfg: Config, prefix: Prefix | None = None, rows: list[int] | None = None
) -> dict[str, float]:
    """Backward over token-budgeted micro-batches of ``mini``; ``.grad`` ends up holding the gradient
    of the mini-batch loss (and SORL's C buffers its clipping-bias gradient). Returns averaged metrics.

    With a ``prefix`` (``rows``: the mini-batch's rows in the prefix's batch) micro-batches keep prompt
    groups together (``group_micro_batches``): the same gradient, fewer prompt passes."""
    sums: dict[str, float] = defaultdict(float)
    policy_tokens = 0
    autocast = cfg.device_policy.autocast
    for local, mb, weight in micro_batch_plan(mini, cfg, prefix, rows):
        with autocast():  # the forward only: backward runs outside autocast
            loss, clip_bias, metrics = micro_batch_loss(
                learner, mb, cfg, prefix, None if prefix is None else [rows[i] for i in local]
            )
        if learner.normalizer is not None:
            nothing_clipped = float(metrics["loss/clip_frac"]) == 0.0
            learner.normalizer.backward(loss * weight, clip_bias * weight, skip_clip_bias=nothing_clipped)
        else:
            (loss * weight).backward()
        for key, value in metrics.items():
            sums[key] += float(value) * weight
        policy_tokens += int(mb.response_mask.sum())
    sums["perf/update_policy_tokens"] = float(policy_tokens)
    return dict(sums)


def _grad_norm(params: list[torch.nn.Parameter]) -> torch.Tensor:
    grads = [p.grad for p in params if p.grad is not None]
    if not grads:
        return torch.zeros(())
    return torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads]))


def optimizer_step(
    learner: Learner, mini: TrainBatch, cfg: Config, prefix: Prefix | None = None, rows: list[int] | None = None
) -> dict[str, float]:
    """One optimizer step on a mini-batch: accumulate, SORL-normalise and clip (in ``algo.sorl_order``), step.

    ``optim/grad_norm`` is the norm clipping saw: after the SORL factor with `before_clip`, before it with
    `after_clip`. ``sorl/effective_scale`` is ||gradient the optimizer got|| / ||policy gradient before SORL
    and clipping||: ``sorl/scale`` when clipping did not act, the clip factor when `before_clip` clipping
    undid SORL's factor (it does unless ||C|| > max(delta, ||grad||))."""
    return apply_gradients(learner, cfg, accumulate_gradients(learner, mini, cfg, prefix, rows))


def apply_gradients(learner: Learner, cfg: Config, sums: dict[str, float]) -> dict[str, float]:
    """The end of an optimizer step, once ``.grad`` holds the mini-batch's gradient (``sums``: the metrics
    accumulated with it): the normaliser and clipping in ``algo.sorl_order``, the optimizer and the scheduler."""
    raw_norm = float(_grad_norm(learner.policy_parameters())) if learner.normalizer is not None else 0.0
    normalize_first = learner.normalizer is not None and cfg.algo.sorl_order == "before_clip"
    if normalize_first:
        sums.update({k: float(v) for k, v in learner.normalizer.apply().items()})
    params = learner.policy_parameters()
    clip = cfg.optim.grad_clip if cfg.optim.grad_clip > 0 else float("inf")
    grad_norm = torch.nn.utils.clip_grad_norm_(params, clip)
    if learner.normalizer is not None and not normalize_first:
        # after_clip: the factor acts on the clipped gradient, so clipping cannot undo it.
        sums.update({k: float(v) for k, v in learner.normalizer.apply().items()})
    if learner.normalizer is not None:
        # What reached the optimizer relative to the raw policy gradient: the SORL factor times whatever
        # clipping did. With before_clip it shows when clipping undid the factor (it then equals the clip factor).
        sums["sorl/effective_scale"] = float(_grad_norm(params)) / raw_norm if raw_norm > 0 else 1.0
    if learner.value_head is not None:
        torch.nn.utils.clip_grad_norm_(learner.value_head.parameters(), clip)
    sums["optim/skipped_steps"] = 0.0
    if not torch.isfinite(grad_norm):
        # A non-finite gradient would poison Adam's moments for the rest of the run: skip the step.
        sums["optim/skipped_steps"] = 1.0
    else:
        learner.optimizer.step()
    learner.optimizer.zero_grad(set_to_none=True)
    learner.scheduler.step()
    sums["optim/grad_norm"] = float(grad_norm)
    sums["optim/lr"] = learner.scheduler.get_last_lr()[0]
    return sums


def update_policy(
    learner: Learner,
    batch: TrainBatch,
    cfg: Config,
    generator: torch.Generator,
    *,
    impl: str = "fast",
    prefix: Prefix | None = None,
) -> dict[str, float]:
    """K epochs x M mini-batches of optimizer steps; returns metrics averaged over the steps.

    ``impl``: `fast` runs the frozen layers once for the whole batch (``stratarl.trainer.prefix``; when
    the model allows it, else as `reference`); `reference` runs every layer in every micro-batch.
    Both give the same gradients up to float rounding. ``prefix``: this batch's ``batch_prefix``, when the
    caller computed it already (for the scoring pass); otherwise the fast impl computes it here."""
    _check_impl(impl)
    if not isinstance(batch, TrainBatch):
        raise TypeError(
            f"update_policy got an unscored {type(batch).__name__}: score it first "
            "(score_batch(...).with_advantages(advantages, returns))"
        )
    learner.model.train()
    per_step: list[dict[str, float]] = []
    try:
        if impl != "fast":
            prefix = None
        elif prefix is None:
            prefix = batch_prefix(learner, batch, cfg, impl)
        for _ in range(cfg.trainer.epochs):
            for rows in mini_batch_rows(batch.size, cfg.trainer.mini_batches, generator):
                per_step.append(optimizer_step(learner, batch.select(rows), cfg, prefix, rows))  # noqa: PERF401  steps
    finally:
        learner.model.eval()
    return update_metrics(per_step)


def update_metrics(per_step: list[dict[str, float]]) -> dict[str, float]:
    """An update's metrics from its optimizer steps' (means; token and step counts summed)."""
    keys = {k for m in per_step for k in m}
    out = {k: sum(m.get(k, 0.0) for m in per_step) / len(per_step) for k in keys}
    out["perf/update_policy_tokens"] = sum(m.get("perf/update_policy_tokens", 0.0) for m in per_step)
    out["optim/steps"] = float(len(per_step))
    if per_step:
        # The first optimizer step of a batch is the on-policy one: its clip fraction must be ~0.
        out["loss/clip_frac_first_step"] = per_step[0].get("loss/clip_frac", 0.0)
    return out
