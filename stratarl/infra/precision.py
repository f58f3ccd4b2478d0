"""Where a run computes and in what precision: one value, ``DevicePolicy``, from ``trainer.device`` and
``trainer.precision``.

The mixed-precision rules (the usual AMP recipe; bf16 needs no loss scaling, its exponent range is fp32's):

- Weights and optimizer state stay fp32 (master weights): the model is never cast, so AdamW's moments
  and every update are fp32.
- ``bf16``: each forward pass (rollout generation, the no-grad scoring pass, the update's loss, SFT) runs
  under ``torch.autocast(dtype=bfloat16)``: matmuls and attention in bf16, reductions in fp32 (autocast's
  op lists). Backward runs outside the autocast region and follows the dtypes the forward chose.
- Log-probs are fp32: the LM head's logits are cast to fp32 before the log-softmax
  (``stratarl.trainer.logprobs``; the generator's ``.float()``), so ratios, KL and entropy are fp32. A frozen
  LM head's weight is cast to bf16 once per weight version (``low_precision_head_weight``), not at every call. The
  value head computes in fp32 with autocast off (``stratarl.trainer.critic``).
- fp16 is not offered (it would need a loss scaler).

``precision: auto`` (the default) is bf16 on a CUDA device that supports it and fp32 otherwise. bf16 on a
CPU pays only where the CPU has bf16 matmul units (AVX512-BF16 or AMX; ``cpu_bf16_matmul`` says which):
there a bf16 GEMM runs 2-2.5x an fp32 one (AVX512-BF16, measured by benchmarks/bench_step.py), elsewhere
it is slower than fp32. So a CPU run takes bf16 only when its config asks for it: ``bf16`` always, ``bf16_native`` only on a CPU
with those units (fp32 elsewhere).

Generation: on a CPU the `kv_cache` backend uses ``stratarl.rollout.fast_forward``'s decoder in both
precisions; with bf16 it runs on bf16 copies of the weights made once per weight version (not re-cast
at every call as autocast does), with a bf16 KV cache and fp32 residual stream, norms and logits. On
CUDA it uses the generic KV-cache loop (the model's own forward, SDPA attention, ``DynamicCache``) under
autocast: the fast decoder's oneDNN weight packing and fused small kernels are built for CPU decode
overheads. Retrieval always stays on the CPU.

With bf16, score old log-probs with ``algo.old_logprobs: recompute``: the sampler's bf16 kernels round
differently from the trainer's, so `rollout` log-probs would make the first step's ratios differ from 1
by bf16 noise; recomputed ones come from the trainer's own forward (tests/trainer/test_bf16_step.py
bounds both).
"""

from __future__ import annotations

import weakref
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import Any, Literal, get_args

import torch

from stratarl.config_errors import ConfigError

PrecisionSetting = Literal["auto", "fp32", "bf16", "bf16_native"]
"""The ``trainer.precision`` choices (:meth:`DevicePolicy.create` resolves one to a ``Precision``)."""
PRECISIONS: tuple[PrecisionSetting, ...] = get_args(PrecisionSetting)
Precision = Literal["fp32", "bf16"]


def bf16_supported(device: torch.device) -> bool:
    """Whether bf16 autocast is usable on ``device``: always on a CPU (slow on most); on CUDA, an Ampere or
    newer GPU (``torch.cuda.is_bf16_supported``)."""
    if device.type == "cpu":
        return True
    if device.type == "cuda":
        return torch.cuda.is_available() and torch.cuda.is_bf16_supported()
    return False


def cpu_bf16_matmul() -> str | None:
    """The CPU's bf16 matmul units: "AMX" (amx_bf16), "AVX512-BF16" (avx512_bf16), or None (bf16 is then
    emulated and slower than fp32). Read from the kernel's CPU flags (Linux), else from PyTorch's
    ``torch.backends.cpu.get_cpu_capability()``."""
    flags: set[str] = set()
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("flags"):
                    flags = set(line.split(":", 1)[1].split())
                    break
    except OSError:
        pass
    capability = torch.backends.cpu.get_cpu_capability() if hasattr(torch.backends, "cpu") else ""
    if "amx_bf16" in flags or "AMX" in capability:
        return "AMX"
    if "avx512_bf16" in flags:
        return "AVX512-BF16"
    return None


def resolve_precision(device: str | torch.device, precision: str) -> Precision:
    """``auto`` -> bf16 on a CUDA device with bf16 support, else fp32; ``bf16_native`` -> bf16 on such a CUDA
    device or on a CPU with bf16 matmul units (``cpu_bf16_matmul``), else fp32; fp32 / bf16 as given (checked)."""
    device = torch.device(device)
    if precision not in PRECISIONS:
        raise ConfigError(
            f"config field `trainer.precision` = {precision!r}: unknown precision. "
            f"Fix: use one of {', '.join(PRECISIONS)}."
        )
    if precision == "auto":
        return "bf16" if device.type == "cuda" and bf16_supported(device) else "fp32"
    if precision == "bf16_native":
        native = cpu_bf16_matmul() is not None if device.type == "cpu" else bf16_supported(device)
        return "bf16" if native else "fp32"
    if precision == "bf16" and not bf16_supported(device):
        raise ConfigError(
            f"config field `trainer.precision` = 'bf16': device {str(device)!r} has no bf16 support "
            "(CUDA GPUs before Ampere). Fix: set trainer.precision=fp32."
        )
    return precision


