"""One RL step, in stages, each returned new:

prompts     P questions from the seeded sampler
behaviour   the sampler's weights: the learner's own, or with an off-policy source (trainer.policy_lag,
            rollout.precision) a copy loaded with version s - lag in the sampler's numerics (BehaviourPolicy)
collected   G rollouts per prompt, rewarded and stratified        (RunParts.collect: stratarl.rollout.collect)
            [trainer.dynamic_sampling: groups whose raw outcome is constant dropped, more prompts collected
            to refill the batch, within trainer.dynamic_sampling_attempts collections (stratarl.trainer.dynamic)]
strata      the strata the advantage uses (the observed ones, or the random-strata control's)
tokens      the rollouts collated                                 (TokenBatch)
forward     the policy's forward for this batch: the frozen       (stratarl.trainer.forward.batch_forward)
            prefix once, or every layer per micro-batch
scored      behaviour / reference log-probs, critic values        (ScoredBatch; stratarl.trainer.update.score_batch)
train       + the algorithm's advantages and returns              (TrainBatch; with each turn's anchor state
                                                                  for an estimator that needs it: GiGPO)
            [algo.overlong: mask: overlong rollouts' loss mask and advantages zeroed]
update      K epochs x M mini-batches of optimizer steps: the     (RunParts.update: stratarl.trainer.update)
            loss (micro_batch_terms), then the optimizer step
metrics     rollout, advantage (and the estimator's own), update, stratum, fault and timing metrics; transcripts

A step reads ``run.settings`` (stratarl.trainer.settings: plain values resolved once), never the config tree.
"""

from __future__ import annotations

import dataclasses
import inspect
import time

import torch

from stratarl.algos.advantages import explained_variance, negative_mass_share
from stratarl.algos.mismatch import mismatch_metrics
from stratarl.algos.presets import AlgorithmSpec
from stratarl.algos.registry import AdvantageBatch, advantage_info
from stratarl.algos.strata import (
    cross_stratum_variance,
    live_strata_group_fraction,
    shuffle_strata_within_groups,
    zero_san_fraction,
)
from stratarl.infra.metrics import write_transcripts
from stratarl.infra.threads import step_threads
from stratarl.rollout.collect import (
    CollectedBatch,
    advantage_metrics,
    batch_metrics,
    faulty_rollouts,
    scored_transcript,
    step_states,
    with_policy_version,
    without_frozen_states,
    without_rollouts,
)
from stratarl.trainer.batch import (
    ScoredBatch,
    TokenBatch,
    TrainBatch,
    collate_rollouts,
    scatter_response_values,
    without_loss,
)
from stratarl.trainer.dynamic import concat_batches, dynsample_metrics, informative_groups, keep_groups, refill_size
from stratarl.trainer.forward import PolicyForward, batch_forward, capture_layer
from stratarl.trainer.run import BoundAdvantage, RunState
from stratarl.trainer.settings import StepSettings
from stratarl.trainer.update import score_batch


def advantage_inputs(
    scored: ScoredBatch,
    rewards: list[float],
    group_ids: list[int],
    strata: list[int],
    states: list[tuple[str, ...]] | None = None,
) -> AdvantageBatch:
    """What every estimator receives, built on the batch's device; ``states``: each rollout's per-turn anchor
    states, for an estimator that declared ``needs_step_states`` (None otherwise)."""
    device = scored.response_mask.device
    return AdvantageBatch(
        rewards=torch.tensor(rewards, dtype=torch.float32, device=device),
        group_ids=torch.tensor(group_ids, device=device),
        response_mask=scored.response_mask,
        strata_ids=torch.tensor(strata, device=device),
        values=scored.old_values,
        step_states=None if states is None else tuple(states),
    )


def compute_advantages(advantage: BoundAdvantage, scored: ScoredBatch, inputs: AdvantageBatch) -> TrainBatch:
    """The train stage: ``scored`` with the estimator's advantages and returns [B, T]. ``advantage`` is the run's
    estimator with its parameters bound (``RunState.advantage``); ``inputs``: :func:`advantage_inputs` of
    ``scored``."""
    advantages, returns = advantage(inputs)
    return scored.with_advantages(advantages, returns)


