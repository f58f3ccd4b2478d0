"""The plain-PyTorch decode path (``FastDecoder``) against the models' own forward:
logits after prefill and after each decode step (left padding, grouped-query heads,
Qwen2's q/k/v biases), row selection, weight updates, and which models fall back."""

from __future__ import annotations

import pytest
import torch

from stratarl.rollout.fast_forward import FastDecoder, fast_decode_unsupported_reason, packing_available
from stratarl.rollout.generation import (
    HFGenerator,
    KVCacheGenerator,
    SamplingParams,
    StopMatcher,
    left_pad,
    stop_candidates,
)


def _config_kwargs(tokenizer):
    return {
        "vocab_size": len(tokenizer),
        "hidden_size": 64,
        "intermediate_size": 96,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "pad_token_id": tokenizer.pad_token_id,
        "eos_token_id": tokenizer.eos_token_id,
        "tie_word_embeddings": False,
        "initializer_range": 0.3,
    }


def _build(kind: str, tokenizer):
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(1)
        if kind == "llama_gqa":
            model = LlamaForCausalLM(LlamaConfig(**_config_kwargs(tokenizer)))
        elif kind == "qwen2_bias":
            model = Qwen2ForCausalLM(Qwen2Config(**_config_kwargs(tokenizer)))
            for layer in model.model.layers:  # random biases, so a dropped bias would show
                for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                    torch.nn.init.normal_(proj.bias, std=0.5)
        else:
            raise ValueError(kind)
    return model.eval()


def _reference_logits(model, rows: list[list[int]], pad_id: int) -> torch.Tensor:
    """The model's own forward over the whole left-padded sequences: last-position logits."""
    ids, mask = left_pad(rows, pad_id, "cpu")
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    return model(input_ids=ids, attention_mask=mask, position_ids=positions).logits[:, -1].float()


PROMPTS = [[5, 17, 230, 99, 1000, 42], [7, 8], [300, 301, 302, 303]]


@pytest.mark.parametrize("kind", ["llama_gqa", "qwen2_bias"])
def test_prefill_and_decode_match_model_forward(kind, smollm2_tokenizer):
    model = _build(kind, smollm2_tokenizer)
    with torch.inference_mode():
        _check_prefill_and_decode(model, smollm2_tokenizer)


def _check_prefill_and_decode(model, smollm2_tokenizer):
    assert fast_decode_unsupported_reason(model) is None
    pad = smollm2_tokenizer.pad_token_id
    ids, mask = left_pad(PROMPTS, pad, "cpu")
    decoder = FastDecoder(model)
    logits = decoder.prefill(ids, mask, capacity=ids.shape[1] + 4)
    rows = [list(p) for p in PROMPTS]
    torch.testing.assert_close(logits, _reference_logits(model, rows, pad), rtol=1e-4, atol=1e-4)
    for _ in range(3):
        tokens = logits.argmax(-1)
        for row, token in zip(rows, tokens.tolist()):
            row.append(token)
        logits = decoder.decode(tokens)
        torch.testing.assert_close(logits, _reference_logits(model, rows, pad), rtol=1e-4, atol=1e-4)


def test_select_keeps_the_chosen_rows(smollm2_tokenizer):
    model = _build("llama_gqa", smollm2_tokenizer)
    with torch.inference_mode():
        _check_select(model, smollm2_tokenizer)


def _check_select(model, smollm2_tokenizer):
    pad = smollm2_tokenizer.pad_token_id
    ids, mask = left_pad(PROMPTS, pad, "cpu")
    decoder = FastDecoder(model)
    tokens = decoder.prefill(ids, mask, capacity=ids.shape[1] + 3).argmax(-1)
    rows = [[*p, t] for p, t in zip(PROMPTS, tokens.tolist())]
    decoder.select(torch.tensor([2, 0]))
    logits = decoder.decode(tokens[[2, 0]])
    torch.testing.assert_close(logits, _reference_logits(model, [rows[2], rows[0]], pad), rtol=1e-4, atol=1e-4)


def test_cache_capacity_is_enforced(smollm2_tokenizer):
    model = _build("llama_gqa", smollm2_tokenizer)
    with torch.inference_mode():
        _check_capacity(model, smollm2_tokenizer)


