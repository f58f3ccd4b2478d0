"""Two wiring facts of the trainer pinned with exact, hand-derived numbers (the suite passed without them):

- ``algo.kl_coef`` is the weight of the KL term: the loss is policy + kl_coef x KL, and one optimizer step of a
  real RL step moves the weights by lr x kl_coef x the KL gradient (computed here by hand), not by any fixed
  weight;
- rollouts whose search failed in the retriever stay out of the update when only some of the step's rollouts
  failed (a real step with a retriever that fails the searches of chosen rollouts).
"""

from __future__ import annotations

import copy
import dataclasses
from pathlib import Path

import pytest
import torch

from stratarl.algos.advantages import broadcast_to_tokens, grpo_advantages
from stratarl.retrieval.base import RetrievalError
from stratarl.rollout.collect import collect as real_collect
from stratarl.rollout.generation import Generation, Generator
from stratarl.trainer.batch import collate_rollouts, collate_sequences
from stratarl.trainer.config import load_config
from stratarl.trainer.forward import REFERENCE
from stratarl.trainer.learner import build_learner
from stratarl.trainer.run import RunParts, build_run
from stratarl.trainer.settings import UpdateSettings
from stratarl.trainer.step import rl_step
from stratarl.trainer.update import micro_batch_terms, score_batch

TINY = Path(__file__).resolve().parents[2] / "configs" / "tiny.yaml"

# --------------------------------------------------------------------------- the KL coefficient

SHIFT = 0.3
"""The reference log-probs sit SHIFT below the policy's on every policy token: the k1 KL is then exactly SHIFT."""


def _kl_batch(learner, cfg):
    """A scored batch of 4 random rows (an observation block between two turns), with advantages of both signs
    and reference log-probs = the behaviour log-probs - SHIFT on policy tokens."""
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 500, (4,), generator=g).tolist() for _ in range(4)]
    responses = [torch.randint(3, 500, (8,), generator=g).tolist() for _ in range(4)]
    tokens = collate_sequences(prompts, responses, [[1, 1, 1, 0, 0, 1, 1, 1]] * 4, pad_id=0)
    advantages = torch.tensor([1.0, -1.0, 0.5, 2.0])[:, None] * tokens.response_mask
    batch = score_batch(learner, tokens, UpdateSettings.from_config(cfg)).with_advantages(
        advantages, advantages.clone()
    )
    return dataclasses.replace(batch, ref_logprobs=batch.old_logprobs - SHIFT * batch.response_mask)


@pytest.mark.parametrize("estimator", ["k1", "k3"])
def test_kl_coef_weights_the_kl_term_of_the_loss(estimator, tiny_model):
    """loss = policy loss + kl_coef x KL (entropy_coef 0, no critic), at two coefficients, on one batch: the
    policy part is the same, the loss moves by exactly delta(kl_coef) x KL. With k1 the KL is hand-derived:
    the reference log-probs are SHIFT below the policy's on every policy token, so KL = SHIFT exactly
    (k3: exp(-SHIFT) + SHIFT - 1). Catches ``loss + kl`` (weight 1) or any fixed weight in place of
    ``settings.kl_coef * kl`` in ``micro_batch_terms``."""
    coefs = (0.05, 0.5)
    cfgs = [
        load_config(
            None,
            [
                "model.name=tiny-random",
                "algo.name=grpo",
                f"algo.kl_coef={c}",
                f"algo.kl_estimator={estimator}",
                "algo.entropy_coef=0",
                "algo.loss_agg=token-mean",
            ],
        )
        for c in coefs
    ]
    learner = build_learner(copy.deepcopy(tiny_model), cfgs[0], total_optimizer_steps=1)
    batch = _kl_batch(learner, cfgs[0])
    expected_kl = SHIFT if estimator == "k1" else float(torch.exp(torch.tensor(-SHIFT)) + SHIFT - 1)
    out = []
    for c, cfg in zip(coefs, cfgs):
        settings = UpdateSettings.from_config(cfg)
        forward = REFERENCE.response_logprobs(
            learner.model,
            batch,
            chunk_tokens=settings.logprob_chunk_tokens,
            temperature=settings.temperature,
            with_entropy=True,
        )
        loss, _, metrics = micro_batch_terms(learner, batch, settings, forward)
        kl, policy = float(metrics["loss/kl"]), float(metrics["loss/policy"])
        assert kl == pytest.approx(expected_kl, abs=1e-5)
        assert float(loss.detach()) == pytest.approx(policy + c * kl, abs=1e-6), f"loss is not policy + {c} x KL"
        out.append((float(loss.detach()), policy, kl))
    (loss_a, policy_a, kl_a), (loss_b, policy_b, kl_b) = out
    assert policy_a == pytest.approx(policy_b, abs=1e-7) and kl_a == pytest.approx(kl_b, abs=1e-7)
    assert loss_b - loss_a == pytest.approx((coefs[1] - coefs[0]) * expected_kl, abs=1e-5)
    assert (coefs[1] - coefs[0]) * expected_kl > 1e-2  # the predicted move is far above the tolerance


