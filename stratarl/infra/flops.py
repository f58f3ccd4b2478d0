"""FLOPs a forward (and backward) of the policy actually executes, and the nominal 6 N D.

A benchmark that divides "6 x parameters x tokens" by a measured matmul peak overstates the
work whenever the code skips some of it: the G rows of a group share one prompt pass
(``logprobs.py``), layers below ``model.trainable_layers`` run forward only, the LM head runs
only on policy tokens. It can then print a utilisation above 100 %, which is impossible. This
module counts what runs, decoder-layer call by decoder-layer call, with these formulas (one
multiply-add = 2 FLOPs; ``p`` = a layer's matmul weights, q, k, v, o and the MLP's matrices;
``d`` = heads x head_dim, the width of the attention; a call runs n rows x q query tokens
against kv keys, its cached prefix included):

    forward                 2 p n q  +  4 d n q kv        (projections + QK^T and AV)
    backward, weight grads  2 p n q                       (only when the layer trains)
    backward, input grads   2 p n q                       (when a matmul's input needs a gradient: the
                                                            layer's input does (a trainable layer lies
                                                            below), or the layer trains: its trainable
                                                            norms feed every projection)
    backward, attention     8 d n q kv                    (dS, dV, dQ, dK: when either backward runs)
    LM head on N positions  2 V H N forward, 2 V H N for dh, 2 V H N for dW when the head trains,
                            + 2 V H N when the backward recomputes the logits (``_HeadLogprobs``)

The attention terms count every (query, key) score the kernel computes, masked ones included
(with padding the trainer passes an explicit mask, so the kernel cannot skip the upper
triangle): that is what runs, and what ``torch.utils.flop_counter`` counts for
``scaled_dot_product_attention``. Norms, rotary embeddings, activations and the softmax are
elementwise (a few FLOPs per element, well under 1 % of the matmuls for these widths) and are not
counted; nor is the embedding lookup (no arithmetic).

    nominal = 6 N D,   N = matmul parameters (decoder layers + LM head), D = tokens in the batch

is the usual estimate (forward 2 N D + backward 4 N D, every token of every row, every layer
trained); it is printed beside the executed count, never as the work done.

The same module prices the trainer's choices: ``layer_pass_costs`` and ``decoder_pass_costs`` (the forward
cost of one pass, per token, per attended pair and per pass) decide how the log-prob passes cut rows into
chunks (stratarl.trainer.prefix, stratarl.trainer.logprobs).

Gradient checkpointing re-runs a trainable layer's forward inside the backward: a call made while
recomputing is recorded like any other (it happens under ``torch.enable_grad`` with the same
shapes), so it is counted too.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch

from stratarl.models import decoder_of, output_head

# Fixed cost of one decoder pass per layer, in FLOPs (forward + backward: ~40 kernels of a few us
# each, at ~100 GFLOP/s): what splitting a pass into one more chunk must save.
PASS_OVERHEAD_FLOPS_PER_LAYER = 4e7


@dataclass(frozen=True)
class LayerShape:
    """Matmul weights ``params`` of one decoder layer and its attention width ``attn_width`` (heads x head_dim)."""

    params: int
    attn_width: int


def layer_call_flops(
    shape: LayerShape, rows: int, queries: int, keys: int, *, weight_grad: bool, input_grad: bool
) -> dict[str, float]:
    """FLOPs of one decoder-layer call on ``rows`` x ``queries`` tokens attending to ``keys`` keys.

    Returns ``forward``, ``backward`` (0 when neither gradient is needed) and ``total``; the
    formulas are in the module docstring.
    """
    tokens = rows * queries
    forward = 2.0 * shape.params * tokens + 4.0 * shape.attn_width * tokens * keys
    backward = 0.0
    if weight_grad:
        backward += 2.0 * shape.params * tokens
    if input_grad:
        backward += 2.0 * shape.params * tokens
    if weight_grad or input_grad:
        backward += 8.0 * shape.attn_width * tokens * keys
    return {"forward": forward, "backward": backward, "total": forward + backward}


def head_flops(
    vocab: int, hidden: int, positions: int, *, input_grad: bool, weight_grad: bool, recompute: bool
) -> float:
    """LM-head FLOPs on ``positions`` rows: 2 V H N forward; in backward 2 V H N for dh (``input_grad``),
    2 V H N for dW (``weight_grad``), and 2 V H N more when it recomputes the logits (``recompute``,
    only counted when a backward runs)."""
    unit = 2.0 * vocab * hidden * positions
    backward = input_grad or weight_grad
    return unit * (1 + int(input_grad) + int(weight_grad) + int(backward and recompute))


def nominal_flops(matmul_params: int, tokens: int) -> float:
    """6 N D: the nominal forward + backward cost of ``tokens`` tokens through ``matmul_params`` weights."""
    return 6.0 * matmul_params * tokens


def layer_shape(layer: torch.nn.Module, config: Any) -> LayerShape:
    """Matmul weights (every 2-D parameter: the norms are 1-D) and attention width of a decoder layer."""
    params = sum(p.numel() for p in layer.parameters() if p.dim() == 2)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return LayerShape(params=params, attn_width=config.num_attention_heads * head_dim)


@dataclass(frozen=True)
class PassCosts:
    """The price of one forward pass through some decoder layers, which decides how the trainer cuts rows into
    passes (``stratarl.trainer.logprobs.response_chunks``): FLOPs per token, per attended (query, key) pair, and a
    fixed cost per pass. Only the ratios matter, but they decide the chunks and so the float rounding of every
    log-prob: each price below is kept exactly as the pass it prices has always used."""

    token: float
    pair: float
    per_pass: float


def layer_pass_costs(decoder: Any, first: int = 0, last: int | None = None) -> PassCosts:
    """A pass through decoder layers ``first`` .. ``last - 1`` (the fast update's frozen prefix and trainable
    suffix): per token 2 x the layers' matmul weights; per pair 4 x hidden size x layers; per pass the fixed
    overhead x layers (at least one)."""
    layers = list(decoder.layers)[first:last]
    weights = sum(layer_shape(layer, decoder.config).params for layer in layers)
    count = max(1, len(layers))
    return PassCosts(
        token=2.0 * weights,
        pair=4.0 * count * decoder.config.hidden_size,
        per_pass=PASS_OVERHEAD_FLOPS_PER_LAYER * count,
    )


def decoder_pass_costs(decoder: Any) -> PassCosts:
    """A pass through the whole decoder (the shared-prompt log-prob pass): per token 2 x every decoder parameter
    but the embedding (the norms' scales counted with the matmul weights, a slight over-count); per pair 4 x
    hidden size x layers; per pass the fixed overhead x layers."""
    embedding = decoder.get_input_embeddings() if hasattr(decoder, "get_input_embeddings") else None
    skip = {id(p) for p in embedding.parameters()} if embedding is not None else set()
    weights = sum(p.numel() for p in decoder.parameters() if id(p) not in skip)
    layers = getattr(decoder.config, "num_hidden_layers", 1)
    return PassCosts(
        token=2.0 * weights,
        pair=4.0 * layers * getattr(decoder.config, "hidden_size", 1),
        per_pass=PASS_OVERHEAD_FLOPS_PER_LAYER * layers,
    )


def matmul_params(model: torch.nn.Module) -> int:
    """Decoder-layer matmul weights + the LM head's (the N of 6 N D; the embedding lookup does no matmul)."""
    decoder = decoder_of(model)
    head = output_head(model)
    return sum(layer_shape(layer, decoder.config).params for layer in decoder.layers) + head.weight.numel()


# Every LM-head pass of the trainer reports itself here (stratarl.trainer.logprobs calls ``observe_head``), so
# that ``record_decoder_calls`` can count it; empty outside a recording.
_HEAD_OBSERVERS: list[Callable[[torch.Tensor, torch.nn.Linear, bool], None]] = []


def observe_head(hidden: torch.Tensor, head: torch.nn.Linear, recompute: bool) -> None:
    """Report one LM-head pass over ``hidden`` [N, H] (``recompute``: its backward recomputes the logits)."""
    for observer in _HEAD_OBSERVERS:
        observer(hidden, head, recompute)


@dataclass
class FlopRecord:
    """Decoder-layer calls seen while recording: (layer index, rows, queries, keys, weight_grad, input_grad)."""

    calls: list[tuple[int, int, int, int, bool, bool]] = field(default_factory=list)
    shapes: list[LayerShape] = field(default_factory=list)
    head: float = 0.0
    """LM-head FLOPs of the ``chunked_head_logprobs`` calls seen (backward included when it needs one)."""

    def total(self) -> float:
        return self.decoder_flops()["total"] + self.head

    def decoder_flops(self) -> dict[str, float]:
        out = {"forward": 0.0, "backward": 0.0, "total": 0.0}
        for index, rows, queries, keys, weight_grad, input_grad in self.calls:
            f = layer_call_flops(
                self.shapes[index], rows, queries, keys, weight_grad=weight_grad, input_grad=input_grad
            )
            for k in out:
                out[k] += f[k]
        return out


def _past_length(cache: Any, layer_index: int) -> int:
    if cache is None:
        return 0
    if hasattr(cache, "past_length"):
        return int(cache.past_length(layer_index))
    if hasattr(cache, "get_seq_length"):
        return int(cache.get_seq_length(layer_index))
    return 0


@contextmanager
def record_decoder_calls(model: torch.nn.Module) -> Iterator[FlopRecord]:
    """Record every decoder-layer call of ``model`` inside the block (yields a ``FlopRecord``).

    Also counts the LM head (every pass that reports itself through ``observe_head``).
    Keys of a call = the layer's cached prefix (``past_key_values``) + its own queries. A call
    needs a weight gradient when grad mode is on and the layer has a parameter that requires
    grad, input gradients (of its matmuls) when its input hidden state requires grad or the layer
    trains (its RMSNorm weights make every projection's input require grad; checked against
    ``torch.utils.flop_counter`` in the tests).
    """
    decoder = decoder_of(model)
    record = FlopRecord(shapes=[layer_shape(layer, decoder.config) for layer in decoder.layers])
    handles = []
    for index, layer in enumerate(decoder.layers):
        trains = any(p.requires_grad for p in layer.parameters())

        def hook(
            module: torch.nn.Module,
            args: tuple[Any, ...],
            kwargs: dict[str, Any],
            index: int = index,
            trains: bool = trains,
        ) -> None:
            hidden = args[0] if args else kwargs["hidden_states"]
            rows, queries = hidden.shape[0], hidden.shape[1]
            keys = _past_length(kwargs.get("past_key_values"), index) + queries
            grad = torch.is_grad_enabled()
            # A trainable layer's norms weight every projection's input, so all its matmuls need dX too.
            record.calls.append(
                (index, rows, queries, keys, grad and trains, grad and (trains or hidden.requires_grad))
            )

        handles.append(layer.register_forward_pre_hook(hook, with_kwargs=True))

    def count_head(hidden: torch.Tensor, head: torch.nn.Linear, recompute: bool) -> None:
        weight = head.weight
        needs_grad = torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad)
        record.head += head_flops(
            weight.shape[0],
            weight.shape[1],
            hidden.shape[0],
            input_grad=needs_grad and hidden.requires_grad,
            weight_grad=needs_grad and weight.requires_grad,
            recompute=recompute,
        )

    _HEAD_OBSERVERS.append(count_head)
    try:
        yield record
    finally:
        _HEAD_OBSERVERS.remove(count_head)
        for h in handles:
            h.remove()
