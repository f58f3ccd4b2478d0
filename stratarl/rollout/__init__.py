"""Search-R1 rollouts: tag parsing, tool-call protocols and tools, the prompt, generation backends, the multi-turn
engine.

Submodules load on first use (PEP 562), so `from stratarl.rollout.prompt import build_prompt`
or `stratarl.rollout.parsing` does not import torch / transformers.
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "Rollout": "engine",
    "RolloutConfig": "config",
    "RolloutEngine": "engine",
    "Turn": "engine",
    "observation_ids": "engine",
    "Generation": "generation",
    "Generator": "generation",
    "HFGenerator": "generation",
    "KVCacheGenerator": "generation",
    "SamplingParams": "generation",
    "StopMatcher": "generation",
    "INVALID_ACTION_OBSERVATION": "parsing",
    "STOP_STRINGS": "parsing",
    "Action": "parsing",
    "format_documents": "parsing",
    "information_observation": "parsing",
    "parse_action": "parsing",
    "ToolProtocol": "protocols",
    "make_protocol": "protocols",
    "register_protocol": "protocols",
    "ToolCall": "tools",
    "ToolContext": "tools",
    "ToolOutput": "tools",
    "register_tool": "tools",
    "SEARCH_R1_TEMPLATE": "prompt",
    "build_prompt": "prompt",
    "encode_messages": "prompt",
    "encode_prompt": "prompt",
    "normalize_question": "prompt",
    "render_mask": "transcript",
    "rollout_metrics": "transcript",
    "transcript": "transcript",
    "transcript_text": "transcript",
}

__all__ = list(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'stratarl.rollout' has no attribute {name!r}")
    module_name = _EXPORTS[name]
    module = importlib.import_module(f"stratarl.rollout.{module_name}")
    # Bind every export of that submodule now: importing `transcript` (the module) sets the
    # package attribute of the same name, which the function `transcript` must win over.
    for export, source in _EXPORTS.items():
        if source == module_name:
            globals()[export] = getattr(module, export)
    return globals()[name]
