"""The learner: everything the policy update mutates (the policy, its optimizer and scheduler, the reference model,
the critic, the gradient normaliser) and the algorithm's parts it calls, built once per run (``build_learner``)."""

from __future__ import annotations

import copy
import functools
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from stratarl.algos.corrections import CorrectionOutput
from stratarl.algos.losses import PolicyLossOutput
from stratarl.algos.registry import GradNormalizer, get_behaviour_correction, get_grad_normalizer, get_policy_loss
from stratarl.infra.schedules import lr_lambda
from stratarl.trainer.config import Config, OptimConfig
from stratarl.trainer.critic import ValueHead, hidden_size_of


class PolicyLoss(Protocol):
    """A registered policy loss (``stratarl.algos.registry.register_policy_loss``), called with the algorithm's
    parameters as keywords."""

    def __call__(
        self,
        logprobs: torch.Tensor,
        old_logprobs: torch.Tensor,
        advantages: torch.Tensor,
        response_mask: torch.Tensor,
        /,
        **params: Any,
    ) -> PolicyLossOutput: ...


class BehaviourCorrection(Protocol):
    """A behaviour correction with its parameters bound: per-token weights for the off-policy tokens."""

    def __call__(
        self, old_logprobs: torch.Tensor, behaviour_logprobs: torch.Tensor, response_mask: torch.Tensor, /
    ) -> CorrectionOutput: ...


@dataclass
class Learner:
    """Everything the update mutates: policy, optional reference / critic, optimizer, scheduler."""

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    policy_loss: PolicyLoss
    """The algorithm's registered policy loss (``algorithm.policy_loss``), looked up once."""
    ref_model: torch.nn.Module | None = None
    value_head: ValueHead | None = None
    normalizer: GradNormalizer | None = None
    use_adapter_as_ref: bool = False
    correction: BehaviourCorrection | None = None
    """The behaviour correction with its parameters bound (``algorithm.correction``), or None."""

    def policy_parameters(self) -> list[torch.nn.Parameter]:
        return [p for p in self.model.parameters() if p.requires_grad]


def make_optimizer(groups: list[dict], optim: OptimConfig) -> torch.optim.Optimizer:
    """``optim.name``: AdamW (default) or SGD (the control for SORL's scale, which Adam largely cancels)."""
    if optim.name == "sgd":
        return torch.optim.SGD(groups, lr=optim.lr, momentum=optim.momentum, weight_decay=optim.weight_decay)
    beta1, beta2 = optim.betas  # validated: two values
    return torch.optim.AdamW(groups, lr=optim.lr, betas=(beta1, beta2), weight_decay=optim.weight_decay)


def build_learner(model: torch.nn.Module, cfg: Config, total_optimizer_steps: int) -> Learner:
    """Optimizer (``optim.name``; the value head gets ``algo.critic_lr``), scheduler, reference model, and the
    algorithm's critic, gradient normaliser and behaviour correction."""
    spec = cfg.algorithm
    value_head = ValueHead(hidden_size_of(model)).to(next(model.parameters()).device) if spec.uses_critic else None
    policy_params = [p for p in model.parameters() if p.requires_grad]
    groups = [{"params": policy_params, "lr": cfg.optim.lr}]
    if value_head is not None:
        groups.append({"params": list(value_head.parameters()), "lr": cfg.algo.critic_lr})
    optimizer = make_optimizer(groups, cfg.optim)
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
