"""The fast decoder's weights: each decoder layer's projections fused (Q|K|V and gate|up stacked into one
matrix each), LoRA adapters merged in (W + s·BA), and oneDNN-packed on CPU where that pays.

Rebuilt by ``FastDecoder.refresh`` only when a parameter changed (tracked by version counters).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from stratarl.rollout.fast_decode_support import is_lora


def effective_weight(linear) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A projection's effective weight: LoRA's W + scaling * B A (when active, not merged)."""
    if not is_lora(linear):
        return linear.weight, linear.bias
    weight = linear.base_layer.weight
    if not getattr(linear, "merged", False) and not getattr(linear, "disable_adapters", False):
        for name in linear.active_adapters:
            if name in linear.lora_A:
                delta = linear.lora_B[name].weight @ linear.lora_A[name].weight
                weight = weight + linear.scaling[name] * delta.to(weight.dtype)
    return weight, linear.base_layer.bias


def packing_available() -> bool:
    """Whether oneDNN weight packing (``torch.ops.mkldnn``, as inductor's CPU freezing uses) exists here."""
    return (
        torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
        and hasattr(torch.ops.mkldnn, "_linear_pointwise")
    )


# Weights with fewer elements than this are not packed when packing is automatic: oneDNN's per-call
# overhead (~10 us) then outweighs its faster kernel (64-wide word-tiny: a packed [32, 64] x [64, 192]
# product takes 18 us, F.linear 7 us; at the 293k-element LM head the two are equal).
PACK_MIN_ELEMENTS = 2**18
# Products with at most this many rows (batch 1 or 2 at decode) run MKL's F.linear even when packed.
GEMV_ROWS = 2


