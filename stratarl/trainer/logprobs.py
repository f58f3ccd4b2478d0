"""Log-probabilities of response tokens, computed in chunks.

A full log-softmax over [tokens x vocab] for a whole batch is the largest tensor
an RL step would otherwise build (SmolLM2: 49k vocab -> 200 KB per token in
fp32). We never build it: the decoder runs once to hidden states, only the
positions that predict a policy token are kept, and the LM head + selective
log-softmax runs over chunks of those positions:

    log p(y_t) = z_t[y_t] - logsumexp(z_t),      z_t = W h_{t-1}
    H_t        = logsumexp(z_t) - sum_v softmax(z_t)_v z_t[v]

Each chunk is wrapped in activation checkpointing when gradients are needed, so
its [chunk x vocab] logits are recomputed in the backward pass instead of being
kept alive for the whole batch (same idea as Liger's fused linear cross-entropy).
"""

from __future__ import annotations

import torch
from torch.utils.checkpoint import checkpoint

from stratarl.algos.losses import entropy_from_logits


def selective_log_softmax(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """log softmax(logits)[target] per row, without materialising the log-softmax.

    logits [N, V], targets [N] (int64) -> [N].
    """
    if logits.dim() != 2 or targets.shape != logits.shape[:1]:
        raise ValueError(f"expected logits [N, V] and targets [N], got {tuple(logits.shape)} and {tuple(targets.shape)}")
    picked = logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    return picked - torch.logsumexp(logits, dim=-1)


def _head_chunk(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, targets: torch.Tensor,
                temperature: float, with_entropy: bool) -> tuple[torch.Tensor, torch.Tensor]:
    logits = torch.nn.functional.linear(hidden, weight, bias).float()
    if temperature != 1.0:
        logits = logits / temperature
    logp = selective_log_softmax(logits, targets)
    # algos' entropy takes [B, T, V]: a chunk is one row of N tokens.
    ent = entropy_from_logits(logits.unsqueeze(0)).squeeze(0) if with_entropy else logits.new_zeros(logp.shape)
    return logp, ent


def chunked_head_logprobs(hidden: torch.Tensor, head: torch.nn.Linear, targets: torch.Tensor, *, chunk_tokens: int = 1024,
                          temperature: float = 1.0, with_entropy: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Apply the LM head and a selective log-softmax chunk by chunk.

    hidden [N, H] (the hidden states that predict each target), targets [N] ->
    (log-probs [N], entropies [N]; zeros when ``with_entropy`` is False).
    Peak extra memory is one [chunk_tokens x V] block (plus its recomputation in backward).
    """
    if hidden.dim() != 2 or targets.shape != hidden.shape[:1]:
        raise ValueError(f"expected hidden [N, H] and targets [N], got {tuple(hidden.shape)} and {tuple(targets.shape)}")
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be >= 1, got {chunk_tokens}")
    weight, bias = head.weight, head.bias
    needs_grad = torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad)
    logps, ents = [], []
    for start in range(0, hidden.shape[0], chunk_tokens):
        h, y = hidden[start:start + chunk_tokens], targets[start:start + chunk_tokens]
        if needs_grad:
            lp, en = checkpoint(_head_chunk, h, weight, bias, y, temperature, with_entropy, use_reentrant=False)
        else:
            lp, en = _head_chunk(h, weight, bias, y, temperature, with_entropy)
        logps.append(lp)
        ents.append(en)
    if not logps:
        empty = hidden.new_zeros(0, dtype=torch.float32)
        return empty, empty
    return torch.cat(logps), torch.cat(ents)


def _shared_prompt_hidden(decoder, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                          prompt_lengths: torch.Tensor, T: int) -> torch.Tensor | None:
    """Hidden states [B, T, H] predicting each response token, computing each distinct prompt once.

    Pass 1: the U distinct prompts, left-padded to P, with a KV cache. Pass 2: the B
    responses (right-padded to R), each over its prompt's cache rows. The state that
    predicts response token 0 is the prompt's last one; token j's is response state j-1.
    Returns None when sharing saves nothing (every prompt distinct, or more padded tokens).
    """
    B = input_ids.shape[0]
    lengths = attention_mask.long().sum(-1)
    prompts = [tuple(input_ids[b, :int(prompt_lengths[b])].tolist()) for b in range(B)]
    first: dict[tuple, int] = {}
    inverse = torch.tensor([first.setdefault(p, len(first)) for p in prompts], device=input_ids.device)
    U, P = len(first), int(prompt_lengths.max())
    R = int((lengths - prompt_lengths).max())
    if U == B or R < 1 or U * P + B * R >= B * input_ids.shape[1]:
        return None
    unique = list(first)
    prompt_ids = input_ids.new_zeros((U, P))
    prompt_mask = attention_mask.new_zeros((U, P))
    for u, prompt in enumerate(unique):  # left padding: every prompt ends at column P - 1
        prompt_ids[u, P - len(prompt):] = torch.tensor(prompt, dtype=input_ids.dtype)
        prompt_mask[u, P - len(prompt):] = 1
    out = decoder(input_ids=prompt_ids, attention_mask=prompt_mask,
                  position_ids=(prompt_mask.long().cumsum(-1) - 1).clamp(min=0), use_cache=True)
    cache = out.past_key_values
    cache.batch_select_indices(inverse)  # B rows; indexing keeps the autograd graph
    columns = torch.arange(R, device=input_ids.device)
    source = (prompt_lengths.view(B, 1) + columns.view(1, R)).clamp(max=input_ids.shape[1] - 1)
    response_ids = input_ids.gather(1, source)
    response_attention = (columns.view(1, R) < (lengths - prompt_lengths).view(B, 1)).to(attention_mask.dtype)
    response_out = decoder(input_ids=response_ids, attention_mask=torch.cat([prompt_mask[inverse], response_attention], 1),
                           position_ids=prompt_lengths.view(B, 1) + columns.view(1, R), past_key_values=cache,
                           use_cache=True)
    states = torch.cat([out.last_hidden_state[inverse, -1:], response_out.last_hidden_state[:, :R - 1]], dim=1)
    if T > R:
        states = torch.cat([states, states.new_zeros(B, T - R, states.shape[-1])], dim=1)
    return states[:, :T]


def _activation_checkpointing(model: torch.nn.Module) -> bool:
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    for name in ("is_activation_checkpointing", "is_gradient_checkpointing"):  # transformers 5 renamed it
        if hasattr(type(base), name):
            return bool(getattr(base, name))
    return False


def _decoder_and_head(model: torch.nn.Module) -> tuple[torch.nn.Module, torch.nn.Module]:
    # peft wraps the HF model; get_decoder / get_output_embeddings reach through it.
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return base.get_decoder(), base.get_output_embeddings()


def response_logprobs(model: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                      prompt_lengths: torch.Tensor, response_mask: torch.Tensor, *, chunk_tokens: int = 1024,
                      temperature: float = 1.0, with_entropy: bool = False,
                      return_hidden: bool = False, share_prompts: bool = True) -> dict[str, torch.Tensor]:
    """Log-probs (and optionally entropies) of the policy tokens of right-padded rows.

    Row b is ``prompt (prompt_lengths[b] tokens) + response`` padded on the right.
    input_ids, attention_mask [B, L]; prompt_lengths [B]; response_mask [B, T]
    (1 on policy tokens, 0 on observation tokens and padding), T <= L - min(prompt_lengths).
    Returns ``logprobs`` and ``entropy`` [B, T] (0 off the mask) and, with
    ``return_hidden``, ``hidden`` [B, T, H]: the hidden state that predicts each response token.
    Only positions with response_mask = 1 go through the LM head.

    ``share_prompts``: rows with the same prompt (the G rollouts of a GRPO group) run
    the prompt through the decoder once; their responses attend to its KV cache, and
    gradients flow back through it (``_shared_prompt_hidden``). Same values as the
    plain pass up to float rounding; skipped when nothing is shared or under
    gradient checkpointing (which turns the KV cache off).
    """
    B, L = input_ids.shape
    T = response_mask.shape[1]
    if attention_mask.shape != (B, L) or prompt_lengths.shape != (B,) or response_mask.shape[0] != B:
        raise ValueError(f"shape mismatch: input_ids {tuple(input_ids.shape)}, attention_mask {tuple(attention_mask.shape)}, "
                         f"prompt_lengths {tuple(prompt_lengths.shape)}, response_mask {tuple(response_mask.shape)}")
    decoder, head = _decoder_and_head(model)
    # Response token j of row b sits at position P_b + j and is predicted by the state at P_b + j - 1.
    index = (prompt_lengths.view(B, 1) - 1 + torch.arange(T, device=input_ids.device).view(1, T)).clamp(max=L - 1)
    hidden = None
    if share_prompts and not _activation_checkpointing(model):
        hidden = _shared_prompt_hidden(decoder, input_ids, attention_mask, prompt_lengths, T)
    if hidden is None:
        position_ids = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)
        hidden_all = decoder(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids).last_hidden_state
        hidden = hidden_all.gather(1, index.unsqueeze(-1).expand(B, T, hidden_all.shape[-1]))
    targets = input_ids.gather(1, (index + 1).clamp(max=L - 1))
    mask = response_mask.bool()
    lp_flat, ent_flat = chunked_head_logprobs(hidden[mask], head, targets[mask], chunk_tokens=chunk_tokens,
                                              temperature=temperature, with_entropy=with_entropy)
    logprobs = hidden.new_zeros(B, T, dtype=torch.float32).masked_scatter(mask, lp_flat)
    entropy = hidden.new_zeros(B, T, dtype=torch.float32).masked_scatter(mask, ent_flat)
    out = {"logprobs": logprobs, "entropy": entropy}
    if return_hidden:
        out["hidden"] = hidden
    return out
