"""Log-probabilities of response tokens, computed in chunks.

A full log-softmax over [tokens x vocab] for a whole batch is the largest tensor
an RL step would otherwise build (SmolLM2: 49k vocab -> 200 KB per token in
fp32). We never build it: the decoder runs once to hidden states, only the
positions that predict a policy token are kept, and the LM head + selective
log-softmax runs over chunks of those positions:

    log p(y_t) = z_t[y_t] - logsumexp(z_t),      z_t = W h_{t-1}
    H_t        = -sum_v p_t[v] log p_t[v]    (= logsumexp(z_t) - sum_v softmax(z_t)_v z_t[v])

When gradients are needed each chunk runs through ``_HeadLogprobs``, whose backward
recomputes its [chunk x vocab] logits instead of keeping them alive for the whole batch
(activation checkpointing, the idea of Liger's fused linear cross-entropy) and computes
their gradient in closed form.
"""

from __future__ import annotations

import torch

from stratarl.infra.flops import decoder_pass_costs, observe_head
from stratarl.infra.precision import low_precision_head_weight
from stratarl.models import activation_checkpointing, decoder_of, output_head


def selective_log_softmax(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """log softmax(logits)[target] per row, without materialising the log-softmax.

    logits [N, V], targets [N] (int64) -> [N].
    """
    if logits.dim() != 2 or targets.shape != logits.shape[:1]:
        raise ValueError(
            f"expected logits [N, V] and targets [N], got {tuple(logits.shape)} and {tuple(targets.shape)}"
        )
    picked = logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    return picked - torch.logsumexp(logits, dim=-1)


def _head_logits(
    hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, temperature: float
) -> torch.Tensor:
    """``(hidden W^T + b) / temperature`` in ``weight``'s dtype, fp32 when a temperature divides it."""
    if hidden.dtype != weight.dtype:
        hidden = hidden.to(weight.dtype)
    if bias is not None and bias.dtype != weight.dtype:
        bias = bias.to(weight.dtype)
    logits = torch.nn.functional.linear(hidden, weight, bias)
    return logits.float() / temperature if temperature != 1.0 else logits


def _head_forward(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    targets: torch.Tensor,
    temperature: float,
    with_entropy: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(log p(target), entropy or zeros, log-softmax [N, V]) of ``(hidden W^T + b) / temperature``; with a bf16
    ``weight`` (``low_precision_head_weight``) the product runs in bf16, as autocast would run it."""
    # bf16 logits are widened inside the log-softmax (the same values as .float() first, without writing and
    # reading back an fp32 copy of the block: 1.7x faster at 128 x 49k on one core).
    logp = torch.log_softmax(_head_logits(hidden, weight, bias, temperature), dim=-1, dtype=torch.float32)
    picked = logp.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    # H = -sum_v p_v log p_v, the same value as logsumexp(z) - sum_v softmax(z)_v z_v.
    entropy = -(logp.exp() * logp).sum(-1) if with_entropy else picked.new_zeros(picked.shape)
    return picked, entropy, logp


# Rows of one LM-head block: about 4 MiB of fp32 logits, so a block's passes stay in cache (1,700
# policy tokens x 4.6k vocabulary: 88 ms forward + backward in blocks of 256 rows, 147 ms in one),
# but at least 128 rows so the GEMM stays efficient for large vocabularies.
HEAD_BLOCK_BYTES = 4 * 2**20
HEAD_MIN_BLOCK_ROWS = 128
# The [N, V] log-softmax is kept for backward (no recomputation) while all of it fits in this.
HEAD_KEEP_BYTES = 128 * 2**20


class _HeadLogprobs(torch.autograd.Function):
    """LM head + selective log-softmax (+ entropy) with a hand-written backward.

    Either it keeps the block's [N, V] log-softmax for backward (``keep``: when the whole call's
    fit in ``HEAD_KEEP_BYTES``), or, like activation checkpointing, only [N]-sized results,
    recomputing the logits in backward. The backward is then a few passes over [N, V] and two
    GEMMs, instead of autograd's replay of the whole block (GEMM, logsumexp, softmax, product,
    sum) and its backward:

        z = (h W^T + b) / T,   log p = log_softmax(z),   p = exp(log p)
        d log p(y) / dz_v = [v = y] - p_v
        d H / dz_v        = -p_v (log p_v + H)
        dz = g_lp [v = y] - p (g_lp + g_H H + g_H log p)
        dh = dz W / T,   dW = (dz / T)^T h,   db = sum_rows dz / T
    """

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, temperature: float, with_entropy: bool, keep: bool):
        picked, entropy, logp = _head_forward(hidden, weight, bias, targets, temperature, with_entropy)
        ctx.save_for_backward(hidden, weight, bias, targets, entropy, logp if keep else None)
        ctx.temperature, ctx.with_entropy = temperature, with_entropy
        return picked, entropy

    @staticmethod
    def backward(ctx, grad_logp, grad_entropy):
        hidden, weight, bias, targets, entropy, logp = ctx.saved_tensors
        if logp is None and not ctx.with_entropy:  # the probabilities alone: one softmax, no log-softmax and exp
            probs = torch.softmax(_head_logits(hidden, weight, bias, ctx.temperature), dim=-1, dtype=torch.float32)
        else:
            if logp is None:
                _, _, logp = _head_forward(hidden, weight, bias, targets, ctx.temperature, False)
            probs = logp.exp()
        # The saved log-softmax is never written to (a retained graph may run backward again).
        if ctx.with_entropy:
            grad = (logp * grad_entropy.unsqueeze(-1)).add_((grad_entropy * entropy + grad_logp).unsqueeze(-1))
            grad = grad.mul_(probs).neg_()
        else:
            grad = probs.mul_(-grad_logp.unsqueeze(-1))
        grad.scatter_add_(-1, targets.unsqueeze(-1), grad_logp.unsqueeze(-1))
        if ctx.temperature != 1.0:
            grad = grad.div_(ctx.temperature)
        grad = grad.to(weight.dtype)
        need_hidden, need_weight, need_bias = ctx.needs_input_grad[:3]
        grad_hidden = (grad @ weight).to(hidden.dtype) if need_hidden else None
        grad_weight = grad.t() @ hidden.to(weight.dtype) if need_weight else None
        grad_bias = grad.sum(0).to(bias.dtype) if bias is not None and need_bias else None
        return grad_hidden, grad_weight, grad_bias, None, None, None, None


def chunked_head_logprobs(
    hidden: torch.Tensor,
    head: torch.nn.Linear,
    targets: torch.Tensor,
    *,
    chunk_tokens: int = 1024,
    temperature: float = 1.0,
    with_entropy: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Apply the LM head and a selective log-softmax chunk by chunk.

    hidden [N, H] (the hidden states that predict each target), targets [N] ->
    (log-probs [N], entropies [N]; zeros when ``with_entropy`` is False).
    Peak extra memory is a few [chunk_tokens x V] blocks, in forward and again in backward
    (``_HeadLogprobs`` recomputes them there), or, when all N x V log-probs fit in
    ``HEAD_KEEP_BYTES``, those. Chunks run in cache-sized blocks (``HEAD_BLOCK_BYTES``).
    """
    if hidden.dim() != 2 or targets.shape != hidden.shape[:1]:
        raise ValueError(
            f"expected hidden [N, H] and targets [N], got {tuple(hidden.shape)} and {tuple(targets.shape)}"
        )
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be >= 1, got {chunk_tokens}")
    weight, bias = head.weight, head.bias
    needs_grad = torch.is_grad_enabled() and (
        hidden.requires_grad or weight.requires_grad or (bias is not None and bias.requires_grad)
    )
    weight = low_precision_head_weight(weight)
    vocab = weight.shape[0]
    block = min(chunk_tokens, max(HEAD_MIN_BLOCK_ROWS, HEAD_BLOCK_BYTES // (4 * vocab)))
    keep = hidden.shape[0] * vocab * 4 <= HEAD_KEEP_BYTES
    observe_head(hidden, head, recompute=not keep)
    logps, ents = [], []
    for start in range(0, hidden.shape[0], block):
        h, y = hidden[start : start + block], targets[start : start + block]
        if needs_grad:
            lp, en = _HeadLogprobs.apply(h, weight, bias, y, temperature, with_entropy, keep)
        else:
            lp, en, _ = _head_forward(h, weight, bias, y, temperature, with_entropy)
        logps.append(lp)
        ents.append(en)
    if not logps:
        empty = hidden.new_zeros(0, dtype=torch.float32)
        return empty, empty
    if len(logps) == 1:
        return logps[0], ents[0]
    return torch.cat(logps), torch.cat(ents)


def response_head_outputs(
    hidden: torch.Tensor,
    head: torch.nn.Linear,
    input_ids: torch.Tensor,
    prompt_lengths: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    chunk_tokens: int,
    temperature: float,
    with_entropy: bool,
    return_hidden: bool,
) -> dict[str, torch.Tensor]:
    """The LM head on ``hidden`` [B, T, H], the states that predict each response token (response token j of
    row b sits at position ``prompt_lengths[b] + j`` of ``input_ids`` [B, L]): ``response_logprobs``'s outputs,
    ``logprobs`` and ``entropy`` [B, T] (0 off ``response_mask``) and, with ``return_hidden``, ``hidden``.
    Only the policy tokens go through the head (``chunked_head_logprobs``)."""
    B, L = input_ids.shape
    T = response_mask.shape[1]
    position = (prompt_lengths.view(B, 1) + torch.arange(T, device=input_ids.device).view(1, T)).clamp(max=L - 1)
    targets = input_ids.gather(1, position)
    mask = response_mask.bool()
    lp_flat, ent_flat = chunked_head_logprobs(
        hidden[mask], head, targets[mask], chunk_tokens=chunk_tokens, temperature=temperature, with_entropy=with_entropy
    )
    out = {
        "logprobs": hidden.new_zeros(B, T, dtype=torch.float32).masked_scatter(mask, lp_flat),
        "entropy": hidden.new_zeros(B, T, dtype=torch.float32).masked_scatter(mask, ent_flat),
    }
    if return_hidden:
        out["hidden"] = hidden
    return out


def response_chunks(
    lengths: list[int], prompt_width: int, *, token_flops: float, pair_flops: float, pass_flops: float
) -> list[list[int]]:
    """Rows grouped into response-pass chunks of similar length, cheapest first-order cost first.

    A chunk of n rows whose longest response has R tokens costs n R (token_flops +
    pair_flops (P + R)) (every padded token through the layers, attending to the prompt and the
    chunk's width) plus ``pass_flops``; rows sorted by length (longest first) are cut where the
    total is smallest (dynamic programming over the B cut points). Returns row indices per chunk.
    """
    order = sorted(range(len(lengths)), key=lambda b: -lengths[b])
    n = len(order)
    best = [0.0] + [float("inf")] * n  # best[j]: cheapest split of order[:j]
    cut = [0] * (n + 1)
    for j in range(1, n + 1):
        for i in range(j):
            width = lengths[order[i]]  # the longest row of order[i:j]
            cost = best[i] + pass_flops + (j - i) * width * (token_flops + pair_flops * (prompt_width + width))
            if cost < best[j]:
                best[j], cut[j] = cost, i
    chunks, j = [], n
    while j > 0:
        chunks.append(order[cut[j] : j])
        j = cut[j]
    return chunks[::-1]


def _shared_prompt_hidden(
    decoder, input_ids: torch.Tensor, attention_mask: torch.Tensor, prompt_lengths: torch.Tensor, T: int
) -> torch.Tensor | None:
    """Hidden states [B, T, H] predicting each response token, computing each distinct prompt once.

    Pass 1: the U distinct prompts, left-padded to P, with a KV cache. Pass 2: the B
    responses, right-padded, each over its prompt's cache rows, in chunks of rows of similar
    length (``response_chunks``: a row shorter than the longest pays no padding in attention
    and the layers). The state that predicts response token 0 is the prompt's last one; token
    j's is response state j-1. Returns None when sharing saves nothing (every prompt distinct,
    or more padded tokens).
    """
    from transformers import DynamicCache  # start-up cost: only for a shared-prompt pass

    B = input_ids.shape[0]
    lengths = attention_mask.long().sum(-1)
    response_lengths = (lengths - prompt_lengths).tolist()
    prompts = [tuple(row[:n]) for row, n in zip(input_ids.tolist(), prompt_lengths.tolist())]
    first: dict[tuple, int] = {}
    inverse = torch.tensor([first.setdefault(p, len(first)) for p in prompts], device=input_ids.device)
    U, P = len(first), int(prompt_lengths.max())
    R = max(response_lengths)
    if U == B or R < 1 or B * input_ids.shape[1] <= U * P + B * R:
        return None
    prompt_ids = input_ids.new_zeros((U, P))
    prompt_mask = attention_mask.new_zeros((U, P))
    for u, prompt in enumerate(first):  # left padding: every prompt ends at column P - 1
        prompt_ids[u, P - len(prompt) :] = torch.tensor(prompt, dtype=input_ids.dtype)
        prompt_mask[u, P - len(prompt) :] = 1
    out = decoder(
        input_ids=prompt_ids,
        attention_mask=prompt_mask,
        position_ids=(prompt_mask.long().cumsum(-1) - 1).clamp(min=0),
        use_cache=True,
    )
    prompt_kv = [(layer.keys, layer.values) for layer in out.past_key_values.layers]
    prompt_last = out.last_hidden_state[:, -1:]  # [U, 1, H]: predicts response token 0
    costs = decoder_pass_costs(decoder)
    chunks = response_chunks(
        response_lengths, P, token_flops=costs.token, pair_flops=costs.pair, pass_flops=costs.per_pass
    )
    pieces, order = [], []
    for rows in chunks:
        index = torch.tensor(rows, device=input_ids.device)
        prompt_rows = inverse[index]
        width = max(response_lengths[b] for b in rows)
        states = prompt_last[prompt_rows]
        if width > 1:
            # Indexing the prompt's K/V keeps the autograd graph: gradients reach the prompt pass.
            cache = DynamicCache([(k[prompt_rows], v[prompt_rows]) for k, v in prompt_kv])
            columns = torch.arange(width, device=input_ids.device)
            starts = prompt_lengths[index].view(-1, 1)
            source = (starts + columns.view(1, width)).clamp(max=input_ids.shape[1] - 1)
            response_ids = input_ids[index].gather(1, source)
            in_response = columns.view(1, width) < (lengths[index].view(-1, 1) - starts)
            attention = torch.cat([prompt_mask[prompt_rows], in_response.to(attention_mask.dtype)], 1)
            response_out = decoder(
                input_ids=response_ids,
                attention_mask=attention,
                position_ids=starts + columns.view(1, width),
                past_key_values=cache,
                use_cache=True,
            )
            states = torch.cat([states, response_out.last_hidden_state[:, : width - 1]], dim=1)
        states = states[:, :T]
        if states.shape[1] < T:
            states = torch.cat([states, states.new_zeros(len(rows), T - states.shape[1], states.shape[-1])], dim=1)
        pieces.append(states)
        order.extend(rows)
    states = torch.cat(pieces) if len(pieces) > 1 else pieces[0]
    if order != list(range(B)):
        position = torch.empty(B, dtype=torch.long)
        position[torch.tensor(order)] = torch.arange(B)
        states = states[position.to(states.device)]
    return states


def response_logprobs(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    prompt_lengths: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    chunk_tokens: int = 1024,
    temperature: float = 1.0,
    with_entropy: bool = False,
    return_hidden: bool = False,
    share_prompts: bool = True,
    with_logprobs: bool = True,
) -> dict[str, torch.Tensor]:
    """Log-probs (and optionally entropies) of the policy tokens of right-padded rows.

    Row b is ``prompt (prompt_lengths[b] tokens) + response`` padded on the right.
    input_ids, attention_mask [B, L]; prompt_lengths [B]; response_mask [B, T]
    (1 on policy tokens, 0 on observation tokens and padding), T <= L - min(prompt_lengths).
    Returns ``logprobs`` and ``entropy`` [B, T] (0 off the mask) and, with
    ``return_hidden``, ``hidden`` [B, T, H]: the hidden state that predicts each response token.
    Only positions with response_mask = 1 go through the LM head; ``with_logprobs=False`` skips
    the head altogether and returns only ``hidden`` (a critic's values need nothing else).

    ``share_prompts``: rows with the same prompt (the G rollouts of a GRPO group) run
    the prompt through the decoder once; their responses attend to its KV cache, and
    gradients flow back through it (``_shared_prompt_hidden``). Same values as the
    plain pass up to float rounding; skipped when nothing is shared or under
    gradient checkpointing (which turns the KV cache off).
    """
    B, L = input_ids.shape
    T = response_mask.shape[1]
    if attention_mask.shape != (B, L) or prompt_lengths.shape != (B,) or response_mask.shape[0] != B:
        raise ValueError(
            f"shape mismatch: input_ids {tuple(input_ids.shape)}, attention_mask {tuple(attention_mask.shape)}, "
            f"prompt_lengths {tuple(prompt_lengths.shape)}, response_mask {tuple(response_mask.shape)}"
        )
    decoder, head = decoder_of(model), output_head(model)
    # Response token j of row b sits at position P_b + j and is predicted by the state at P_b + j - 1.
    index = (prompt_lengths.view(B, 1) - 1 + torch.arange(T, device=input_ids.device).view(1, T)).clamp(max=L - 1)
    hidden = None
    if share_prompts and not activation_checkpointing(model):
        hidden = _shared_prompt_hidden(decoder, input_ids, attention_mask, prompt_lengths, T)
    if hidden is None:
        position_ids = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)
        hidden_all = decoder(
            input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids
        ).last_hidden_state
        hidden = hidden_all.gather(1, index.unsqueeze(-1).expand(B, T, hidden_all.shape[-1]))
    if not with_logprobs:
        return {"hidden": hidden}
    return response_head_outputs(
        hidden,
        head,
        input_ids,
        prompt_lengths,
        response_mask,
        chunk_tokens=chunk_tokens,
        temperature=temperature,
        with_entropy=with_entropy,
        return_hidden=return_hidden,
    )