def _mean_response_logprob(model, batch, temperature):
    """Token-mean log-prob of the policy tokens, straight from the model's logits (no trainer code)."""
    logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits.float() / temperature
    logp = torch.log_softmax(logits, dim=-1)
    total, count = logp.new_zeros(()), 0.0
    for b in range(batch.size):
        start, length = int(batch.prompt_lengths[b]), int(batch.response_lengths[b])
        targets = batch.input_ids[b, start : start + length]
        token_logp = logp[b, start - 1 : start + length - 1].gather(-1, targets[:, None])[:, 0]
        mask = batch.response_mask[b, :length]
        total = total + (token_logp * mask).sum()
        count += float(mask.sum())
    return total / count


def test_kl_coef_scales_the_kl_gradient_of_a_real_step(tmp_path, tiny_overrides):
    """Two real RL steps (same seed, so the same rollouts and the same first weights) at kl_coef 0.05 and 0.5, one
    plain SGD step each (no clipping, no momentum, no decay, no warm-up), the k1 estimator: the KL gradient is
    the gradient of the token-mean policy log-prob (the reference is detached), so the weights after the two
    steps differ by exactly -lr x 0.45 x that gradient, computed here from the model's logits. Catches a KL
    term whose weight is not ``algo.kl_coef`` anywhere on the way through the trainer's update."""
    coefs, lr = (0.05, 0.5), 1.0
    runs = {}
    for c in coefs:
        cfg = load_config(
            TINY,
            [
                *tiny_overrides,
                "algo.name=grpo",
                f"algo.kl_coef={c}",
                "algo.kl_estimator=k1",
                "algo.entropy_coef=0",
                "algo.loss_agg=token-mean",
                "trainer.epochs=1",
                "trainer.mini_batches=1",
                "optim.name=sgd",
                f"optim.lr={lr}",
                "optim.grad_clip=0",
                "optim.warmup_steps=0",
                "optim.weight_decay=0",
                "rollout.temperature=1.0",
                "trainer.prompts_per_step=2",
                "rollout.group_size=4",
            ],
        )
        seen = {}

        def update(learner, batch, cfg, generator, _seen=seen, **kwargs):
            _seen["batch"], _seen["model"] = copy.deepcopy(batch), copy.deepcopy(learner.model)
            _seen["lr"] = learner.optimizer.param_groups[0]["lr"]
            return RunParts().update(learner, batch, cfg, generator, **kwargs)

        run = build_run(cfg, tmp_path / f"kl{c}", parts=RunParts(update=update))
        try:
            metrics = rl_step(run)
        finally:
            run.logger.close()
        assert metrics["optim/steps"] == 1.0 and metrics["optim/skipped_steps"] == 0.0
        assert seen["lr"] == lr
        runs[c] = (seen, {n: p.detach().clone() for n, p in run.model.named_parameters()})
    (seen_a, after_a), (seen_b, after_b) = runs[coefs[0]], runs[coefs[1]]
    assert torch.equal(seen_a["batch"].input_ids, seen_b["batch"].input_ids)  # the same rollouts
    model = seen_a["model"]
    for (name, p), q in zip(model.named_parameters(), seen_b["model"].parameters()):
        assert torch.equal(p, q), name  # the same weights before the step
    model.train()
    mean_logprob = _mean_response_logprob(model, seen_a["batch"], temperature=1.0)
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    grads = torch.autograd.grad(
        mean_logprob, [p for n, p in model.named_parameters() if p.requires_grad], allow_unused=True
    )
    moved = 0.0
    for name, grad in zip(names, grads):
        expected = -lr * (coefs[1] - coefs[0]) * (torch.zeros_like(after_a[name]) if grad is None else grad)
        torch.testing.assert_close(
            after_b[name] - after_a[name], expected, rtol=1e-3, atol=2e-6, msg=lambda m, name=name: f"{name}: {m}"
        )
        moved = max(moved, float(expected.abs().max()))
    assert moved > 1e-3  # the KL gradient moves some weight far above the tolerance


# --------------------------------------------------------------------------- partial retrieval faults

VICTIMS = (1, 6, 7, 12)
"""Rollouts (of 4 prompts x 4) whose second search fails: one, two, none and one per group; 4/16 < 0.5."""
MARK, POISON = "zqvictimzq", "zqpoisonzq"


