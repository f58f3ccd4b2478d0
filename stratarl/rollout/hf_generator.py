"""``HFGenerator``, the reference backend: Hugging Face ``model.generate`` with our stop rule as a
``StoppingCriteria``, then the same per-row cut as every backend (see ``stratarl.rollout.generator``)."""

from __future__ import annotations

import torch

from stratarl.rollout.generator import FinishReason, Generation, Generator, SamplingParams, left_pad, row_limits
from stratarl.rollout.stopping import StopMatcher, finish_of, special_token_ids


class _RowStopCriteria:
    """HF ``StoppingCriteria`` applying our per-row rule (EOS, stop string, row budget)."""

    def __init__(self, prompt_width: int, limits: list[int], eos_ids: set[int], matcher: StopMatcher):
        self.prompt_width = prompt_width
        self.limits = limits
        self.eos_ids = eos_ids
        self.matcher = matcher

    def __call__(self, input_ids: torch.Tensor, scores=None, **kwargs) -> torch.Tensor:
        generated = input_ids[:, self.prompt_width :].tolist()
        done = [
            finish_of(row, limit, self.eos_ids, self.matcher) is not None if row else False
            for row, limit in zip(generated, self.limits)
        ]
        return torch.tensor(done, dtype=torch.bool, device=input_ids.device)


class HFGenerator(Generator):
    """The reference backend: Hugging Face ``model.generate`` with our stop rule as a
    ``StoppingCriteria`` and raw logits returned, then the same per-row cut.

    Sampling uses the global torch RNG (seeded per call from ``seed``), so sampled
    tokens differ from ``KVCacheGenerator``'s; greedy tokens are identical.
    """

    def __init__(self, model, tokenizer, *, seed: int = 0):
        self.model = model
        self.tokenizer = tokenizer
        self.device = next(model.parameters()).device
        self.eos_ids, self.eos_id, self.pad_id = special_token_ids(model, tokenizer)
        self._seed = seed
        self._calls = 0

    def _config(self, params: SamplingParams, max_new: int):
        """The ``GenerationConfig`` of one call: ``params`` with raw logits returned for the log-probs."""
        from transformers import GenerationConfig  # start-up cost: transformers loads when the reference runs

        sampling = {} if params.greedy else {"temperature": params.temperature, "top_p": params.top_p, "top_k": 0}
        return GenerationConfig(
            max_new_tokens=max_new,
            do_sample=not params.greedy,
            pad_token_id=self.pad_id,
            eos_token_id=sorted(self.eos_ids),
            output_logits=True,
            return_dict_in_generate=True,
            **sampling,
        )

    @torch.inference_mode()
    def generate(self, prompts, params: SamplingParams, max_new_tokens=None) -> list[Generation]:
        from transformers import StoppingCriteriaList  # start-up cost: transformers loads when the reference runs

        limits = row_limits(len(prompts), params, max_new_tokens)
        if max(limits) == 0:
            return [Generation([], [], "length") for _ in prompts]
        matcher = StopMatcher(self.tokenizer, params.stop_strings)
        ids, attention = left_pad(prompts, self.pad_id, self.device)
        criteria = _RowStopCriteria(ids.shape[1], limits, self.eos_ids, matcher)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(self._seed + self._calls)
            self._calls += 1
            out = self.model.generate(
                input_ids=ids,
                attention_mask=attention,
                generation_config=self._config(params, max(limits)),
                stopping_criteria=StoppingCriteriaList([criteria]),
            )
        new_ids = out.sequences[:, ids.shape[1] :].tolist()
        logp = torch.log_softmax(torch.stack(out.logits, dim=1).float() / params.temperature, dim=-1)
        results = []
        for row, limit in enumerate(limits):
            tokens: list[int] = []
            reason: tuple[FinishReason, str | None] = ("length", None)
            for token in new_ids[row][:limit]:
                tokens.append(token)
                ended = finish_of(tokens, limit, self.eos_ids, matcher)
                if ended is not None:
                    reason = ended
                    break
            row_logp = [logp[row, t, token].item() for t, token in enumerate(tokens)]
            if reason[0] == "stop" and reason[1] in params.eos_after and len(tokens) < limit:
                row_logp.append(self._next_logprob(prompts[row], tokens, params.temperature))
                tokens.append(self.eos_id)
            results.append(Generation(tokens, row_logp, reason[0], reason[1]))
        return results

    def _next_logprob(self, prompt, tokens, temperature: float) -> float:
        """log p(EOS | prompt + tokens), from one unpadded forward pass over all of it."""
        full = torch.tensor([list(prompt) + tokens], device=self.device)
        logits = self.model(input_ids=full).logits[0, -1].float()
        return torch.log_softmax(logits / temperature, dim=-1)[self.eos_id].item()