def _check_capacity(model, smollm2_tokenizer):
    ids, mask = left_pad(PROMPTS, smollm2_tokenizer.pad_token_id, "cpu")
    decoder = FastDecoder(model)
    with pytest.raises(ValueError, match="capacity"):
        decoder.prefill(ids, mask, capacity=ids.shape[1] - 1)
    tokens = decoder.prefill(ids, mask, capacity=ids.shape[1] + 1).argmax(-1)
    decoder.decode(tokens)
    with pytest.raises(ValueError, match="KV cache full"):
        decoder.decode(tokens)


def test_weight_updates_are_followed(smollm2_tokenizer):
    """The fused weights are rebuilt after an optimizer step changes the parameters in place."""
    model = _build("llama_gqa", smollm2_tokenizer)
    pad = smollm2_tokenizer.pad_token_id
    ids, mask = left_pad(PROMPTS, pad, "cpu")
    decoder = FastDecoder(model)
    with torch.inference_mode():
        before = decoder.prefill(ids, mask, capacity=ids.shape[1] + 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    model(input_ids=ids).logits.square().mean().backward()
    optimizer.step()
    with torch.inference_mode():
        after = decoder.prefill(ids, mask, capacity=ids.shape[1] + 1)
        expected = _reference_logits(model, [list(p) for p in PROMPTS], pad)
    assert not torch.allclose(before, after)
    torch.testing.assert_close(after, expected, rtol=1e-4, atol=1e-4)


def test_unsupported_models_fall_back(smollm2_tokenizer, tiny_model):
    import copy

    from peft import LoraConfig, get_peft_model
    from transformers import GPT2Config, GPT2LMHeadModel

    gpt2 = GPT2LMHeadModel(GPT2Config(vocab_size=64, n_embd=16, n_layer=1, n_head=2))
    assert "model_type 'gpt2'" in fast_decode_unsupported_reason(gpt2)
    with pytest.raises(ValueError, match="fast=True"):
        KVCacheGenerator(gpt2, smollm2_tokenizer, fast=True)
    dora = get_peft_model(copy.deepcopy(tiny_model), LoraConfig(r=2, target_modules=["q_proj"], use_dora=True))
    assert "DoRA" in fast_decode_unsupported_reason(dora)
    assert KVCacheGenerator(dora, smollm2_tokenizer).fast_decoder is None
    assert KVCacheGenerator(tiny_model, smollm2_tokenizer).fast_decoder is not None
    assert KVCacheGenerator(tiny_model, smollm2_tokenizer, fast=False).fast_decoder is None


def test_lora_adapters_are_merged_and_followed(smollm2_tokenizer):
    """A peft LoRA policy decodes on the fast path with W + scaling * B A, also after B changes."""
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(
        _build("llama_gqa", smollm2_tokenizer),
        LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "up_proj", "down_proj"]),
    )
    assert fast_decode_unsupported_reason(model) is None
    pad = smollm2_tokenizer.pad_token_id
    ids, mask = left_pad(PROMPTS, pad, "cpu")
    decoder = FastDecoder(model)
    for _ in range(2):
        with torch.no_grad():  # lora_B starts at zero: give the adapters a real effect
            for name, param in model.named_parameters():
                if "lora_B" in name:
                    param.add_(0.05 * torch.randn_like(param))
        with torch.inference_mode():
            logits = decoder.prefill(ids, mask, capacity=ids.shape[1] + 1)
            expected = _reference_logits(model, [list(p) for p in PROMPTS], pad)
            torch.testing.assert_close(logits, expected, rtol=1e-4, atol=1e-4)
    with torch.inference_mode(), model.disable_adapter():
        base = _reference_logits(model, [list(p) for p in PROMPTS], pad)
        # Switching the adapter off changes no parameter; the decoder still notices.
        torch.testing.assert_close(decoder.prefill(ids, mask, capacity=ids.shape[1] + 1), base, rtol=1e-4, atol=1e-4)
    assert not torch.allclose(logits, base, atol=1e-3)


