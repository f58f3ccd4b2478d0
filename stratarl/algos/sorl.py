"""SORL's clipping-triggered normalisation (SO-PPO / SO-GRPO), as a reusable stateful helper.

    g ← ∇J_PPO(θ) / max(‖C(θ)‖₂, δ),     C = ∇J_IS − ∇J_PPO = ∇J_C

Source: Li et al., "SORL" (arXiv 2511.20718; v1 "ST-PPO"). J_C is the surrogate restricted to
the clipped tokens (turns); :func:`stratarl.algos.clipped_policy_loss` returns it as
``clip_bias`` from the same forward graph as the PPO loss. ‖g‖ ≤ ‖∇J_PPO‖ / δ.

Two readings of δ, neither confirmed as the paper's value: a *threshold* (the default, δ = 1: the step
is plain PPO until ‖C‖ exceeds 1, then shrinks in proportion) or a small *floor* that only keeps the
division away from zero (δ ≪ every ‖C‖: each step is divided by ‖C‖). The ``running_pg`` rule is a
scale-free threshold (docs/training.md, "SORL's normalisation").

Usage with gradient accumulation (C accumulates beside ``.grad``, with the same micro-batch
weights as the loss)::

    normalizer = ClipBiasNormalizer(policy.parameters(), delta=1.0)
    for micro in micro_batches:
        out = clipped_policy_loss(..., level="turn")
        normalizer.backward(out.loss * w, out.clip_bias * w)       # w = micro-batch weight
    metrics = normalizer.apply()                                   # scales .grad in place
    optimizer.step(); optimizer.zero_grad()

Only parameters with ``requires_grad`` are tracked (LoRA: just the adapters). ``apply``
scales everything accumulated in their ``.grad``, including any KL / entropy terms that were
part of the loss passed to ``backward``. Under data parallelism, all-reduce the C buffers like
gradients before ``apply`` (``c_buffers``); this single-process helper does not.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Literal, get_args

import torch
from torch import Tensor

DeltaRule = Literal["fixed", "running_pg"]
"""How SORL's floor δ_t is set: a fixed δ, or δ times a running mean of ‖∇J_PPO‖ (:func:`sorl_scale`)."""
DELTA_RULES: tuple[DeltaRule, ...] = get_args(DeltaRule)


