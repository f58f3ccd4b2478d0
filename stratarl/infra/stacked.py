"""K models of one Llama-style architecture as one computation: their parameters stacked along a new first
dimension, and the decoder layer's math on stacked weights (batched matmuls).

A population (stratarl.trainer.population) trains K independent runs in one process. Their policies share an
architecture but not their weights, so a product of the K runs' rows with their own weights is one
``torch.bmm`` over [K, rows, in] x [K, in, out] instead of K small products: the per-op overhead that
dominates a 0.3 M-parameter policy's step is paid once for K runs. Nothing is shared between the runs' rows:
row r of member k only ever meets member k's weights (every op here is per member or per row).

``StackedParams`` holds one leaf per parameter, ``torch.stack`` of the K models' tensors (a copy), so autograd
gives a gradient [K, ...] whose slice k is member k's own; ``grads_into`` adds those slices to each model's
``.grad``. ``fused`` builds the projections the layer math uses (Q|K|V and gate|up concatenated, transposed
for ``bmm``) from the leaves, inside the autograd graph.

The math is Hugging Face's Llama layer: RMSNorm (fp32), rotary embeddings from the model's own
``rotary_emb``, softmax attention with the model's scale, SiLU-gated MLP, the final norm and the LM head
(tied or not). It covers fp32 models whose every parameter is one of those (``stack_reason`` says why a
model is not covered; the caller then runs that member alone).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from stratarl.models import activation_checkpointing, decoder_of, output_head

STACKED_TYPES = ("llama", "mistral")
"""Model types whose layers ``stack_reason`` accepts (Llama-style, no biases, no q/k norms)."""


def _eps(norm: torch.nn.Module) -> float:
    return float(getattr(norm, "variance_epsilon", getattr(norm, "eps", 1e-6)))


def parameter_table(model: torch.nn.Module) -> dict[str, torch.nn.Parameter]:
    """Every parameter of a Llama-style causal LM by a fixed key (``embed``, ``norm``, ``head`` when untied, and
    ``<layer>.<part>`` for norm1, q, k, v, o, norm2, gate, up, down)."""
    decoder = decoder_of(model)
    table = {"embed": decoder.embed_tokens.weight, "norm": decoder.norm.weight}
    for index, layer in enumerate(decoder.layers):
        attn, mlp = layer.self_attn, layer.mlp
        parts = {
            "norm1": layer.input_layernorm,
            "q": attn.q_proj,
            "k": attn.k_proj,
            "v": attn.v_proj,
            "o": attn.o_proj,
            "norm2": layer.post_attention_layernorm,
            "gate": mlp.gate_proj,
            "up": mlp.up_proj,
            "down": mlp.down_proj,
        }
        table.update({f"{index}.{name}": module.weight for name, module in parts.items()})
    head = output_head(model).weight
    if head is not decoder.embed_tokens.weight:
        table["head"] = head
    return table


def stack_reason(model: torch.nn.Module) -> str | None:
    """None when ``model`` can run stacked with others of its architecture, else a sentence saying why not."""
    if hasattr(model, "get_base_model"):
        return "LoRA adapters"
    config = getattr(model, "config", None)
    if getattr(config, "model_type", None) not in STACKED_TYPES:
        return f"model type {getattr(config, 'model_type', None)!r} is not one of {STACKED_TYPES}"
    if getattr(config, "hidden_act", "silu") != "silu":
        return f"hidden_act {getattr(config, 'hidden_act', None)!r} is not silu"
    if getattr(config, "use_sliding_window", False) or getattr(config, "sliding_window", None):
        return "sliding-window attention"
    rope = getattr(config, "rope_scaling", None) or getattr(config, "rope_parameters", None) or {}
    if isinstance(rope, dict) and "dynamic" in str(rope.get("rope_type", rope.get("type", ""))):
        return "dynamic rope scaling"
    if activation_checkpointing(model):
        return "gradient checkpointing"
    try:
        table = parameter_table(model)
    except AttributeError as error:
        return f"not a Llama-style decoder ({error})"
    if {id(p) for p in model.parameters()} != {id(p) for p in table.values()}:
        return "parameters beyond the Llama layer's weights (biases, q/k norms, adapters)"
    if any(p.dtype != torch.float32 for p in table.values()):
        return "weights not in fp32"
    return None


def architecture(model: torch.nn.Module) -> tuple[object, ...]:
    """What members must share to be stacked: every parameter's key and shape, the heads, the norms' epsilon
    and the rotary frequencies (models of equal architecture give equal tuples)."""
    decoder = decoder_of(model)
    config: Any = model.config  # a transformers config: its fields are read by name
    heads = config.num_attention_heads
    shapes = tuple((key, tuple(p.shape), p.requires_grad) for key, p in parameter_table(model).items())
    rotary = tuple(float(x) for x in decoder.rotary_emb.inv_freq.tolist())
    return (
        shapes,
        heads,
        getattr(config, "num_key_value_heads", None) or heads,
        getattr(config, "head_dim", None) or config.hidden_size // heads,
        _eps(decoder.norm),
        float(getattr(decoder.rotary_emb, "attention_scaling", 1.0)),
        rotary,
        str(next(model.parameters()).device),
    )


def weights_version(model: torch.nn.Module) -> tuple[tuple[int, int], ...] | None:
    """Every parameter's (address, version counter): changes whenever an optimizer writes to a parameter
    (as ``FastDecoder`` tracks it); None for inference tensors, which have no counter."""
    try:
        return tuple((p.data_ptr(), p._version) for p in model.parameters())
    except RuntimeError:
        return None


@dataclass
class Layer:
    """One decoder layer's stacked weights in the layout ``bmm`` takes: x [K, N, in] @ w [K, in, out]."""

    norm1: torch.Tensor  # [K, H]
    qkv: torch.Tensor  # [K, H, (heads + 2 kv_heads) D]
    o: torch.Tensor  # [K, heads D, H]
    norm2: torch.Tensor  # [K, H]
    gate_up: torch.Tensor  # [K, H, 2 I]
    down: torch.Tensor  # [K, I, H]


