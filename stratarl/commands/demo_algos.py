"""`stratarl demo-algos`: the algorithm core end to end on hand-made rollouts, in a few seconds.

(`stratarl demo` is the trainer's main job, in commands/demo.py.)

1. Two prompt groups of rollouts with different numbers of search calls and 0/1 rewards. Their
   response masks are built turn by turn, and the strata (search counts) are read back from the
   masks alone, as a veRL hook would.
2. A table of GRPO vs Stratified GRPO advantages per rollout, with the cross-stratum bias
   ``mean_{B_k} R − mean R`` that GRPO silently adds to every rollout of stratum k.
3. A SORL step on a toy policy at three off-policy degrees: ‖C‖, the scale 1/max(‖C‖, δ) and
   the clip fraction, showing the normalisation switch on as the batch grows stale.
"""

from __future__ import annotations

import argparse

# (prompt group, number of searches, reward): group 0 rewards searching, group 1 is mixed.
ROLLOUTS = [
    (0, 0, 0.0), (0, 0, 0.0), (0, 1, 1.0), (0, 1, 0.0), (0, 2, 1.0), (0, 2, 1.0),
    (1, 0, 1.0), (1, 0, 0.0), (1, 0, 0.0), (1, 1, 1.0), (1, 3, 1.0), (1, 3, 0.0),
]  # fmt: skip
TURN_TOKENS, OBSERVATION_TOKENS = 3, 2


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "demo-algos",
        help="Show GRPO vs Stratified GRPO advantages and a SORL step on toy rollouts (seconds, CPU).",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--alpha",
        type=float,
        help="Stratified GRPO blend weight α (default: the paper's value, stratarl.algos.STRATIFIED_ALPHA)",
    )
    parser.add_argument("--delta", type=float, default=1.0, help="SORL threshold δ (default 1.0)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the toy SORL policy (default 0)")
    parser.set_defaults(func=run)


def build_response_mask(num_searches: list[int]):
    """One policy turn per search plus the answer turn, an observation block after each search."""
    import torch

    rows = []
    for searches in num_searches:
        row = []
        for _ in range(searches):
            row += [1] * TURN_TOKENS + [0] * OBSERVATION_TOKENS
        rows.append(row + [1] * TURN_TOKENS)
    length = max(len(r) for r in rows)
    return torch.tensor([r + [0] * (length - len(r)) for r in rows], dtype=torch.float32)


def advantage_table(alpha: float) -> str:
    import torch

    from stratarl.algos import cross_stratum_bias, grpo_advantages, search_counts, stratified_advantages

    groups = torch.tensor([g for g, _, _ in ROLLOUTS])
    rewards = torch.tensor([r for _, _, r in ROLLOUTS])
    mask = build_response_mask([s for _, s, _ in ROLLOUTS])
    strata = search_counts(mask)  # recovered from the mask alone
    grpo = grpo_advantages(rewards, groups)
    strat = stratified_advantages(rewards, groups, strata, alpha=alpha)
    bias = cross_stratum_bias(rewards, groups, strata)
    header = (
        f"{'group':>5} {'rollout':>7} {'searches':>8} {'reward':>6} {'GRPO':>8} "
        f"{'Stratified(α=' + format(alpha, 'g') + ')':>18} {'cross-stratum bias':>18}"
    )
    lines = [header]
    lines.extend(
        f"{int(groups[i]):>5} {i:>7} {int(strata[i]):>8} {float(rewards[i]):>6.1f} {float(grpo[i]):>+8.3f} "
        f"{float(strat[i]):>+18.3f} {float(bias[i]):>+18.3f}"
        for i in range(len(ROLLOUTS))
    )
    return "\n".join(lines)


def sorl_steps(delta: float, seed: int) -> str:
    import torch

    from stratarl.algos import ClipBiasNormalizer, broadcast_to_tokens, clipped_policy_loss, grpo_advantages

    vocab, width = 16, 32
    torch.manual_seed(seed)
    policy = torch.nn.Sequential(torch.nn.Embedding(vocab, width), torch.nn.Tanh(), torch.nn.Linear(width, vocab))

    def log_probs(model: torch.nn.Module, tokens: torch.Tensor) -> torch.Tensor:
        previous = torch.nn.functional.pad(tokens, (1, 0))[:, :-1]
        return torch.log_softmax(model(previous), dim=-1).gather(-1, tokens[..., None]).squeeze(-1)

    groups = torch.tensor([g for g, _, _ in ROLLOUTS])
    rewards = torch.tensor([r for _, _, r in ROLLOUTS])
    mask = build_response_mask([s for _, s, _ in ROLLOUTS])
    tokens = torch.randint(0, vocab, tuple(mask.shape))
    advantages = broadcast_to_tokens(grpo_advantages(rewards, groups), mask)
    lines = [f"{'old-policy noise':>16} {'clip_frac':>9} {'clip_frac_turn':>14} {'‖C‖':>8} {'scale':>7}"]
    for noise in (0.0, 0.1, 0.5, 1.0):
        # The behaviour policy = the current one plus noise: larger noise = a staler batch.
        old_policy = _noisy_copy(policy, noise, seed + 1)
        old = log_probs(old_policy, tokens).detach()
        normalizer = ClipBiasNormalizer(policy.parameters(), delta=delta)
        out = clipped_policy_loss(log_probs(policy, tokens), old, advantages, mask, level="turn")
        normalizer.backward(out.loss, out.clip_bias)
        metrics = normalizer.apply()
        policy.zero_grad()
        lines.append(
            f"{noise:>16.2f} {float(out.metrics['loss/clip_frac']):>9.3f} "
            f"{float(out.metrics['loss/clip_frac_turn']):>14.3f} {float(metrics['sorl/c_norm']):>8.4f} "
            f"{float(metrics['sorl/scale']):>7.3f}"
        )
    return "\n".join(lines)


def _noisy_copy(model, noise: float, seed: int):
    import copy

    import torch

    other = copy.deepcopy(model)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in other.parameters():
            param.add_(noise * torch.randn(param.shape, generator=generator))
    return other


def run(args: argparse.Namespace) -> int:
    import torch

    from stratarl.algos import STRATIFIED_ALPHA  # start-up cost: torch, only when the demo runs

    torch.set_num_threads(1)  # tiny tensors: threads only add overhead
    print("Stratified GRPO vs GRPO on hand-made rollouts (strata = search counts read from the masks)\n")
    print(advantage_table(STRATIFIED_ALPHA if args.alpha is None else args.alpha))
    print(
        "\nGRPO centres each reward on its group: R − mean R = (R − mean_stratum R) + cross-stratum bias,"
        "\nso a rollout is credited (or blamed) for its stratum's average reward, not only for its own."
        "\nStratified GRPO normalises inside each stratum (SAN) and blends α·SAN + (1−α)·GRPO.\n"
    )
    print(f"SORL step on a toy policy (turn-level ratios, δ = {args.delta:g}): scale = 1 / max(‖C‖, δ)\n")
    print(sorl_steps(args.delta, args.seed))
    return 0