@pytest.mark.parametrize("fast", [True, False])
def test_both_forwards_match_hf_generate_greedy(fast, smollm2_tokenizer):
    model = _build("llama_gqa", smollm2_tokenizer)
    params = SamplingParams(max_new_tokens=8, greedy=True, stop_strings=())
    ours = KVCacheGenerator(model, smollm2_tokenizer, fast=fast).generate(PROMPTS, params, [8, 3, 8])
    reference = HFGenerator(model, smollm2_tokenizer).generate(PROMPTS, params, [8, 3, 8])
    for a, b in zip(ours, reference):
        assert a.token_ids == b.token_ids
        torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs), rtol=1e-4, atol=1e-4)


def test_rows_dropped_in_batches_give_the_same_output(smollm2_tokenizer):
    """Finished rows leave the batch once they are a quarter of it; output is as if kept."""
    model = _build("llama_gqa", smollm2_tokenizer)
    prompts = PROMPTS * 3
    limits = [1, 2, 3, 4, 5, 6, 7, 8, 9]
    params = SamplingParams(max_new_tokens=9, greedy=True, stop_strings=())
    dropped = KVCacheGenerator(model, smollm2_tokenizer, drop_finished=True).generate(prompts, params, limits)
    kept = KVCacheGenerator(model, smollm2_tokenizer, drop_finished=False).generate(prompts, params, limits)
    assert [g.token_ids for g in dropped] == [g.token_ids for g in kept]
    assert [len(g.token_ids) for g in dropped] == limits


class TestStopCandidates:
    def test_every_token_that_can_complete_a_stop_is_a_candidate(self, smollm2_tokenizer):
        tokenizer = smollm2_tokenizer
        candidates = stop_candidates(tokenizer, ("</search>", "</answer>"))
        assert candidates is not None and 0 < len(candidates) < len(tokenizer) // 100
        # The token that first completes a stop string (as generation meets it) is a candidate.
        matcher = StopMatcher(tokenizer, ("</search>", "</answer>"))
        for text in ["a </search>", "x</answer>", "<search> q</search>\n", "ok </answer>.", "</search>>"]:
            ids = tokenizer(text, add_special_tokens=False)["input_ids"]
            first = next(i for i in range(1, len(ids) + 1) if matcher.check(ids[:i]) is not None)
            assert ids[first - 1] in candidates

    def test_prefilter_never_changes_the_answer(self, smollm2_tokenizer):
        tokenizer = smollm2_tokenizer
        stops = ("</search>", "</answer>")
        plain = StopMatcher(tokenizer, stops)
        filtered = StopMatcher(tokenizer, stops, stop_candidates(tokenizer, stops))
        generator = torch.Generator().manual_seed(0)
        pieces = tokenizer("<search> a </search> b </answer> c >", add_special_tokens=False)["input_ids"]
        stops_seen = 0
        for _ in range(300):
            ids = torch.randint(0, len(tokenizer), (6,), generator=generator).tolist()
            ids += pieces[: int(torch.randint(0, len(pieces) + 1, (1,), generator=generator))]
            # Token by token, as the generator checks: until the first stop, both agree.
            for end in range(1, len(ids) + 1):
                expected = plain.check(ids[:end])
                assert filtered.check(ids[:end]) == expected
                if expected is not None:
                    stops_seen += 1
                    break
        assert stops_seen > 50  # the comparison covered many real stops, not just misses

    def test_non_ascii_stop_disables_the_prefilter(self, smollm2_tokenizer):
        assert stop_candidates(smollm2_tokenizer, ("fin»",)) is None
        assert stop_candidates(smollm2_tokenizer, ()) is None


def test_identical_prompts_are_prefilled_once_and_give_the_same_cache(smollm2_tokenizer):
    model = _build("llama_gqa", smollm2_tokenizer)
    pad = smollm2_tokenizer.pad_token_id
    prompts = [PROMPTS[0], PROMPTS[1], PROMPTS[0], PROMPTS[2], PROMPTS[1]]
    with torch.inference_mode():
        ids, mask = left_pad(prompts, pad, "cpu")
        grouped = FastDecoder(model)
        logits = grouped.prefill(ids, mask, capacity=ids.shape[1] + 2)
        # One prompt at a time, no sharing possible: the same logits and cache rows.
        for row, _prompt in enumerate(prompts):
            single = FastDecoder(model)
            one_ids, one_mask = ids[row : row + 1], mask[row : row + 1]
            torch.testing.assert_close(logits[row : row + 1], single.prefill(one_ids, one_mask, ids.shape[1] + 2))
            torch.testing.assert_close(grouped.k_cache[:, row : row + 1], single.k_cache)
        tokens = logits.argmax(-1)
        rows = [[*p, t] for p, t in zip(prompts, tokens.tolist())]
        torch.testing.assert_close(grouped.decode(tokens), _reference_logits(model, rows, pad), rtol=1e-4, atol=1e-4)


