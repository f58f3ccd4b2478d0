"""The policy update: K epochs x M mini-batches of optimizer steps over one rollout batch.

Per optimizer step (one mini-batch), gradients accumulate over micro-batches
sized by a token budget. Each micro-batch's loss is weighted so the accumulated
gradient equals the gradient of the mini-batch loss under the chosen aggregation
(token-mean: policy tokens of the micro-batch / policy tokens of the mini-batch).

    loss = policy loss (``settings.algorithm.policy_loss`` at its ratio level)  +  kl_coef * KL(pi || pi_ref)
           -  entropy_coef * H  [+ value loss when the algorithm has a critic]

With a gradient normaliser (``settings.algorithm.normalizer``; ``sorl`` for so_ppo / so_grpo, or
``algo.normalizer: sorl`` on any preset), SORL's clipping-bias gradient C is accumulated beside the gradient
(``stratarl.algos.ClipBiasNormalizer``) and the policy gradient is scaled by 1 / max(||C||, delta)
(``algo.sorl_delta_rule``: fixed delta, or a scale-free floor relative to the running policy-gradient norm) before
gradient-norm clipping (``algo.sorl_order: before_clip``, the default) or after it (``after_clip``), then the
optimizer steps (``optim.name``: AdamW, or SGD as a control). Observation tokens have response_mask 0 and never
enter any term.

Every function here reads ``UpdateSettings`` (stratarl.trainer.settings), never the config tree, and runs the
policy through a ``PolicyForward`` (stratarl.trainer.forward: the reference path or the frozen-prefix one).
"""

from __future__ import annotations

from collections import defaultdict
from contextlib import nullcontext

import torch

from stratarl.algos.corrections import CorrectionOutput
from stratarl.algos.losses import aggregate_loss, clipped_value_loss, kl_penalty
from stratarl.trainer.batch import ScoredBatch, TokenBatch, TrainBatch, mini_batch_rows
from stratarl.trainer.critic import response_values
from stratarl.trainer.forward import REFERENCE, PolicyForward, batch_forward
from stratarl.trainer.learner import Learner
from stratarl.trainer.settings import UpdateSettings

# --------------------------------------------------------------------------- the scored stage


@torch.no_grad()
def score_batch(
    learner: Learner,
    batch: TokenBatch,
    settings: UpdateSettings,
    sampling_logprobs: torch.Tensor | None = None,
    forward: PolicyForward = REFERENCE,
    *,
    shortcut: bool = False,
    measure_learner: bool = False,
) -> ScoredBatch:
    """The scored stage of ``batch``: behaviour log-probs (recomputed by the trainer's forward pass, or with
    ``algo.old_logprobs: rollout`` the sampler's ``sampling_logprobs`` [B, T]), reference log-probs (with a
    KL term) and the critic's values (with a critic). ``sampling_logprobs`` may be None only when the run
    recomputes them (``algo.old_logprobs: recompute``).

    ``forward``: the policy's forward the update uses too (``batch_forward`` of this batch; with a frozen prefix
    the scoring pass shares its frozen-layer pass and micro-batches). With ``shortcut`` (the trainer's step) and
    ``settings.on_policy_shortcut`` no old log-probs are computed: the scored batch is ``on_policy`` and the
    update uses its own detached ones.

    ``measure_learner`` (a run with an off-policy source): the learner's log-probs are computed even when the
    update would not need them (``learner_logprobs``), to measure the sampler/learner mismatch; training is
    unchanged by it. ``behaviour_logprobs`` are always the sampler's, when given."""
    on_policy = shortcut and settings.on_policy_shortcut
    need_old = not on_policy and settings.old_logprobs == "recompute"
    need_learner = need_old or measure_learner
    if sampling_logprobs is None and settings.old_logprobs != "recompute":
        raise ValueError("algo.old_logprobs=rollout scores with the sampler's log-probs: pass sampling_logprobs")
    B, T = batch.response_mask.shape
    device = batch.response_mask.device
    behaviour = sampling_logprobs.to(device) if sampling_logprobs is not None else None
    old = torch.zeros(B, T, device=device) if need_old or behaviour is None else behaviour
    learner_lp = old if need_old else (torch.zeros(B, T, device=device) if need_learner else None)
    ref = torch.zeros(B, T, device=device) if settings.kl_coef > 0 else None
    values = torch.zeros(B, T, device=device) if learner.value_head is not None else None
    if need_learner or ref is not None or values is not None:
        for rows in forward.micro_batches(batch, settings.micro_batch_tokens):
            _score_rows(learner, batch, rows, settings, forward.select(rows), learner_lp, ref, values)
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


