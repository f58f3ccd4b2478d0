"""Where SORL's factor acts relative to gradient-norm clipping is explicit (algo.sorl_order) and logged
(sorl/effective_scale: what reached the optimizer over the raw policy gradient)."""

from __future__ import annotations

import copy
from dataclasses import replace

import pytest
import torch

from stratarl.trainer.batch import collate_sequences
from stratarl.trainer.config import load_config
from stratarl.trainer.learner import build_learner
from stratarl.trainer.settings import UpdateSettings
from stratarl.trainer.update import optimizer_step, score_batch


def _step(tiny_model, *overrides):
    cfg = load_config(
        None,
        [
            "model.name=tiny-random",
            "algo.kl_coef=0.0",
            "trainer.logprob_chunk_tokens=7",
            "algo.name=grpo",
            "algo.normalizer=sorl",
            "algo.sorl_delta=1e-6",
            "optim.name=sgd",
            "optim.lr=1.0",
            *overrides,
        ],
    )
    learner = build_learner(copy.deepcopy(tiny_model), cfg, total_optimizer_steps=1)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 500, (4,), generator=g).tolist() for _ in range(4)]
    responses = [torch.randint(3, 500, (8,), generator=g).tolist() for _ in range(4)]
    tokens = collate_sequences(prompts, responses, [[1, 1, 1, 0, 0, 1, 1, 1]] * 4, pad_id=0)
    advantages = torch.tensor([1.0, -1.0, 0.5, 2.0])[:, None] * tokens.response_mask
    batch = score_batch(learner, tokens, UpdateSettings.from_config(cfg)).with_advantages(
        advantages, advantages.clone()
    )
    batch = replace(batch, old_logprobs=batch.old_logprobs - 2.0 * batch.response_mask)  # all clipped: ||C|| > 0
    return optimizer_step(learner, batch, UpdateSettings.from_config(cfg))


@pytest.mark.parametrize("order", ["before_clip", "after_clip"])
def test_effective_scale_is_the_factor_when_clipping_does_not_act(tiny_model, order):
    m = _step(tiny_model, "optim.grad_clip=0", f"algo.sorl_order={order}")
    assert m["sorl/scale"] < 0.5
    assert m["sorl/effective_scale"] == pytest.approx(m["sorl/scale"], rel=1e-4)


def test_tight_clipping_undoes_the_factor_before_clip_but_not_after(tiny_model):
    clip = 1e-4
    before = _step(tiny_model, f"optim.grad_clip={clip}", "algo.sorl_order=before_clip")
    after = _step(tiny_model, f"optim.grad_clip={clip}", "algo.sorl_order=after_clip")
    raw = before["sorl/pg_grad_norm"]  # with before_clip: the norm before SORL and clipping
    assert raw > clip / before["sorl/scale"]  # the scaled gradient is still above the clip norm
    assert before["sorl/effective_scale"] == pytest.approx(clip / raw, rel=1e-3)
    assert after["sorl/effective_scale"] == pytest.approx(after["sorl/scale"] * clip / raw, rel=1e-3)


def test_lora_dropout_is_refused_because_the_first_step_would_be_off_policy():
    from stratarl.trainer.config import ConfigError

    with pytest.raises(
        ConfigError, match=r"`model.lora.dropout` = 0.1: the behaviour log-probs are computed without dropout"
    ):
        load_config(None, ["model.lora.enabled=true", "model.lora.dropout=0.1"])
    assert load_config(None, ["model.lora.enabled=true"]).model.lora.dropout == 0.0