def rollout_step_states(spec: AlgorithmSpec, collected: CollectedBatch, tokenizer) -> list[tuple[str, ...]] | None:
    """Each rollout's per-turn anchor states (stratarl.rollout.collect.step_states) when the algorithm's estimator
    declared ``needs_step_states`` (GiGPO); None otherwise (nothing is decoded)."""
    if not advantage_info(spec.advantage).needs_step_states:
        return None
    return [step_states(rollout, tokenizer) for rollout in collected.rollouts]


def estimator_metrics(spec: AlgorithmSpec, inputs: AdvantageBatch) -> dict[str, float]:
    """The metrics the algorithm's estimator declared (``AdvantageInfo.metrics``, e.g. GiGPO's ``gigpo/``
    step-group sizes), with the estimator's parameters; {} when it declared none."""
    metrics = advantage_info(spec.advantage).metrics
    return {} if metrics is None else {k: float(v) for k, v in metrics(inputs, **spec.advantage_params).items()}


def advantage_diagnostics(batch: TrainBatch) -> dict[str, float]:
    """What the update's advantages push: ``advantage/negative_mass_share`` (the share of |A| mass on policy tokens
    with A < 0; stratarl.algos.advantages.negative_mass_share) and, with a critic,
    ``critic/explained_variance`` of the returns by the values the advantages used (omitted when the returns do
    not vary)."""
    out = {"advantage/negative_mass_share": negative_mass_share(batch.advantages, batch.response_mask)}
    if batch.old_values is not None:
        ev = explained_variance(batch.old_values, batch.returns, batch.response_mask)
        if ev == ev:  # not nan
            out["critic/explained_variance"] = ev
    return out


def advantage_strata(settings: StepSettings, observed: list[int], group_ids: list[int], step: int) -> list[int]:
    """The strata the advantage uses: the observed ones, or for ``algo.stratum_key: random`` the observed
    strata permuted inside each group (same sizes, random members; seeded by trainer.seed and the step,
    so a resumed run draws the same strata)."""
    if not settings.random_strata:
        return list(observed)
    generator = torch.Generator().manual_seed(settings.seed * 1_000_003 + step)
    return shuffle_strata_within_groups(torch.tensor(observed), torch.tensor(group_ids), generator).tolist()


def stratum_metrics(settings: StepSettings, collected: CollectedBatch, strata: list[int]) -> dict[str, float]:
    """stratum/cross_var and stratum/zero_san_frac on the strata the advantage used (see
    stratarl.algos.strata); with random strata also stratum/cross_var_observed on the real ones.
    stratum/live_groups_frac (groups with >= 2 strata of mean reward in [0.05, 0.95]) is always taken on the
    observed strata: it says whether the task gives Stratified GRPO anything to act on, whatever the arm."""
    if not collected.rewards:
        return {}
    rewards, groups = torch.tensor(collected.rewards, dtype=torch.float64), torch.tensor(collected.group_ids)
    used = torch.tensor(strata)
    out = {
        "stratum/cross_var": float(cross_stratum_variance(rewards, groups, used)),
        "stratum/zero_san_frac": float(zero_san_fraction(rewards, groups, used)),
        "stratum/live_groups_frac": float(live_strata_group_fraction(rewards, groups, torch.tensor(collected.strata))),
    }
    if settings.random_strata:
        out["stratum/cross_var_observed"] = float(
            cross_stratum_variance(rewards, groups, torch.tensor(collected.strata))
        )
    return out


def em_by_type(examples: list, em: list[float], prefix: str = "reward/em_by_type") -> dict[str, float]:
    """Mean EM per ``metadata['question_type']`` (synthetic KB: single, 2hop, ...); {} when no example has one."""
    by_type: dict[str, list[float]] = {}
    for example, value in zip(examples, em):
        question_type = example.metadata.get("question_type") if example.metadata else None
        if question_type is not None:
            by_type.setdefault(str(question_type), []).append(value)
    return {f"{prefix}/{t}": sum(v) / len(v) for t, v in sorted(by_type.items())}