def _score_rows(
    learner: Learner,
    batch: TokenBatch,
    rows: list[int],
    settings: UpdateSettings,
    forward: PolicyForward,
    learner_lp: torch.Tensor | None,
    ref: torch.Tensor | None,
    values: torch.Tensor | None,
) -> None:
    """Fill rows ``rows`` of the scored stage's tensors that are not None: the learner's log-probs, the reference
    model's and the critic's values (``forward``: the policy's forward for these rows)."""
    mb = batch.select(rows)
    t = mb.response_mask.shape[1]
    chunk_tokens, temperature = settings.logprob_chunk_tokens, settings.temperature
    if learner_lp is not None or values is not None:
        with settings.policy.autocast():
            out = forward.response_logprobs(
                learner.model,
                mb,
                chunk_tokens=chunk_tokens,
                temperature=temperature,
                return_hidden=values is not None,
                with_logprobs=learner_lp is not None,
            )
        if learner_lp is not None:
            learner_lp[rows, :t] = out["logprobs"]
        if values is not None and learner.value_head is not None:
            values[rows, :t] = response_values(learner.value_head, out["hidden"], mb.response_mask)
    if ref is not None:
        # A LoRA-wrapped (peft) model has disable_adapter: its base weights are the reference.
        ctx = learner.model.disable_adapter() if learner.use_adapter_as_ref else nullcontext()  # type: ignore[operator]
        ref_model = learner.model if learner.use_adapter_as_ref else learner.ref_model
        if ref_model is None:
            raise RuntimeError("the KL term needs a reference model and the learner has none (build_learner makes one)")
        with ctx, settings.policy.autocast():
            ref[rows, :t] = REFERENCE.response_logprobs(
                ref_model, mb, chunk_tokens=chunk_tokens, temperature=temperature
            )["logprobs"]


# --------------------------------------------------------------------------- the loss


def _agg_units(mask: torch.Tensor, agg: str) -> float:
    """How much of an aggregate a set of rows accounts for (tokens for token-mean, rows otherwise)."""
    if agg == "token-mean":
        return float(mask.sum())
    if agg == "seq-mean-token-mean":
        return float((mask.sum(1) > 0).sum())
    return float(mask.shape[0])


