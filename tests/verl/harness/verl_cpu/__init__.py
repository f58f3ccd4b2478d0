"""A CPU "platform" for veRL 0.9.1, so its trainer can be smoke-tested on a machine without GPUs.

Test harness only (tests/verl/harness, outside the installed package), and no stratarl plugin: importing it
registers no estimator or loss, so it also runs plain veRL (its own GRPO) on a CPU. Ray workers import it by
name, so ``tests/verl`` must be on their PYTHONPATH (``harness.smoke.pythonpath``).

veRL picks its hardware backend from a registry (``verl.plugin.platform.PlatformRegistry``: nvidia,
huawei, amd) and falls back to ``nvidia`` when none is present, after which every worker asks for
NCCL and ``torch.cuda``. This module registers one more backend, ``stratarl_cpu``: device ``cpu``,
collectives over gloo, and Ray's (logical) ``GPU`` resource as the slot of one training process,
because veRL's resource pools count ``GPU``/``NPU`` resources only. It selects itself when
``VERL_PLATFORM=stratarl_cpu``; load it with the plugins:

    VERL_PLATFORM=stratarl_cpu \\
    VERL_USE_EXTERNAL_MODULES=stratarl.integrations.verl,harness.verl_cpu \\
    python -m verl.trainer.main_ppo ... +ray_kwargs.ray_init.num_gpus=1

(without ``stratarl.integrations.verl`` for plain veRL).

For tests and smoke runs only: a CPU has no memory statistics, streams or IPC, and the calls veRL
makes for them are answered with zeros and no-ops. See docs/verl.md ("Running veRL's trainer on a CPU").
"""

from __future__ import annotations

import os
from contextlib import contextmanager
from types import SimpleNamespace
from typing import Any

import torch
from verl.plugin.platform import PlatformBase, PlatformRegistry

from harness.verl_cpu import hf_rollout

PLATFORM_NAME = "stratarl_cpu"


def _zero(*args: Any, **kwargs: Any) -> int:
    return 0


def _nothing(*args: Any, **kwargs: Any) -> None:
    return None


def _cpu_device_module() -> SimpleNamespace:
    """``torch.cpu`` plus the ``torch.cuda`` calls veRL makes (memory stats, RNG state, streams)."""
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return SimpleNamespace(
        is_available=lambda: True,
        is_initialized=lambda: True,
        current_device=lambda: "cpu",
        device_count=lambda: 1,
        set_device=_nothing,
        synchronize=_nothing,
        empty_cache=_nothing,
        ipc_collect=_nothing,
        manual_seed=torch.manual_seed,
        manual_seed_all=torch.manual_seed,
        get_rng_state=torch.get_rng_state,
        set_rng_state=torch.set_rng_state,
        mem_get_info=lambda *args: (total, total),
        memory_allocated=_zero,
        memory_reserved=_zero,
        max_memory_allocated=_zero,
        max_memory_reserved=_zero,
        reset_peak_memory_stats=_nothing,
        set_per_process_memory_fraction=_nothing,
        get_device_name=lambda *args: "cpu",
        current_stream=torch.cpu.current_stream,
        stream=torch.cpu.stream,
        Stream=torch.cpu.Stream,
        Event=torch.cpu.Event,
        amp=torch.cpu.amp,
    )


