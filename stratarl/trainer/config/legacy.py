"""Older spellings of the ``algo`` section, rewritten once, when a config is loaded, into their one home.

Stored configs (a run directory's config.yaml, experiment files, users' YAMLs) keep loading: each older
spelling is rewritten into the current field, with one deprecation note on stderr per spelling. A config
that sets both spellings to different values is refused, naming the two (a field at its default counts as
not set, since a saved config.yaml lists every field).

    older spelling                          rewritten to
    algo.turn_level_ratio: true / false     algo.ratio_level: turn / token   (null: dropped)
    algo.sorl_normalize: true / false       algo.normalizer: sorl / none     (null: dropped)
    algo.policy_loss: sorl                  algo.policy_loss: ppo            (the same surrogate; the ratio level
                                                                              always came from algo.ratio_level)

A shared knob's keyword written inside a ``*_params`` mapping (``algo.normalizer_params.delta``) is moved to
the knob (``algo.sorl_delta``) by stratarl.trainer.config.resolve.move_knob_params, which knows each part's
signature.
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Callable

from stratarl.config_errors import fail
from stratarl.trainer.config.algo import AlgoConfig

# A field at its default was not set by the user (a saved config.yaml lists every field): an older
# spelling may then fill it, as the older precedence let it.
DEFAULTS = {f.name: f.default for f in dataclasses.fields(AlgoConfig)}

# Boolean switches -> (the field they name a part of, value for true, value for false).
SWITCHES = {"turn_level_ratio": ("ratio_level", "turn", "token"), "sorl_normalize": ("normalizer", "sorl", "none")}
POLICY_LOSS_ALIASES = {"sorl": "ppo"}


_NOTED: set[str] = set()


def note_deprecated(text: str) -> None:
    """One line on stderr, once per process for each older spelling."""
    if text not in _NOTED:
        _NOTED.add(text)
        print(f"note: {text}", file=sys.stderr, flush=True)


def set_once(algo: dict, field: str, value, source: str) -> None:
    """``algo[field] = value`` unless the config already sets ``field`` to another value (then refuse, naming
    both spellings). A field at its default counts as not set."""
    if algo.get(field, DEFAULTS[field]) not in (None, DEFAULTS[field], value):
        fail(
            f"algo.{field}",
            algo[field],
            f"contradicts `algo.{source}` (which means {value!r})",
            f"drop `algo.{source}` (a deprecated spelling of algo.{field})",
        )
    algo[field] = value


def rewrite_legacy(data: dict, note: Callable[[str], None] = note_deprecated) -> dict:
    """``data`` (a YAML-shaped config, overrides applied) with every older ``algo`` spelling rewritten; the
    input is not changed."""
    algo = data.get("algo")
    if not isinstance(algo, dict):
        return data
    algo = dict(algo)
    for switch, (field, on, off) in SWITCHES.items():
        if switch not in algo:
            continue
        value = algo.pop(switch)
        if value is None:
            continue
        if not isinstance(value, bool):
            fail(f"algo.{switch}", value, "expected true, false or null", f"use algo.{field} instead")
        set_once(algo, field, on if value else off, switch)
        note(f"algo.{switch}={str(value).lower()} is deprecated; read as algo.{field}={on if value else off}")
    policy_loss = algo.get("policy_loss")
    alias = POLICY_LOSS_ALIASES.get(policy_loss) if isinstance(policy_loss, str) else None
    if alias is not None:
        note(
            f"algo.policy_loss={algo['policy_loss']} is deprecated; read as algo.policy_loss={alias} "
            "(its ratio level is algo.ratio_level)"
        )
        algo["policy_loss"] = alias
    return {**data, "algo": algo}
