"""Which models ``FastDecoder`` (``stratarl.rollout.fast_forward``) covers, and why not the others.

Covered: ``model_type`` in ``SUPPORTED_MODEL_TYPES`` (``stratarl.models.MODEL_SUPPORT``) with plain
``nn.Linear`` projections or peft LoRA on them, SiLU MLP, no sliding window shorter than the context, no
dynamic rope and no q/k norms. ``fast_decode_unsupported_reason(model)`` says why a model is not covered; the
generator then uses the model's own forward.
"""

from __future__ import annotations

from typing import Any

import torch

from stratarl.models import decoder_of, supported_types, unwrap

SUPPORTED_MODEL_TYPES = supported_types("fast_decode")  # stratarl.models.MODEL_SUPPORT


def decoder_with_layers(model):
    """The decoder of ``model`` (unwrapped) when it has a ``.layers`` list, else None."""
    inner = decoder_of(model) if hasattr(model, "get_decoder") else None
    return inner if inner is not None and hasattr(inner, "layers") else None


def is_lora(linear) -> bool:
    """Whether ``linear`` is a peft LoRA layer (a base layer with A / B adapters)."""
    return hasattr(linear, "base_layer") and hasattr(linear, "lora_A") and hasattr(linear, "lora_B")


def _linear_problem(linear) -> str | None:
    """Why ``FastDecoder`` cannot use the projection ``linear`` (None: it can)."""
    if type(linear) is torch.nn.Linear:
        return None
    if is_lora(linear):
        if type(linear.base_layer) is not torch.nn.Linear:
            return f"LoRA over {type(linear.base_layer).__name__} (quantised?) is not plain nn.Linear"
        if any(getattr(linear, "use_dora", {}).values()) or any(getattr(linear, "lora_bias", {}).values()):
            return "DoRA / LoRA bias adapters are not implemented"
        return None
    return f"{type(linear).__name__} projections are not plain nn.Linear or LoRA"


def fast_decode_unsupported_reason(model) -> str | None:
    """None when ``FastDecoder`` covers ``model``, else a sentence saying why not."""
    model = unwrap(model)
    config: Any = getattr(model, "config", None)  # a transformers config: its fields are read by name
    model_type = getattr(config, "model_type", None)
    if model_type not in SUPPORTED_MODEL_TYPES:
        return f"model_type {model_type!r} is not one of {SUPPORTED_MODEL_TYPES}"
    inner = decoder_with_layers(model)
    if inner is None or not hasattr(model, "lm_head"):
        return "the model has no .model.layers / .lm_head"
    if getattr(config, "hidden_act", "silu") != "silu":
        return f"hidden_act {config.hidden_act!r} is not silu"
    rope = getattr(config, "rope_scaling", None) or getattr(config, "rope_parameters", None) or {}
    if isinstance(rope, dict) and "dynamic" in str(rope.get("rope_type", rope.get("type", ""))):
        return "dynamic rope scaling depends on the sequence length"
    window = getattr(config, "sliding_window", None)
    if window is not None and getattr(config, "use_sliding_window", True) and window < config.max_position_embeddings:
        return f"sliding_window {window} is not implemented"
    if getattr(config, "pretraining_tp", 1) != 1:
        return "pretraining_tp != 1"
    for layer in inner.layers:
        attn, mlp = layer.self_attn, layer.mlp
        for linear in (attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj, mlp.gate_proj, mlp.up_proj, mlp.down_proj):
            problem = _linear_problem(linear)
            if problem is not None:
                return problem
        if hasattr(attn, "q_norm") or hasattr(attn, "k_norm"):
            return "q/k norms are not implemented"
    if _linear_problem(model.lm_head) is not None:
        return f"lm_head: {_linear_problem(model.lm_head)}"
    return None