class TwoSearchGenerator(Generator):
    """A scripted policy: in its first turn rollout i searches (the rollouts in VICTIMS for MARK); after the
    first observation the VICTIMS search again (for POISON) while the others answer; then they answer. So the
    victims' second searches form one retriever call of their own."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.calls = 0

    def generate(self, prompts, params, max_new_tokens=None):
        first_turn = self.calls == 0
        self.calls += 1
        budgets = list(max_new_tokens) if max_new_tokens is not None else [params.max_new_tokens] * len(prompts)
        out = []
        for i, (prompt, budget) in enumerate(zip(prompts, budgets)):
            history = self.tokenizer.decode(prompt)
            if first_turn:
                text = f"<search> {MARK if i in VICTIMS else 'who wrote it'} </search>"
            elif MARK in history and POISON not in history:
                text = f"<search> {POISON} who </search>"
            else:
                text = f"<answer> {'x' * (1 + i % 3)} </answer>"
            ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
            assert len(ids) <= budget, (text, budget)
            stop = "</answer>" if text.startswith("<answer>") else "</search>"
            out.append(Generation(ids, [-1.0] * len(ids), "stop", stop))
        return out


class PoisonedRetriever:
    """Raises for any call holding a POISON query; records every call's queries and whether it failed."""

    def __init__(self, inner) -> None:
        self.inner, self.calls = inner, []

    def search(self, queries, k):
        failed = any(POISON in q for q in queries)
        self.calls.append((list(queries), failed))
        if failed:
            raise RetrievalError("injected fault")
        return self.inner.search(queries, k)


def test_only_the_rollouts_whose_search_failed_leave_the_update(tmp_path, tiny_overrides):
    """A real step of 16 rollouts where the retriever fails the second search of 4 of them (fewer than
    retrieval.max_failed_fraction): the step updates, ``retrieval/faulty_rollout_frac`` is 4/16, and the batch
    the update receives holds exactly the 12 other rollouts' tokens, in order, with GRPO advantages over the
    kept rollouts' rewards and groups. Catches faulty rollouts kept in the update whenever only part of a step
    failed (the ``without_rollouts`` filtering in ``trainer.step._collect`` skipped or wrong)."""
    seen = {"updates": []}

    def collect(*args, **kwargs):
        seen["collected"] = real_collect(*args, **kwargs)
        return seen["collected"]

    def update(learner, batch, cfg, generator, **kwargs):
        seen["updates"].append(copy.deepcopy(batch))
        return RunParts().update(learner, batch, cfg, generator, **kwargs)

    parts = RunParts(
        make_generator=lambda model, tokenizer, backend, seed, **kwargs: TwoSearchGenerator(tokenizer),
        collect=collect,
        update=update,
    )
    cfg = load_config(
        TINY,
        [
            *tiny_overrides,
            "algo.name=grpo",
            "trainer.prompts_per_step=4",
            "rollout.group_size=4",
            "rollout.max_turns=2",
            "rollout.max_tokens_per_turn=16",
            "retrieval.max_failed_fraction=0.5",
            "trainer.epochs=1",
            "trainer.mini_batches=2",
            "logging.num_transcripts=0",
        ],
    )
    run = build_run(cfg, tmp_path / "run", parts=parts)
    retriever = run.retriever.inner = PoisonedRetriever(run.retriever.inner)
    try:
        metrics = rl_step(run)
    finally:
        run.logger.close()

    # The fault hit exactly the victims' second searches, in a call of their own.
    assert [failed for _, failed in retriever.calls] == [False, True]
    assert len(retriever.calls[0][0]) == 16 and len(retriever.calls[1][0]) == len(VICTIMS)
    rollouts = seen["collected"].rollouts
    assert len(rollouts) == 16
    assert [i for i, r in enumerate(rollouts) if r.tool_errors] == list(VICTIMS)
    assert all(r.num_searches == (2 if i in VICTIMS else 1) and r.answered for i, r in enumerate(rollouts))

    assert metrics["retrieval/faulty_rollout_frac"] == len(VICTIMS) / 16
    assert metrics["update/skipped"] == 0.0 and metrics["optim/steps"] == 2.0
    assert len(seen["updates"]) == 1
    batch = seen["updates"][0]
    kept = [i for i in range(16) if i not in VICTIMS]
    assert batch.size == len(kept)
    expected = collate_rollouts([rollouts[i] for i in kept], run.tokenizer.pad_token_id)
    rows = [row[mask.bool()].tolist() for row, mask in zip(batch.input_ids, batch.attention_mask)]
    assert rows == [rollouts[i].prompt_ids + rollouts[i].response_ids for i in kept]
    torch.testing.assert_close(batch.response_mask, expected.response_mask.to(batch.response_mask.dtype))
    assert all(POISON in run.tokenizer.decode(rollouts[i].response_ids) for i in VICTIMS)
    assert not any(POISON in run.tokenizer.decode(row) for row in rows)
    # The group baselines see only the kept rollouts.
    collected = seen["collected"]
    rewards = torch.tensor([collected.rewards[i] for i in kept], dtype=torch.float32)
    groups = torch.tensor([collected.group_ids[i] for i in kept])
    torch.testing.assert_close(
        batch.advantages,
        broadcast_to_tokens(grpo_advantages(rewards, groups, eps=1e-6), batch.response_mask),
        rtol=1e-5,
        atol=1e-6,
    )