class PackedLinear:
    """``x @ W^T + b`` for a fixed weight, oneDNN-packed on CPU (fp32) when available.

    Why: at decode, M = batch rows is small and every weight is read once per step;
    MKL's sgemm behind ``F.linear`` runs such skinny products at a fraction of the
    bandwidth, while a pre-packed oneDNN weight runs a 30-layer SmolLM2 sweep of them
    1.5-1.8x faster (M = 4 to 32) and the 49k-wide LM head 2-3x faster. At M <= ``GEMV_ROWS``
    it is the other way round (MKL's matrix-vector kernels: 41 vs 51 ms per SmolLM2 sweep at
    M = 1, one thread), so such calls run ``F.linear`` on ``parts``: the unfused projections
    the weight was stacked from (the model's own tensors, no copy).
    ``pack``: True packs, False does not, None packs weights of at least ``PACK_MIN_ELEMENTS``,
    "parts" neither packs nor stacks: every call runs ``F.linear`` on ``parts`` (for a decoder
    whose batch is at most ``GEMV_ROWS`` rows, so no copy of the weights is made at all).
    """

    def __init__(
        self,
        parts: list[tuple[torch.Tensor, torch.Tensor | None]],
        pack: bool | str | None,
        dtype: torch.dtype = torch.float32,
    ) -> None:
        # ``dtype`` bf16: the weights are copied to bf16 once here (once per weight version, not per call
        # as autocast re-casts them), inputs are cast to bf16 and outputs returned in fp32, so the residual
        # stream, the norms and the logits stay fp32 (autocast's rules).
        self.dtype = dtype
        parts = [(w.detach().to(dtype), b.detach().to(dtype) if b is not None else None) for w, b in parts]
        self.out_features = sum(w.shape[0] for w, _ in parts)
        self.binary_add = hasattr(torch.ops.mkldnn._linear_pointwise, "binary") and dtype == torch.float32
        self.packed = None
        self.parts: list[tuple[torch.Tensor, torch.Tensor | None]] | None = parts
        if pack == "parts":
            self.weight = self.bias = None
            return
        weight, bias = _fuse(parts)
        self.weight, self.bias = weight, bias
        if pack is None:
            pack = weight.numel() >= PACK_MIN_ELEMENTS
        if pack and weight.device.type == "cpu" and weight.dtype in (torch.float32, torch.bfloat16):
            try:
                self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), 32)
                self.bias = bias.detach().contiguous() if bias is not None else None
                self.weight = None  # the stacked copy; ``parts`` stay (views of the model's parameters)
            except (RuntimeError, AttributeError):  # an op or format this build lacks: plain GEMM
                self.packed = None
        if self.packed is None:
            self.parts = None

    def _gemv(self, x: torch.Tensor) -> torch.Tensor:
        if self.parts is None:
            raise RuntimeError("GEMV by parts needs packed weights (the parts are kept only then)")
        outs = [F.linear(x, w, b) for w, b in self.parts]
        return outs[0] if len(outs) == 1 else torch.cat(outs, dim=-1)

    def __call__(self, x: torch.Tensor, *, fp32_out: bool = True) -> torch.Tensor:
        """``x @ W^T + b``; with bf16 weights the output is fp32 unless ``fp32_out`` is False."""
        if self.dtype != torch.float32:
            out = self._product(x.to(self.dtype))
            return out.float() if fp32_out else out
        return self._product(x)

    def _product(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is None:
            return F.linear(x, self.weight, self.bias) if self.weight is not None else self._gemv(x)
        flat = x.reshape(-1, x.shape[-1])
        if flat.shape[0] <= GEMV_ROWS:
            return self._gemv(x)
        out = torch.ops.mkldnn._linear_pointwise(flat, self.packed, self.bias, "none", [], "")
        return out.reshape(*x.shape[:-1], self.out_features)

    def add_to(self, residual: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """``residual + x @ W^T + b``. Packed, the addition is oneDNN's sum post-op on the fp32
        result (one pass instead of a GEMM and an add, and bit for bit the same numbers)."""
        if self.packed is None or not self.binary_add or residual.numel() <= GEMV_ROWS * self.out_features:
            return residual + self(x)
        flat = x.reshape(-1, x.shape[-1])
        out = torch.ops.mkldnn._linear_pointwise.binary(
            flat, residual.reshape(-1, self.out_features), self.packed, self.bias, "add"
        )
        return out.reshape(residual.shape)


class LayerWeights:
    """One decoder layer's weights, with Q|K|V and gate|up fused into single matrices
    (unless ``pack`` is "parts"; see ``PackedLinear``)."""

    def __init__(self, layer, pack: bool | str | None, dtype: torch.dtype = torch.float32) -> None:
        attn, mlp = layer.self_attn, layer.mlp
        q, k, v = (effective_weight(p) for p in (attn.q_proj, attn.k_proj, attn.v_proj))
        self.qkv = PackedLinear([q, k, v], pack, dtype)
        self.o = PackedLinear([effective_weight(attn.o_proj)], pack, dtype)
        gate, up = effective_weight(mlp.gate_proj), effective_weight(mlp.up_proj)
        self.gate_up = PackedLinear([gate, up], pack, dtype)
        self.down = PackedLinear([effective_weight(mlp.down_proj)], pack, dtype)
        self.norm1_w, self.norm1_eps = layer.input_layernorm.weight, norm_eps(layer.input_layernorm)
        self.norm2_w, self.norm2_eps = layer.post_attention_layernorm.weight, norm_eps(layer.post_attention_layernorm)
        self.intermediate = gate[0].shape[0]


def _fuse(parts: list[tuple[torch.Tensor, torch.Tensor | None]]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Stack projections' weights (and biases, zeros where one has none) into one matrix."""
    if len(parts) == 1:
        return parts[0]
    weight = torch.cat([w for w, _ in parts], dim=0)
    if all(b is None for _, b in parts):
        return weight, None
    bias = torch.cat(
        [b if b is not None else torch.zeros(w.shape[0], dtype=w.dtype, device=w.device) for w, b in parts]
    )
    return weight, bias


def norm_eps(norm) -> float:
    """The epsilon of an RMSNorm module (``variance_epsilon`` in Llama, ``eps`` elsewhere)."""
    return float(getattr(norm, "variance_epsilon", getattr(norm, "eps", 1e-6)))
