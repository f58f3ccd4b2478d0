"""The update: micro-batch accumulation equals one big batch, first step on-policy,
observation tokens inert, SORL metrics, the critic's isolation."""

from __future__ import annotations

import copy
from dataclasses import replace

import pytest
import torch

from stratarl.trainer.batch import collate_sequences
from stratarl.trainer.config import load_config
from stratarl.trainer.learner import build_learner
from stratarl.trainer.settings import UpdateSettings
from stratarl.trainer.update import accumulate_gradients, score_batch, update_policy


def _batch(seed: int = 0, rows: int = 6):
    g = torch.Generator().manual_seed(seed)
    prompts, responses, masks = [], [], []
    for _r in range(rows):
        p = torch.randint(3, 500, (int(torch.randint(2, 6, (1,), generator=g)),), generator=g).tolist()
        n = int(torch.randint(3, 9, (1,), generator=g))
        resp = torch.randint(3, 500, (n,), generator=g).tolist()
        # policy turn, observation (mask 0), policy turn
        mask = [1] * n
        if n > 4:
            mask[2:4] = [0, 0]
        prompts.append(p), responses.append(resp), masks.append(mask)
    tokens = collate_sequences(prompts, responses, masks, pad_id=0)
    return tokens, torch.randn(rows, generator=g)[:, None] * tokens.response_mask


def _train_batch(learner, cfg, seed: int = 0, rows: int = 6):
    """``_batch(seed)`` scored by ``learner`` (recomputed old log-probs), with its advantages as returns too."""
    tokens, advantages = _batch(seed, rows)
    return score_batch(learner, tokens, UpdateSettings.from_config(cfg)).with_advantages(advantages, advantages.clone())


def _cfg(*overrides):
    return load_config(
        None,
        [
            "model.name=tiny-random",
            "rollout.temperature=1.0",
            "algo.kl_coef=0.0",
            "trainer.logprob_chunk_tokens=7",
            *overrides,
        ],
    )


def _grads(model):
    return [p.grad.clone() if p.grad is not None else torch.zeros_like(p) for p in model.parameters()]


def _by_micro_batch_budget(tiny_model, *overrides):
    """[(gradients, metrics, batch)] of one accumulation with one micro-batch, then with one row at a time."""
    model = copy.deepcopy(tiny_model)
    results = []
    for budget in (10_000, 12):  # one micro-batch vs one row at a time
        cfg = _cfg(f"trainer.micro_batch_tokens={budget}", "algo.entropy_coef=0.01", *overrides)
        learner = build_learner(model, cfg, total_optimizer_steps=1)
        batch = _train_batch(learner, cfg)
        batch = replace(batch, old_logprobs=batch.old_logprobs - 0.05)  # off-policy: ratios != 1, some clipped
        model.zero_grad(set_to_none=True)
        metrics = accumulate_gradients(learner, batch, UpdateSettings.from_config(cfg))
        results.append((_grads(model), metrics, batch))
    return results


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"])
def test_micro_batching_does_not_change_the_gradient(tiny_model, agg):
    results = _by_micro_batch_budget(tiny_model, f"algo.loss_agg={agg}")
    for a, b in zip(results[0][0], results[1][0]):
        torch.testing.assert_close(a, b)
    assert any(g.abs().sum() > 0 for g in results[0][0])
    torch.testing.assert_close(results[0][1]["loss/policy"], results[1][1]["loss/policy"])


def test_first_step_is_on_policy(tiny_model):
    model = copy.deepcopy(tiny_model)
    cfg = _cfg("trainer.micro_batch_tokens=40")
    learner = build_learner(model, cfg, total_optimizer_steps=1)
    batch = _train_batch(learner, cfg, 1)
    metrics = accumulate_gradients(learner, batch, UpdateSettings.from_config(cfg))
    assert metrics["loss/clip_frac"] == 0.0
    torch.testing.assert_close(metrics["loss/ratio_max"], 1.0)
    torch.testing.assert_close(metrics["loss/ratio_min"], 1.0)