@PlatformRegistry.register(platform=PLATFORM_NAME)
class PlatformStratarlCPU(PlatformBase):
    """veRL platform backend for CPU-only smoke runs (gloo collectives, no accelerator)."""

    def __init__(self) -> None:
        self._module = _cpu_device_module()

    @property
    def device_name(self) -> str:
        return "cpu"

    @property
    def vendor_name(self) -> str:
        return "cpu"

    @property
    def device_module(self) -> Any:
        return self._module

    def is_available(self) -> bool:
        return True

    def is_platform_available(self, use_smi_check: bool = False) -> bool:
        # Chosen only explicitly (VERL_PLATFORM), never by auto-detection on a GPU machine.
        return os.environ.get("VERL_PLATFORM", "").strip().lower() == PLATFORM_NAME

    def current_device(self) -> str:
        # veRL moves tensors and modules with ``.to(get_device_id())``; an index would name an accelerator.
        return "cpu"

    def device_count(self) -> int:
        return 1

    def set_device(self, device_index: int) -> None:
        return None

    def synchronize(self, device_index: int | None = None) -> None:
        return None

    def manual_seed(self, seed: int) -> None:
        torch.manual_seed(seed)

    def manual_seed_all(self, seed: int) -> None:
        torch.manual_seed(seed)

    def set_allocator_settings(self, settings: str) -> None:
        return None

    def empty_cache(self) -> None:
        return None

    def get_device_capability(self, device_index: int = 0) -> tuple[int | None, int | None]:
        return None, None

    def communication_backend_name(self) -> str:
        return "gloo"

    def visible_devices_envvar(self) -> str:
        return "CUDA_VISIBLE_DEVICES"

    @contextmanager
    def nvtx_range(self, msg: str):
        yield

    def profiler_start(self) -> None:
        return None

    def profiler_stop(self) -> None:
        return None

    def ray_resource_name(self) -> str:
        # veRL's ResourcePoolManager counts only GPU/NPU resources; a logical GPU (ray_init num_gpus)
        # stands for one training process.
        return "GPU"

    def ray_noset_envvars(self) -> list[str]:
        return ["RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES"]

    def is_ipc_supported(self) -> bool:
        return False

    def cudart(self) -> Any:
        return None


def _register_fsdp_engine_for_cpu() -> None:
    """Let veRL's own FSDP / FSDP2 engines serve ``device=cpu`` (veRL registers them for cuda and npu)."""
    from verl.workers.engine import EngineRegistry  # veRL: only in .venv-verl
    from verl.workers.engine.fsdp.transformer_impl import FSDPEngineWithLMHead  # veRL: only in .venv-verl

    registry = EngineRegistry._engines.get("language_model", {})
    if all("cpu" in registry.get(backend, {}) for backend in ("fsdp", "fsdp2")):
        return
    EngineRegistry.register(model_type="language_model", backend=["fsdp", "fsdp2"], device="cpu")(FSDPEngineWithLMHead)


_register_fsdp_engine_for_cpu()


def _cpu_training_worker():
    """veRL's ``TrainingWorker`` that starts its process group with gloo alone on a CPU.

    veRL's default backend string is ``cpu:gloo,<device>:<backend>``, invalid when the device itself is
    the CPU (``Duplicate device type cpu``, ``verl/utils/distributed.py:89``). Installed through
    ``ActorRolloutRefWorker.actor_worker_cls`` only while that is veRL's own ``TrainingWorker``; stratarl's
    ``SORLTrainingWorker`` does the same itself and replaces this one (``stratarl_cpu_only``).
    """
    from verl.utils.device import get_device_name  # veRL: only in .venv-verl
    from verl.utils.distributed import initialize_global_process_group_ray  # veRL: only in .venv-verl
    from verl.workers.engine_workers import TrainingWorker  # veRL: only in .venv-verl

    class CPUTrainingWorker(TrainingWorker):
        stratarl_cpu_only = True

        def __init__(self, config):
            if get_device_name() == "cpu":
                initialize_global_process_group_ray(timeout_second=None, backend="gloo")
            super().__init__(config)

    CPUTrainingWorker.__module__ = __name__
    CPUTrainingWorker.__qualname__ = "CPUTrainingWorker"
    return CPUTrainingWorker


def _install_cpu_training_worker() -> bool:
    """Set :class:`CPUTrainingWorker` as the actor's training worker unless another one is installed."""
    from verl.workers.engine_workers import ActorRolloutRefWorker, TrainingWorker  # veRL: only in .venv-verl

    if ActorRolloutRefWorker.actor_worker_cls is not TrainingWorker:
        return getattr(ActorRolloutRefWorker.actor_worker_cls, "stratarl_cpu_only", False)
    ActorRolloutRefWorker.actor_worker_cls = CPUTrainingWorker
    return True


CPUTrainingWorker = _cpu_training_worker()
CPU_TRAINING_WORKER_INSTALLED = _install_cpu_training_worker()

# veRL 0.9.1 generates only through vLLM / SGLang / TensorRT-LLM servers; none runs on a CPU.
HF_ROLLOUT_REGISTERED = hf_rollout.register()
