"""A plain-PyTorch decode path for Llama-family causal LMs (Llama, Qwen2, Mistral, SmolLM2).

Why: on a CPU, a decode step of a small model at batch 8-32 is dominated not by
FLOPs but by overheads of the generic Hugging Face forward: ~15 small kernels per
layer each behind Python module dispatch, a ``DynamicCache`` that concatenates
every layer's K/V at every step (18% of a SmolLM2-135M step at batch 32), mask
construction per step, and three separate skinny GEMMs for Q, K and V (and two
for gate / up), which run far below the matmul peak at M = batch rows. This
module runs the same math with:

- a preallocated KV cache ``[layers, batch, kv_heads, capacity, head_dim]``
  written in place (no concatenation);
- fused projections: one GEMM for Q|K|V and one for gate|up per layer, with the
  weights pre-packed for oneDNN on CPU (rebuilt only when a parameter changed,
  tracked by version counters);
- decode attention by SDPA reading the grouped-query K/V in place (no repetition: a
  K/V head's query heads are its query positions), with an additive padding bias
  kept across steps;
- residual additions inside the o_proj / down_proj GEMMs (oneDNN's sum post-op), and at
  1-2 batch rows MKL's matrix-vector products on the model's own weights instead.

The math is the model's own: RMSNorm in fp32 as ``LlamaRMSNorm``, the model's
``rotary_emb`` module for cos / sin (so rope scaling variants are honoured), and
``softmax(q k^T / sqrt(d) + mask) v``. Greedy tokens equal Hugging Face's
(tests/rollout/test_rollout_fast_forward.py compares logits and greedy ids).

Supported: ``model_type`` in ``SUPPORTED_MODEL_TYPES`` (llama, qwen2, mistral) with plain ``nn.Linear``
projections or peft LoRA on them (merged into the fused weights, W + s·BA), SiLU MLP, no sliding window
shorter than the context and no dynamic rope. ``fast_decode_unsupported_reason(model)`` says why a model is not
covered (``stratarl.rollout.fast_decode_support``); the generator then uses the model's own forward. The
fused, packed weights are built in ``stratarl.rollout.decoder_weights``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from stratarl.models import unwrap
from stratarl.rollout.decoder_weights import (
    GEMV_ROWS,
    PACK_MIN_ELEMENTS,
    LayerWeights,
    PackedLinear,
    effective_weight,
    norm_eps,
    packing_available,
)
from stratarl.rollout.fast_decode_support import (
    SUPPORTED_MODEL_TYPES,
    decoder_with_layers,
    fast_decode_unsupported_reason,
    is_lora,
)

__all__ = [
    "GEMV_ROWS",
    "PACK_MIN_ELEMENTS",
    "SUPPORTED_MODEL_TYPES",
    "FastDecoder",
    "fast_decode_unsupported_reason",
    "packing_available",
]


def _apply_rope(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """``x * cos + rotate_half(x) * sin`` with ``signed_sin`` = [-sin_1, sin_2] (the halves of sin):
    rotate_half(x) * sin = [-x_2 sin_1, x_1 sin_2] = roll(x, D/2) * signed_sin, bit for bit
    (negation is exact), in one copy instead of two slices, a negation and a concatenation."""
    return x * cos + x.roll(x.shape[-1] // 2, dims=-1) * signed_sin


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # LlamaRMSNorm: the variance in fp32, the weight applied after casting back. In fp32 that is
    # F.rms_norm's formula (x * rsqrt(mean(x^2) + eps) * w), one call instead of six ops.
    if x.dtype == torch.float32 and weight.dtype == torch.float32:
        return F.rms_norm(x, (x.shape[-1],), weight, eps)
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


def _parameter_key(module) -> tuple:
    """(address, version counter) of each of ``module``'s parameters: equal keys mean unchanged weights."""
    return tuple((p.data_ptr(), p._version) for p in module.parameters())


def _own_dtypes():
    """Autocast off: the decoder sets every dtype itself (a generator may be called under autocast)."""
    return torch.autocast("cpu", enabled=False)