@dataclass
class Fused:
    """K models' weights for the layer math: ``embed`` [K, V, H], ``layers``, ``norm`` [K, H], ``head`` [K, V, H]
    (the embedding itself when tied) and its transpose ``head_t`` [K, H, V]."""

    embed: torch.Tensor
    layers: list[Layer]
    norm: torch.Tensor
    head: torch.Tensor
    head_t: torch.Tensor


def _layer(leaves: dict[str, torch.Tensor], i: int) -> Layer:
    """Layer ``i``'s fused weights from the stacked leaves (q, k, v and gate, up concatenated)."""

    def get(name: str) -> torch.Tensor:
        return leaves[f"{i}.{name}"]

    return Layer(
        norm1=get("norm1"),
        qkv=torch.cat([get("q"), get("k"), get("v")], dim=1).transpose(1, 2),
        o=get("o").transpose(1, 2),
        norm2=get("norm2"),
        gate_up=torch.cat([get("gate"), get("up")], dim=1).transpose(1, 2),
        down=get("down").transpose(1, 2),
    )


class StackedParams:
    """The parameters of K models of one architecture, stacked: one tensor [K, ...] per parameter key.

    ``grad``: the stacked tensors are autograd leaves (for a trainable parameter), whose ``.grad`` slice k is
    model k's gradient (``grads_into``). The stacks are copies, made from the models' current values."""

    def __init__(self, models: list[torch.nn.Module], *, grad: bool = False) -> None:
        if not models:
            raise ValueError("StackedParams needs at least one model")
        reference = architecture(models[0])
        for model in models[1:]:
            if architecture(model) != reference:
                raise ValueError("models of different architectures cannot be stacked")
        self.models = list(models)
        self.tables = [parameter_table(m) for m in models]
        first = models[0]
        decoder = decoder_of(first)
        config: Any = first.config  # a transformers config: its fields are read by name
        self.heads: int = config.num_attention_heads
        self.kv_heads: int = getattr(config, "num_key_value_heads", None) or self.heads
        self.head_dim: int = getattr(config, "head_dim", None) or config.hidden_size // self.heads
        self.scale: float = self.head_dim**-0.5
        self.eps1 = [_eps(layer.input_layernorm) for layer in decoder.layers]
        self.eps2 = [_eps(layer.post_attention_layernorm) for layer in decoder.layers]
        self.eps = _eps(decoder.norm)
        self.rotary_emb = decoder.rotary_emb
        self.num_layers = len(decoder.layers)
        self.leaves: dict[str, torch.Tensor] = {}
        for key, param in self.tables[0].items():
            stacked = torch.stack([table[key].detach() for table in self.tables])
            self.leaves[key] = stacked.requires_grad_(grad and param.requires_grad)

    @property
    def size(self) -> int:
        return len(self.models)

    def fused(self) -> Fused:
        """The layer math's weights, built from the leaves (differentiable)."""
        leaves = self.leaves
        layers = [_layer(leaves, i) for i in range(self.num_layers)]
        head = leaves.get("head", leaves["embed"])
        return Fused(leaves["embed"], layers, leaves["norm"], head, head.transpose(1, 2))

    @torch.no_grad()
    def grads_into(self, members: list[int] | None = None) -> None:
        """Add each leaf's gradient slice k to model k's ``.grad`` (``members``: only these k)."""
        for key, leaf in self.leaves.items():
            if leaf.grad is None:
                continue
            for k in range(self.size) if members is None else members:
                param = self.tables[k][key]
                if param.grad is None:
                    param.grad = leaf.grad[k].clone()
                else:
                    param.grad.add_(leaf.grad[k])

    def zero_leaf_grads(self) -> None:
        for leaf in self.leaves.values():
            leaf.grad = None