def micro_batch_terms(
    learner: Learner, mb: TrainBatch, settings: UpdateSettings, out: dict[str, torch.Tensor]
) -> tuple[torch.Tensor, torch.Tensor | None, dict]:
    """(loss, clip-bias objective, metrics) of a micro-batch from its forward ``out``: ``logprobs`` and
    ``entropy`` [B, T] (and ``hidden`` [B, T, H] with a critic), whichever forward computed them."""
    logprobs, mask, agg, length = out["logprobs"], mb.response_mask, settings.loss_agg, settings.norm_length
    # The on-policy step: the behaviour log-probs are this very forward, detached (on_policy_shortcut).
    old_logprobs = logprobs.detach() if mb.on_policy else mb.old_logprobs
    extra: dict = {} if length is None else {"norm_length": length}
    corrected = _behaviour_weights(learner, mb, old_logprobs)
    if corrected is not None:  # after the clip, before SORL's normalisation (the loss multiplies each token's term)
        extra["token_weights"] = corrected.weights
    params = settings.algorithm.policy_loss_params
    pl = learner.policy_loss(logprobs, old_logprobs, mb.advantages, mask, **params, **extra)
    loss = pl.loss
    metrics = {"loss/policy": pl.loss.detach(), **{k: v for k, v in pl.metrics.items() if k != "loss/pg_loss"}}
    if corrected is not None:
        metrics.update(corrected.metrics)
    entropy = aggregate_loss(out["entropy"], mask, agg, norm_length=length)
    metrics["loss/entropy"] = entropy.detach()
    if settings.entropy_coef:
        loss = loss - settings.entropy_coef * entropy
    if mb.ref_logprobs is not None:
        kl = aggregate_loss(
            kl_penalty(logprobs, mb.ref_logprobs, mask, settings.kl_estimator), mask, agg, norm_length=length
        )
        metrics["loss/kl"] = kl.detach()
        loss = loss + settings.kl_coef * kl
    if learner.value_head is not None:
        if mb.old_values is None:
            raise RuntimeError("a critic's value loss needs the batch's old values (score_batch computes them)")
        values = response_values(learner.value_head, out["hidden"], mask, detach=settings.critic_detach)
        vloss, vmetrics = clipped_value_loss(
            values, mb.old_values, mb.returns, mask, clip=settings.value_clip, agg=agg, norm_length=length
        )
        metrics.update(vmetrics)
        metrics["loss/value"] = vloss.detach()
        loss = loss + vloss
    return loss, pl.clip_bias, metrics


def _behaviour_weights(learner: Learner, mb: TrainBatch, old_logprobs: torch.Tensor) -> CorrectionOutput | None:
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
    mini: TrainBatch, settings: UpdateSettings, forward: PolicyForward = REFERENCE
) -> list[tuple[list[int], TrainBatch, float]]:
    """The micro-batches of ``mini`` (cut by ``forward``) as (rows in ``mini``, the micro-batch, its weight in the
    mini-batch loss); those without policy tokens are left out (they contribute nothing to any term)."""
    total_units = _agg_units(mini.response_mask, settings.loss_agg)
    plan = []
    for local in forward.micro_batches(mini, settings.micro_batch_tokens):
        mb = mini.select(local)
        weight = _agg_units(mb.response_mask, settings.loss_agg) / total_units if total_units else 0.0
        if weight != 0.0:
            plan.append((local, mb, weight))
    return plan


# --------------------------------------------------------------------------- the optimizer step


def accumulate_gradients(
    learner: Learner,
    mini: TrainBatch,
    settings: UpdateSettings,
    forward: PolicyForward = REFERENCE,
    record: tuple[torch.Tensor, list[int]] | None = None,
) -> dict[str, float]:
    """Backward over token-budgeted micro-batches of ``mini``; ``.grad`` ends up holding the gradient
    of the mini-batch loss (and SORL's C buffers its clipping-bias gradient). Returns averaged metrics.

    ``forward``: the policy's forward for ``mini``'s rows (a ``PrefixForward`` keeps prompt groups together in a
    micro-batch: the same gradient, fewer prompt passes). ``record`` (target [B, T], the batch row of each of
    ``mini``'s rows): each micro-batch's log-probs, detached, are written to the target's rows."""
    sums: dict[str, float] = defaultdict(float)
    policy_tokens = 0
    for local, mb, weight in micro_batch_plan(mini, settings, forward):
        with settings.policy.autocast():  # the forward only: backward runs outside autocast
            out = forward.select(local).response_logprobs(
                learner.model,
                mb,
                chunk_tokens=settings.logprob_chunk_tokens,
                temperature=settings.temperature,
                with_entropy=True,
                return_hidden=learner.value_head is not None,
            )
            loss, clip_bias, metrics = micro_batch_terms(learner, mb, settings, out)
        if record is not None:
            target, batch_rows = record
            logprobs = out["logprobs"].detach()
            target[[batch_rows[i] for i in local], : logprobs.shape[1]] = logprobs.to(target.dtype)
        if learner.normalizer is not None:
            nothing_clipped = float(metrics["loss/clip_frac"]) == 0.0
            weighted_bias = None if clip_bias is None else clip_bias * weight
            learner.normalizer.backward(loss * weight, weighted_bias, skip_clip_bias=nothing_clipped)
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
    learner: Learner,
    mini: TrainBatch,
    settings: UpdateSettings,
    forward: PolicyForward = REFERENCE,
    record: tuple[torch.Tensor, list[int]] | None = None,
) -> dict[str, float]:
    """One optimizer step on a mini-batch: accumulate, SORL-normalise and clip (in ``algo.sorl_order``), step.

    ``optim/grad_norm`` is the norm clipping saw: after the SORL factor with `before_clip`, before it with
    `after_clip`. ``sorl/effective_scale`` is ||gradient the optimizer got|| / ||policy gradient before SORL
    and clipping||: ``sorl/scale`` when clipping did not act, the clip factor when `before_clip` clipping
    undid SORL's factor (it does unless ||C|| > max(delta, ||grad||)). ``record``: see ``accumulate_gradients``."""
    return apply_gradients(learner, settings, accumulate_gradients(learner, mini, settings, forward, record))