class FastDecoder:
    """Prefill + one-token decode steps of a supported model over a preallocated KV cache.

    Usage (all under ``torch.inference_mode()``)::

        decoder = FastDecoder(model)          # once; weights are re-fused only when they change
        logits = decoder.prefill(ids, attention_mask, capacity)   # [B, V], last position
        logits = decoder.decode(tokens)       # [B, V]; appends one column to the cache
        decoder.select(rows)                  # keep only these batch rows
    """

    def __init__(self, model, *, pack: bool | None = None, dtype: torch.dtype = torch.float32) -> None:
        """``pack``: oneDNN-packed weights: True all, False none, None (default) the weights of at least
        ``PACK_MIN_ELEMENTS`` elements when ``packing_available()``.

        ``dtype`` bfloat16: the projections and the LM head run on bf16 copies of the weights, made once
        per weight version (``refresh``), and the KV cache, attention and the MLP's activation are bf16;
        the residual stream, every norm and the logits stay fp32 (the rules of ``torch.autocast``, without
        its re-cast of every weight at every call). It pays on CPUs with bf16 matmul units (AVX512-BF16,
        AMX; ``stratarl.infra.precision.cpu_bf16_matmul``)."""
        if dtype not in (torch.float32, torch.bfloat16):
            raise ValueError(f"FastDecoder dtype must be float32 or bfloat16, got {dtype}")
        self.dtype = dtype
        reason = fast_decode_unsupported_reason(model)
        if reason is not None:
            raise ValueError(f"FastDecoder does not support this model: {reason}")
        self.model = model  # parameters (LoRA's included) are tracked on the model as given
        model = unwrap(model)
        self.causal_lm = model
        self.config = model.config
        inner = decoder_with_layers(model)
        self.inner = inner
        self.num_heads = self.config.num_attention_heads
        self.num_kv_heads = getattr(self.config, "num_key_value_heads", None) or self.num_heads
        self.head_dim = getattr(self.config, "head_dim", None) or self.config.hidden_size // self.num_heads
        self.scale = self.head_dim**-0.5
        self.groups = self.num_heads // self.num_kv_heads  # query heads per K/V head
        self._layers: list[LayerWeights] = []
        self._lora_modules = [m for m in model.modules() if is_lora(m)]
        self.pack = False if not packing_available() else pack
        self._version: tuple | None = None
        self._unpacked_for_small = False  # layers built without packing for a batch of <= GEMV_ROWS rows
        self._layer_keys: list[tuple] = []  # each layer's ``_parameter_key`` when its weights were built
        self._head_key: tuple = ()
        self._rope_cos: torch.Tensor | None = None  # [n, D] tables for positions 0..n-1
        self._rope_sin: torch.Tensor | None = None
        # ``capture_layer`` k: keep the hidden states entering layer k (the residual stream, fp32) of every
        # token the decoder runs, in ``h_cache`` [B, capacity, H] next to the K/V. When layers 0..k-1 are
        # frozen, these are the states the trainer's frozen prefix would recompute for the same tokens
        # (``stratarl.trainer.prefix.captured_prefix``). None: nothing is kept.
        self.capture_layer: int | None = None
        self.h_cache: torch.Tensor | None = None
        # ``prefill_chunk_rows`` n: prefill runs n rows at a time through every layer (their activations stay in
        # the CPU's caches: 1.25x faster at 8 rows of 160 tokens than 64 at once for SmolLM2 in bf16); None: all.
        self.prefill_chunk_rows: int | None = None

    # -- weights ---------------------------------------------------------------------------
    def _weights_version(self) -> tuple | None:
        """Every parameter's (address, version counter) and every LoRA layer's active adapters, or None."""
        try:
            adapters = tuple(
                bool(getattr(m, "disable_adapters", False)) or tuple(m.active_adapters) for m in self._lora_modules
            )  # toggling an adapter changes no parameter
            return (_parameter_key(self.model), adapters)
        except RuntimeError:  # inference tensors (a model built under inference_mode) have no counter
            return None

    @property
    def weights_version(self) -> tuple | None:
        """The parameter versions the fused weights were built from (None: not tracked, e.g. inference
        tensors); a KV computed under one version is reusable only while it holds."""
        return self._version

    def refresh(self, rows: int | None = None) -> None:
        """Re-fuse the projection weights if any parameter changed since the last call.

        ``rows``: the batch about to be decoded. With automatic packing and at most
        ``GEMV_ROWS`` rows, nothing is packed or stacked (every product then runs F.linear on
        the model's own weights, the fastest at that size), which saves the copy of every
        weight a packing costs (~0.4 s for SmolLM2 on one core); a later, larger batch packs."""
        version = self._weights_version()
        small = self.pack is None and rows is not None and rows <= GEMV_ROWS
        stale = version is None or version != self._version
        repack = self._unpacked_for_small and not small and rows is not None
        if stale or repack:
            pack = "parts" if small else self.pack
            # Only the parts whose parameters changed are rebuilt: an RL step trains the last few layers, and
            # re-fusing the frozen ones and the LM head (a 49k x 576 copy and repack for SmolLM2) cost ~0.3 s a step.
            keep = (  # the same packing and adapters as the parts built before
                version is not None
                and self._version is not None
                and version[1] == self._version[1]
                and small == self._unpacked_for_small  # a repack changes this too
            )
            layer_keys = [_parameter_key(layer) for layer in self.inner.layers]
            head_key = _parameter_key(self.causal_lm.lm_head)
            self._layers = [
                self._layers[i] if keep and key == self._layer_keys[i] else LayerWeights(layer, pack, self.dtype)
                for i, (layer, key) in enumerate(zip(self.inner.layers, layer_keys))
            ]
            if not (keep and head_key == self._head_key):
                self._lm_head = PackedLinear([effective_weight(self.causal_lm.lm_head)], pack, self.dtype)
            self._layer_keys, self._head_key = layer_keys, head_key
            self._version = version
            self._unpacked_for_small = small

    # -- cache -----------------------------------------------------------------------------
    def _rope(self, positions: torch.Tensor, max_position: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [B, L, D] of ``positions`` (all <= ``max_position``), looked up in tables the
        model's own ``rotary_emb`` computed once for positions 0..n-1 (it multiplies each position by
        each inverse frequency, a single rounding, so an entry equals a direct call's up to the last
        bit of cos / sin); the sign of rotate_half is folded into the sin table (see ``_apply_rope``)."""
        weight = self.inner.embed_tokens.weight
        cos_table, sin_table = self._rope_cos, self._rope_sin
        if (
            cos_table is None
            or sin_table is None
            or cos_table.shape[0] <= max_position
            or cos_table.device != weight.device
            or cos_table.dtype != weight.dtype
        ):
            size = max(2 * max_position + 2, 1024)
            # rotary_emb reads only the dtype and device of its first argument.
            cos, sin = self.inner.rotary_emb(weight, torch.arange(size, device=weight.device)[None])
            half = cos.shape[-1] // 2
            cos_table, sin_table = cos[0], torch.cat([-sin[0, :, :half], sin[0, :, half:]], dim=-1)
            self._rope_cos, self._rope_sin = cos_table, sin_table
        return cos_table[positions], sin_table[positions]

    def prefill(
        self,
        ids: torch.Tensor,
        attention_mask: torch.Tensor,
        capacity: int,
        prefixes: list[tuple[torch.Tensor, torch.Tensor] | None] | None = None,
    ) -> torch.Tensor:
        """Run the left-padded prompts ``ids`` [B, L]; allocate a cache of ``capacity`` columns.

        ``prefixes`` (optional, one entry per row): the (keys, values) of tokens that come
        *before* the row's ``ids``, each ``[layers, kv_heads, n, head_dim]`` as returned by
        ``row_cache`` (rope already applied), or None. Only ``ids`` are computed; the row's
        positions continue after its prefix. This is how a multi-turn rollout's next turn
        skips re-reading its history.

        Without prefixes, identical rows (a GRPO group samples G rollouts of one prompt)
        are computed once and their cache rows copied.
        Returns the last position's logits [B, V] in fp32.
        """
        if ids.dim() != 2 or ids.shape != attention_mask.shape:
            raise ValueError(
                f"ids {tuple(ids.shape)} and attention_mask {tuple(attention_mask.shape)} must be equal [B, L]"
            )
        length = ids.shape[1]
        self.refresh(rows=len(ids))  # the rows that will be decoded (before identical prompts are merged)
        if prefixes is not None:
            if len(prefixes) != len(ids):
                raise ValueError(f"{len(prefixes)} prefixes for {len(ids)} rows")
            if all(p is None for p in prefixes):
                prefixes = None
        prefix_width = max((p[0].shape[2] for p in prefixes if p is not None), default=0) if prefixes else 0
        if capacity < prefix_width + length:
            raise ValueError(f"capacity {capacity} < prefix {prefix_width} + prompt width {length}")
        if prefixes is not None:
            return self._prefill_rows(ids, attention_mask, capacity, prefixes, prefix_width)
        unique, inverse = torch.unique(
            torch.cat([ids, attention_mask.to(ids.dtype)], dim=1), dim=0, return_inverse=True
        )
        if len(unique) == len(ids):
            return self._prefill_rows(ids, attention_mask, capacity, None, 0)
        logits = self._prefill_rows(unique[:, :length], unique[:, length:], capacity, None, 0)
        self.select(inverse)
        return logits[inverse]

    def _prefill_rows(self, ids, attention_mask, capacity: int, prefixes, prefix_width: int) -> torch.Tensor:
        """Cache layout per row: its prefix right-aligned in columns [0, P), its new
        tokens left-padded in [P, P + L); everything else is masked out."""
        batch, length = ids.shape
        weight = self.inner.embed_tokens.weight
        shape = (len(self._layers), batch, self.num_kv_heads, capacity, self.head_dim)
        self.k_cache = torch.zeros(shape, dtype=self.dtype, device=weight.device)
        self.v_cache = torch.zeros(shape, dtype=self.dtype, device=weight.device)
        self.valid = torch.zeros((batch, capacity), dtype=torch.bool, device=weight.device)
        start = torch.zeros(batch, dtype=torch.long, device=ids.device)  # tokens before ids, per row
        for row, prefix in enumerate(prefixes or ()):
            if prefix is None:
                continue
            keys, values = prefix
            n = keys.shape[2]
            self.k_cache[:, row, :, prefix_width - n : prefix_width] = keys
            self.v_cache[:, row, :, prefix_width - n : prefix_width] = values
            self.valid[row, prefix_width - n : prefix_width] = True
            start[row] = n
        real = attention_mask.bool()
        self.valid[:, prefix_width : prefix_width + length] = real
        # Additive attention bias over the cache columns for decode: 0 on real tokens, -inf elsewhere;
        # each decode step opens one column for every row.
        self.bias = torch.zeros((batch, capacity), dtype=self.dtype, device=weight.device)
        self.bias.masked_fill_(~self.valid, float("-inf"))
        self.length = prefix_width + length
        self.next_position = start + attention_mask.long().sum(-1)  # positions follow the real tokens
        positions = start[:, None] + (attention_mask.long().cumsum(-1) - 1).clamp(min=0)
        self._max_position = int(self.next_position.max())  # the next decode step's largest position
        cos, sin = self._rope(positions, self._max_position + capacity - self.length)
        # Causal over real keys; every position may also see itself so pad rows never softmax
        # over nothing (their outputs are unused, but a NaN would leak into later layers' K/V).
        causal = torch.ones(length, length, dtype=torch.bool, device=ids.device).tril()
        allowed = (causal[None] & real[:, None, :]) | torch.eye(length, dtype=torch.bool, device=ids.device)[None]
        if prefix_width:
            allowed = torch.cat(
                [self.valid[:, None, :prefix_width].expand(batch, length, prefix_width), allowed], dim=-1
            )
        # [B, 1, L, P + L] additive: SDPA on CPU runs a float mask ~1.4x faster than a boolean one.
        mask = torch.zeros(allowed.shape, dtype=self.dtype, device=ids.device)
        mask = mask.masked_fill_(~allowed, float("-inf"))[:, None]
        hidden = self.inner.embed_tokens(ids)
        last = len(self._layers) - 1
        capture = self.capture_layer if self.capture_layer is not None and self.capture_layer <= last else None
        h_cache = self.h_cache = (
            torch.zeros((batch, capacity, hidden.shape[-1]), dtype=torch.float32, device=weight.device)
            if capture is not None
            else None
        )
        step = self.prefill_chunk_rows or batch
        with _own_dtypes():
            logits = []
            for start_row in range(0, batch, step):  # rows are independent: a chunk runs every layer in turn
                rows = slice(start_row, start_row + step)
                chunk = hidden[rows]
                for index, layer in enumerate(self._layers):
                    if h_cache is not None and index == capture:  # the new tokens' states; a prefix's stay 0
                        h_cache[rows, prefix_width : prefix_width + length] = chunk
                    chunk = self._layer_prefill(
                        index, layer, chunk, cos[rows], sin[rows], mask[rows], prefix_width, index == last, rows
                    )
                logits.append(self._logits(chunk[:, -1]))
            return logits[0] if len(logits) == 1 else torch.cat(logits)

    def _layer_prefill(
        self, index, layer: LayerWeights, hidden, cos, sin, mask, prefix_width: int, last_only: bool, rows: slice
    ):
        """One layer over all prompt positions, writing their K/V to the cache. ``last_only``
        (the last layer): only the last position's output is needed (the logits read nothing
        else), so attention, o_proj and the MLP run for it alone; every position's K/V is
        still computed and cached. Rows are independent, so the numbers are the same. ``rows``: the cache rows
        of ``hidden``'s batch."""
        batch, length, _ = hidden.shape
        q, k, v = self._qkv(layer, hidden, cos, sin)  # [B, heads, L, D], in the cache's dtype
        end = prefix_width + length
        self.k_cache[index, rows, :, prefix_width:end] = k
        self.v_cache[index, rows, :, prefix_width:end] = v
        if prefix_width:
            k, v = self.k_cache[index, rows, :, :end], self.v_cache[index, rows, :, :end]
        if last_only:
            q, mask, hidden = q[:, :, -1:], mask[:, :, -1:], hidden[:, -1:]
            length = 1
        attn = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=self.scale, enable_gqa=self.groups > 1)
        attn = attn.transpose(1, 2).reshape(batch, length, self.num_heads * self.head_dim)
        return self._finish_layer(layer, hidden, attn)

    def row_cache(self, row: int, num_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Copies of row ``row``'s first ``num_tokens`` cached keys and values, each
        ``[layers, kv_heads, num_tokens, head_dim]``: a prefix for a later ``prefill``."""
        columns = self.valid[row, : self.length].nonzero().squeeze(-1)
        if len(columns) < num_tokens:
            raise ValueError(f"row {row} has {len(columns)} cached tokens, asked for {num_tokens}")
        columns = columns[:num_tokens]
        return self.k_cache[:, row].index_select(2, columns), self.v_cache[:, row].index_select(2, columns)

    def row_hidden(self, row: int, num_tokens: int) -> torch.Tensor:
        """Row ``row``'s captured states [num_tokens, H] (``capture_layer``) of its first ``num_tokens``
        cached tokens, in the order of ``row_cache``; the columns of a prefix given to ``prefill`` are 0."""
        if self.h_cache is None:
            raise ValueError("no hidden states were captured: set capture_layer before prefill")
        columns = self.valid[row, : self.length].nonzero().squeeze(-1)
        if len(columns) < num_tokens:
            raise ValueError(f"row {row} has {len(columns)} cached tokens, asked for {num_tokens}")
        return self.h_cache[row].index_select(0, columns[:num_tokens])

    def _qkv(self, layer: LayerWeights, hidden, cos, sin):
        """Q, K (rope applied) and V, each [B, heads, L, D]; ``sin`` is the signed table of ``_rope``."""
        batch, length, _ = hidden.shape
        normed = _rms_norm(hidden, layer.norm1_w, layer.norm1_eps)
        heads, kv_heads = self.num_heads, self.num_kv_heads
        qkv = layer.qkv(normed).view(batch, length, heads + 2 * kv_heads, self.head_dim)
        # Q and K heads rotated together: [B, L, heads + kv, D] with cos / sin [B, L, 1, D].
        qk = _apply_rope(qkv[:, :, : heads + kv_heads], cos[:, :, None], sin[:, :, None])
        if self.dtype != qk.dtype:
            qk, qkv = qk.to(self.dtype), qkv.to(self.dtype)
        q = qk[:, :, :heads].transpose(1, 2)
        k = qk[:, :, heads:].transpose(1, 2)
        v = qkv[:, :, heads + kv_heads :].transpose(1, 2)
        return q, k, v

    def _finish_layer(self, layer: LayerWeights, hidden, attn):
        hidden = layer.o.add_to(hidden, attn)
        normed = _rms_norm(hidden, layer.norm2_w, layer.norm2_eps)
        gate_up = layer.gate_up(normed, fp32_out=False)  # bf16 weights: the activation stays bf16
        gate, up = gate_up[..., : layer.intermediate], gate_up[..., layer.intermediate :]
        return layer.down.add_to(hidden, F.silu(gate).mul_(up))  # silu(gate) is contiguous, as the GEMM wants

    def _logits(self, hidden_last: torch.Tensor) -> torch.Tensor:
        final = self.inner.norm
        hidden_last = _rms_norm(hidden_last, final.weight, norm_eps(final))
        return self._lm_head(hidden_last).float()

    def decode(self, tokens: torch.Tensor) -> torch.Tensor:
        """Append one token per row (``tokens`` [B]) and return the next logits [B, V]."""
        batch = tokens.shape[0]
        if tokens.dim() != 1 or batch != self.k_cache.shape[1]:
            raise ValueError(f"tokens must be [B={self.k_cache.shape[1]}], got {tuple(tokens.shape)}")
        column = self.length
        if column >= self.k_cache.shape[3]:
            raise ValueError(f"KV cache full ({column} columns): prefill with a larger capacity")
        self.valid[:, column] = True
        self.bias[:, column] = 0.0
        self.length = column + 1
        positions = self.next_position[:, None]
        self.next_position = self.next_position + 1
        cos, sin = self._rope(positions, self._max_position)
        self._max_position += 1
        bias = self.bias[:, None, None, : self.length]  # [B, 1, 1, T]: 0 on real tokens, -inf on padding
        hidden = self.inner.embed_tokens(tokens[:, None])  # [B, 1, H]
        with _own_dtypes():
            return self._decode_layers(hidden, cos, sin, bias, column, batch)

    def _decode_layers(self, hidden, cos, sin, bias, column: int, batch: int) -> torch.Tensor:
        for index, layer in enumerate(self._layers):
            if index == self.capture_layer and self.h_cache is not None:
                self.h_cache[:, column] = hidden[:, 0]
            q, k, v = self._qkv(layer, hidden, cos, sin)  # q [B, heads, 1, D]
            self.k_cache[index, :, :, column] = k[:, :, 0]
            self.v_cache[index, :, :, column] = v[:, :, 0]
            keys = self.k_cache[index, :, :, : self.length]  # [B, kv, T, D]
            values = self.v_cache[index, :, :, : self.length]
            # The G query heads sharing a K/V head are that head's G "query positions" (a view:
            # heads are grouped consecutively, as repeat_interleave lays them out), so SDPA reads
            # each K/V head in place once for its G queries: no repetition, and in isolation 1.2-2x
            # faster on CPU than SDPA's enable_gqa, which walks K/V once per query head (in a whole
            # step the reads of the cache from memory dominate either way).
            grouped = q.view(batch, self.num_kv_heads, self.groups, self.head_dim)
            attn = F.scaled_dot_product_attention(grouped, keys, values, attn_mask=bias, scale=self.scale)
            hidden = self._finish_layer(layer, hidden, attn.reshape(batch, 1, self.num_heads * self.head_dim))
        return self._logits(hidden[:, 0])

    def select(self, rows: torch.Tensor) -> None:
        """Keep only batch ``rows`` (an index tensor) of the cache and positions."""
        self.k_cache = self.k_cache.index_select(1, rows)
        self.v_cache = self.v_cache.index_select(1, rows)
        self.valid = self.valid.index_select(0, rows)
        self.bias = self.bias.index_select(0, rows)
        self.next_position = self.next_position.index_select(0, rows)
        if self.h_cache is not None:
            self.h_cache = self.h_cache.index_select(0, rows)
