"""The trainer: config tree, RL loop, warm start, eval, report (see docs/training.md).

Public API::

    from stratarl.trainer import load_config, train, warm_start, evaluate, build_report
    cfg = load_config("configs/demo.yaml", ["algo.name=grpo", "trainer.steps=20"])
    summary = train(cfg, "runs/grpo")
"""

from __future__ import annotations

import importlib

# Every name loads on first use: `import stratarl.evaluation.stats` (pure Python) must not pull in the config
# tree, which imports the algorithms and so torch (benchmarks/evidence/tables.py runs without torch).
_LAZY = {
    "Config": ("stratarl.trainer.config", "Config"),
    "ConfigError": ("stratarl.trainer.config", "ConfigError"),
    "load_config": ("stratarl.trainer.config", "load_config"),
    "save_config": ("stratarl.trainer.config", "save_config"),
    "train": ("stratarl.trainer.rl", "train"),
    "warm_start": ("stratarl.trainer.warmstart.stages", "warm_start"),
    "evaluate": ("stratarl.evaluation.greedy", "evaluate"),
    "build_report": ("stratarl.evaluation.report", "build_report"),
}


def __getattr__(name: str):
    # Heavy modules (torch, transformers) load on first use, not on `import stratarl.trainer`.
    if name in _LAZY:
        module, attr = _LAZY[name]
        return getattr(importlib.import_module(module), attr)
    raise AttributeError(f"module 'stratarl.trainer' has no attribute {name!r}")


__all__ = list(_LAZY)