def test_observation_tokens_never_contribute(tiny_model):
    model = copy.deepcopy(tiny_model)
    cfg = _cfg("algo.kl_coef=0.1", "algo.entropy_coef=0.1")
    learner = build_learner(model, cfg, total_optimizer_steps=1)
    batch = _train_batch(learner, cfg, 2)
    batch = replace(batch, old_logprobs=batch.old_logprobs + 0.1)
    model.zero_grad(set_to_none=True)
    accumulate_gradients(learner, batch, UpdateSettings.from_config(cfg))
    reference = _grads(model)
    # Scribble on every masked (observation / padding) entry of the loss inputs.
    off = batch.response_mask == 0
    batch = replace(
        batch,
        advantages=torch.where(off, torch.full_like(batch.advantages, 1e3), batch.advantages),
        old_logprobs=torch.where(off, torch.full_like(batch.old_logprobs, -50.0), batch.old_logprobs),
        ref_logprobs=torch.where(off, torch.full_like(batch.ref_logprobs, 7.0), batch.ref_logprobs),
    )
    model.zero_grad(set_to_none=True)
    accumulate_gradients(learner, batch, UpdateSettings.from_config(cfg))
    for a, b in zip(reference, _grads(model)):
        torch.testing.assert_close(a, b)


def test_so_grpo_logs_sorl_metrics_and_is_plain_ppo_when_nothing_clipped(tiny_model):
    cfg_so = _cfg("algo.name=so_grpo", "trainer.epochs=1", "trainer.mini_batches=1", "optim.grad_clip=0")
    cfg_ppo = _cfg(
        "algo.name=grpo", "algo.ratio_level=turn", "trainer.epochs=1", "trainer.mini_batches=1", "optim.grad_clip=0"
    )
    finals = []
    for cfg in (cfg_so, cfg_ppo):
        model = copy.deepcopy(tiny_model)
        learner = build_learner(model, cfg, total_optimizer_steps=1)
        batch = _train_batch(learner, cfg, 3)
        metrics = update_policy(learner, batch, UpdateSettings.from_config(cfg), torch.Generator().manual_seed(0))
        finals.append([p.detach().clone() for p in model.parameters()])
        if cfg is cfg_so:
            assert metrics["sorl/c_norm"] == 0.0 and metrics["sorl/scale"] == 1.0
            assert "loss/clip_frac_turn" in metrics
    # delta = 1 and nothing clipped on the on-policy step: SO-GRPO's step equals the unnormalised one.
    for a, b in zip(*finals):
        assert torch.equal(a, b)


def test_so_grpo_shrinks_a_heavily_clipped_step(tiny_model):
    cfg = _cfg("algo.name=so_grpo", "algo.sorl_delta=1e-6")
    model = copy.deepcopy(tiny_model)
    learner = build_learner(model, cfg, total_optimizer_steps=1)
    batch = _train_batch(learner, cfg, 4)
    batch = replace(batch, old_logprobs=batch.old_logprobs - 2.0 * batch.response_mask)  # ratio e^2: clipped
    model.zero_grad(set_to_none=True)
    metrics = accumulate_gradients(learner, batch, UpdateSettings.from_config(cfg))
    assert metrics["loss/clip_frac"] > 0
    out = learner.normalizer.apply()
    assert out["sorl/c_norm"] > 0
    torch.testing.assert_close(out["sorl/scale"], 1.0 / out["sorl/c_norm"])


def test_ppo_critic_learns_without_touching_the_policy_gradient(tiny_model):
    cfg = _cfg("algo.name=ppo", "algo.critic_detach=true")
    model = copy.deepcopy(tiny_model)
    learner = build_learner(model, cfg, total_optimizer_steps=1)
    assert learner.value_head is not None
    batch = _train_batch(learner, cfg, 5)
    assert batch.old_values is not None and batch.old_values.abs().sum() == 0  # zero-initialised head
    batch = replace(batch, returns=batch.advantages + 1.0 * batch.response_mask)
    model.zero_grad(set_to_none=True)
    accumulate_gradients(learner, batch, UpdateSettings.from_config(cfg))
    with_critic = _grads(model)
    assert learner.value_head.linear.bias.grad.abs() > 0
    # Same batch without the value term: identical policy gradient (the head reads detached states).
    learner.value_head = None
    model.zero_grad(set_to_none=True)
    accumulate_gradients(learner, batch, UpdateSettings.from_config(cfg))
    for a, b in zip(with_critic, _grads(model)):
        torch.testing.assert_close(a, b)


def test_reference_model_is_frozen_copy(tiny_model):
    cfg = _cfg("algo.kl_coef=0.01")
    model = copy.deepcopy(tiny_model)
    learner = build_learner(model, cfg, total_optimizer_steps=1)
    assert learner.ref_model is not None and learner.ref_model is not model
    assert not any(p.requires_grad for p in learner.ref_model.parameters())
    assert build_learner(copy.deepcopy(tiny_model), _cfg("algo.kl_coef=0"), 1).ref_model is None