def fault_metrics(faulty: list[bool], max_failed_fraction: float, mini_batches: int) -> dict[str, float]:
    """``retrieval/faulty_rollout_frac``: the share of the step's rollouts kept out of the update because a
    search of theirs failed in the retriever or their reward could not be computed (a judge's fault);
    ``update/skipped`` 1.0 when the step takes no optimizer step: that share passes ``max_failed_fraction``
    (retrieval.max_failed_fraction), or fewer clean rollouts remain than trainer.mini_batches needs."""
    share = sum(faulty) / max(1, len(faulty))
    clean = len(faulty) - sum(faulty)
    skipped = share > max_failed_fraction or (clean < mini_batches and clean < len(faulty))
    return {"retrieval/faulty_rollout_frac": share, "update/skipped": float(skipped)}


def rl_step(run: RunState) -> dict[str, float]:
    """One RL step: rollouts -> rewards -> strata -> advantages -> K x M updates. Returns its metrics.
    A small policy runs it on one thread (``step_threads``)."""
    with step_threads(run.model):
        metrics = _rl_step(run)
        metrics["perf/threads"] = float(torch.get_num_threads())
    return metrics


def _rl_step(run: RunState) -> dict[str, float]:
    """The stages of the module docstring, in order."""
    step_start = time.perf_counter()
    version, lag = _prepare_behaviour(run)
    capture = _capture(run)
    collected, faults = _collect(run, capture)
    collected = with_policy_version(collected, version)
    if not _trainable(run, collected, faults):  # no optimizer step
        return {
            **batch_metrics(collected),
            **faults,
            "update/no_signal": float(not faults["update/skipped"]),
            **lag,
            **run.timer.pop(),
            "time/step": time.perf_counter() - step_start,
        }
    strata = advantage_strata(run.settings.step, collected.strata, collected.group_ids, run.step)
    in_update = _mismatch_in_update(run)
    tokens, forward, collected = _forward(run, collected, capture)  # the old batch's hidden states freed here
    scored = _score(run, collected, tokens, forward, measure_learner=run.behaviour is not None and not in_update)
    states = rollout_step_states(run.settings.algorithm, collected, run.tokenizer)
    inputs = advantage_inputs(scored, collected.rewards, collected.group_ids, strata, states)
    batch = compute_advantages(run.advantage, scored, inputs)
    if run.settings.step.mask_overlong:  # overlong rollouts out of the loss (algo.overlong: mask)
        batch = without_loss(batch, collected.overlong)
        faults = {**faults, "rollout/overlong_masked": float(sum(collected.overlong))}
    estimated = estimator_metrics(run.settings.algorithm, inputs)
    recorded = torch.zeros(batch.response_mask.shape, device=batch.response_mask.device) if in_update else None
    with run.timer("update"):
        extra = {"learner_logprobs": recorded} if recorded is not None else {}
        update = run.parts.update(run.learner, batch, run.settings.update, run.shuffle_rng, forward=forward, **extra)
    if recorded is not None:
        scored = dataclasses.replace(scored, learner_logprobs=recorded)

    metrics = {
        **batch_metrics(collected),
        **advantage_metrics(batch.advantages, batch.response_mask),
        **advantage_diagnostics(batch),
        **estimated,
        **update,
        **stratum_metrics(run.settings.step, collected, strata),
        **em_by_type(collected.examples, collected.em),
        **faults,
        **lag,
        **_mismatch(scored),
    }
    metrics.update(run.timer.pop())
    metrics["perf/prefix_from_rollouts"] = float(forward.prefix is not None and forward.prefix.source == "rollouts")
    metrics["time/step"] = time.perf_counter() - step_start
    update_tokens = float(batch.attention_mask.sum()) * run.settings.update.epochs
    metrics["perf/update_tokens_per_s"] = update_tokens / max(metrics.get("time/update", 0.0), 1e-9)
    generated = sum(sum(r.response_mask) for r in collected.rollouts)
    metrics["perf/generation_tokens_per_s"] = generated / max(collected.generation_s, 1e-9)
    if run.settings.step.num_transcripts:
        _write_transcripts(run, collected, strata, batch)
    return metrics


