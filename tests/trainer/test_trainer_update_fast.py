"""The fast update (frozen layers once per batch, prompt groups kept together) gives the reference
update's gradients and parameters, for every algorithm family, on a tiny model whose lower layers
are frozen."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch

from stratarl.infra.flops import record_decoder_calls
from stratarl.models import build_tiny_model, freeze_all_but_last_layers
from stratarl.trainer.batch import collate_sequences
from stratarl.trainer.config import load_config
from stratarl.trainer.forward import REFERENCE, PrefixForward
from stratarl.trainer.learner import build_learner
from stratarl.trainer.prefix import frozen_prefix, group_micro_batches, unsupported_reason
from stratarl.trainer.settings import UpdateSettings
from stratarl.trainer.update import accumulate_gradients, score_batch, update_policy


@pytest.fixture(scope="module")
def frozen_model(smollm2_tokenizer):
    """4 random layers, the lower 2 frozen (as model.trainable_layers=2 does)."""
    model = build_tiny_model(smollm2_tokenizer, num_layers=4, seed=0)
    model.config.use_cache = False
    freeze_all_but_last_layers(model, 2)
    return model


def _grouped_batch(seed: int = 0, groups: int = 3, group_size: int = 3):
    """``groups`` prompts of different lengths, ``group_size`` responses each with an observation block."""
    g = torch.Generator().manual_seed(seed)
    prompts, responses, masks = [], [], []
    for _ in range(groups):
        prompt = torch.randint(3, 500, (int(torch.randint(3, 9, (1,), generator=g)),), generator=g).tolist()
        for _ in range(group_size):
            n = int(torch.randint(4, 14, (1,), generator=g))
            mask = [1] * n
            if n > 6:
                mask[2:5] = [0, 0, 0]
            prompts.append(prompt)
            responses.append(torch.randint(3, 500, (n,), generator=g).tolist())
            masks.append(mask)
    tokens = collate_sequences(prompts, responses, masks, pad_id=0)
    return tokens, torch.randn(tokens.size, 1, generator=g) * tokens.response_mask


def _train_batch(learner, cfg, seed: int = 0):
    """``_grouped_batch(seed)`` scored by ``learner`` (recomputed old log-probs), with its advantages."""
    tokens, advantages = _grouped_batch(seed)
    return score_batch(learner, tokens, UpdateSettings.from_config(cfg)).with_advantages(advantages, advantages.clone())


def _cfg(*overrides):
    return load_config(
        None,
        [
            "model.name=tiny-random",
            "rollout.temperature=0.8",
            "algo.kl_coef=0.0",
            "trainer.logprob_chunk_tokens=7",
            "trainer.micro_batch_tokens=60",
            "algo.entropy_coef=0.01",
            *overrides,
        ],
    )


def _grads(model, value_head=None):
    params = list(model.parameters()) + (list(value_head.parameters()) if value_head is not None else [])
    return [p.grad.clone() if p.grad is not None else torch.zeros_like(p) for p in params]


def _params_after_update(frozen_model, cfg, impl: str, *, batch_seed: int, optimizer_steps: int, hook=None):
    """The parameters of a copy of ``frozen_model`` after ``update_policy(impl=impl)`` on a scored batch
    (``hook``: a forward hook on the frozen layer 0's down projection while it runs)."""
    model = copy.deepcopy(frozen_model)
    handle = model.model.layers[0].mlp.down_proj.register_forward_hook(hook) if hook is not None else None
    learner = build_learner(model, cfg, total_optimizer_steps=optimizer_steps)
    update_policy(
        learner,
        _train_batch(learner, cfg, batch_seed),
        UpdateSettings.from_config(cfg),
        torch.Generator().manual_seed(0),
        impl=impl,
    )
    if handle is not None:
        handle.remove()
    return [p.detach().clone() for p in model.parameters()]


ALGOS = [
    ["algo.name=grpo"],
    ["algo.name=stratified_grpo"],
    ["algo.name=so_grpo"],
    ["algo.name=so_ppo"],
    ["algo.name=ppo"],
    ["algo.name=grpo", "algo.loss_agg=seq-mean-token-mean"],
]


def test_the_fast_path_runs_on_the_tiny_model(frozen_model):
    assert unsupported_reason(frozen_model) is None


@pytest.mark.parametrize("overrides", ALGOS, ids=lambda o: "-".join(x.split("=")[1] for x in o))
def test_fast_gradients_equal_the_reference(frozen_model, overrides):
    cfg = _cfg(*overrides)
    results = []
    for impl in ("reference", "fast"):
        model = copy.deepcopy(frozen_model)
        learner = build_learner(model, cfg, total_optimizer_steps=1)
        batch = _train_batch(learner, cfg)
        # off-policy: some ratios clipped
        batch = dataclasses.replace(batch, old_logprobs=batch.old_logprobs - 0.1 * batch.response_mask)
        if learner.value_head is not None:  # a non-zero critic, so the value loss has a gradient
            torch.nn.init.normal_(learner.value_head.linear.weight, std=0.1, generator=torch.Generator().manual_seed(0))
        forward = REFERENCE
        if impl == "fast":
            forward = PrefixForward(frozen_prefix(model, batch.input_ids, batch.attention_mask, batch.prompt_lengths))
        model.train()
        metrics = accumulate_gradients(learner, batch, UpdateSettings.from_config(cfg), forward)
        results.append((_grads(model, learner.value_head), metrics))
    (ref_grads, ref_metrics), (fast_grads, fast_metrics) = results
    assert any(g.abs().sum() > 0 for g in ref_grads)
    for a, b in zip(ref_grads, fast_grads):
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-6)
    for key in ("loss/policy", "loss/entropy", "loss/clip_frac"):
        torch.testing.assert_close(fast_metrics[key], ref_metrics[key], rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize(
    "overrides", [["algo.name=stratified_grpo"], ["algo.name=so_ppo"]], ids=["stratified_grpo", "so_ppo"]
)
def test_fast_update_policy_equals_the_reference_over_epochs_and_mini_batches(frozen_model, overrides):
    """K=2 epochs x M=2 mini-batches: the prefix computed once stays valid across optimizer steps."""
    cfg = _cfg("trainer.epochs=2", "trainer.mini_batches=2", *overrides)
    params = [
        _params_after_update(frozen_model, cfg, impl, batch_seed=1, optimizer_steps=4) for impl in ("reference", "fast")
    ]
    moved = [not torch.equal(a, b) for a, b in zip(params[0], frozen_model.parameters())]
    assert any(moved)
    for a, b in zip(params[0], params[1]):
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-6)