class TestPrefixCache:
    def test_prefill_after_a_cached_prefix_equals_a_full_prefill(self, smollm2_tokenizer):
        model = _build("llama_gqa", smollm2_tokenizer)
        pad = smollm2_tokenizer.pad_token_id
        histories = [PROMPTS[0] + [11, 12, 13], PROMPTS[1] + [14], PROMPTS[2] + [15, 16]]
        with torch.inference_mode():
            first = FastDecoder(model)
            ids, mask = left_pad(PROMPTS, pad, "cpu")
            first.prefill(ids, mask, capacity=ids.shape[1] + 1)
            # Rows 0 and 2 reuse their prompt's KV; row 1 is computed from scratch.
            prefixes = [first.row_cache(0, len(PROMPTS[0])), None, first.row_cache(2, len(PROMPTS[2]))]
            new_tokens = [histories[0][len(PROMPTS[0]) :], histories[1], histories[2][len(PROMPTS[2]) :]]
            ids, mask = left_pad(new_tokens, pad, "cpu")
            second = FastDecoder(model)
            logits = second.prefill(ids, mask, capacity=6 + ids.shape[1] + 2, prefixes=prefixes)
            torch.testing.assert_close(logits, _reference_logits(model, histories, pad), rtol=1e-4, atol=1e-4)
            tokens = logits.argmax(-1)
            rows = [[*h, t] for h, t in zip(histories, tokens.tolist())]
            torch.testing.assert_close(second.decode(tokens), _reference_logits(model, rows, pad), rtol=1e-4, atol=1e-4)

    def test_next_turn_reuses_the_history_and_matches_a_fresh_generator(self, smollm2_tokenizer):
        model = _build("llama_gqa", smollm2_tokenizer)
        params = SamplingParams(max_new_tokens=5, greedy=True, stop_strings=())
        cached = KVCacheGenerator(model, smollm2_tokenizer)
        keys = ["a", "b", "c"]
        turn1 = cached.generate(PROMPTS, params, [5, 2, 4], cache_keys=keys)
        assert cached.last_reused_tokens == 0
        observation = [21, 22, 23]
        histories = [p + g.token_ids + observation for p, g in zip(PROMPTS, turn1)]
        histories[1] = [999, *histories[1][1:]]  # row 1's history changed: its cache must not be used
        turn2 = cached.generate(histories, params, [5, 5, 5], cache_keys=keys)
        # Rows 0 and 2 reuse prompt + all generated tokens but the last (never fed).
        assert cached.last_reused_tokens == (len(PROMPTS[0]) + 4) + (len(PROMPTS[2]) + 3)
        fresh = KVCacheGenerator(model, smollm2_tokenizer).generate(histories, params, [5, 5, 5])
        for a, b in zip(turn2, fresh):
            assert a.token_ids == b.token_ids
            torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs), rtol=1e-4, atol=1e-4)

    def test_cache_is_dropped_when_the_weights_change(self, smollm2_tokenizer):
        model = _build("llama_gqa", smollm2_tokenizer)
        params = SamplingParams(max_new_tokens=3, greedy=True, stop_strings=())
        generator = KVCacheGenerator(model, smollm2_tokenizer)
        out = generator.generate(PROMPTS, params, cache_keys=[0, 1, 2])
        with torch.no_grad():
            model.lm_head.weight.mul_(1.5)
        histories = [p + g.token_ids for p, g in zip(PROMPTS, out)]
        generator.generate(histories, params, cache_keys=[0, 1, 2])
        assert generator.last_reused_tokens == 0

    def test_byte_budget_is_respected(self, smollm2_tokenizer):
        model = _build("llama_gqa", smollm2_tokenizer)
        params = SamplingParams(max_new_tokens=3, greedy=True, stop_strings=())
        generator = KVCacheGenerator(model, smollm2_tokenizer, prefix_cache_bytes=0)
        out = generator.generate(PROMPTS, params, cache_keys=[0, 1, 2])
        generator.generate([p + g.token_ids for p, g in zip(PROMPTS, out)], params, cache_keys=[0, 1, 2])
        assert generator.last_reused_tokens == 0
        with pytest.raises(ValueError, match="cache_keys has 2 entries"):
            generator.generate(PROMPTS, params, cache_keys=[0, 1])


