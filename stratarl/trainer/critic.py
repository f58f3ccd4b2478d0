"""The critic of PPO / SO-PPO: a scalar value head on the policy's own hidden states.

Why this design (and not a separate value model): on a CPU the forward and
backward passes of the policy dominate a step. A head on the hidden states the
policy pass already computes (``response_logprobs(..., return_hidden=True)``)
costs one [H x 1] matmul per token: no second model, no second forward. By
default the head reads *detached* hidden states (``algo.critic_detach``), so the
value loss never moves the policy and SORL's normalisation sees the policy
gradient alone; set it to false to let the value loss shape the shared trunk too
(the classic shared-backbone PPO).

V(s_t) for response token t is read from the hidden state that predicts token t,
i.e. the state after everything before t: exactly the GAE state s_t.
"""

from __future__ import annotations

import torch
from torch import nn


class ValueHead(nn.Module):
    """h [.., H] -> V [..]: one linear layer, zero-initialised (V = 0 at the start)."""

    def __init__(self, hidden_size: int) -> None:
        super().__init__()
        self.linear = nn.Linear(hidden_size, 1)
        nn.init.zeros_(self.linear.weight)
        nn.init.zeros_(self.linear.bias)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        # fp32 even inside a bf16 autocast region (values and their loss stay fp32).
        with torch.autocast(device_type=hidden.device.type, enabled=False):
            return self.linear(hidden.float()).squeeze(-1)


def response_values(
    head: ValueHead, hidden: torch.Tensor, response_mask: torch.Tensor, *, detach: bool = True
) -> torch.Tensor:
    """Values [B, T] of the states before each response token; 0 off ``response_mask``.

    hidden [B, T, H] (from ``response_logprobs(..., return_hidden=True)``), response_mask [B, T].
    """
    if hidden.dim() != 3 or hidden.shape[:2] != response_mask.shape:
        raise ValueError(
            f"expected hidden [B, T, H] matching response_mask [B, T], got {tuple(hidden.shape)} "
            f"and {tuple(response_mask.shape)}"
        )
    values = head(hidden.detach() if detach else hidden)
    return values * response_mask.to(values.dtype)


def hidden_size_of(model: nn.Module) -> int:
    config = getattr(model, "config", None)
    size = getattr(config, "hidden_size", None)
    if size is None:
        raise ValueError("cannot find config.hidden_size on the policy model; the value head needs it")
    return int(size)
