"""``actor_rollout_ref.rollout.name=hf``: a Hugging Face ``generate`` rollout server for veRL 0.9.1.

veRL 0.9.1's trainer generates only through inference servers (vLLM, SGLang, TensorRT-LLM): the
agent loop sends token ids to a server (``RolloutReplica``), and the actor worker pushes new weights
to it after every update (``BaseRollout.update_weights``). None of them runs on a CPU, so this module
adds a small one with the same contract, for CPU smoke runs of the real trainer:

- :class:`HFRolloutServer`, a Ray actor holding a ``transformers`` model; ``generate`` samples one
  response (temperature, top-p, top-k from veRL's sampling params, ``rollout.response_length``
  new tokens at most) and returns its token ids and log-probabilities as veRL's ``TokenOutput``;
- :class:`HFRolloutReplica`, veRL's ``RolloutReplica`` that starts one server per replica;
- :class:`HFRolloutAdapter`, the ``BaseRollout`` living in the hybrid actor worker: veRL's
  ``update_weights`` hands it the trained weights (and the trainer step they belong to), which it
  loads into the server; the server reports that step as ``extra_fields["global_steps"]`` on every
  response, as vLLM's does (veRL's v1 trainer needs it for its staleness bookkeeping).

Registered with veRL's rollout registries under ``hf`` (unless veRL already has an ``hf``) by
:mod:`harness.verl_cpu`. One request at a time, no KV-cache management, no batching:
for tests and smoke runs, not for training speed.
"""

from __future__ import annotations

import asyncio
import json
import logging
import zlib
from collections.abc import Generator
from typing import Any

import ray
import torch
from verl.workers.rollout import base as rollout_base
from verl.workers.rollout.base import BaseRollout
from verl.workers.rollout.replica import RolloutReplica, RolloutReplicaRegistry, TokenOutput

logger = logging.getLogger(__name__)

ROLLOUT_NAME = "hf"
SERVER_NAME = "stratarl_hf_rollout_server_{rank}"


def sample_next_token(
    logits: torch.Tensor, *, temperature: float, top_p: float, top_k: int, generator: torch.Generator | None = None
) -> torch.Tensor:
    """One token id [1] from logits [V] under veRL's sampling params (temperature 0 = greedy, top_k <= 0 = all)."""
    if temperature <= 0:
        return logits.argmax(dim=-1, keepdim=True)
    scores = logits / temperature
    if 0 < top_k < scores.shape[-1]:
        kth = torch.topk(scores, top_k).values[-1]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if top_p < 1.0:
        sorted_scores, order = torch.sort(scores, descending=True)
        cumulative = torch.softmax(sorted_scores, dim=-1).cumsum(dim=-1)
        drop = cumulative - torch.softmax(sorted_scores, dim=-1) > top_p  # keep the first token always
        scores = scores.masked_fill(torch.zeros_like(drop).scatter(0, order, drop), float("-inf"))
    return torch.multinomial(torch.softmax(scores, dim=-1), 1, generator=generator)