class ClipBiasNormalizer:
    """Accumulates C = ∇J_C across micro-batches and rescales the PPO gradient by 1/max(‖C‖, δ)."""

    def __init__(
        self, parameters: Iterable[Tensor], *, delta: float = 1.0, rule: str = "fixed", ema: float = 0.9
    ) -> None:
        if delta <= 0:
            raise ValueError(f"delta must be > 0 (the default, 1, is the threshold reading), got {delta!r}")
        if rule not in DELTA_RULES:
            raise ValueError(f"unknown delta rule {rule!r}; use one of {', '.join(DELTA_RULES)}")
        if not 0 <= ema < 1:
            raise ValueError(f"ema must lie in [0, 1), got {ema!r}")
        self.parameters = [p for p in parameters if p.requires_grad]
        if not self.parameters:
            raise ValueError("ClipBiasNormalizer got no trainable parameters (none has requires_grad=True)")
        self.delta = float(delta)
        self.rule = rule
        self.ema = float(ema)
        self.pg_norm_ema: float | None = None  # running_pg: EMA of ‖∇J_PPO‖ over the previous steps
        self.c_buffers: list[Tensor] = [torch.zeros_like(p) for p in self.parameters]

    def state_dict(self) -> dict[str, Any]:
        """The running statistic of the ``running_pg`` rule (a checkpoint must carry it to resume exactly)."""
        return {"pg_norm_ema": self.pg_norm_ema}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.pg_norm_ema = state.get("pg_norm_ema")

    def backward(self, loss: Tensor, clip_bias: Tensor | None, *, skip_clip_bias: bool = False) -> None:
        """``loss.backward()`` into ``.grad``, and add ∇clip_bias into the C buffers first.

        Both must come from the same forward graph and carry the same micro-batch weight.
        ``skip_clip_bias=True`` (e.g. when the micro-batch's ``loss/clip_frac`` is 0, so ∇J_C = 0)
        saves the extra backward pass.
        """
        if loss.dim() != 0 or (clip_bias is not None and clip_bias.dim() != 0):
            raise ValueError("loss and clip_bias must be scalars (aggregate before calling backward)")
        if clip_bias is not None and not skip_clip_bias and clip_bias.requires_grad:
            grads = torch.autograd.grad(clip_bias, self.parameters, retain_graph=True, allow_unused=True)
            for buffer, grad in zip(self.c_buffers, grads):
                if grad is not None:
                    buffer.add_(grad)
        torch.autograd.backward(loss)  # loss.backward(), which torch leaves untyped

    @torch.no_grad()
    def c_norm(self) -> Tensor:
        """‖C‖₂ over all tracked parameters, accumulated since the last ``apply``."""
        norm: Tensor = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(b) for b in self.c_buffers]))
        return norm

    @torch.no_grad()
    def apply(self) -> dict[str, Tensor]:
        """Scale every tracked ``.grad`` (see :func:`sorl_scale`), reset C, return the step's metrics.

        Metrics: ``sorl/c_norm`` (‖C‖), ``sorl/scale`` (the factor applied), ``sorl/pg_grad_norm``
        (‖.grad‖ before scaling), ``sorl/delta`` (the floor δ_t used), ``sorl/engaged`` (1 when ‖C‖ > δ_t:
        the step was shrunk relative to an unclipped one, else 0).
        """
        c_norm = self.c_norm()
        grads = [p.grad for p in self.parameters if p.grad is not None]
        grad_norm = (
            torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads]))
            if grads
            else c_norm.new_zeros(())
        )
        if self.rule == "running_pg" and self.pg_norm_ema is None:
            self.pg_norm_ema = float(grad_norm)  # first step: the running statistic starts at this step's norm
        scale, floor = sorl_scale(c_norm, delta=self.delta, rule=self.rule, pg_norm_ema=self.pg_norm_ema)
        if self.rule == "running_pg" and self.pg_norm_ema is not None:  # set above when it was None
            self.pg_norm_ema = self.ema * self.pg_norm_ema + (1 - self.ema) * float(grad_norm)
        for grad in grads:
            grad.mul_(scale.to(grad.dtype))
        for buffer in self.c_buffers:
            buffer.zero_()
        return {
            "sorl/c_norm": c_norm,
            "sorl/scale": scale,
            "sorl/pg_grad_norm": grad_norm,
            "sorl/delta": floor,
            "sorl/engaged": (c_norm > floor).to(c_norm.dtype),
        }


def sorl_scale(
    c_norm: Tensor, *, delta: float, rule: str = "fixed", pg_norm_ema: float | None = None
) -> tuple[Tensor, Tensor]:
    """The gradient factor of SORL's normalisation and the floor δ_t it used: (scale, δ_t).

        ``fixed`` (the formula of Li et al., arXiv 2511.20718): δ_t = δ, scale = 1 / max(‖C‖, δ). δ = 1 reads δ as
    a threshold, a small δ as a floor (every step divided by ‖C‖); the paper's value is not confirmed.
        ``running_pg`` (scale-free; stratarl's option): δ_t = δ · m_t with m_t the exponential moving average
        of ‖∇J_PPO‖ over the previous optimizer steps, scale = δ_t / max(‖C‖, δ_t) = min(1, δ_t / ‖C‖). The
        step is left alone (scale 1) until the clip-bias gradient exceeds δ times the typical policy-gradient
        norm, then shrinks in proportion: the same trigger at any model size, loss scale or learning rate,
        where a fixed δ = 1 is a gradient-norm threshold that small models never reach. Under AdamW a constant
        factor changes nothing but Adam's ε term, so both rules act only through how the factor varies
        between steps (docs/results.md, Paper B).
    """
    if c_norm.dim() != 0:
        raise ValueError(f"c_norm must be a scalar, got shape {tuple(c_norm.shape)}")
    if rule == "fixed":
        floor = c_norm.new_tensor(float(delta))
        return 1.0 / torch.maximum(c_norm, floor), floor
    if rule == "running_pg":
        if pg_norm_ema is None:
            raise ValueError("the running_pg rule needs pg_norm_ema (the running mean of the policy-gradient norm)")
        floor = c_norm.new_tensor(float(delta) * float(pg_norm_ema))
        if float(floor) <= 0:
            return c_norm.new_ones(()), floor  # a zero policy gradient: nothing to scale
        return floor / torch.maximum(c_norm, floor), floor
    raise ValueError(f"unknown delta rule {rule!r}; use one of {', '.join(DELTA_RULES)}")
