"""Compose and validate a recipe with veRL's own config loader, then stop before any worker starts.

    python -m stratarl.integrations.verl.dry_run --config-dir recipes/verl --config-name stratified_grpo [overrides…]
    bash recipes/verl/run.sh --dry-run stratified_grpo [overrides…]      (the same, through the launcher)

Runs what ``verl.trainer.main_ppo`` runs before it starts Ray: Hydra composes the recipe over veRL's
``ppo_trainer.yaml`` (an unknown key is an error there), then veRL's ``validate_config`` (batch sizes
against GPU counts, the actor config as veRL's dataclasses). On top it converts the algorithm, the
rollout and its multi-turn block to veRL's dataclasses (stratarl's settings and guards included),
loads the function tools from ``multi_turn.function_tool_path`` and the custom reward function, and
checks that the agent loop is registered. Prints the composed settings that matter for a run, one
``key: value`` a line; exit status 0 when everything validated. Needs no GPU, model or data.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def compose_recipe(config_dir: Path, config_name: str, overrides: list[str]):
    """The recipe's DictConfig as veRL's ``main_ppo`` would receive it (Hydra compose, same search path)."""
    from hydra import compose, initialize_config_dir  # veRL: only in .venv-verl

    with initialize_config_dir(config_dir=str(config_dir.resolve()), version_base=None):
        return compose(config_name=config_name, overrides=list(overrides))


def validate_recipe(cfg) -> dict[str, object]:
    """veRL's validation + stratarl's, as far as a CPU can; returns the summary printed by :func:`main`."""
    import verl.experimental.agent_loop  # noqa: F401  (registers single_turn_agent / tool_agent)
    from verl.experimental.agent_loop.agent_loop import _agent_loop_registry  # veRL: only in .venv-verl
    from verl.tools.function_tool import load_function_tools_from_path  # veRL: only in .venv-verl
    from verl.trainer.ppo.core_algos import get_adv_estimator_fn, get_policy_loss_fn  # veRL: only in .venv-verl
    from verl.trainer.ppo.reward import get_custom_reward_fn  # veRL: only in .venv-verl
    from verl.trainer.ppo.utils import need_critic, need_reference_policy  # veRL: only in .venv-verl
    from verl.utils.config import omega_conf_to_dataclass, validate_config  # veRL: only in .venv-verl

    import stratarl.integrations.verl  # noqa: F401  (registers the estimator, losses, worker)

    validate_config(cfg, use_reference_policy=need_reference_policy(cfg), use_critic=need_critic(cfg))
    algorithm = omega_conf_to_dataclass(cfg.algorithm)
    actor = omega_conf_to_dataclass(cfg.actor_rollout_ref.actor)
    rollout = omega_conf_to_dataclass(cfg.actor_rollout_ref.rollout)
    get_adv_estimator_fn(algorithm.adv_estimator)
    get_policy_loss_fn(actor.policy_loss.loss_mode)
    multi_turn = rollout.multi_turn
    tools = []
    if multi_turn.function_tool_path:
        tools = [tool.name for tool in load_function_tools_from_path(multi_turn.function_tool_path)]
        if not tools:
            raise ValueError(f"multi_turn.function_tool_path {multi_turn.function_tool_path}: no @function_tool found")
    agent_loop = cfg.actor_rollout_ref.rollout.agent.default_agent_loop
    if agent_loop not in _agent_loop_registry:
        raise ValueError(
            f"rollout.agent.default_agent_loop={agent_loop!r} is not a registered agent loop; "
            f"registered: {sorted(_agent_loop_registry)}"
        )
    if get_custom_reward_fn(cfg) is None:
        raise ValueError("reward.custom_reward_function.path is not set; the recipes score with recipes/verl/reward.py")
    use_v1 = bool(cfg.trainer.get("use_v1", False))
    mode = cfg.trainer.v1.trainer_mode if use_v1 else None
    return {
        "trainer": f"v1 (trainer.use_v1=true, trainer.v1.trainer_mode={mode})"
        if use_v1
        else "legacy RayPPOTrainer (trainer.use_v1=false, deprecated by veRL)",
        "algorithm.adv_estimator": algorithm.adv_estimator,
        "actor.policy_loss.loss_mode": actor.policy_loss.loss_mode,
        "rollout.name": rollout.name,
        "rollout.agent.default_agent_loop": agent_loop,
        "rollout.multi_turn.format": multi_turn.format,
        "rollout.multi_turn.tools": ",".join(tools),
        "rollout.multi_turn.max_assistant_turns": multi_turn.max_assistant_turns,
        "rollout.multi_turn.max_tool_response_length (characters)": multi_turn.max_tool_response_length,
        "rollout.n": rollout.n,
        "data.train_batch_size": cfg.data.train_batch_size,
        "actor.ppo_mini_batch_size": cfg.actor_rollout_ref.actor.ppo_mini_batch_size,
        "data.max_prompt_length": cfg.data.max_prompt_length,
        "data.max_response_length": cfg.data.max_response_length,
        "model.path": cfg.actor_rollout_ref.model.path,
        "trainer.n_gpus_per_node": cfg.trainer.n_gpus_per_node,
        "trainer.nnodes": cfg.trainer.nnodes,
    }


def root_cause(error: BaseException) -> str:
    """The innermost exception of a chain (Hydra wraps a dataclass's ValueError), as one line."""
    while (inner := error.__cause__ or (None if error.__suppress_context__ else error.__context__)) is not None:
        error = inner
    lines = str(error).strip().splitlines()
    return f"{type(error).__name__}: {lines[0] if lines else ''}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config-dir", type=Path, required=True, help="folder of the recipe yaml (recipes/verl)")
    parser.add_argument("--config-name", required=True, help="recipe name, e.g. stratified_grpo")
    parser.add_argument("overrides", nargs="*", help="Hydra overrides, as for main_ppo")
    args = parser.parse_args(argv)
    try:
        summary = validate_recipe(compose_recipe(args.config_dir, args.config_name, args.overrides))
    except Exception as error:  # noqa: BLE001  Hydra and veRL raise many types; one line: what failed and why
        print(f"dry run: {args.config_name}: {root_cause(error)}", file=sys.stderr)
        return 1
    for key, value in summary.items():
        print(f"{key}: {value}")
    print(f"dry run: {args.config_name} composed and validated; no worker started")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
