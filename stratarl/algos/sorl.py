"""SORL's clipping-triggered normalisation (SO-PPO / SO-GRPO), as a reusable stateful helper.

    g ← ∇J_PPO(θ) / max(‖C(θ)‖₂, δ),     C = ∇J_IS − ∇J_PPO = ∇J_C

Source: Li et al., "SORL" (arXiv 2511.20718; v1 "ST-PPO"). J_C is the surrogate restricted to
the clipped tokens (turns); :func:`stratarl.algos.clipped_policy_loss` returns it as
``clip_bias`` from the same forward graph as the PPO loss. With δ = 1 the step is plain PPO
until ‖C‖ exceeds 1, then shrinks in proportion, so ‖g‖ ≤ ‖∇J_PPO‖ / δ.

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

import torch
from torch import Tensor


class ClipBiasNormalizer:
    """Accumulates C = ∇J_C across micro-batches and rescales the PPO gradient by 1/max(‖C‖, δ)."""

    def __init__(self, parameters: Iterable[Tensor], *, delta: float = 1.0) -> None:
        if delta <= 0:
            raise ValueError(f"delta must be > 0 (the paper's default is 1), got {delta!r}")
        self.parameters = [p for p in parameters if p.requires_grad]
        if not self.parameters:
            raise ValueError("ClipBiasNormalizer got no trainable parameters (none has requires_grad=True)")
        self.delta = float(delta)
        self.c_buffers: list[Tensor] = [torch.zeros_like(p) for p in self.parameters]

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
        loss.backward()

    @torch.no_grad()
    def c_norm(self) -> Tensor:
        """‖C‖₂ over all tracked parameters, accumulated since the last ``apply``."""
        return torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(b) for b in self.c_buffers]))

    @torch.no_grad()
    def apply(self) -> dict[str, Tensor]:
        """Scale every tracked ``.grad`` by 1 / max(‖C‖, δ), reset C, return the step's metrics.

        Metrics: ``sorl/c_norm`` (‖C‖), ``sorl/scale`` (1/max(‖C‖, δ)), ``sorl/pg_grad_norm``
        (‖.grad‖ before scaling).
        """
        c_norm = self.c_norm()
        scale = 1.0 / torch.clamp(c_norm, min=self.delta)
        grads = [p.grad for p in self.parameters if p.grad is not None]
        grad_norm = (
            torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads]))
            if grads
            else c_norm.new_zeros(())
        )
        for grad in grads:
            grad.mul_(scale.to(grad.dtype))
        for buffer in self.c_buffers:
            buffer.zero_()
        return {"sorl/c_norm": c_norm, "sorl/scale": scale, "sorl/pg_grad_norm": grad_norm}
