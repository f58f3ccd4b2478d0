"""The fast update's forward: frozen layers once per rollout batch, trainable layers per micro-batch.

With ``model.trainable_layers`` (the last n layers train, the embedding and the layers below are
frozen), the hidden states entering the lowest trainable layer k depend on nothing the optimizer
changes. ``frozen_prefix`` computes them once per rollout batch, without autograd, with every
distinct prompt run once for the whole batch (not once per micro-batch): prompts left-padded to P,
their frozen layers' K/V reused by all the group's responses, which run in passes of rows of
similar length (``logprobs.response_chunks``). Each micro-batch then runs only layers k..L-1 and
the final norm (``suffix_hidden``), again with each distinct prompt once and responses in passes
of similar length; all epochs and mini-batches reuse the same prefix.

Same values as ``response_logprobs`` up to float rounding (the same layers on the same inputs; the
attention mask is additive instead of boolean and padding is laid out differently), so the same
gradients to float tolerance: tests/trainer/test_trainer_update_fast.py checks them for several algorithms.

The layers are called one by one (``_run_layers``), as the decoder's own forward does for the
Llama-style decoders (``stratarl.models.MODEL_SUPPORT``, frozen_prefix); anything else (LoRA, gradient checkpointing,
a trainable embedding, sliding-window attention, other architectures) takes the reference path.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from stratarl.infra.flops import layer_pass_costs
from stratarl.models import activation_checkpointing, decoder_of, output_head, supported_types
from stratarl.trainer import logprobs
from stratarl.trainer.batch import micro_batches


class _PrefixKV:
    """``past_key_values`` for one pass: layer i's keys / values are ``past[i]`` (if any) followed by the
    pass's own, which are kept in ``new`` (the prompt pass's K/V, for the responses to attend to)."""

    def __init__(self, past: dict[int, tuple[torch.Tensor, torch.Tensor]] | None = None) -> None:
        self.past = past or {}
        self.new: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def past_length(self, layer_idx: int) -> int:
        return int(self.past[layer_idx][0].shape[2]) if layer_idx in self.past else 0

    def update(self, key, value, layer_idx, *args, **kwargs):
        self.new[layer_idx] = (key, value)
        if layer_idx in self.past:
            past_key, past_value = self.past[layer_idx]
            key, value = torch.cat([past_key, key], dim=2), torch.cat([past_value, value], dim=2)
        return key, value


def unsupported_reason(model: torch.nn.Module) -> str | None:
    """Why the fast path cannot run on ``model`` (None when it can)."""
    if hasattr(model, "get_base_model"):
        return "LoRA adapters train inside every layer"
    config = getattr(model, "config", None)
    supported = supported_types("frozen_prefix")
    if getattr(config, "model_type", None) not in supported:
        return f"model type {getattr(config, 'model_type', None)!r} is not one of {supported}"
    if getattr(config, "use_sliding_window", False):
        return "sliding-window attention"
    decoder = decoder_of(model)
    if not all(hasattr(decoder, a) for a in ("embed_tokens", "layers", "norm", "rotary_emb")):
        return "the decoder lacks embed_tokens / layers / norm / rotary_emb"
    if activation_checkpointing(model):
        return "gradient checkpointing"
    if any(p.requires_grad for p in decoder.embed_tokens.parameters()):
        return "the embedding trains (nothing below the first layer is frozen)"
    return None


def lowest_trainable_layer(decoder: torch.nn.Module) -> int:
    """Index of the lowest decoder layer with a trainable parameter (the number of layers if none)."""
    layers: torch.nn.ModuleList = decoder.layers  # type: ignore[assignment]  # a Llama-type decoder's ModuleList
    for index, layer in enumerate(layers):
        if any(p.requires_grad for p in layer.parameters()):
            return index
    return len(layers)


def _run_layers(
    decoder,
    first: int,
    last: int,
    hidden: torch.Tensor,
    position_ids: torch.Tensor,
    key_valid: torch.Tensor,
    past: dict | None = None,
) -> tuple[torch.Tensor, dict]:
    """Decoder layers first..last-1 on hidden [n, q, H] at ``position_ids`` [n, q]; key_valid [n, kv]
    (kv = past length + q) marks real tokens. Query i sees key j iff key j is real and j <= past + i.
    Returns (hidden [n, q, H], this pass's K/V per layer)."""
    n, q = hidden.shape[:2]
    kv = key_valid.shape[1]
    offset = kv - q
    causal = torch.arange(kv, device=hidden.device).view(1, kv) <= (
        offset + torch.arange(q, device=hidden.device)
    ).view(q, 1)
    allowed = causal.view(1, 1, q, kv) & key_valid.bool().view(n, 1, 1, kv)
    mask = torch.zeros(allowed.shape, dtype=hidden.dtype, device=hidden.device).masked_fill_(
        ~allowed, torch.finfo(hidden.dtype).min
    )
    cache = _PrefixKV(past)
    if first >= last:
        return hidden, cache.new
    position_embeddings = decoder.rotary_emb(hidden, position_ids=position_ids)
    for index in range(first, last):
        out = decoder.layers[index](
            hidden,
            attention_mask=mask,
            position_embeddings=position_embeddings,
            position_ids=position_ids,
            past_key_values=cache,
            use_cache=True,
        )
        hidden = out[0] if isinstance(out, tuple) else out
    return hidden, cache.new


def _chunks(decoder, first: int, last: int, widths: list[int], past: int) -> list[list[int]]:
    """Rows grouped into passes of similar width (``logprobs.response_chunks`` with layers first..last-1's costs):
    a short response pays no padding for the longest one."""
    costs = layer_pass_costs(decoder, first, last)
    return logprobs.response_chunks(
        widths, past, token_flops=costs.token, pair_flops=costs.pair, pass_flops=costs.per_pass
    )


@dataclass
class Prefix:
    """Hidden states entering layer ``layer`` (the lowest trainable one) for a whole rollout batch.

    prompt_hidden [U, P, H] and prompt_valid [U, P]: the U distinct prompts, left-padded to P;
    response_hidden [B, R, H]: response tokens 0..R-1 of each row (R = longest response - 1: the
    state after a row's last token predicts nothing); inverse [B]: each row's prompt;
    prompt_lengths, response_lengths [B]; source: "computed" (``frozen_prefix``) or "rollouts"
    (``captured_prefix``).
    """

    layer: int
    prompt_hidden: torch.Tensor
    prompt_valid: torch.Tensor
    response_hidden: torch.Tensor
    inverse: torch.Tensor
    prompt_lengths: torch.Tensor
    response_lengths: torch.Tensor
    source: str = "computed"  # "computed" by frozen_prefix, or "rollouts": captured by the generator


def distinct_prompts(input_ids: torch.Tensor, prompt_lengths: torch.Tensor) -> tuple[list[tuple], torch.Tensor]:
    """(the distinct prompts, in order of first appearance; inverse [B]: each row's index among them)."""
    prompts = [tuple(row[:n]) for row, n in zip(input_ids.tolist(), prompt_lengths.tolist())]
    first: dict[tuple, int] = {}
    inverse = torch.tensor([first.setdefault(p, len(first)) for p in prompts], dtype=torch.long)
    return list(first), inverse


@torch.no_grad()
def frozen_prefix(
    model: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor, prompt_lengths: torch.Tensor
) -> Prefix:
    """Run the embedding and the frozen layers once over the batch (each distinct prompt once).

    Rows as in ``response_logprobs`` (prompt + response, right-padded). Responses go through in
    passes of rows of similar length (``logprobs.response_chunks``), each only as wide as its longest.
    """
    decoder = decoder_of(model)
    k = lowest_trainable_layer(decoder)
    device = input_ids.device
    prompts, inverse = distinct_prompts(input_ids, prompt_lengths)
    inverse = inverse.to(device)
    U, P = len(prompts), int(prompt_lengths.max())
    prompt_ids = input_ids.new_zeros((U, P))
    prompt_valid = torch.zeros((U, P), dtype=torch.bool, device=device)
    for prompt_index, prompt in enumerate(prompts):  # left padding: every prompt ends at column P - 1
        prompt_ids[prompt_index, P - len(prompt) :] = torch.tensor(prompt, dtype=input_ids.dtype)
        prompt_valid[prompt_index, P - len(prompt) :] = True
    prompt_positions = (prompt_valid.long().cumsum(-1) - 1).clamp(min=0)
    prompt_hidden, prompt_kv = _run_layers(
        decoder, 0, k, decoder.embed_tokens(prompt_ids), prompt_positions, prompt_valid
    )
    response_lengths = attention_mask.long().sum(-1) - prompt_lengths
    R = max(int(response_lengths.max()) - 1, 0)
    B, H = input_ids.shape[0], prompt_hidden.shape[-1]
    response_hidden = prompt_hidden.new_zeros((B, R, H))
    if R > 0:
        widths = (response_lengths - 1).clamp(min=0).tolist()  # the state after a row's last token is not needed
        for chunk in _chunks(decoder, 0, k, widths, P):
            width = max(widths[b] for b in chunk)
            if width == 0:
                continue
            rows = torch.tensor(chunk, dtype=torch.long, device=device)
            columns = torch.arange(width, device=device)
            starts = prompt_lengths[rows].view(-1, 1)
            source = (starts + columns.view(1, width)).clamp(max=input_ids.shape[1] - 1)
            u = inverse[rows]
            past = {i: (key[u], value[u]) for i, (key, value) in prompt_kv.items()}
            key_valid = torch.cat([prompt_valid[u], columns.view(1, width) < response_lengths[rows].view(-1, 1)], dim=1)
            hidden, _ = _run_layers(
                decoder,
                0,
                k,
                decoder.embed_tokens(input_ids[rows].gather(1, source)),
                starts + columns.view(1, width),
                key_valid,
                past,
            )
            response_hidden[rows, :width] = hidden
    return Prefix(k, prompt_hidden, prompt_valid, response_hidden, inverse, prompt_lengths, response_lengths)


def captured_prefix(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    prompt_lengths: torch.Tensor,
    states: list,
) -> tuple[Prefix | None, str | None]:
    """The ``Prefix`` of a batch from the hidden states its rollouts captured while generating, or (None,
    why not): then ``frozen_prefix`` must compute it.

    ``states[b]``: row b's ``Rollout.frozen_states`` (tokens, hidden [len(tokens), H]): the states entering
    the generator's capture layer of the tokens it read. They are this batch's prefix when that layer is
    ``lowest_trainable_layer`` (layers below it are frozen, so their outputs are the same whenever they
    run) and the tokens are row b's own: its prompt and every response token but the last (checked token
    by token here). The generator computed them with its own kernels (fused projections, bf16 copies of
    the weights in a bf16 run): the same values as ``frozen_prefix`` up to float rounding.
    """
    decoder = decoder_of(model)
    k = lowest_trainable_layer(decoder)
    if k >= len(decoder.layers):
        return None, "no decoder layer trains"
    if len(states) != input_ids.shape[0]:
        raise ValueError(f"{len(states)} captured states for {input_ids.shape[0]} batch rows")
    response_lengths = attention_mask.long().sum(-1) - prompt_lengths
    lengths = prompt_lengths.tolist()
    needs = [n + max(int(r) - 1, 0) for n, r in zip(lengths, response_lengths.tolist())]
    rows = input_ids.tolist()
    H = decoder.config.hidden_size
    for b, (state, need) in enumerate(zip(states, needs)):
        if state is None:
            return None, f"row {b} has no captured states"
        tokens, hidden = state
        if getattr(hidden, "shape", None) is None or hidden.dim() != 2 or hidden.shape[1] != H:
            return None, f"row {b}'s captured states are not [tokens, {H}]"
        if len(tokens) < need or list(tokens[:need]) != rows[b][:need] or hidden.shape[0] < need:
            return None, f"row {b}'s captured tokens are not its prompt and response"
    device, dtype = input_ids.device, decoder.embed_tokens.weight.dtype
    prompts, inverse = distinct_prompts(input_ids, prompt_lengths)
    U, P = len(prompts), int(prompt_lengths.max())
    first = {int(u): b for b, u in reversed(list(enumerate(inverse.tolist())))}
    prompt_hidden = torch.zeros((U, P, H), dtype=dtype, device=device)
    prompt_valid = torch.zeros((U, P), dtype=torch.bool, device=device)
    for u in range(U):  # left padding: every prompt ends at column P - 1
        n = lengths[first[u]]
        prompt_hidden[u, P - n :] = states[first[u]][1][:n].to(device=device, dtype=dtype)
        prompt_valid[u, P - n :] = True
    R = max(int(response_lengths.max()) - 1, 0)
    response_hidden = torch.zeros((len(rows), R, H), dtype=dtype, device=device)
    for b, (n, need) in enumerate(zip(lengths, needs)):
        response_hidden[b, : need - n] = states[b][1][n:need].to(device=device, dtype=dtype)
    return Prefix(
        k,
        prompt_hidden,
        prompt_valid,
        response_hidden,
        inverse.to(device),
        prompt_lengths,
        response_lengths,
        source="rollouts",
    ), None


def suffix_hidden(model: torch.nn.Module, prefix: Prefix, rows: list[int], T: int) -> torch.Tensor:
    """Final hidden states [n, T, H] predicting response tokens 0..T-1 of batch rows ``rows``, through
    the trainable layers (with autograd), each distinct prompt of the rows once. Columns at or past
    a row's response length hold finite values that predict nothing."""
    decoder = decoder_of(model)
    L = len(decoder.layers)
    device = prefix.prompt_hidden.device
    index = torch.tensor(rows, dtype=torch.long, device=device)
    groups, local = torch.unique(prefix.inverse[index], return_inverse=True)
    P = prefix.prompt_hidden.shape[1]
    width = int(prefix.prompt_lengths[index].max())  # the rows' longest prompt: trim the shared left padding
    prompt_valid = prefix.prompt_valid[groups, P - width :]
    positions = (prompt_valid.long().cumsum(-1) - 1).clamp(min=0)
    prompt_out, prompt_kv = _run_layers(
        decoder, prefix.layer, L, prefix.prompt_hidden[groups, P - width :], positions, prompt_valid
    )
    local = local.to(device)
    last_state = decoder.norm(prompt_out[:, -1:])  # the prompt's last state predicts response token 0
    H = last_state.shape[-1]
    widths = [min(int(n) - 1, T - 1, prefix.response_hidden.shape[1]) for n in prefix.response_lengths[index].tolist()]
    pieces, order = [], []
    for chunk in _chunks(decoder, prefix.layer, L, [max(w, 0) for w in widths], width):
        c = torch.tensor(chunk, dtype=torch.long, device=device)
        states = last_state[local[c]]
        R = max(widths[i] for i in chunk)
        if R > 0:
            columns = torch.arange(R, device=device)
            g = local[c]
            past = {i: (key[g], value[g]) for i, (key, value) in prompt_kv.items()}
            response_valid = columns.view(1, R) < prefix.response_lengths[index[c]].view(-1, 1)
            response_out, _ = _run_layers(
                decoder,
                prefix.layer,
                L,
                prefix.response_hidden[index[c], :R],
                prefix.prompt_lengths[index[c]].view(-1, 1) + columns.view(1, R),
                torch.cat([prompt_valid[g], response_valid], dim=1),
                past,
            )
            states = torch.cat([states, decoder.norm(response_out)], dim=1)
        if states.shape[1] < T:
            states = torch.cat([states, states.new_zeros(len(chunk), T - states.shape[1], H)], dim=1)
        pieces.append(states)
        order.extend(chunk)
    states = torch.cat(pieces) if len(pieces) > 1 else pieces[0]
    if order != list(range(len(rows))):
        position = torch.empty(len(rows), dtype=torch.long)
        position[torch.tensor(order)] = torch.arange(len(rows))
        states = states[position.to(device)]
    return states


def group_micro_batches(row_lengths: torch.Tensor, groups: torch.Tensor, token_budget: int) -> list[list[int]]:
    """Micro-batches (positions into ``row_lengths``) holding whole prompt groups when they fit.

    Same budget as ``batch.micro_batches`` (rows x longest row <= ``token_budget``), but a group's
    rows stay together so its prompt runs once per micro-batch; a group over the budget alone is
    split by length. Groups longest first, packed greedily. Any partition gives the same
    accumulated gradient (each micro-batch's loss is weighted by its share of the aggregate).
    """
    members: dict[int, list[int]] = {}
    for position, g in enumerate(groups.tolist()):
        members.setdefault(g, []).append(position)
    units: list[list[int]] = []
    for rows in members.values():
        longest = max(int(row_lengths[r]) for r in rows)
        units.extend([rows] if len(rows) * longest <= token_budget else micro_batches(row_lengths, token_budget, rows))
    units.sort(key=lambda rows: -max(int(row_lengths[r]) for r in rows))
    out: list[list[int]] = []
    current: list[int] = []
    for rows in units:
        longest = max(int(row_lengths[r]) for r in current + rows)
        if current and (len(current) + len(rows)) * longest > token_budget:
            out.append(current)
            current = []
        current = current + rows
    if current:
        out.append(current)
    return out


def prefix_response_logprobs(
    model: torch.nn.Module,
    prefix: Prefix,
    rows: list[int],
    input_ids: torch.Tensor,
    prompt_lengths: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    chunk_tokens: int = 1024,
    temperature: float = 1.0,
    with_entropy: bool = False,
    return_hidden: bool = False,
) -> dict[str, torch.Tensor]:
    """``response_logprobs`` of batch rows ``rows`` from their ``prefix``: the same outputs.

    input_ids [n, L], prompt_lengths [n], response_mask [n, T]: the rows' own tensors (a
    micro-batch selected from the batch the prefix was computed on).
    """
    hidden = suffix_hidden(model, prefix, rows, response_mask.shape[1])
    return logprobs.response_head_outputs(
        hidden,
        output_head(model),
        input_ids,
        prompt_lengths,
        response_mask,
        chunk_tokens=chunk_tokens,
        temperature=temperature,
        with_entropy=with_entropy,
        return_hidden=return_hidden,
    )
