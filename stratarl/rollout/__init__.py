"""Search-R1 rollouts: tag parsing, the prompt, generation backends, the multi-turn engine."""

from stratarl.rollout.engine import Rollout, RolloutConfig, RolloutEngine, Turn
from stratarl.rollout.generation import (
    Generation,
    Generator,
    HFGenerator,
    KVCacheGenerator,
    SamplingParams,
    StopMatcher,
)
from stratarl.rollout.parsing import (
    INVALID_ACTION_OBSERVATION,
    STOP_STRINGS,
    Action,
    format_documents,
    information_observation,
    parse_action,
)
from stratarl.rollout.prompt import SEARCH_R1_TEMPLATE, build_prompt, encode_prompt, normalize_question
from stratarl.rollout.transcript import render_mask, rollout_metrics, transcript, transcript_text

__all__ = [
    "INVALID_ACTION_OBSERVATION",
    "SEARCH_R1_TEMPLATE",
    "STOP_STRINGS",
    "Action",
    "Generation",
    "Generator",
    "HFGenerator",
    "KVCacheGenerator",
    "Rollout",
    "RolloutConfig",
    "RolloutEngine",
    "SamplingParams",
    "StopMatcher",
    "Turn",
    "build_prompt",
    "encode_prompt",
    "format_documents",
    "information_observation",
    "normalize_question",
    "parse_action",
    "render_mask",
    "rollout_metrics",
    "transcript",
    "transcript_text",
]
