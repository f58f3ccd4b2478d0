"""SORL's exact normalisation in veRL's actor step, on a CPU engine that follows veRL's BaseEngine contract.

veRL's FSDP engines need CUDA; `CpuEngine` implements the same methods (`optimizer_zero_grad`,
`forward_backward_batch` over micro-batches calling the loss as `loss_function(model_output=,
data=, dp_group=)`, `optimizer_step`) with veRL's no-padding log-prob layout, so veRL's real
`ppo_loss` (and `no_padding_2_padding`) run unchanged. The oracle is stratarl's own
`ClipBiasNormalizer` + `clipped_policy_loss` on a copy of the same model.
"""

from __future__ import annotations

import copy
from functools import partial

import pytest

# "verl.trainer…", not "verl": in the main venv this folder itself is importable as a namespace package "verl".
pytest.importorskip("verl.trainer.ppo.core_algos", reason="needs veRL (make test-verl runs these in .venv-verl)")

import torch
from tensordict import TensorDict
from verl.utils import tensordict_utils as tu
from verl.workers.config import FSDPActorConfig
from verl.workers.engine.base import BaseEngine
from verl.workers.engine_workers import ActorRolloutRefWorker
from verl.workers.utils.losses import ppo_loss

from stratarl.algos import ClipBiasNormalizer, clipped_policy_loss
from stratarl.integrations.verl import SORLTrainingWorker, sorl_train_batch
from stratarl.integrations.verl.config import SORLPolicyLossConfig

VOCAB, PROMPT, RESPONSE = 11, 3, 10
TENSOR_KEYS = ("prompts", "responses", "attention_mask", "response_mask", "old_log_probs", "advantages")
WEIGHTS = "rollout_is_weights"  # veRL's rollout-correction weights, carried when a batch has them


def batch_keys(data) -> tuple[str, ...]:
    return TENSOR_KEYS + ((WEIGHTS,) if WEIGHTS in data.keys() else ())  # noqa: SIM118  a TensorDict: keys() lists it


def tiny_lm(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Embedding(VOCAB, 8), torch.nn.Tanh(), torch.nn.Linear(8, VOCAB))


def row_log_probs(model, prompt, response, response_len) -> torch.Tensor:
    """log π(token_{i+1} | token_i) along one real sequence (a bigram model), length P + R_real."""
    seq = torch.cat([prompt, response[:response_len]])
    logp = torch.log_softmax(model(seq[:-1]), dim=-1).gather(1, seq[1:, None]).squeeze(1)
    return torch.cat([logp, logp.new_zeros(1)])  # veRL's layout: value i predicts token i + 1


def padded_response_log_probs(model, data) -> torch.Tensor:
    rows = []
    for b in range(data["prompts"].shape[0]):
        n = int(data["attention_mask"][b, PROMPT:].sum())
        lp = row_log_probs(model, data["prompts"][b], data["responses"][b], n)[PROMPT - 1 : PROMPT - 1 + n]
        rows.append(torch.nn.functional.pad(lp, (0, RESPONSE - n)))
    return torch.stack(rows)


class CpuEngine(BaseEngine):
    """A single-process engine with veRL's BaseEngine contract (dp_size 1, SGD, no grad clipping)."""

    def __init__(self, model: torch.nn.Module, micro_batch_size: int, lr: float = 1.0):
        self.module = model
        self.optimizer = torch.optim.SGD(model.parameters(), lr=lr)
        self.micro_batch_size = micro_batch_size
        self.stepped_grads: list[torch.Tensor] | None = None

    def is_mp_src_rank_with_outputs(self) -> bool:
        return True

    def optimizer_zero_grad(self):
        self.optimizer.zero_grad(set_to_none=True)

    def forward_backward_batch(self, data, loss_function, forward_only=False):
        # As FSDPEngine: normalise by the global token count of the mini-batch.
        total_tokens = int(data["response_mask"].sum())
        batch = data["prompts"].shape[0]
        metrics: dict[str, list] = {}
        for start in range(0, batch, self.micro_batch_size):
            rows = slice(start, start + self.micro_batch_size)
            micro = TensorDict(
                {k: data[k][rows] for k in batch_keys(data)}, batch_size=[data["prompts"][rows].shape[0]]
            )
            tu.assign_non_tensor(micro, dp_size=1, batch_num_tokens=total_tokens, global_batch_size=batch)
            values = []
            for b in range(micro.batch_size[0]):
                n = int(micro["attention_mask"][b, PROMPT:].sum())
                values.append(row_log_probs(self.module, micro["prompts"][b], micro["responses"][b], n))
            loss, step_metrics = loss_function(model_output={"log_probs": torch.cat(values)}, data=micro, dp_group=None)
            if not forward_only:
                loss.backward()
            for key, value in step_metrics.items():
                metrics.setdefault(key, []).append(value)
        return {"metrics": metrics}

    def optimizer_step(self):
        self.stepped_grads = [p.grad.detach().clone() for p in self.module.parameters()]
        norm = torch.nn.utils.get_total_norm(self.stepped_grads)
        self.optimizer.step()
        return float(norm)