# --------------------------------------------------------------------------- the layer math


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """LlamaRMSNorm per member: x [K, ..., H] normalised in fp32, times member k's weight [K, H]."""
    shape = (weight.shape[0],) + (1,) * (x.dim() - 2) + (weight.shape[1],)
    return F.rms_norm(x, (x.shape[-1],), eps=eps) * weight.view(shape)


def project(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [K, ..., in] @ weight [K, in, out] -> [K, ..., out]: one batched matmul for the K members."""
    K = x.shape[0]
    out = torch.bmm(x.reshape(K, -1, x.shape[-1]), weight)
    return out.view(*x.shape[:-1], weight.shape[-1])


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding ``x cos + rotate_half(x) sin`` (Hugging Face's apply_rotary_pos_emb)."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


def qkv(
    stack: StackedParams, layer: Layer, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Q, K (rotated) and V of hidden [K, B, L, H], each [K, B, heads, L, D]; cos / sin broadcast to
    [K, B, L, D] (the positions of each row)."""
    K, B, L, _ = hidden.shape
    heads, kv, D = stack.heads, stack.kv_heads, stack.head_dim
    mixed = project(rms_norm(hidden, layer.norm1, eps), layer.qkv).view(K, B, L, heads + 2 * kv, D)
    qk = rotate(mixed[..., : heads + kv, :], cos.unsqueeze(-2), sin.unsqueeze(-2))
    q = qk[..., :heads, :].transpose(2, 3)
    k = qk[..., heads:, :].transpose(2, 3)
    v = mixed[..., heads + kv :, :].transpose(2, 3)
    return q, k, v


def finish_layer(layer: Layer, hidden: torch.Tensor, attn: torch.Tensor, eps: float) -> torch.Tensor:
    """The residual stream after attention output ``attn`` [K, B, L, heads D] and the MLP."""
    hidden = hidden + project(attn, layer.o)
    gate_up = project(rms_norm(hidden, layer.norm2, eps), layer.gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    return hidden + project(F.silu(gate) * up, layer.down)


def rope_tables(stack: StackedParams, positions: torch.Tensor, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [*positions.shape, D] from the model's own ``rotary_emb`` (members share it: ``architecture``)."""
    flat = positions.reshape(1, -1)
    cos, sin = stack.rotary_emb(like, position_ids=flat)
    return cos.view(*positions.shape, -1), sin.view(*positions.shape, -1)


def causal_hidden(stack: StackedParams, fused: Fused, input_ids: torch.Tensor) -> torch.Tensor:
    """Final hidden states [K, B, L, H] of right-padded rows ``input_ids`` [K, B, L] (member k's rows run on
    member k's weights), causal attention over each row's own tokens: a real token never sees the right
    padding after it, so padding needs no mask, and position t is column t."""
    K, B, L = input_ids.shape
    V = fused.embed.shape[1]
    offsets = (torch.arange(K, device=input_ids.device) * V).view(K, 1, 1)
    hidden = fused.embed.reshape(K * V, -1)[(input_ids + offsets).view(-1)].view(K, B, L, -1)
    cos, sin = rope_tables(stack, torch.arange(L, device=input_ids.device), hidden)
    heads, D = stack.heads, stack.head_dim
    for index, layer in enumerate(fused.layers):
        q, k, v = qkv(stack, layer, hidden, cos, sin, stack.eps1[index])
        attn = F.scaled_dot_product_attention(
            q.reshape(K * B, heads, L, D),
            k.reshape(K * B, -1, L, D),
            v.reshape(K * B, -1, L, D),
            is_causal=True,
            scale=stack.scale,
            enable_gqa=stack.kv_heads != heads,
        )
        attn = attn.view(K, B, heads, L, D).transpose(2, 3).reshape(K, B, L, heads * D)
        hidden = finish_layer(layer, hidden, attn, stack.eps2[index])
    return rms_norm(hidden, fused.norm, stack.eps)
