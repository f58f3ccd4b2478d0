"""``KVCacheGenerator(share_prompts=True)``: rows that start with the same tokens have that prefix computed once,
and generate what a full prefill generates (greedy tokens identical, log-probs to float rounding)."""

from __future__ import annotations

import torch

from stratarl.rollout import prefix_cache
from stratarl.rollout.generation import KVCacheGenerator, SamplingParams


def _prompts(tokenizer):
    template = tokenizer("You answer questions about a small world. Think, then answer.\nQuestion: ")["input_ids"]
    questions = ["who founded the orchard?", "where is the river", "name the film", "x"]
    return [list(template) + list(tokenizer(q, add_special_tokens=False)["input_ids"]) for q in questions]


def test_shared_prompts_give_the_full_prefills_tokens(varied_model, smollm2_tokenizer, monkeypatch):
    prompts = _prompts(smollm2_tokenizer)
    calls = []
    real = prefix_cache.sequence_cache
    monkeypatch.setattr(prefix_cache, "sequence_cache", lambda d, t, rows: calls.append(len(t)) or real(d, t, rows))
    params = SamplingParams(max_new_tokens=10, greedy=True)
    full = KVCacheGenerator(varied_model, smollm2_tokenizer).generate(prompts, params)
    assert calls == []
    shared = KVCacheGenerator(varied_model, smollm2_tokenizer, share_prompts=True).generate(prompts, params)
    assert calls == [prefix_cache.common_prefix_length(prompts)] and calls[0] >= 10
    assert [g.token_ids for g in shared] == [g.token_ids for g in full]
    for a, b in zip(shared, full, strict=True):
        torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs), rtol=1e-4, atol=1e-4)


def test_a_kept_prefix_is_preferred_and_a_short_common_prefix_is_not_shared(varied_model, smollm2_tokenizer):
    generator = KVCacheGenerator(varied_model, smollm2_tokenizer, share_prompts=True)
    prompts = _prompts(smollm2_tokenizer)
    params = SamplingParams(max_new_tokens=4, greedy=True)
    first = generator.generate(prompts, params, cache_keys=list(range(4)))
    # The next turn: each row's history reads its kept KV, never the shared template (nothing to share).
    histories = [p + g.token_ids + [13] for p, g in zip(prompts, first, strict=True)]
    generator.generate(histories, params, cache_keys=list(range(4)))
    # Kept: each row's prompt and its generated tokens but the last (never fed back).
    assert generator.last_reused_tokens == sum(len(p) + len(g.token_ids) - 1 for p, g in zip(prompts, first))
    assert prefix_cache.common_prefix_length([[1, 2, 3, 4, 5], [1, 2, 3, 4, 6]]) < prefix_cache.SHARED_PREFIX_MIN_TOKENS


def test_prefill_in_row_chunks_is_the_whole_batchs_prefill(varied_model, smollm2_tokenizer):
    from stratarl.rollout.fast_forward import FastDecoder
    from stratarl.rollout.generator import left_pad

    prompts = [*_prompts(smollm2_tokenizer), [5, 6, 7]]
    ids, attention = left_pad(prompts, smollm2_tokenizer.pad_token_id, "cpu")
    out = {}
    for chunk in (None, 2):  # 5 rows: chunks of 2, 2 and 1
        decoder = FastDecoder(varied_model)
        decoder.prefill_chunk_rows, decoder.capture_layer = chunk, 1
        with torch.inference_mode():
            logits = decoder.prefill(ids, attention, ids.shape[1] + 3)
            logits = torch.stack([logits, decoder.decode(logits.argmax(-1))])
        out[chunk] = (logits, decoder.k_cache.clone(), decoder.v_cache.clone(), decoder.h_cache.clone())
    for whole, chunked in zip(out[None], out[2], strict=True):
        torch.testing.assert_close(chunked, whole)
