"""Refuse veRL options that rewrite ``response_mask`` before stratarl's plugins read it.

``stratified_grpo`` takes a rollout's stratum from the mask (one block of 0s per tool round) and
``turn_ppo`` / ``sorl`` take its turns from the mask (one run of 1s per assistant turn). veRL 0.9.1
has one option that changes the mask first: rollout rejection sampling,
``algorithm.rollout_correction.rollout_rs`` (``rollout_corr_helper.compute_rollout_correction_and_add_to_batch``
sets rejected tokens, or whole rejected rollouts, to 0 before ``compute_advantage`` and the actor
update). A rejected token inside an assistant turn splits it in two and adds a block that is not a
tool round (a phantom stratum, a phantom turn); a rejected rollout becomes stratum 0 while its reward
still counts. Its bypass mode (``rollout_correction.bypass_mode``) also replaces the actor's
``loss_mode`` with veRL's own ``bypass_mode`` loss, which would drop the turn-level loss silently.
So both are refused with a one-line error, not handled.

Pure functions of a veRL config block (DictConfig, dict or dataclass); no veRL import.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any


def _get(config: Any, key: str) -> Any:
    if config is None:
        return None
    if isinstance(config, Mapping) or hasattr(config, "get"):
        return config.get(key, None)
    return getattr(config, key, None)


def mask_rewrite_settings(rollout_correction: Any) -> list[str]:
    """The set options of veRL's ``rollout_correction`` block that rewrite the mask or the loss, as ``key=value``."""
    found = []
    rs = _get(rollout_correction, "rollout_rs")
    if rs not in (None, "", "null", "none", "None"):
        found.append(f"rollout_rs={rs!r}")
    if _get(rollout_correction, "bypass_mode"):
        found.append("bypass_mode=true")
    return found


def refuse_mask_rewrites(rollout_correction: Any, *, plugin: str, where: str) -> None:
    """Raise one line naming the setting, the plugin and the fix when ``rollout_correction`` rewrites the mask."""
    found = mask_rewrite_settings(rollout_correction)
    if found:
        raise ValueError(
            f"{plugin} reads tool rounds and turns from response_mask, but {where}.{found[0]} rewrites it first "
            f"(phantom strata/turns); set {where}.{found[0].split('=')[0]}=null (or false) to use {plugin}"
        )