@dataclass(frozen=True)
class DevicePolicy:
    """The device a run's model, value head, reference model and batches live on, and the precision of
    its forward passes (see the module docstring for the rules)."""

    device: torch.device
    precision: Precision = "fp32"

    @classmethod
    def create(cls, device: str | torch.device = "cpu", precision: str = "auto") -> DevicePolicy:
        device = torch.device(device)
        return cls(device, resolve_precision(device, precision))

    @property
    def autocast_dtype(self) -> torch.dtype | None:
        return torch.bfloat16 if self.precision == "bf16" else None

    @property
    def compute_dtype(self) -> torch.dtype:
        """The dtype of the forward passes' matmuls: bf16 or fp32."""
        return self.autocast_dtype or torch.float32

    def autocast(self) -> AbstractContextManager[object]:
        """Context of a forward pass: bf16 autocast on this device type, or nothing for fp32."""
        if self.autocast_dtype is None:
            return nullcontext()
        return torch.autocast(device_type=self.device.type, dtype=self.autocast_dtype)

    def fast_decode(self, backend: str) -> bool | None:
        """The ``fast`` argument of ``KVCacheGenerator`` for ``rollout.backend``: None (the fast CPU decoder
        when the model supports it, in ``compute_dtype``) for `kv_cache` on a CPU; False (the generic loop)
        for `kv_cache_generic` and for every CUDA run."""
        if backend == "kv_cache_generic" or self.device.type != "cpu":
            return False
        return None


def policy_of(trainer_cfg: Any) -> DevicePolicy:
    """The ``DevicePolicy`` of a config's ``trainer`` section (``device``, ``precision``)."""
    return DevicePolicy.create(trainer_cfg.device, getattr(trainer_cfg, "precision", "auto"))


def policy_for_model(model: torch.nn.Module, precision: str = "auto") -> DevicePolicy:
    """The ``DevicePolicy`` of a model's own device."""
    return DevicePolicy.create(next(model.parameters()).device, precision)


def check_placement(model: torch.nn.Module, device: str | torch.device, *modules: torch.nn.Module | None) -> None:
    """Raise ``RuntimeError`` naming the first parameter of ``model`` (or of ``modules``) not on ``device``,
    or not fp32 (master weights)."""
    device = torch.device(device)
    for owner in (model, *modules):
        if owner is None:
            continue
        for name, p in owner.named_parameters():
            if p.device.type != device.type or (device.index is not None and p.device.index != device.index):
                raise RuntimeError(f"parameter {name} of {type(owner).__name__} is on {p.device}, expected {device}")
            if p.is_floating_point() and p.dtype != torch.float32:
                raise RuntimeError(
                    f"parameter {name} of {type(owner).__name__} is {p.dtype}; master weights must be "
                    "fp32 (autocast runs the forward in bf16)"
                )


class _CastCache:
    """One weight's low-precision copy, kept while it is the same tensor (a weak reference: a new tensor that
    happens to reuse a freed one's address is not mistaken for it) with the same storage and version counter."""

    def __init__(self) -> None:
        self.source: weakref.ref[torch.Tensor] | None = None
        self.key: tuple[int, int, torch.dtype] | None = None
        self.copy: torch.Tensor | None = None

    def get(self, weight: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        try:
            key = (weight.data_ptr(), weight._version, dtype)
        except RuntimeError:  # an inference tensor has no version counter: cast, keep nothing
            return weight.detach().to(dtype)
        same = self.source is not None and self.source() is weight and key == self.key
        if not same or self.copy is None:
            self.copy = None  # free the old copy before making the new one
            self.copy, self.key, self.source = weight.detach().to(dtype), key, weakref.ref(weight)
        return self.copy


_HEAD_CAST = _CastCache()


def low_precision_head_weight(weight: torch.Tensor) -> torch.Tensor:
    """The LM head's weight as the head's GEMMs should read it: under CPU bf16 autocast a frozen weight's bf16
    copy, made once per weight version, else ``weight`` itself.

    Why: autocast casts a weight at every call and caches the cast only for leaf tensors that require grad,
    so a frozen head (SmolLM2's tied embedding: 49k x 576) was copied to bf16 once per LM-head block, forward
    and backward, and the backward's GEMMs (the recomputed logits, dh = dz W) ran in fp32. With the bf16 copy
    both passes run their GEMMs in bf16, as the forward's autocast does, from one copy per optimizer step
    at most (a frozen head: once per run). A trainable head keeps autocast's own rules (fp32 dW)."""
    if weight.requires_grad or weight.device.type != "cpu" or not torch.is_autocast_enabled("cpu"):
        return weight
    dtype = torch.get_autocast_dtype("cpu")
    if dtype == weight.dtype:
        return weight
    return _HEAD_CAST.get(weight, dtype)
