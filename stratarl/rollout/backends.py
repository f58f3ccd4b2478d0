"""The generator a run samples with: ``rollout.backend`` on the model's device, in the run's precision."""

from __future__ import annotations

from collections.abc import Sequence

from stratarl.infra.precision import DevicePolicy
from stratarl.rollout.generation import Generation, Generator, HFGenerator, KVCacheGenerator, SamplingParams


class AutocastGenerator(Generator):
    """A generator whose ``generate`` runs under a device policy's autocast (the generic loop in bf16). It
    declares the wrapped generator's capabilities and shares its RNG."""

    def __init__(self, inner: Generator, policy: DevicePolicy) -> None:
        self.inner = inner
        self.policy = policy
        self.supports_cache_keys = inner.supports_cache_keys
        self.supports_capture = inner.supports_capture
        self.rng = inner.rng

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        params: SamplingParams,
        max_new_tokens: Sequence[int] | None = None,
        **capabilities,
    ) -> list[Generation]:
        """``inner.generate`` under autocast; ``capabilities``: ``cache_keys`` / ``capture_layer`` when declared."""
        with self.policy.autocast():
            return self.inner.generate(prompts, params, max_new_tokens, **capabilities)


def make_generator(
    model,
    tokenizer,
    backend: str,
    seed: int,
    policy: DevicePolicy,
    *,
    share_prompts: bool = False,
    prefill_chunk_rows: int | None = None,
) -> Generator:
    """The ``rollout.backend`` generator for ``model`` under ``policy`` (the run's device and precision): on
    CUDA `kv_cache` is the generic KV-cache loop (``DevicePolicy.fast_decode``); on a CPU the fast decoder in
    the policy's compute dtype (bf16 weight copies with bf16). A generic loop in bf16 runs every ``generate``
    under autocast. ``share_prompts``: the fast decoder computes the prompts' common prefix once per call
    and ``prefill_chunk_rows`` its prefill's rows at a time (``KVCacheGenerator``; greedy evaluation uses both)."""
    if backend == "hf":
        generator: Generator = HFGenerator(model, tokenizer, seed=seed)
    else:
        generator = KVCacheGenerator(
            model,
            tokenizer,
            seed=seed,
            fast=policy.fast_decode(backend),
            dtype=policy.compute_dtype,
            share_prompts=share_prompts,
            prefill_chunk_rows=prefill_chunk_rows,
        )
        if generator.fast_decoder is not None:
            return generator  # the fast decoder sets its own dtypes
    return AutocastGenerator(generator, policy) if policy.autocast_dtype is not None else generator