@pytest.mark.skipif(
    not __import__("stratarl.rollout.fast_forward", fromlist=["x"]).packing_available(),
    reason="this torch build has no oneDNN weight packing",
)
def test_packed_weights_give_the_same_logits(smollm2_tokenizer):
    model = _build("qwen2_bias", smollm2_tokenizer)  # biases go through the packed op too
    ids, mask = left_pad(PROMPTS, smollm2_tokenizer.pad_token_id, "cpu")
    with torch.inference_mode():
        packed, plain = FastDecoder(model, pack=True), FastDecoder(model, pack=False)
        a = packed.prefill(ids, mask, capacity=ids.shape[1] + 2)
        b = plain.prefill(ids, mask, capacity=ids.shape[1] + 2)
        assert packed._layers[0].qkv.packed is not None and plain._layers[0].qkv.packed is None
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
        tokens = a.argmax(-1)
        torch.testing.assert_close(packed.decode(tokens), plain.decode(tokens), rtol=1e-4, atol=1e-4)
        # Down to GEMV_ROWS rows the packed decoder runs F.linear on the unfused projections
        # (biases included): still the same logits.
        rows = torch.tensor([1])
        packed.select(rows)
        plain.select(rows)
        torch.testing.assert_close(packed.decode(tokens[rows]), plain.decode(tokens[rows]), rtol=1e-4, atol=1e-4)


def test_rope_tables_and_rolled_rotation_equal_the_models_rotary_embedding(smollm2_tokenizer):
    # FastDecoder looks cos / sin up in tables and rotates with roll + a signed sin; the
    # model's own rotary_emb + rotate_half must give the same q and k.
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    from stratarl.rollout.fast_forward import _apply_rope

    model = _build("llama_gqa", smollm2_tokenizer)
    decoder = FastDecoder(model)
    positions = torch.tensor([[0, 1, 2, 3], [5, 6, 700, 1500]])  # beyond the first table: it grows
    with torch.inference_mode():
        cos, signed_sin = decoder._rope(positions, int(positions.max()))
        ref_cos, ref_sin = model.model.rotary_emb(model.model.embed_tokens.weight, positions)
        q, k = torch.randn(2, 4, 4, 16), torch.randn(2, 2, 4, 16)  # [B, heads, L, D]
        ref_q, ref_k = apply_rotary_pos_emb(q, k, ref_cos, ref_sin)
        torch.testing.assert_close(cos, ref_cos)
        torch.testing.assert_close(_apply_rope(q, cos[:, None], signed_sin[:, None]), ref_q)
        torch.testing.assert_close(_apply_rope(k, cos[:, None], signed_sin[:, None]), ref_k)


def test_small_weights_are_not_packed_unless_asked(smollm2_tokenizer):
    from stratarl.rollout.fast_forward import PACK_MIN_ELEMENTS, packing_available

    model = _build("llama_gqa", smollm2_tokenizer)
    decoder = FastDecoder(model)
    decoder.refresh()
    assert decoder._layers[0].qkv.packed is None  # 64 x 128: far below the threshold
    head_packed = decoder._lm_head.packed is not None
    assert head_packed == (packing_available() and model.lm_head.weight.numel() >= PACK_MIN_ELEMENTS)