def _trainable(run: RunState, collected: CollectedBatch, faults: dict[str, float]) -> bool:
    """Whether the step takes an optimizer step: not when faults skip it (the rewards are a broken retriever's or
    judge's: ``update/skipped``), nor when there is nothing to train on (``update/no_signal``): dynamic sampling
    kept fewer rollouts than trainer.mini_batches needs, or every rollout is overlong and masked out of the loss."""
    if faults["update/skipped"] or len(collected.rollouts) < run.settings.update.mini_batches:
        return False
    return not (run.settings.step.mask_overlong and all(collected.overlong))


def _collect(run: RunState, capture: int | None) -> tuple[CollectedBatch, dict[str, float]]:
    """The step's rollouts without the faulty ones, and the fault metrics (``update/skipped`` 1: no update); with
    dynamic sampling, only the groups whose raw outcome varies (``_collect_informative``)."""
    settings = run.settings.step
    run.reward_fault = ""
    if settings.dynamic_sampling:
        return _collect_informative(run, capture)
    return _collect_once(run, capture, settings.prompts_per_step, run.settings.update.mini_batches)


def _collect_informative(run: RunState, capture: int | None) -> tuple[CollectedBatch, dict[str, float]]:
    """Dynamic sampling: collect, drop the groups whose raw outcome is constant (stratarl.trainer.dynamic), and
    collect more prompts until ``prompts_per_step`` groups are kept or ``dynamic_sampling_attempts`` collections
    are made; kept groups beyond ``prompts_per_step`` are left out. Every prompt comes from the run's sampler, so
    a resumed run draws the same ones. A collection where more than retrieval.max_failed_fraction of the rollouts
    are faulty skips the step; ``retrieval/faulty_rollout_frac`` is the share over every collection."""
    settings = run.settings.step
    target, kept, totals = settings.prompts_per_step, [], []
    seen = dropped = drawn = attempts = num_kept = 0
    faulty = 0.0
    while attempts < settings.dynamic_sampling_attempts and num_kept < target:
        size = refill_size(target - num_kept, num_kept, seen, target)
        attempts, drawn = attempts + 1, drawn + size
        # mini_batches 0: a small refill is never too small; _trainable checks the kept batch's size.
        collected, faults = _collect_once(run, capture, size, mini_batches=0)
        faulty += faults["retrieval/faulty_rollout_frac"] * size
        if faults["update/skipped"]:
            return collected, {**faults, **dynsample_metrics(attempts, seen, dropped, num_kept, target, drawn)}
        groups = informative_groups(collected)
        totals.extend(collected.rewards)
        seen += len(set(collected.group_ids))
        dropped += len(set(collected.group_ids)) - len(groups)
        take = groups[: target - num_kept]
        kept.append(keep_groups(collected, take, first_id=num_kept))
        num_kept += len(take)
    metrics = dynsample_metrics(attempts, seen, dropped, num_kept, target, drawn)
    metrics["dynsample/reward_mean_sampled"] = sum(totals) / max(1, len(totals))  # reward/mean: the kept groups'
    return concat_batches(kept), {"retrieval/faulty_rollout_frac": faulty / drawn, "update/skipped": 0.0, **metrics}


def _collect_once(
    run: RunState, capture: int | None, num_prompts: int, mini_batches: int
) -> tuple[CollectedBatch, dict[str, float]]:
    """``num_prompts`` prompts' rollouts without the faulty ones, and the fault metrics (too few clean rollouts
    for ``mini_batches`` skip the update too)."""
    settings = run.settings.step
    examples = [run.task.train[i] for i in run.sampler.next(num_prompts)]
    collected = run.parts.collect(
        run.generator,
        run.retriever,
        run.tokenizer,
        examples,
        settings.rollout,
        run.scoring,
        group_size=settings.rollout.group_size,
        prompt_cache=run.prompt_cache,
        capture_layer=capture,
    )
    run.timer.add("generation", collected.generation_s)
    run.timer.add("retrieval", collected.retrieval_s)
    faulty = faulty_rollouts(collected.rollouts, collected.reward_faults)
    run.reward_fault = next((fault for fault in collected.reward_faults if fault), run.reward_fault)  # for the stop
    faults = fault_metrics(faulty, settings.max_failed_fraction, mini_batches)
    if any(faulty) and not faults["update/skipped"]:
        collected = without_rollouts(collected, faulty)
    return collected, faults