def make_batch(model, *, off_policy: float, seed: int = 0) -> TensorDict:
    gen = torch.Generator().manual_seed(seed)
    batch = 6
    prompts = torch.randint(0, VOCAB, (batch, PROMPT), generator=gen)
    responses = torch.randint(0, VOCAB, (batch, RESPONSE), generator=gen)
    lengths = torch.tensor([10, 9, 7, 10, 6, 8])
    attention = torch.ones(batch, PROMPT + RESPONSE, dtype=torch.long)
    response_mask = torch.zeros(batch, RESPONSE, dtype=torch.long)
    for b, n in enumerate(lengths.tolist()):
        attention[b, PROMPT + n :] = 0
        # Turns of 2–3 policy tokens with 1–2 observation tokens in between.
        pattern = [1, 1, 0, 1, 1, 1, 0, 0, 1, 1] if b % 2 == 0 else [1, 1, 1, 0, 1, 1, 0, 1, 1, 1]
        response_mask[b, :n] = torch.tensor(pattern[:n])
    data = TensorDict(
        {"prompts": prompts, "responses": responses, "attention_mask": attention, "response_mask": response_mask},
        batch_size=[batch],
    )
    with torch.no_grad():
        current = padded_response_log_probs(model, data)
    old = current + off_policy * torch.randn(current.shape, generator=gen)
    advantages = torch.randn(batch, 1, generator=gen) * response_mask
    data["old_log_probs"] = old * response_mask
    data["advantages"] = advantages.float()
    return data


def actor_config(loss_mode: str, delta: float = 1.0) -> FSDPActorConfig:
    return FSDPActorConfig(
        strategy="fsdp",
        ppo_mini_batch_size=6,
        ppo_micro_batch_size_per_gpu=2,
        rollout_n=1,
        clip_ratio=0.2,
        policy_loss=SORLPolicyLossConfig(loss_mode=loss_mode, sorl_delta=delta),
    )


def reference_step(model, data, *, delta: float, micro_batch_size: int = 2):
    """stratarl's SORL step: ClipBiasNormalizer over micro-batches weighted to the global token mean (with the
    batch's rollout-correction weights as ``token_weights`` when it has them, as stratarl's trainer applies them)."""
    normalizer = ClipBiasNormalizer(model.parameters(), delta=delta)
    total = data["response_mask"].sum()
    for start in range(0, data["prompts"].shape[0], micro_batch_size):
        rows = slice(start, start + micro_batch_size)
        micro = {k: data[k][rows] for k in batch_keys(data)}
        log_prob = padded_response_log_probs(model, micro)
        mask = micro["response_mask"].bool()
        out = clipped_policy_loss(
            log_prob,
            micro["old_log_probs"],
            micro["advantages"],
            mask,
            level="turn",
            clip_low=0.2,
            clip_high=0.2,
            dual_clip=3.0,
            agg="token-mean",
            token_weights=micro.get(WEIGHTS),
        )
        weight = mask.sum() / total
        normalizer.backward(out.loss * weight, out.clip_bias * weight)
    metrics = normalizer.apply()
    return [p.grad.detach().clone() for p in model.parameters()], metrics