@pytest.mark.parametrize("batch", [1, 4, 8])
def test_greedy_ids_equal_hf_generate_at_several_batch_sizes(batch, smollm2_tokenizer):
    """Left-padded prompts of 1..9 tokens at batch 1, 4, 8: the same greedy ids as HF generate,
    log-probs within fp32 rounding.

    Both backends sum in different orders, so their logits differ by ~1e-5; at a step whose
    top-1 / top-2 margin is that small either id is a correct argmax. So each row's ids are
    compared up to its first near tie (margin < 1e-3 in one unpadded forward pass), and the
    compared steps must be most of the run, or the test would be vacuous."""
    model = _build("llama_gqa", smollm2_tokenizer)
    prompts = [[(37 * row + 11 * i) % 4000 + 5 for i in range(1 + (3 * row) % 9)] for row in range(batch)]
    params = SamplingParams(max_new_tokens=10, greedy=True, stop_strings=())
    ours = KVCacheGenerator(model, smollm2_tokenizer, fast=True).generate(prompts, params)
    reference = HFGenerator(model, smollm2_tokenizer).generate(prompts, params)
    compared = 0
    for prompt, a, b in zip(prompts, ours, reference):
        with torch.inference_mode():
            logits = model(input_ids=torch.tensor([prompt + b.token_ids])).logits[0, len(prompt) - 1 : -1]
        top2 = logits.topk(2, dim=-1).values
        ties = ((top2[:, 0] - top2[:, 1]) < 1e-3).nonzero()
        clear = int(ties[0]) if len(ties) else len(b.token_ids)  # steps before the first near tie
        assert a.token_ids[:clear] == b.token_ids[:clear]
        torch.testing.assert_close(
            torch.tensor(a.logprobs[:clear]), torch.tensor(b.logprobs[:clear]), rtol=1e-4, atol=1e-4
        )
        compared += clear
    assert compared >= 0.8 * batch * params.max_new_tokens


def test_a_batch_of_one_or_two_rows_packs_nothing_and_a_larger_batch_packs(smollm2_tokenizer):
    """Automatic packing: at <= GEMV_ROWS rows the LM head (3.1M elements, packed otherwise)
    stays the model's own weight; a later 3-row batch packs it. Logits match the model either way."""
    model = _build("llama_gqa", smollm2_tokenizer)
    pad = smollm2_tokenizer.pad_token_id
    decoder = FastDecoder(model)
    with torch.inference_mode():
        for prompts, packed in ((PROMPTS[:1], False), (PROMPTS[:2], False), (PROMPTS, True)):
            ids, mask = left_pad(prompts, pad, "cpu")
            logits = decoder.prefill(ids, mask, capacity=ids.shape[1] + 1)
            assert (decoder._lm_head.packed is not None) == (packed and packing_available())
            assert decoder._lm_head.weight is None or packed  # no stacked copy for small batches
            torch.testing.assert_close(
                logits, _reference_logits(model, [list(p) for p in prompts], pad), rtol=1e-4, atol=1e-4
            )
            rows = [[*p, t] for p, t in zip(prompts, logits.argmax(-1).tolist())]
            torch.testing.assert_close(
                decoder.decode(logits.argmax(-1)), _reference_logits(model, rows, pad), rtol=1e-4, atol=1e-4
            )


# --------------------------------------------------------------------------- bf16 weights


@pytest.mark.parametrize("pack", [True, False])
def test_bf16_decoder_stays_within_bf16_rounding_of_fp32_and_keeps_fp32_weights(pack, smollm2_tokenizer):
    """``dtype=bfloat16``: projections on bf16 copies of the weights, fp32 residual stream and logits.
    Its logits differ from fp32 (bf16 really ran) by no more than bf16 autocast of the model's own
    forward does, and the model's parameters stay fp32 and unchanged."""
    model = _build("qwen2_bias", smollm2_tokenizer)
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    pad = smollm2_tokenizer.pad_token_id
    ids, mask = left_pad(PROMPTS, pad, "cpu")
    rows = [list(p) for p in PROMPTS]
    with torch.inference_mode():
        decoder = FastDecoder(model, pack=pack, dtype=torch.bfloat16)
        logits = decoder.prefill(ids, mask, capacity=ids.shape[1] + 4)
        assert logits.dtype == torch.float32 and decoder.k_cache.dtype == torch.bfloat16
        assert decoder._layers[0].qkv.dtype == torch.bfloat16
        for _ in range(3):
            reference = _reference_logits(model, rows, pad)
            with torch.autocast("cpu", dtype=torch.bfloat16):
                autocast_logits = _reference_logits(model, rows, pad)
            error, autocast_error = (logits - reference).abs().max(), (autocast_logits - reference).abs().max()
            assert 0 < error <= 2 * autocast_error + 1e-3, (error, autocast_error)
            tokens = reference.argmax(-1)
            for row, token in zip(rows, tokens.tolist()):
                row.append(token)
            logits = decoder.decode(tokens)
    for name, p in model.named_parameters():
        assert p.dtype == torch.float32 and torch.equal(p, before[name]), name