def test_fast_gradients_equal_the_reference_with_a_pass_per_length(frozen_model, monkeypatch):
    """No fixed cost per pass: ``response_chunks`` gives rows of each length their own pass (prefix and suffix)."""
    from stratarl.infra import flops

    monkeypatch.setattr(flops, "PASS_OVERHEAD_FLOPS_PER_LAYER", 0.0)
    test_fast_gradients_equal_the_reference(frozen_model, ["algo.name=so_grpo"])


def test_frozen_layers_run_once_per_batch_in_the_fast_update(frozen_model):
    """Counting layer calls: the reference runs the frozen layers in every micro-batch and epoch, the fast
    update once for the batch (a prompt pass and response chunks), under no_grad."""
    cfg = _cfg("trainer.epochs=2", "trainer.mini_batches=2")
    counts = {}
    for impl in ("reference", "fast"):
        model = copy.deepcopy(frozen_model)
        learner = build_learner(model, cfg, total_optimizer_steps=4)
        batch = _train_batch(learner, cfg, 2)
        with record_decoder_calls(model) as record:
            update_policy(learner, batch, UpdateSettings.from_config(cfg), torch.Generator().manual_seed(0), impl=impl)
        counts[impl] = sum(r * q for layer, r, q, _, _, _ in record.calls if layer == 0)
    batch, _ = _grouped_batch(2)
    unique_prompt_tokens = 3 * int(batch.prompt_lengths.max())  # 3 prompts, left-padded to the longest
    assert counts["fast"] <= unique_prompt_tokens + batch.size * int(batch.response_lengths.max())
    assert counts["reference"] > 2 * counts["fast"]


def test_group_micro_batches_keep_groups_together_and_fit_the_budget():
    lengths = torch.tensor([10, 12, 11, 30, 31, 5, 6])
    groups = torch.tensor([0, 0, 0, 1, 1, 2, 2])
    parts = group_micro_batches(lengths, groups, token_budget=70)
    assert sorted(r for p in parts for r in p) == list(range(7))
    for part in parts:
        assert len(part) * max(int(lengths[r]) for r in part) <= 70
    where = {r: i for i, p in enumerate(parts) for r in p}
    assert where[0] == where[1] == where[2] and where[3] == where[4] and where[5] == where[6]
    # a group over the budget alone is split by length
    parts = group_micro_batches(lengths, groups, token_budget=31)
    assert [3] in parts and [4] in parts


def test_models_the_fast_path_cannot_take_are_named(smollm2_tokenizer, frozen_model):
    all_trainable = build_tiny_model(smollm2_tokenizer, num_layers=2, seed=0)
    assert "embedding trains" in unsupported_reason(all_trainable)
    checkpointed = copy.deepcopy(frozen_model)
    checkpointed.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    assert unsupported_reason(checkpointed) == "gradient checkpointing"


def test_an_unknown_update_impl_is_refused(frozen_model):
    cfg = _cfg()
    learner = build_learner(copy.deepcopy(frozen_model), cfg, total_optimizer_steps=1)
    with pytest.raises(ValueError, match="update impl 'quick' is not one of"):
        update_policy(
            learner,
            _train_batch(learner, cfg),
            UpdateSettings.from_config(cfg),
            torch.Generator().manual_seed(0),
            impl="quick",
        )


def test_fast_update_under_bf16_runs_the_frozen_prefix_in_bf16_and_tracks_the_reference(frozen_model):
    """trainer.precision=bf16: the frozen layers' forward runs under autocast too (their matmuls give
    bf16), and the fast update's parameter steps stay within bf16 rounding of the reference update's."""
    cfg = _cfg("trainer.precision=bf16", "algo.name=grpo")
    prefix_dtypes: list[torch.dtype] = []  # layer 0 is frozen: in the fast update it runs only in the prefix
    params = [
        _params_after_update(frozen_model, cfg, "reference", batch_seed=2, optimizer_steps=1),
        _params_after_update(
            frozen_model,
            cfg,
            "fast",
            batch_seed=2,
            optimizer_steps=1,
            hook=lambda m, i, out: prefix_dtypes.append(out.dtype),
        ),
    ]
    assert prefix_dtypes and set(prefix_dtypes) == {torch.bfloat16}
    assert all(p.dtype == torch.float32 for p in params[1])
    moved = [not torch.equal(a, b) for a, b in zip(params[0], frozen_model.parameters())]
    assert any(moved)
    for a, b, start in zip(params[0], params[1], frozen_model.parameters()):
        torch.testing.assert_close(b - start, a - start, rtol=0.1, atol=2e-3)
