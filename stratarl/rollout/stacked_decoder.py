"""Prefill and one-token decode steps of K members' rows at once, each row on its member's own weights.

``FastDecoder`` (stratarl.rollout.fast_forward) decodes one model's batch over a preallocated KV cache. A
population (stratarl.trainer.population) samples K runs' rollouts at the same time; here their K batches
share one cache ``[layers, K, B, kv_heads, capacity, head_dim]`` (B: the largest member batch, smaller ones
padded with rows that compute nothing anyone reads) and every projection is one batched matmul over the K
members' stacked weights (stratarl.infra.stacked). The layout per member row is ``FastDecoder``'s: a
reused prefix right-aligned in columns [0, P), the new tokens left-padded in [P, P + L), decode columns
after; positions follow each row's real tokens, so a row's numbers are the ones ``FastDecoder`` computes
for it alone, up to float rounding (other kernels, more masked columns).

``member_view(k)`` is member k's side of it, with what the prefix cache (stratarl.rollout.prefix_cache)
reads of a ``FastDecoder``: ``k_cache``, ``h_cache``, ``weights_version``, ``refresh`` and ``row_cache``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

from stratarl.infra.stacked import StackedParams, finish_layer, project, qkv, rms_norm, rope_tables, weights_version

_LAYER_FIELDS = ("norm1", "qkv", "o", "norm2", "gate_up", "down")


class StackedDecoder:
    """The decoder of K members (``models``, one architecture) over one stacked KV cache.

    Members are named by their index in ``models``; members that finished leave (``select``), the others
    keep their cache rows."""

    @torch.no_grad()
    def __init__(self, models: Sequence[torch.nn.Module]) -> None:
        self.stack = StackedParams(list(models))
        fused = self.stack.fused()  # contiguous copies: bmm reads them fastest
        layers = [type(layer)(**{f: getattr(layer, f).contiguous() for f in _LAYER_FIELDS}) for layer in fused.layers]
        self.weights = type(fused)(fused.embed, layers, fused.norm, fused.head, fused.head_t.contiguous())
        self.versions = [weights_version(m) for m in models]
        self.slots = list(range(len(models)))  # slot -> member
        self.rows = [0] * len(models)  # member -> its live rows (slot's rows 0..n-1)

    # ------------------------------------------------------------------ layout

    def _slot(self, member: int) -> int:
        return self.slots.index(member)

    def _embed(self, ids: torch.Tensor) -> torch.Tensor:
        """Embeddings [K', B, L, H] of ids [K', B, L], member slot k's rows from its own table."""
        embed = self._members_weights().embed
        K, V = embed.shape[:2]
        offsets = (torch.arange(K, device=ids.device) * V).view(K, *([1] * (ids.dim() - 1)))
        return embed.reshape(K * V, -1)[(ids + offsets).reshape(-1)].view(*ids.shape, -1)

    def _members_weights(self):
        """The fused weights of the members still in the cache, in slot order."""
        if len(self.slots) == self.stack.size:
            return self.weights
        return self._active

    # ------------------------------------------------------------------ prefill / decode

    @torch.no_grad()
    def prefill(
        self,
        ids: Sequence[torch.Tensor],
        attention: Sequence[torch.Tensor],
        prefixes: Sequence[list | None],
        max_new: Sequence[int],
    ) -> list[torch.Tensor]:
        """Member k's left-padded rows ``ids[k]`` [B_k, L_k] with ``attention[k]``, after ``prefixes[k]`` (per
        row (keys, values) [layers, kv_heads, n, D] or None, as ``FastDecoder.prefill`` takes them, or None for
        none), with room for ``max_new[k]`` decode steps. Returns each member's last-position logits [B_k, V]."""
        K = self.stack.size
        device = self.weights.embed.device
        B = max(x.shape[0] for x in ids)
        L = max(x.shape[1] for x in ids)
        widths = [max((p[0].shape[2] for p in pre if p is not None), default=0) if pre else 0 for pre in prefixes]
        P = max(widths)
        capacity = P + L + max(max_new)
        layers, kv, D = self.stack.num_layers, self.stack.kv_heads, self.stack.head_dim
        all_ids = torch.zeros((K, B, L), dtype=torch.long, device=device)
        real = torch.zeros((K, B, L), dtype=torch.bool, device=device)
        self.k_cache = torch.zeros((layers, K, B, kv, capacity, D), device=device)
        self.v_cache = torch.zeros_like(self.k_cache)
        self.valid = torch.zeros((K, B, capacity), dtype=torch.bool, device=device)
        start = torch.zeros((K, B), dtype=torch.long, device=device)
        for k, (x, mask, pre) in enumerate(zip(ids, attention, prefixes)):
            rows, width = x.shape
            all_ids[k, :rows, L - width :] = x
            real[k, :rows, L - width :] = mask.bool()
            self.rows[k] = rows
            for row, prefix in enumerate(pre or ()):
                if prefix is None:
                    continue
                keys, values = prefix
                n = keys.shape[2]
                self.k_cache[:, k, row, :, P - n : P] = keys
                self.v_cache[:, k, row, :, P - n : P] = values
                self.valid[k, row, P - n : P] = True
                start[k, row] = n
        self.valid[:, :, P : P + L] = real
        self.bias = torch.zeros((K, B, capacity), device=device).masked_fill_(~self.valid, float("-inf"))
        self.length = P + L
        self.next_position = start + real.long().sum(-1)
        positions = start[..., None] + (real.long().cumsum(-1) - 1).clamp(min=0)
        hidden = self._embed(all_ids)
        cos, sin = rope_tables(self.stack, positions, hidden)
        causal = torch.ones(L, L, dtype=torch.bool, device=device).tril()
        allowed = (causal & real[:, :, None, :]) | torch.eye(L, dtype=torch.bool, device=device)
        if P:
            allowed = torch.cat([self.valid[:, :, None, :P].expand(K, B, L, P), allowed], dim=-1)
        mask = torch.zeros(allowed.shape, device=device).masked_fill_(~allowed, float("-inf")).view(K * B, 1, L, P + L)
        weights, stack, last = self.weights, self.stack, self.stack.num_layers - 1
        for index, layer in enumerate(weights.layers):
            q, key, value = qkv(stack, layer, hidden, cos, sin, stack.eps1[index])  # [K, B, heads, L, D]
            self.k_cache[index, :, :, :, P : P + L] = key
            self.v_cache[index, :, :, :, P : P + L] = value
            keys, values = self.k_cache[index, :, :, :, : P + L], self.v_cache[index, :, :, :, : P + L]
            layer_mask, queries = mask, L
            if index == last:  # only the last position's output is read (its logits)
                q, layer_mask, hidden, queries = q[..., -1:, :], mask[:, :, -1:], hidden[:, :, -1:], 1
            attn = F.scaled_dot_product_attention(
                q.reshape(K * B, stack.heads, queries, D),
                keys.reshape(K * B, kv, P + L, D),
                values.reshape(K * B, kv, P + L, D),
                attn_mask=layer_mask,
                scale=stack.scale,
                enable_gqa=kv != stack.heads,
            )
            attn = attn.view(K, B, stack.heads, queries, D).transpose(2, 3).reshape(K, B, queries, -1)
            hidden = finish_layer(layer, hidden, attn, stack.eps2[index])
        logits = self._logits(hidden[:, :, -1])
        return [logits[k, : self.rows[k]] for k in range(K)]

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        weights = self._members_weights()
        return project(rms_norm(hidden, weights.norm, self.stack.eps), weights.head_t).float()

    @torch.no_grad()
    def decode(self, tokens: dict[int, torch.Tensor]) -> dict[int, torch.Tensor]:
        """Append one token per live row of each member still in the cache (``tokens[member]`` [rows]); returns
        each member's next logits [rows, V]."""
        K, B = len(self.slots), self.k_cache.shape[2]
        device = self.k_cache.device
        column = self.length
        if column >= self.k_cache.shape[4]:
            raise ValueError(f"KV cache full ({column} columns)")
        all_tokens = torch.zeros((K, B), dtype=torch.long, device=device)
        for slot, member in enumerate(self.slots):
            all_tokens[slot, : self.rows[member]] = tokens[member]
        self.valid[:, :, column] = True
        self.bias[:, :, column] = 0.0
        self.length = column + 1
        positions = self.next_position[..., None]
        self.next_position = self.next_position + 1
        hidden = self._embed(all_tokens[..., None])  # [K, B, 1, H]
        cos, sin = rope_tables(self.stack, positions, hidden)
        bias = self.bias[:, :, : self.length].reshape(K * B, 1, 1, self.length)
        weights, stack = self._members_weights(), self.stack
        kv, D, groups = stack.kv_heads, stack.head_dim, stack.heads // stack.kv_heads
        for index, layer in enumerate(weights.layers):
            q, key, value = qkv(stack, layer, hidden, cos, sin, stack.eps1[index])  # [K, B, heads, 1, D]
            self.k_cache[index, :, :, :, column] = key[..., 0, :]
            self.v_cache[index, :, :, :, column] = value[..., 0, :]
            keys = self.k_cache[index, :, :, :, : self.length].reshape(K * B, kv, self.length, D)
            values = self.v_cache[index, :, :, :, : self.length].reshape(K * B, kv, self.length, D)
            # A K/V head's query heads are its "query positions" (as FastDecoder does): no repetition of K/V.
            attn = F.scaled_dot_product_attention(
                q.reshape(K * B, kv, groups, D), keys, values, attn_mask=bias, scale=stack.scale
            )
            hidden = finish_layer(layer, hidden, attn.reshape(K, B, 1, -1), stack.eps2[index])
        logits = self._logits(hidden[:, :, 0])
        return {member: logits[slot, : self.rows[member]] for slot, member in enumerate(self.slots)}

    @torch.no_grad()
    def select(self, keep: dict[int, torch.Tensor | None]) -> None:
        """Keep, of each member in ``keep``, only its rows ``keep[member]`` (None: all of them); members not in
        ``keep`` leave the cache."""
        members = [m for m in self.slots if m in keep]
        if members == self.slots and all(keep[m] is None for m in members):
            return
        rows = {m: (torch.arange(self.rows[m]) if (kept := keep[m]) is None else kept.cpu()) for m in members}
        B_old = self.k_cache.shape[2]
        B = max(len(r) for r in rows.values())
        index = []
        for m in members:  # pad a member's rows with copies of its first: computed, never read
            r = rows[m]
            index.append(self._slot(m) * B_old + torch.cat([r, r[:1].expand(B - len(r))]))
            self.rows[m] = len(r)
        flat = torch.cat(index).to(self.k_cache.device)
        layers, K, _, kv, C, D = self.k_cache.shape
        flat_shape, shape = (layers, K * B_old, kv, C, D), (layers, -1, B, kv, C, D)
        self.k_cache = self.k_cache.view(flat_shape).index_select(1, flat).view(shape)
        self.v_cache = self.v_cache.view(flat_shape).index_select(1, flat).view(shape)
        self.valid = self.valid.view(K * B_old, C).index_select(0, flat).view(-1, B, C)
        self.bias = self.bias.view(K * B_old, C).index_select(0, flat).view(-1, B, C)
        self.next_position = self.next_position.view(K * B_old).index_select(0, flat).view(-1, B)
        if members != self.slots:
            self.slots = members
            chosen = torch.tensor(members, device=self.k_cache.device)
            full = self.weights
            chosen_layers = [
                type(layer)(**{f: getattr(layer, f)[chosen] for f in _LAYER_FIELDS}) for layer in full.layers
            ]
            self._active = type(full)(
                full.embed[chosen], chosen_layers, full.norm[chosen], full.head[chosen], full.head_t[chosen]
            )

    def row_cache(self, member: int, row: int, num_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Copies of member's row ``row``'s first ``num_tokens`` cached keys and values, each
        ``[layers, kv_heads, num_tokens, head_dim]`` (``FastDecoder.row_cache``'s layout)."""
        slot = self._slot(member)
        columns = self.valid[slot, row, : self.length].nonzero().squeeze(-1)
        if len(columns) < num_tokens:
            raise ValueError(f"row {row} has {len(columns)} cached tokens, asked for {num_tokens}")
        columns = columns[:num_tokens]
        return self.k_cache[:, slot, row].index_select(2, columns), self.v_cache[:, slot, row].index_select(2, columns)

    def member_view(self, member: int) -> MemberView:
        return MemberView(self, member)


class MemberView:
    """Member ``member``'s side of a ``StackedDecoder``, as the prefix cache reads a ``FastDecoder``
    (``RowCollector``, ``reusable_prefixes``): its cache rows, its weights' version, its rows' K/V."""

    h_cache = None  # a population's generator does not capture hidden states (supports_capture is False)

    def __init__(self, decoder: StackedDecoder | None, member: int, version: tuple | None = None) -> None:
        self.decoder = decoder
        self.member = member
        self._version = version if decoder is None else decoder.versions[member]

    def _stacked(self) -> StackedDecoder:
        if self.decoder is None:
            raise RuntimeError(f"member {self.member}'s view holds only its weights' version, no cache")
        return self.decoder

    @property
    def k_cache(self) -> torch.Tensor:
        """[layers, B, kv_heads, capacity, D]: the member's slot of the stacked cache."""
        decoder = self._stacked()
        return decoder.k_cache[:, decoder._slot(self.member)]

    @property
    def weights_version(self) -> tuple | None:
        return self._version

    def refresh(self) -> None:
        """Nothing to re-fuse: the stacked weights were taken from the models when the decoder was built."""

    def row_cache(self, row: int, num_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self._stacked().row_cache(self.member, row, num_tokens)
