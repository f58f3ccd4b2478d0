"""The veRL versions stratarl's plugins are tested with, and the veRL hooks they rely on.

This is the one place that states the tested versions (docs/verl.md and requirements/verl.txt point
here). :func:`moved_hooks` looks up every veRL name the plugins, the CPU platform, the ``hf`` rollout and
the smoke runs use; :func:`require_hooks` raises one error naming the installed veRL version, the
tested ones and each hook that moved. The smokes (:mod:`.smoke`, :mod:`.smoke_multiturn`) call it
before starting ``main_ppo``, and ``tests/verl/test_verl_v1_trainer.py`` runs it on the installed veRL, so
an upgrade that moves a hook fails loudly there instead of training without the plugin.

Plain lookups (imports and attributes, a few signatures); nothing is patched.
"""

from __future__ import annotations

import importlib
import inspect
import sys
from collections.abc import Callable
from importlib import metadata

# The veRL releases the plugins and tests/verl were run against (requirements/verl.txt pins the newest).
TESTED_VERL_VERSIONS = ("0.9.1",)


def verl_version() -> str:
    """The installed veRL's version (``"not installed"`` when there is none)."""
    try:
        return metadata.version("verl")
    except metadata.PackageNotFoundError:
        return "not installed"


def _attr(module: str, *names: str) -> Callable[[], object]:
    def look_up() -> object:
        value: object = importlib.import_module(module)
        for name in names:
            value = getattr(value, name)
        return value

    return look_up


def _has_params(module: str, name: str, params: tuple[str, ...]) -> Callable[[], object]:
    def look_up() -> object:
        function = _attr(module, *name.split("."))()
        if not callable(function):
            raise TypeError(f"{module}.{name} is not callable")
        missing = [p for p in params if p not in inspect.signature(function).parameters]
        if missing:
            raise TypeError(f"no parameter(s) {missing}")
        return function

    return look_up


def _actor_worker_hook() -> object:
    from verl.workers.engine_workers import ActorRolloutRefWorker, TrainingWorker  # veRL: only in .venv-verl

    current = ActorRolloutRefWorker.actor_worker_cls  # AttributeError when the hook is gone
    if not (isinstance(current, type) and issubclass(current, TrainingWorker)):
        raise TypeError(f"actor_worker_cls is {current!r}, not a TrainingWorker subclass")
    return current


# (what the plugins use it for, how to look it up). Order: plugins, CPU platform / hf rollout, trainers.
HOOKS: list[tuple[str, Callable[[], object]]] = [
    (
        "register_adv_est (algorithm.adv_estimator=stratified_grpo)",
        _attr("verl.trainer.ppo.core_algos", "register_adv_est"),
    ),
    ("register_policy_loss (loss_mode=turn_ppo|sorl)", _attr("verl.trainer.ppo.core_algos", "register_policy_loss")),
    ("ActorRolloutRefWorker.actor_worker_cls (SORLTrainingWorker)", _actor_worker_hook),
    (
        "BaseEngine.forward_backward_batch / optimizer_zero_grad / optimizer_step (SORL's step)",
        lambda: [
            _attr("verl.workers.engine.base", "BaseEngine", n)()
            for n in ("forward_backward_batch", "optimizer_zero_grad", "optimizer_step", "is_mp_src_rank_with_outputs")
        ],
    ),
    ("verl.workers.utils.losses.ppo_loss (the actor loss SORL scales)", _attr("verl.workers.utils.losses", "ppo_loss")),
    ("no_padding_2_padding (SORL's clipping-bias pass)", _attr("verl.workers.utils.padding", "no_padding_2_padding")),
    ("fsdp2_clip_grad_norm_ (‖C‖ on FSDP2)", _attr("verl.utils.fsdp_utils", "fsdp2_clip_grad_norm_")),
    (
        "initialize_global_process_group_ray(backend=) (gloo on a CPU)",
        _has_params("verl.utils.distributed", "initialize_global_process_group_ray", ("backend",)),
    ),
    (
        "rollout_corr_helper option sets (guards.py)",
        lambda: [
            _attr("verl.trainer.ppo.rollout_corr_helper", n)()
            for n in ("TOKEN_LEVEL_ROLLOUT_RS_OPTIONS", "SUPPORTED_ROLLOUT_RS_OPTIONS")
        ],
    ),
    ("function_tool (recipes/verl/search_tool.py)", _attr("verl.tools.function_tool", "function_tool")),
    (
        "PlatformRegistry.register (the stratarl_cpu platform)",
        _attr("verl.plugin.platform", "PlatformRegistry", "register"),
    ),
    (
        "EngineRegistry._engines (FSDP engines for device=cpu)",
        _attr("verl.workers.engine", "EngineRegistry", "_engines"),
    ),
    ("rollout base._ROLLOUT_REGISTRY (rollout.name=hf)", _attr("verl.workers.rollout.base", "_ROLLOUT_REGISTRY")),
    (
        "RolloutReplicaRegistry.register (the hf replica)",
        _attr("verl.workers.rollout.replica", "RolloutReplicaRegistry", "register"),
    ),
    ("main_ppo.TaskRunnerV1 (trainer.use_v1=true)", _attr("verl.trainer.main_ppo", "TaskRunnerV1")),
    ("main_ppo_v0.TaskRunner (trainer.use_v1=false)", _attr("verl.trainer.main_ppo_v0", "TaskRunner")),
    (
        "v1 compute_advantage_for_multi_trajectories(batch_keys) (the estimator's session check)",
        _has_params("verl.trainer.ppo.v1.utils", "compute_advantage_for_multi_trajectories", ("data", "batch_keys")),
    ),
    ("transfer_queue (the v1 trainer's data plane)", _attr("transfer_queue", "init")),
    ("ToolAgentLoop (multi_turn tool calls)", _attr("verl.experimental.agent_loop.tool_agent_loop", "ToolAgentLoop")),
]


def moved_hooks() -> list[str]:
    """``"<hook>: <error>"`` for every hook that cannot be found in the installed veRL ([] when all are there)."""
    problems = []
    for name, look_up in HOOKS:
        try:
            look_up()
        except Exception as error:  # noqa: BLE001  ImportError, AttributeError, TypeError: the hook moved or changed
            problems.append(f"{name}: {type(error).__name__}: {error}")
    return problems


def require_hooks() -> str:
    """Raise RuntimeError naming the veRL version and each moved hook; returns the version when all are there."""
    version = verl_version()
    problems = moved_hooks()
    if problems:
        raise RuntimeError(
            f"veRL {version}: {len(problems)} hook(s) stratarl's plugins rely on moved (tested with veRL "
            f"{', '.join(TESTED_VERL_VERSIONS)}; stratarl/integrations/verl/compat.py): " + "; ".join(problems)
        )
    return version


def preflight() -> int:
    """A smoke command line's check before it starts: 0, with :func:`version_note` printed, or 2, with the one-line
    :func:`require_hooks` error on stderr."""
    try:
        require_hooks()
    except RuntimeError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    print(version_note())
    return 0


def version_note() -> str:
    """One line for logs: the installed veRL and whether it is a tested version."""
    version = verl_version()
    tested = ", ".join(TESTED_VERL_VERSIONS)
    status = "tested" if version in TESTED_VERL_VERSIONS else f"NOT a tested version (tested: {tested})"
    return f"veRL {version} ({status})"
