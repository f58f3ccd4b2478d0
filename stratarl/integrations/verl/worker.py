"""SORL's clipping-triggered normalisation inside veRL's actor update: exact, in gradient space.

    g ← ∇J_PPO(θ) / max(‖C(θ)‖₂, δ),    C = ∇J_IS − ∇J_PPO = ∇J_C     (Li et al., arXiv 2511.20718)

A veRL policy loss returns a loss, not a gradient, and ‖C‖ is a norm over all parameters and
all micro-batches of the optimizer step, so the normalisation cannot live in the loss. It lives
in the actor's training step, built only from veRL's public engine API (``BaseEngine``):

1. ``optimizer_zero_grad``; ``forward_backward_batch`` with the clipping-bias loss J_C over the
   whole mini-batch → ``.grad`` = C, reduced across micro-batches and data-parallel ranks by the
   engine itself (FSDP / FSDP2 reduce-scatter as for any gradient); ‖C‖ = the engine's grad norm.
2. ``optimizer_zero_grad``; ``forward_backward_batch`` with veRL's own ``ppo_loss`` (policy loss
   ``sorl`` + KL / entropy terms) multiplied by s = 1 / max(‖C‖, δ) → ``.grad`` = s · ∇L.
3. ``optimizer_step`` (veRL's grad clipping, then the optimizer).

Scaling the loss by the constant s scales its gradient by s exactly, so this is the paper's
update, not an approximation. Cost: one extra forward + backward per optimizer step (the
actor update roughly doubles; rollout generation, usually the larger part, is unchanged).
Like stratarl's own trainer (:class:`stratarl.algos.ClipBiasNormalizer`), the KL and entropy
terms of the actor loss are scaled together with the policy-gradient term.

Installation: :class:`SORLTrainingWorker` is veRL's ``TrainingWorker`` plus this step, switched on
only when ``actor.policy_loss.loss_mode == "sorl"``; importing :mod:`stratarl.integrations.verl`
sets it as ``ActorRolloutRefWorker.actor_worker_cls`` (the class attribute veRL provides for
swapping the actor's training worker; its Tinker worker uses the same hook). δ is read from
``actor.policy_loss.sorl_delta`` when the policy-loss config has that field
(:class:`stratarl.integrations.verl.config.SORLPolicyLossConfig`), else 1.0.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable
from contextlib import contextmanager
from functools import partial
from typing import Any

import torch
from tensordict import TensorDict
from verl.single_controller.base.decorator import Dispatch, register
from verl.utils.device import get_device_name
from verl.utils.distributed import initialize_global_process_group_ray
from verl.utils.metric import Metric
from verl.utils.tensordict_utils import maybe_fix_3d_position_ids
from verl.workers.engine_workers import ActorRolloutRefWorker, TrainingWorker
from verl.workers.utils.padding import no_padding_2_padding

from stratarl.integrations.verl.losses import SORL_LOSS_MODES, SORL_STEP_ACTIVE, turn_level_loss

DEFAULT_DELTA = 1.0
# When set, every SORL optimizer step appends one json line per data-parallel rank to this file: the
# rank's ‖C‖, scale, grad norm and a digest of the full parameters after the step (for checking that
# ranks agree; costs one all-gather of the parameters per step, so only for tests and smoke runs).
SORL_DUMP_ENV = "STRATARL_VERL_SORL_DUMP"
_steps_taken = 0


def sorl_delta(actor_config: Any) -> float | None:
    """δ when the actor's policy loss is SORL's, else None (the worker then behaves as veRL's)."""
    policy_loss = actor_config.get("policy_loss", None) if hasattr(actor_config, "get") else None
    if policy_loss is None or policy_loss.get("loss_mode", "vanilla") not in SORL_LOSS_MODES:
        return None
    value = policy_loss.get("sorl_delta", None)
    delta = DEFAULT_DELTA if value is None else float(value)
    if delta <= 0:
        raise ValueError(
            f"actor.policy_loss.sorl_delta must be > 0 (stratarl's default is 1, the threshold reading), got {delta}"
        )
    return delta


def clip_bias_loss(config: Any, model_output: dict, data: TensorDict, dp_group=None) -> tuple[torch.Tensor, dict]:
    """J_C for one micro-batch, with the same inputs and global aggregation as veRL's ``ppo_loss``.

    Mirrors the data plumbing of ``verl.workers.utils.losses.ppo_loss`` (padding removal, global
    batch info) and returns only the clipping-bias objective: its gradient is C for this
    micro-batch's share of the mini-batch. No KL or entropy terms: C is defined by the policy
    surrogate alone. veRL's ``rollout_is_weights``, when the batch has them, weight the clipped
    tokens here exactly as in the PPO pass, so C = ∇J_IS − ∇J_PPO of the weighted surrogate.
    """
    log_prob = no_padding_2_padding(model_output["log_probs"], data)
    config.global_batch_info["dp_size"] = data["dp_size"]
    config.global_batch_info["batch_num_tokens"] = data["batch_num_tokens"]
    config.global_batch_info["global_batch_size"] = data["global_batch_size"]
    config.global_batch_info["loss_scale_factor"] = config.loss_scale_factor
    fields = ["response_mask", "old_log_probs", "advantages"]
    if "rollout_is_weights" in data:
        fields.append("rollout_is_weights")
    padded = data.select(*fields).to_padded_tensor()
    _, clip_bias, _ = turn_level_loss(
        old_log_prob=padded["old_log_probs"],
        log_prob=log_prob,
        advantages=padded["advantages"],
        response_mask=padded["response_mask"].to(bool),
        loss_agg_mode=config.loss_agg_mode,
        config=config,
        rollout_is_weights=padded.get("rollout_is_weights", None),
    )
    return clip_bias, {}


def engine_grad_norm(engine: Any) -> torch.Tensor:
    """Global L2 norm of the gradients held by ``engine.module`` (as veRL's ``optimizer_step`` measures it).

    FSDP1: ``module.clip_grad_norm_(inf)``; FSDP2: veRL's ``fsdp2_clip_grad_norm_`` with
    ``max_norm = inf`` (a no-op rescale by 1) and ``full_tensor()``; a plain module: the norm of its
    ``.grad``s. Megatron keeps gradients in its own buffers and is not supported (yet).
    """
    module = engine.module
    if isinstance(module, (list, tuple)):
        raise NotImplementedError(
            "SORL's normalisation in veRL supports the FSDP / FSDP2 engines (actor.strategy=fsdp or fsdp2); "
            "Megatron keeps gradients in its own buffers"
        )
    inf = float("inf")
    try:
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP1  # only under FSDP in a veRL worker
    except ImportError:  # pragma: no cover - torch without distributed
        FSDP1 = ()  # type: ignore[assignment,misc]  # isinstance(x, ()) is False
    try:
        from torch.distributed.fsdp import FSDPModule  # only under FSDP in a veRL worker
    except ImportError:  # pragma: no cover
        FSDPModule = ()  # type: ignore[assignment,misc]  # isinstance(x, ()) is False
    if isinstance(module, FSDP1):
        norm = module.clip_grad_norm_(inf)
    elif isinstance(module, FSDPModule):
        from verl.utils.fsdp_utils import fsdp2_clip_grad_norm_  # veRL: only in .venv-verl

        norm = fsdp2_clip_grad_norm_(module.parameters(), max_norm=inf)  # type: ignore[attr-defined]  # also a Module
    else:
        grads = [p.grad for p in module.parameters() if p.grad is not None]
        norm = torch.nn.utils.get_total_norm(grads) if grads else torch.zeros(())
    if hasattr(norm, "full_tensor"):
        norm = norm.full_tensor()
    return norm.detach().float()


@contextmanager
def _sorl_step_active():
    token = SORL_STEP_ACTIVE.set(True)
    try:
        yield
    finally:
        SORL_STEP_ACTIVE.reset(token)


def _scaled(loss_function: Callable, scale: float) -> Callable:
    def scaled_loss(*args, **kwargs):
        loss, metrics = loss_function(*args, **kwargs)
        return loss * scale, metrics

    return scaled_loss


def sorl_train_batch(engine: Any, data: TensorDict, loss_function: Callable, *, delta: float = DEFAULT_DELTA) -> Any:
    """One optimizer step with SORL's exact normalisation (replaces ``BaseEngine.train_batch``).

    ``loss_function`` is the actor's ``partial(ppo_loss, config=actor_config)``. Returns the
    engine's outputs with ``grad_norm`` (after scaling, before clipping, as veRL logs it) and
    ``sorl/c_norm``, ``sorl/scale`` (veRL ``Metric``s, mean-aggregated) added to the metrics.
    """
    actor_config = getattr(loss_function, "keywords", {}).get("config")
    if actor_config is None:
        raise TypeError(
            "SORL's actor step expects the actor loss partial(ppo_loss, config=actor_config); "
            f"got {loss_function!r} (distillation losses are not supported with loss_mode=sorl)"
        )
    maybe_fix_3d_position_ids(data)
    engine.optimizer_zero_grad()
    engine.forward_backward_batch(data, partial(clip_bias_loss, actor_config), forward_only=False)
    c_norm = engine_grad_norm(engine)
    scale = 1.0 / max(float(c_norm), delta)
    engine.optimizer_zero_grad()
    with _sorl_step_active():
        outputs = engine.forward_backward_batch(data, _scaled(loss_function, scale), forward_only=False)
    grad_norm = engine.optimizer_step()
    if os.environ.get(SORL_DUMP_ENV):
        dump_sorl_step(os.environ[SORL_DUMP_ENV], engine, c_norm=float(c_norm), scale=scale, grad_norm=grad_norm)
    if engine.is_mp_src_rank_with_outputs():
        metrics = outputs["metrics"]
        metrics["grad_norm"] = grad_norm
        # veRL Metrics: TrainingWorker gathers metrics over data-parallel ranks and expects each to be
        # a Metric or a per-micro-batch list; only its own loss / grad_norm / lr may be plain numbers.
        metrics["sorl/c_norm"] = Metric(aggregation="mean", value=float(c_norm))
        metrics["sorl/scale"] = Metric(aggregation="mean", value=scale)
    return outputs


def full_parameters(module: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    """(name, full tensor) of every parameter; FSDP2's DTensors are all-gathered (a collective: every rank calls)."""
    out = []
    for name, param in module.named_parameters():
        tensor = param.full_tensor() if hasattr(param, "full_tensor") else param
        out.append((name, tensor.detach().to("cpu", torch.float32)))
    return out


def dump_sorl_step(path: str, engine: Any, *, c_norm: float, scale: float, grad_norm: Any) -> None:
    """Append this rank's record of one SORL step (see :data:`SORL_DUMP_ENV`)."""
    global _steps_taken  # noqa: PLW0603  this worker process's step count, numbering its dump records
    _steps_taken += 1
    digest = hashlib.sha256()
    squares = 0.0
    for name, tensor in full_parameters(engine.module):
        digest.update(name.encode())
        digest.update(tensor.contiguous().numpy().tobytes())
        squares += float(tensor.double().pow(2).sum())
    ready = torch.distributed.is_available() and torch.distributed.is_initialized()
    record = {
        "call": _steps_taken,
        "rank": torch.distributed.get_rank() if ready else 0,
        "world": torch.distributed.get_world_size() if ready else 1,
        "c_norm": c_norm,
        "scale": scale,
        "grad_norm": float(grad_norm),
        "params_sha": digest.hexdigest(),
        "params_norm": squares**0.5,
    }
    with open(path, "a") as out:
        out.write(json.dumps(record) + "\n")


class SORLTrainingWorker(TrainingWorker):
    """veRL's ``TrainingWorker`` whose optimizer step applies SORL's normalisation when the
    actor's ``policy_loss.loss_mode`` is ``sorl``; identical to veRL's otherwise."""

    def __init__(self, config):
        if get_device_name() == "cpu":
            # veRL's default backend string "cpu:gloo,<device>:<backend>" is invalid when the device
            # itself is the CPU (the CPU test harness, tests/verl/harness/verl_cpu); gloo alone serves both.
            initialize_global_process_group_ray(timeout_second=None, backend="gloo")
        super().__init__(config)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def set_loss_fn(self, loss_fn):
        self.loss_fn = loss_fn
        config = getattr(loss_fn, "keywords", {}).get("config")
        delta = sorl_delta(config) if config is not None else None
        # Per-instance binding: only this worker's actor engine takes the SORL step; removing
        # the instance attribute restores the engine's own train_batch.
        self.engine.__dict__.pop("train_batch", None)
        if delta is None:
            return
        if isinstance(getattr(self.engine, "module", None), (list, tuple)):
            engine_grad_norm(self.engine)  # raises the clear "not supported" error
        self.engine.train_batch = partial(sorl_train_batch, self.engine, delta=delta)


def install_actor_worker() -> bool:
    """Make veRL's ``ActorRolloutRefWorker`` build :class:`SORLTrainingWorker` for the actor.

    Returns True when installed (or already installed). Leaves a different custom actor worker
    in place and returns False; a ``sorl`` run then fails loudly in the loss instead of training
    without the normalisation.
    """
    current = ActorRolloutRefWorker.actor_worker_cls
    if current is SORLTrainingWorker:
        return True
    # The CPU test harness's worker (tests/verl/harness/verl_cpu: gloo init only) may go first; SORL's does the
    # same.
    if current is not TrainingWorker and not getattr(current, "stratarl_cpu_only", False):
        return False
    ActorRolloutRefWorker.actor_worker_cls = SORLTrainingWorker
    return True