def _prepare_behaviour(run: RunState) -> tuple[int, dict[str, float]]:
    """Load the sampler with the weights this step samples with: (their version, the lag metrics). Without an
    off-policy source the learner samples its own current weights (version = the step; no metrics)."""
    if run.behaviour is None:
        return run.step, {}
    version, lag = run.behaviour.prepare(run.step)
    return version, {"offpolicy/lag": float(lag), "offpolicy/policy_version": float(version)}


def _capture(run: RunState) -> int | None:
    """The decoder layer whose input states the generator keeps while sampling: the frozen prefix the update
    needs, computed once (None when the fast update does not run, or when the sampler's numerics differ from
    the learner's: its states are not the learner's prefix)."""
    same_numerics = run.behaviour is None or run.behaviour.same_numerics(run.settings.policy)
    return capture_layer(run.learner.model) if run.settings.step.prefix_from_rollouts and same_numerics else None


def _mismatch_in_update(run: RunState) -> bool:
    """Whether the sampler/learner mismatch of a run with an off-policy source is measured on the log-probs of the
    update's own forward (``update_policy(..., learner_logprobs=...)``): when the update takes one optimizer step
    per batch, its forward runs the learner's weights before they change, so a separate scoring pass would
    compute the same numbers again (a stale-weights step then costs what a fresh one does)."""
    update = run.settings.update
    return (
        run.behaviour is not None
        and update.epochs * update.mini_batches == 1
        and "learner_logprobs" in inspect.signature(run.parts.update).parameters
    )


def _forward(
    run: RunState, collected: CollectedBatch, capture: int | None
) -> tuple[TokenBatch, PolicyForward, CollectedBatch]:
    """The step's rollouts collated, the policy's forward the scoring pass and the update share, and the batch
    without the captured states that forward now holds."""
    tokens = collate_rollouts(collected.rollouts, run.tokenizer.pad_token_id).to(run.settings.step.device)
    with run.timer("frozen_prefix"):  # the frozen layers, once for the scoring pass and every optimizer step
        states = [r.frozen_states for r in collected.rollouts] if capture is not None else None
        forward = batch_forward(run.learner.model, tokens, run.settings.policy, states=states)
    return tokens, forward, without_frozen_states(collected)


def _score(
    run: RunState, collected: CollectedBatch, tokens: TokenBatch, forward: PolicyForward, *, measure_learner: bool
) -> ScoredBatch:
    """The scored stage of the step's rollouts on the shared forward (``measure_learner``: ``score_batch``'s)."""
    sampling = scatter_response_values([r.sampling_logprobs for r in collected.rollouts], tokens.response_lengths)
    with run.timer("logprobs"):
        return score_batch(
            run.learner,
            tokens,
            run.settings.update,
            sampling,
            forward,
            shortcut=True,
            measure_learner=measure_learner,
        )


def _mismatch(scored: ScoredBatch) -> dict[str, float]:
    """The sampler/learner mismatch (``offpolicy/``; stratarl.algos.mismatch) when the scoring pass computed the
    learner's log-probs; {} otherwise."""
    if scored.learner_logprobs is None or scored.behaviour_logprobs is None:
        return {}
    found = mismatch_metrics(scored.learner_logprobs, scored.behaviour_logprobs, scored.response_mask)
    return {key: float(value) for key, value in found.items()}


def _write_transcripts(run: RunState, collected: CollectedBatch, strata: list[int], batch: TrainBatch) -> None:
    """The first ``logging.num_transcripts`` rollouts of the step, with the stratum and advantage the update used."""
    adv = batch.advantages[:, 0] if batch.advantages.shape[1] else torch.zeros(batch.size)
    records = [
        scored_transcript(r, e, run.tokenizer, reward=rw, stratum=s, advantage=float(a))
        for r, e, rw, s, a in zip(collected.rollouts, collected.examples, collected.rewards, strata, adv.tolist())
    ][: run.settings.step.num_transcripts]
    write_transcripts(run.run_dir / "transcripts" / f"step_{run.step + 1:06d}.jsonl", records)
