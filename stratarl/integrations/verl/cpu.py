"""The CPU platform and ``hf`` rollout of :mod:`stratarl.integrations.verl_cpu`, loaded with the plugins.

    VERL_PLATFORM=stratarl_cpu \\
    VERL_USE_EXTERNAL_MODULES=stratarl.integrations.verl,stratarl.integrations.verl.cpu \\
    python -m verl.trainer.main_ppo ... +ray_kwargs.ray_init.num_gpus=1

Importing this module imports :mod:`stratarl.integrations.verl` (its parent package: the plugins) and
then the CPU harness; for plain veRL on a CPU load :mod:`stratarl.integrations.verl_cpu` alone. See
docs/verl.md ("Running veRL's trainer on a CPU").
"""

from __future__ import annotations

from typing import Any

# A module import, not names: veRL imports this module from inside `import verl` (VERL_USE_EXTERNAL_MODULES),
# which can happen while stratarl.integrations.verl_cpu itself is still being imported (its own `import verl`).
import stratarl.integrations.verl_cpu as _harness  # registers the platform, engines and hf rollout


def __getattr__(name: str) -> Any:
    return getattr(_harness, name)
