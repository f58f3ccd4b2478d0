"""One RL step, in stages, each returned new:

prompts     P questions from the seeded sampler
behaviour   the sampler's weights: the learner's own, or with an off-policy source (trainer.policy_lag,
            rollout.precision) a copy loaded with version s - lag in the sampler's numerics (BehaviourPolicy)
collected   G rollouts per prompt, rewarded and stratified        (RunParts.collect)
strata      the strata the advantage uses (the observed ones, or the random-strata control's)
tokens      the rollouts collated                                 (TokenBatch)
scored      behaviour / reference log-probs, critic values        (ScoredBatch; update.score_batch)
train       + the algorithm's advantages and returns              (TrainBatch; with each turn's anchor state
                                                                  for an estimator that needs it: GiGPO)
update      K epochs x M mini-batches of optimizer steps          (RunParts.update)
metrics     rollout, advantage (and the estimator's own), update, stratum, fault and timing metrics; transcripts
"""

from __future__ import annotations

import time

import torch

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
    without_rollouts,
)
from stratarl.trainer.batch import ScoredBatch, TrainBatch, collate_rollouts, scatter_response_values
from stratarl.trainer.config import Config
from stratarl.trainer.run import RunState
from stratarl.trainer.update import batch_prefix, capture_layer, score_batch


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


def compute_advantages(advantage, scored: ScoredBatch, inputs: AdvantageBatch) -> TrainBatch:
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


def advantage_strata(cfg: Config, observed: list[int], group_ids: list[int], step: int) -> list[int]:
    """The strata the advantage uses: the observed ones, or for ``algo.stratum_key: random`` the observed
    strata permuted inside each group (same sizes, random members; seeded by trainer.seed and the step,
    so a resumed run draws the same strata)."""
    if cfg.algo.stratum_key != "random":
        return list(observed)
    generator = torch.Generator().manual_seed(cfg.trainer.seed * 1_000_003 + step)
    return shuffle_strata_within_groups(torch.tensor(observed), torch.tensor(group_ids), generator).tolist()


def stratum_metrics(cfg: Config, collected: CollectedBatch, strata: list[int]) -> dict[str, float]:
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
    if cfg.algo.stratum_key == "random":
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
    search of theirs failed in the retriever; ``update/skipped`` 1.0 when the step takes no optimizer
    step: that share passes ``max_failed_fraction`` (retrieval.max_failed_fraction), or fewer clean
    rollouts remain than trainer.mini_batches needs."""
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


def _collect(run: RunState, capture: int | None) -> tuple[CollectedBatch, dict[str, float]]:
    """The step's rollouts without the faulty ones, and the fault metrics (``update/skipped`` 1: no update)."""
    cfg = run.cfg
    examples = [run.task.train[i] for i in run.sampler.next(cfg.trainer.prompts_per_step)]
    collected = run.parts.collect(
        run.generator,
        run.retriever,
        run.tokenizer,
        examples,
        cfg.rollout,
        run.scoring,
        group_size=cfg.rollout.group_size,
        prompt_cache=run.prompt_cache,
        capture_layer=capture,
    )
    run.timer.add("generation", collected.generation_s)
    run.timer.add("retrieval", collected.retrieval_s)
    faulty = faulty_rollouts(collected.rollouts)
    faults = fault_metrics(faulty, cfg.retrieval.max_failed_fraction, cfg.trainer.mini_batches)
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


def _rl_step(run: RunState) -> dict[str, float]:
    cfg, timer = run.cfg, run.timer
    step_start = time.perf_counter()
    version, lag = _prepare_behaviour(run)
    # The generator keeps the hidden states entering the lowest trainable layer: the frozen prefix the
    # update needs, already computed while sampling (None when the fast update does not run, or when the
    # sampler's numerics differ from the learner's: its states are not the learner's prefix).
    same_numerics = run.behaviour is None or run.behaviour.same_numerics(cfg.device_policy)
    capture = capture_layer(run.learner) if cfg.trainer.prefix_from_rollouts and same_numerics else None
    collected, faults = _collect(run, capture)
    for rollout in collected.rollouts:
        rollout.policy_version = version
    if faults["update/skipped"]:  # no optimizer step: the rewards are the broken retriever's
        return {
            **batch_metrics(collected),
            **faults,
            **lag,
            **timer.pop(),
            "time/step": time.perf_counter() - step_start,
        }
    strata = advantage_strata(cfg, collected.strata, collected.group_ids, run.step)

    tokens = collate_rollouts(collected.rollouts, run.tokenizer.pad_token_id).to(cfg.trainer.device)
    sampling = scatter_response_values([r.sampling_logprobs for r in collected.rollouts], tokens.response_lengths)
    with timer("frozen_prefix"):  # the frozen layers, once for the scoring pass and every optimizer step
        states = [r.frozen_states for r in collected.rollouts] if capture is not None else None
        prefix = batch_prefix(run.learner, tokens, cfg, states=states)
    for rollout in collected.rollouts:
        rollout.frozen_states = None  # the states' memory, now in the prefix
    with timer("logprobs"):
        scored = score_batch(
            run.learner, tokens, cfg, sampling, prefix, shortcut=True, measure_learner=run.behaviour is not None
        )
    inputs = advantage_inputs(
        scored,
        collected.rewards,
        collected.group_ids,
        strata,
        rollout_step_states(cfg.algorithm, collected, run.tokenizer),
    )
    batch = compute_advantages(run.advantage, scored, inputs)
    estimated = estimator_metrics(cfg.algorithm, inputs)

    with timer("update"):
        update = run.parts.update(run.learner, batch, cfg, run.shuffle_rng, prefix=prefix)

    metrics = {
        **batch_metrics(collected),
        **advantage_metrics(batch.advantages, batch.response_mask),
        **estimated,
        **update,
        **stratum_metrics(cfg, collected, strata),
        **em_by_type(collected.examples, collected.em),
        **faults,
        **lag,
        **_mismatch(scored),
    }
    metrics.update(timer.pop())
    metrics["perf/prefix_from_rollouts"] = float(prefix is not None and prefix.source == "rollouts")
    metrics["time/step"] = time.perf_counter() - step_start
    update_tokens = float(batch.attention_mask.sum()) * cfg.trainer.epochs
    metrics["perf/update_tokens_per_s"] = update_tokens / max(metrics.get("time/update", 0.0), 1e-9)
    generated = sum(sum(r.response_mask) for r in collected.rollouts)
    metrics["perf/generation_tokens_per_s"] = generated / max(collected.generation_s, 1e-9)
    if cfg.logging.num_transcripts:
        _write_transcripts(run, collected, strata, batch)
    return metrics


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
    ][: run.cfg.logging.num_transcripts]
    write_transcripts(run.run_dir / "transcripts" / f"step_{run.step + 1:06d}.jsonl", records)