def apply_gradients(learner: Learner, settings: UpdateSettings, sums: dict[str, float]) -> dict[str, float]:
    """The end of an optimizer step, once ``.grad`` holds the mini-batch's gradient (``sums``: the metrics
    accumulated with it): the normaliser and clipping in ``algo.sorl_order``, the optimizer and the scheduler."""
    raw_norm = float(_grad_norm(learner.policy_parameters())) if learner.normalizer is not None else 0.0
    normalize_first = learner.normalizer is not None and settings.sorl_order == "before_clip"
    if normalize_first and learner.normalizer is not None:
        sums.update({k: float(v) for k, v in learner.normalizer.apply().items()})
    params = learner.policy_parameters()
    clip = settings.grad_clip if settings.grad_clip > 0 else float("inf")
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
    sums["optim/lr"] = float(learner.scheduler.get_last_lr()[0])
    return sums


def update_policy(
    learner: Learner,
    batch: TrainBatch,
    settings: UpdateSettings,
    generator: torch.Generator,
    *,
    impl: str = "fast",
    forward: PolicyForward | None = None,
    learner_logprobs: torch.Tensor | None = None,
) -> dict[str, float]:
    """K epochs x M mini-batches of optimizer steps; returns metrics averaged over the steps.

    ``forward``: this batch's ``batch_forward``, when the caller chose it already (for the scoring pass);
    otherwise it is chosen here by ``impl``: `fast` runs the frozen layers once for the whole batch (when the
    model allows it, else as `reference`); `reference` runs every layer in every micro-batch. Both give the same
    gradients up to float rounding.

    ``learner_logprobs`` [B, T] (an update of one optimizer step only): filled with the learner's log-probs of the
    batch's response tokens, detached, from that step's own forward, before the optimizer changes the weights:
    what a scoring pass would compute (the same weights on the same tokens), without the pass. A run with an
    off-policy source measures the sampler/learner mismatch with them (stratarl.trainer.step)."""
    if learner_logprobs is not None and settings.epochs * settings.mini_batches != 1:
        raise ValueError(
            f"learner_logprobs needs an update of one optimizer step, not epochs x mini_batches = "
            f"{settings.epochs} x {settings.mini_batches}: score the batch with measure_learner instead"
        )
    if not isinstance(batch, TrainBatch):
        raise TypeError(
            f"update_policy got an unscored {type(batch).__name__}: score it first "
            "(score_batch(...).with_advantages(advantages, returns))"
        )
    learner.model.train()
    per_step: list[dict[str, float]] = []
    try:
        if forward is None:
            forward = batch_forward(learner.model, batch, settings.policy, impl=impl)
        for _ in range(settings.epochs):
            minis = mini_batch_rows(batch.size, settings.mini_batches, generator)
            per_step.extend(
                optimizer_step(
                    learner,
                    batch.select(rows),
                    settings,
                    forward.select(rows),
                    None if learner_logprobs is None else (learner_logprobs, list(rows)),
                )
                for rows in minis
            )
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