@pytest.mark.parametrize("delta", [1e-3, 1.0])
def test_sorl_step_matches_stratarl_clip_bias_normalizer(delta):
    model = tiny_lm()
    data = make_batch(model, off_policy=0.7)
    reference_model = copy.deepcopy(model)
    engine = CpuEngine(model, micro_batch_size=2)
    config = actor_config("sorl", delta)
    outputs = sorl_train_batch(engine, data, partial(ppo_loss, config=config), delta=delta)

    expected_grads, expected = reference_step(reference_model, data, delta=delta)
    for got, want in zip(engine.stepped_grads, expected_grads):
        torch.testing.assert_close(got, want)
    metrics = {key: float(outputs["metrics"][key].aggregate()) for key in ("sorl/c_norm", "sorl/scale")}
    torch.testing.assert_close(torch.tensor(metrics["sorl/c_norm"]), expected["sorl/c_norm"])
    torch.testing.assert_close(torch.tensor(metrics["sorl/scale"]), expected["sorl/scale"])
    assert metrics["sorl/c_norm"] > 0  # the batch is off-policy enough for turns to clip
    # scale = 1 / max(‖C‖, δ): here ‖C‖ ≈ 0.28, so δ = 1e-3 rescales the step and δ = 1 leaves it as PPO's.
    assert metrics["sorl/scale"] == pytest.approx(1.0 / max(metrics["sorl/c_norm"], delta))
    assert (metrics["sorl/scale"] != 1.0) == (metrics["sorl/c_norm"] > delta)


def test_sorl_step_at_old_policy_is_plain_turn_ppo_bit_for_bit():
    # θ = θ_old: nothing clips, C = 0, scale = 1/max(0, δ=1) = 1 → veRL's own step with turn_ppo.
    model = tiny_lm(seed=1)
    data = make_batch(model, off_policy=0.0, seed=1)
    plain_model = copy.deepcopy(model)
    engine = CpuEngine(model, micro_batch_size=2)
    outputs = sorl_train_batch(engine, data, partial(ppo_loss, config=actor_config("sorl")), delta=1.0)
    plain = CpuEngine(plain_model, micro_batch_size=2)
    plain.train_batch(data, loss_function=partial(ppo_loss, config=actor_config("turn_ppo")))
    assert outputs["metrics"]["sorl/c_norm"].aggregate() == 0.0
    for got, want in zip(engine.stepped_grads, plain.stepped_grads):
        assert torch.equal(got, want)


def test_update_norm_is_bounded_by_ppo_gradient_over_delta():
    # ‖g‖ ≤ ‖∇J_PPO‖ / δ (docs/algorithms.md §2).
    model = tiny_lm(seed=2)
    data = make_batch(model, off_policy=1.0, seed=2)
    plain = CpuEngine(copy.deepcopy(model), micro_batch_size=3)
    plain.train_batch(data, loss_function=partial(ppo_loss, config=actor_config("turn_ppo")))
    delta = 0.05
    engine = CpuEngine(model, micro_batch_size=3)
    sorl_train_batch(engine, data, partial(ppo_loss, config=actor_config("sorl", delta)), delta=delta)
    sorl_norm = torch.nn.utils.get_total_norm(engine.stepped_grads)
    ppo_norm = torch.nn.utils.get_total_norm(plain.stepped_grads)
    assert sorl_norm <= ppo_norm / delta * (1 + 1e-6)


def test_worker_binds_the_sorl_step_only_for_loss_mode_sorl():
    assert ActorRolloutRefWorker.actor_worker_cls is SORLTrainingWorker
    worker = object.__new__(SORLTrainingWorker)  # no Ray / process group needed for this hook
    worker.engine = CpuEngine(tiny_lm(), micro_batch_size=2)
    worker.set_loss_fn(partial(ppo_loss, config=actor_config("sorl", 0.5)))
    bound = worker.engine.train_batch
    assert bound.func is sorl_train_batch and bound.keywords == {"delta": 0.5}
    worker.set_loss_fn(partial(ppo_loss, config=actor_config("vanilla")))
    assert worker.engine.train_batch.__func__ is BaseEngine.train_batch


def test_sorl_delta_must_be_positive():
    with pytest.raises(ValueError, match="sorl_delta must be > 0"):
        SORLPolicyLossConfig(loss_mode="sorl", sorl_delta=0.0)


def test_sorl_delta_is_read_from_the_policy_loss_config():
    from omegaconf import OmegaConf

    from stratarl.integrations.verl.worker import sorl_delta

    assert sorl_delta(actor_config("sorl", 0.25)) == 0.25
    assert sorl_delta(actor_config("turn_ppo", 0.25)) is None  # only loss_mode=sorl is normalised
    plain = OmegaConf.create({"policy_loss": {"loss_mode": "sorl"}})  # veRL's PolicyLossConfig: no field
    assert sorl_delta(plain) == 1.0
    with pytest.raises(ValueError, match="sorl_delta must be > 0"):
        sorl_delta(OmegaConf.create({"policy_loss": {"loss_mode": "sorl", "sorl_delta": 0}}))
