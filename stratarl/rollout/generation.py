"""Generation backends over token ids, in one import: Hugging Face ``generate`` (the reference) and our
batched KV-cache sampling loop for any Hugging Face causal LM.

Where each part lives:

- ``stratarl.rollout.generator``: the contract every backend follows (``Generator``, ``SamplingParams``,
  ``Generation``), with the stop rule and the log-prob convention in its docstring;
- ``stratarl.rollout.stopping``: the stop rule (``StopMatcher``, ``finish_of``);
- ``stratarl.rollout.sampling``: argmax / top-p sampling;
- ``stratarl.rollout.kv_cache_generator``: ``KVCacheGenerator`` (``FastDecoder`` of
  ``stratarl.rollout.fast_forward`` where it applies, else the model's own forward), with the multi-turn
  prefix cache of ``stratarl.rollout.prefix_cache``;
- ``stratarl.rollout.hf_generator``: ``HFGenerator``.
"""

from __future__ import annotations

from stratarl.rollout.generator import FinishReason, Generation, Generator, SamplingParams, left_pad, row_limits
from stratarl.rollout.hf_generator import HFGenerator
from stratarl.rollout.kv_cache_generator import KVCacheGenerator
from stratarl.rollout.sampling import sample_categorical, sample_tokens
from stratarl.rollout.stopping import StopMatcher, eos_token_ids, finish_of, stop_candidates

__all__ = [
    "FinishReason",
    "Generation",
    "Generator",
    "HFGenerator",
    "KVCacheGenerator",
    "SamplingParams",
    "StopMatcher",
    "eos_token_ids",
    "finish_of",
    "left_pad",
    "row_limits",
    "sample_categorical",
    "sample_tokens",
    "stop_candidates",
]
