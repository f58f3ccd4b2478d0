"""Shape / dtype checks shared by the algorithm core, and masked reductions.

Conventions (fixed letters): B rollouts, T response tokens. Masks are bool or
float ``[B, T]`` with values in {0, 1}; they are converted with :func:`as_bool_mask`.
Every masked reduction over an empty mask returns 0, never NaN.
"""

from __future__ import annotations

import torch
from torch import Tensor


def check_1d(name: str, x: Tensor, size: int | None = None) -> None:
    """Raise a ValueError naming ``name`` unless ``x`` is a 1-D tensor (of length ``size``)."""
    if not isinstance(x, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if x.dim() != 1:
        raise ValueError(f"{name} must be 1-D [B], got shape {tuple(x.shape)}")
    if size is not None and x.shape[0] != size:
        raise ValueError(f"{name} has length {x.shape[0]}, expected B={size} (one entry per rollout)")


def check_2d(name: str, x: Tensor, shape: tuple[int, ...] | None = None) -> None:
    """Raise a ValueError naming ``name`` unless ``x`` is 2-D (of shape ``shape``)."""
    if not isinstance(x, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if x.dim() != 2:
        raise ValueError(f"{name} must be 2-D [B, T], got shape {tuple(x.shape)}")
    if shape is not None and tuple(x.shape) != tuple(shape):
        raise ValueError(f"{name} has shape {tuple(x.shape)}, expected [B, T]={tuple(shape)}")


def check_ids(name: str, ids: Tensor, size: int) -> None:
    """Group / stratum ids: a 1-D integer tensor with one entry per rollout."""
    check_1d(name, ids, size)
    if ids.dtype.is_floating_point or ids.dtype.is_complex or ids.dtype == torch.bool:
        raise TypeError(f"{name} must be an integer tensor (any values), got dtype {ids.dtype}")


def float_values(name: str, x: Tensor) -> Tensor:
    """``x`` as a floating tensor (integers and bools become float32); rejects NaN / inf."""
    if not x.dtype.is_floating_point:
        x = x.to(torch.float32)
    if x.numel() and not bool(torch.isfinite(x).all()):
        raise ValueError(f"{name} contains NaN or inf; every reward must be a finite number")
    return x


def as_bool_mask(name: str, mask: Tensor) -> Tensor:
    """A {0,1} mask of any dtype as bool; raises if it holds other values."""
    if mask.dtype == torch.bool:
        return mask
    if mask.numel() and not bool(((mask == 0) | (mask == 1)).all()):
        raise ValueError(f"{name} must contain only 0 and 1 (policy token = 1, observation/padding = 0)")
    return mask != 0


def masked_sum(x: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    """Sum of ``x`` where ``mask`` is true (``torch.where``, so NaN/inf outside the mask are ignored)."""
    picked = torch.where(mask, x, torch.zeros((), dtype=x.dtype, device=x.device))
    return picked.sum() if dim is None else picked.sum(dim=dim)


def masked_mean(x: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    """Mean of ``x`` over ``mask``; 0 where the mask is empty (never NaN)."""
    count = mask.sum() if dim is None else mask.sum(dim=dim)
    return masked_sum(x, mask, dim) / count.clamp(min=1).to(x.dtype)