@ray.remote(num_cpus=0)
class HFRolloutServer:
    """A rollout server with veRL's server methods, backed by a ``transformers`` causal LM on the CPU."""

    def __init__(self, model_path: str, response_length: int, seed: int = 0) -> None:
        from transformers import AutoModelForCausalLM  # start-up cost: the smoke worker only

        self.model = AutoModelForCausalLM.from_pretrained(
            model_path, dtype=torch.float32, attn_implementation="sdpa"
        ).eval()
        eos = self.model.generation_config.eos_token_id
        self.eos_ids = set(eos if isinstance(eos, list) else [] if eos is None else [eos])
        self.response_length = int(response_length)
        self.seed = int(seed)
        # One random stream per prompt: the k-th request for a prompt gets the same sample whatever
        # order the agent loop's concurrent requests arrive in, so a seeded run is reproducible.
        self.streams: dict[tuple[int, ...], torch.Generator] = {}
        self.weight_version = 0
        # The trainer step of the loaded weights, as vLLM's server reports it (``set_global_steps``);
        # veRL's v1 trainer reads it back from every TokenOutput (min/max_global_steps, staleness).
        self.global_steps: int | None = None
        self.requests = 0

    @torch.no_grad()
    def _generate(self, prompt_ids: list[int], sampling_params: dict[str, Any]) -> TokenOutput:
        temperature = float(sampling_params.get("temperature", 1.0))
        top_p = float(sampling_params.get("top_p", 1.0))
        top_k = int(sampling_params.get("top_k", -1))
        max_new = int(sampling_params.get("max_tokens", sampling_params.get("max_new_tokens", self.response_length)))
        key = tuple(prompt_ids)
        if key not in self.streams:
            digest = zlib.crc32(json.dumps(prompt_ids).encode())
            self.streams[key] = torch.Generator().manual_seed((self.seed * 1_000_003 + digest) % 2**63)
        generator = self.streams[key]
        ids = torch.tensor([prompt_ids], dtype=torch.long)
        out = self.model(input_ids=ids, use_cache=True)
        past, logits = out.past_key_values, out.logits[0, -1].float()
        tokens: list[int] = []
        log_probs: list[float] = []
        for _ in range(min(max_new, self.response_length)):
            token = sample_next_token(logits, temperature=temperature, top_p=top_p, top_k=top_k, generator=generator)
            tokens.append(int(token))
            log_probs.append(float(torch.log_softmax(logits, dim=-1)[token]))
            if int(token) in self.eos_ids:
                break
            out = self.model(input_ids=token.view(1, 1), past_key_values=past, use_cache=True)
            past, logits = out.past_key_values, out.logits[0, -1].float()
        self.requests += 1
        return TokenOutput(
            token_ids=tokens,
            log_probs=log_probs,
            stop_reason="completed",
            extra_fields={"global_steps": self.global_steps, "stratarl_hf_weight_version": self.weight_version},
        )

    async def generate(
        self, request_id: str, *, prompt_ids: list[int], sampling_params: dict[str, Any], **kwargs: Any
    ) -> TokenOutput:
        if kwargs.get("image_data") or kwargs.get("video_data") or kwargs.get("audio_data"):
            raise NotImplementedError("the hf rollout server is text-only")
        return self._generate(list(prompt_ids), dict(sampling_params))

    def load_weights(self, state_dict: dict[str, torch.Tensor], global_steps: int | None = None) -> int:
        """Load trained weights (names as the model's own state dict); returns how many tensors were loaded.

        ``global_steps``: the trainer step these weights belong to (veRL passes it with every update).
        """
        own = self.model.state_dict()
        loaded = {name: tensor for name, tensor in state_dict.items() if name in own}
        if not loaded:
            raise ValueError(
                f"none of the {len(state_dict)} weights sent to the hf rollout server match the model's "
                f"parameter names (e.g. sent {next(iter(state_dict), None)!r}, expected {next(iter(own))!r})"
            )
        self.model.load_state_dict(loaded, strict=False)
        self.weight_version += 1
        if global_steps is not None:
            self.global_steps = int(global_steps)
        return len(loaded)

    async def set_global_steps(self, global_steps: int) -> None:
        """veRL's server method: the trainer step of the current weights."""
        self.global_steps = int(global_steps)

    def stats(self) -> dict[str, int]:
        return {"requests": self.requests, "weight_version": self.weight_version}

    # veRL's server control methods; a CPU server has no device memory to free or resume.
    async def wake_up(self) -> None: ...
    async def sleep(self) -> None: ...
    async def abort_all_requests(self, reject_request: bool = False) -> None: ...
    async def resume_generation(self) -> None: ...
    async def clear_kv_cache(self) -> None: ...
    async def release_kv_cache(self) -> None: ...
    async def resume_kv_cache(self) -> None: ...
    async def start_profile(self, **kwargs: Any) -> None: ...
    async def stop_profile(self) -> None: ...


class HFRolloutReplica(RolloutReplica):
    """veRL ``RolloutReplica`` that serves generation from one :class:`HFRolloutServer`."""

    def rollout_worker_use_gpu(self) -> bool:
        return False

    async def launch_servers(self) -> None:
        name = SERVER_NAME.format(rank=self.replica_rank)
        # model_config is veRL's actor_rollout_ref.model (a DictConfig here, HFModelConfig elsewhere).
        path = getattr(self.model_config, "local_path", None) if not hasattr(self.model_config, "get") else None
        path = path or self.model_config.get("local_path", None) or self.model_config.get("path")
        # ray.remote made the class an actor class, with .options (the Ray stubs are not installed).
        server = HFRolloutServer.options(name=name).remote(path, self.config.response_length, seed=self.replica_rank)  # type: ignore[attr-defined]
        await server.stats.remote()  # wait until the model is loaded
        self.servers = [server]
        self._server_handle = server
        self._server_address = f"hf-rollout-{self.replica_rank}"


class HFRolloutAdapter(BaseRollout):
    """The rollout side of veRL's hybrid actor worker: forwards ``update_weights`` to the replica's server."""

    def __init__(self, config, model_config, device_mesh, *args, **kwargs) -> None:
        super().__init__(config, model_config, device_mesh)
        world = (
            self.config.tensor_model_parallel_size
            * self.config.data_parallel_size
            * self.config.pipeline_model_parallel_size
        )
        rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
        self.replica_rank, self.is_leader = rank // world, rank % world == 0
        self.sleep_level = 2

    async def resume(self, tags: list[str]) -> None:
        return None

    async def release(self) -> None:
        return None

    async def update_weights(
        self,
        weights: Generator[tuple[str, torch.Tensor], None, None],
        wire_format: str = "named_tensors",
        **kwargs: Any,
    ) -> None:
        if wire_format != "named_tensors":
            raise NotImplementedError(f"the hf rollout takes full named tensors, not {wire_format!r}")
        state = {}
        for name, tensor in weights:
            tensor = tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor
            state[name] = tensor.detach().to("cpu", torch.float32).clone()
        if not self.is_leader:
            return
        server = ray.get_actor(SERVER_NAME.format(rank=self.replica_rank))
        await asyncio.wrap_future(server.load_weights.remote(state, kwargs.get("global_steps")).future())


def register() -> bool:
    """Register ``hf`` with veRL's rollout registries; False when veRL already provides an ``hf``."""
    key = (ROLLOUT_NAME, "async")
    if key in rollout_base._ROLLOUT_REGISTRY and not rollout_base._ROLLOUT_REGISTRY[key].startswith(__name__):
        return False
    rollout_base._ROLLOUT_REGISTRY[key] = f"{__name__}.HFRolloutAdapter"
    RolloutReplicaRegistry.register(ROLLOUT_NAME, lambda: HFRolloutReplica)
    return True