def test_small_policies_run_their_step_on_one_thread():
    from stratarl.infra.threads import SINGLE_THREAD_MAX_PARAMS, step_threads

    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        with step_threads(torch.nn.Linear(4, 4)):
            assert torch.get_num_threads() == 1
        assert torch.get_num_threads() == 2  # restored
        large = torch.nn.Linear(SINGLE_THREAD_MAX_PARAMS // 1000 + 1, 1000, bias=False)
        with step_threads(large):
            assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)


def test_seq_mean_token_sum_norm_uses_one_constant_length_so_micro_batching_does_not_change_the_gradient(tiny_model):
    """Dr.GRPO's aggregation divides each rollout's token sum by L = rollout.max_total_tokens, not by a
    micro-batch's padded length: one micro-batch and one row at a time give the same gradient, and the policy
    loss is the hand-computed Σ_rows Σ_t / (B · L) of the same per-token terms."""
    from stratarl.algos import clipped_policy_loss

    overrides = ("algo.loss_agg=seq-mean-token-sum-norm", "rollout.max_total_tokens=300")
    assert UpdateSettings.from_config(_cfg(*overrides)).norm_length == 300
    results = _by_micro_batch_budget(tiny_model, *overrides)
    for a, b in zip(results[0][0], results[1][0]):
        torch.testing.assert_close(a, b)
    assert any(g.abs().sum() > 0 for g in results[0][0])
    batch = results[0][2]
    # The same policy loss by hand: the token-level PPO terms summed per row, over B rows and L = 300.
    seq_sum = clipped_policy_loss(
        batch.old_logprobs + 0.05,
        batch.old_logprobs,
        batch.advantages,
        batch.response_mask,
        agg="seq-mean-token-sum",
        norm_length=None,
    ).loss
    torch.testing.assert_close(torch.tensor(results[0][1]["loss/policy"]), seq_sum / 300, rtol=1e-4, atol=1e-7)


def _turn_means(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Each policy token's value replaced by the mean over its turn (a maximal run of mask 1 in its row)."""
    out = torch.zeros_like(values)
    for r in range(values.shape[0]):
        t = 0
        while t < values.shape[1]:
            if mask[r, t] == 0:
                t += 1
                continue
            end = t
            while end < values.shape[1] and mask[r, end] == 1:
                end += 1
            out[r, t:end] = values[r, t:end].mean()
            t = end
    return out


def _on_policy_gradient(tiny_model, name: str, advantages: torch.Tensor) -> list[torch.Tensor]:
    """The policy gradient of one on-policy mini-batch (old log-probs = the current ones) of ``name``."""
    model = copy.deepcopy(tiny_model)
    cfg = _cfg(f"algo.name={name}")
    learner = build_learner(model, cfg, total_optimizer_steps=1)
    tokens, _ = _batch(6)
    batch = score_batch(learner, tokens, UpdateSettings.from_config(cfg)).with_advantages(
        advantages * tokens.response_mask, advantages * tokens.response_mask
    )
    model.zero_grad(set_to_none=True)
    metrics = accumulate_gradients(learner, batch, UpdateSettings.from_config(cfg))
    assert metrics["loss/clip_frac"] == 0.0  # on-policy: nothing clipped, C = 0
    return _grads(model)


def test_on_policy_so_grpo_equals_grpo_but_so_ppo_differs_from_ppo(tiny_model):
    """On-policy with nothing clipped, the turn ratio pushes each token by its turn's mean advantage. GRPO's
    advantage is constant over a rollout, so SO-GRPO's gradient is GRPO's; GAE advantages vary inside a turn,
    so SO-PPO's is not PPO's: it is PPO's gradient with every advantage replaced by its turn's mean."""
    mask = _batch(6)[0].response_mask
    per_rollout = torch.randn(mask.shape[0], 1, generator=torch.Generator().manual_seed(1)).expand_as(mask).clone()
    for a, b in zip(
        _on_policy_gradient(tiny_model, "so_grpo", per_rollout), _on_policy_gradient(tiny_model, "grpo", per_rollout)
    ):
        torch.testing.assert_close(a, b)
    per_token = torch.randn(mask.shape, generator=torch.Generator().manual_seed(2))
    so_ppo = _on_policy_gradient(tiny_model, "so_ppo", per_token)
    ppo = _on_policy_gradient(tiny_model, "ppo", per_token)
    gap = sum(float((a - b).abs().sum()) for a, b in zip(so_ppo, ppo))
    assert gap > 1e-3 * sum(float(b.abs().sum()) for b in ppo)
    for a, b in zip(so_ppo, _on_policy_gradient(tiny_model, "ppo", _turn_means(per_token, mask))):
        torch.testing.assert_close(a, b)