def test_bf16_decoder_rebuilds_its_copies_when_the_weights_change(smollm2_tokenizer):
    model = _build("llama_gqa", smollm2_tokenizer)
    ids, mask = left_pad(PROMPTS, smollm2_tokenizer.pad_token_id, "cpu")
    decoder = FastDecoder(model, dtype=torch.bfloat16)
    with torch.inference_mode():
        first = decoder.prefill(ids, mask, capacity=ids.shape[1] + 1)
        copies = decoder._layers
        again = decoder.prefill(ids, mask, capacity=ids.shape[1] + 1)
        assert decoder._layers is copies  # same weights: the bf16 copies are reused, not re-cast
        torch.testing.assert_close(first, again, rtol=0, atol=0)
    head = decoder._lm_head
    with torch.no_grad():
        model.model.layers[0].mlp.down_proj.weight.mul_(3.0)
    with torch.inference_mode():
        changed = decoder.prefill(ids, mask, capacity=ids.shape[1] + 1)
        fresh = FastDecoder(model, dtype=torch.bfloat16).prefill(ids, mask, capacity=ids.shape[1] + 1)
    assert decoder._layers is not copies and not torch.allclose(changed, first)
    # Only the layer whose weights changed is rebuilt; the others and the LM head are the same objects.
    assert decoder._layers[0] is not copies[0]
    assert all(new is old for new, old in zip(decoder._layers[1:], copies[1:]))
    assert decoder._lm_head is head
    torch.testing.assert_close(changed, fresh, rtol=0, atol=0)


def test_a_changed_lm_head_or_adapter_state_rebuilds_what_depends_on_it(smollm2_tokenizer):
    """The LM head is rebuilt when its weight changes (the layers are kept); switching LoRA adapters off rebuilds
    every layer (no parameter changes then)."""
    from peft import LoraConfig, get_peft_model

    model = _build("llama_gqa", smollm2_tokenizer)
    ids, mask = left_pad(PROMPTS, smollm2_tokenizer.pad_token_id, "cpu")
    decoder = FastDecoder(model, dtype=torch.bfloat16)
    with torch.inference_mode():
        decoder.prefill(ids, mask, capacity=ids.shape[1] + 1)
    layers, head = list(decoder._layers), decoder._lm_head
    with torch.no_grad():
        model.lm_head.weight.mul_(2.0)
    with torch.inference_mode():
        changed = decoder.prefill(ids, mask, capacity=ids.shape[1] + 1)
        fresh = FastDecoder(model, dtype=torch.bfloat16).prefill(ids, mask, capacity=ids.shape[1] + 1)
    assert decoder._lm_head is not head and all(a is b for a, b in zip(decoder._layers, layers))
    torch.testing.assert_close(changed, fresh, rtol=0, atol=0)

    peft_model = get_peft_model(model, LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False))
    decoder = FastDecoder(peft_model)
    with torch.inference_mode():
        with_adapter = decoder.prefill(ids, mask, capacity=ids.shape[1] + 1)
        layers = list(decoder._layers)
        with peft_model.disable_adapter():
            without = decoder.prefill(ids, mask, capacity=ids.shape[1] + 1)
            assert all(a is not b for a, b in zip(decoder._layers, layers))
            expected = FastDecoder(peft_model).prefill(ids, mask, capacity=ids.shape[1] + 1)
    assert not torch.allclose(with_adapter, without)
    torch.testing.assert_close(without, expected, rtol=0, atol=0)
