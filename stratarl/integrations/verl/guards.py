"""Which of veRL's rollout corrections compose with stratarl's plugins, and one line for each that does not.

veRL 0.9.1's ``algorithm.rollout_correction`` (``verl/trainer/ppo/rollout_corr_helper.py``) has two kinds
of correction and two modes:

- ``rollout_is`` (``token`` | ``sequence``, TIS or IcePop thresholds, optional batch normalisation) only
  computes detached weights ``rollout_is_weights`` that the actor's loss multiplies into its per-token
  terms. ``response_mask`` is untouched, so it composes with everything: ``stratified_grpo`` never sees
  the weights, ``turn_ppo`` / ``sorl`` multiply them in after the clip (:mod:`.losses`).
- ``rollout_rs`` (rejection) rewrites ``response_mask``. In the default, decoupled mode
  (``bypass_mode=false``) ``compute_rollout_correction_and_add_to_batch`` runs before
  ``compute_advantage`` and before the actor update (``ray_trainer.py``, the v1 trainer and the
  separation trainer alike), so both our estimator (strata: blocks of 0s = tool rounds) and our
  turn-level loss (turns: runs of 1s) read the rewritten mask. The ``token_k*`` options zero single
  tokens: inside a turn that splits it in two (two ratios, two clip decisions) and adds a block of 0s
  that is no tool round (a phantom stratum). The ``seq_*`` options zero whole rollouts: the turns of
  every kept rollout stay as they were, so they compose with the turn-level losses; but a rejected
  rollout's mask is all 0, so ``stratified_grpo`` would put it in stratum 0 while its reward still
  counts in the group.
- ``bypass_mode=true`` skips that pre-advantage step (the estimator sees the intact mask) and makes
  veRL's trainer swap ``actor.policy_loss.loss_mode`` for its own ``bypass_mode`` loss
  (``apply_bypass_mode``), which applies ``rollout_is`` / ``rollout_rs`` only inside itself. With
  ``stratified_grpo`` and a token-level loss that composes; ``turn_ppo`` / ``sorl`` would be dropped
  (or, where the swap does not reach the worker, run with the corrections silently ignored).

Pure functions of a veRL config block (DictConfig, dict or dataclass); no veRL import. The option sets
are veRL 0.9.1's ``TOKEN_LEVEL_ROLLOUT_RS_OPTIONS`` and the rest of ``SUPPORTED_ROLLOUT_RS_OPTIONS``
(tests/verl/test_verl_rollout_correction.py pins them, so a veRL upgrade that adds a mode fails there).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

TOKEN_RS_OPTIONS = frozenset({"token_k1", "token_k2", "token_k3"})
SEQUENCE_RS_OPTIONS = frozenset(
    {
        "seq_sum_k1",
        "seq_sum_k2",
        "seq_sum_k3",
        "seq_mean_k1",
        "seq_mean_k2",
        "seq_mean_k3",
        "seq_max_k2",
        "seq_max_k3",
    }
)
_UNSET = (None, "", "null", "none", "None")


def _get(config: Any, key: str) -> Any:
    if config is None:
        return None
    if isinstance(config, Mapping) or hasattr(config, "get"):
        return config.get(key, None)
    return getattr(config, key, None)


def rs_options(rollout_correction: Any) -> list[str]:
    """The options of ``rollout_rs`` (veRL's comma-separated string), [] when rejection is off."""
    value = _get(rollout_correction, "rollout_rs")
    if value in _UNSET:
        return []
    return [option.strip() for option in str(value).split(",") if option.strip()]


def _not_whole_rollout(options: list[str]) -> str | None:
    """The first option that does not zero whole rollouts only (a token-level or unknown one), else None."""
    return next((option for option in options if option not in SEQUENCE_RS_OPTIONS), None)


def _zeroes_tokens(option: str) -> str:
    if option in TOKEN_RS_OPTIONS:
        return f"{option} zeroes single tokens"
    return f"{option} is no veRL 0.9.1 mode known to zero whole rollouts only, so it may zero single tokens"


def estimator_conflict(rollout_correction: Any, *, where: str = "algorithm.rollout_correction") -> str | None:
    """One line saying why ``stratified_grpo`` cannot run with this block, or None when it composes."""
    options = rs_options(rollout_correction)
    if not options or _get(rollout_correction, "bypass_mode"):
        return None  # weights only, or rejection inside veRL's bypass loss: the estimator sees the intact mask
    value = _get(rollout_correction, "rollout_rs")
    token = _not_whole_rollout(options)
    why = (
        f"{_zeroes_tokens(token)}, adding blocks of 0s that are no tool round (phantom strata)"
        if token
        else "a rejected rollout's all-0 mask puts it in stratum 0 while its reward still counts"
    )
    return (
        f"stratified_grpo cannot compose with {where}.rollout_rs={value!r}: veRL rewrites response_mask before "
        f"compute_advantage and the estimator reads each rollout's tool rounds from it; {why}; fix: set "
        f"{where}.rollout_rs=null (rollout_is weights compose), or bypass_mode=true with a token-level actor loss "
        "(veRL then rejects inside its loss, after the advantage)"
    )


def turn_loss_conflict(rollout_correction: Any, *, plugin: str, where: str) -> str | None:
    """One line saying why the turn-level loss ``plugin`` cannot run with this block, or None when it composes."""
    if _get(rollout_correction, "bypass_mode"):
        return (
            f"{plugin} cannot compose with {where}.bypass_mode=true: veRL's bypass mode swaps "
            "actor.policy_loss.loss_mode for its own 'bypass_mode' loss (rollout_corr_helper.apply_bypass_mode) and "
            "applies rollout_is / rollout_rs only inside it, so the turn-level loss is dropped or runs uncorrected; "
            f"fix: set {where}.bypass_mode=false (decoupled: π_old recomputed, rollout_is weights and seq_* "
            "rollout_rs compose)"
        )
    token = _not_whole_rollout(rs_options(rollout_correction))
    if token is None:
        return None
    return (
        f"{plugin} cannot compose with {where}.rollout_rs={_get(rollout_correction, 'rollout_rs')!r}: "
        f"{_zeroes_tokens(token)} of response_mask before the actor and the turn-level loss reads turns from that "
        "mask, so a rejected token splits its turn in two (two ratios, two clip decisions); fix: a whole-rollout "
        "mode (seq_sum_*, seq_mean_*, seq_max_*), or weight 0 instead of mask 0 with rollout_is=token and "
        "rollout_is_threshold='<lower>_<upper>' (IcePop)"
    )


def refuse_for_estimator(rollout_correction: Any, *, where: str = "algorithm.rollout_correction") -> None:
    """Raise :func:`estimator_conflict`'s line as a ValueError when there is one."""
    message = estimator_conflict(rollout_correction, where=where)
    if message:
        raise ValueError(message)


def refuse_for_turn_loss(rollout_correction: Any, *, plugin: str, where: str) -> None:
    """Raise :func:`turn_loss_conflict`'s line as a ValueError when there is one."""
    message = turn_loss_conflict(rollout_correction, plugin=plugin, where=where)
    if message:
        raise ValueError(message)
