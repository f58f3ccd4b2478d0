"""The frozen prefix captured while sampling (``KVCacheGenerator.generate(capture_layer=k)`` ->
``prefix.captured_prefix``) equals the one the trainer would compute (``prefix.frozen_prefix``), across
a multi-turn rollout whose later turns reuse the KV prefix cache; anything that does not match the
batch's tokens falls back to computing it; and the RL step takes it from the rollouts."""

from __future__ import annotations

import copy

import pytest
import torch

from stratarl.models import build_tiny_model, freeze_all_but_last_layers
from stratarl.rollout.generation import KVCacheGenerator, SamplingParams
from stratarl.trainer.batch import collate_sequences
from stratarl.trainer.prefix import captured_prefix, frozen_prefix, lowest_trainable_layer

LAYERS, TRAINABLE = 4, 2


@pytest.fixture(scope="module")
def frozen_model(smollm2_tokenizer):
    model = build_tiny_model(smollm2_tokenizer, num_layers=LAYERS, seed=0)
    freeze_all_but_last_layers(model, TRAINABLE)
    return model.eval()


def _reference_states(model, tokens: list[int]) -> torch.Tensor:
    """The hidden states entering the lowest trainable layer, from the model's own forward."""
    k = lowest_trainable_layer(model.get_decoder())
    with torch.no_grad():
        return model(input_ids=torch.tensor([tokens]), output_hidden_states=True).hidden_states[k][0]


def _two_turns(model, tokenizer, dtype=torch.float32):
    """Two prompts x 3 samples; turn 1 stops at per-row budgets, turn 2 continues after an observation
    (the prefix cache is reused). Returns the rows' (prompt, response, mask) and their captured states."""
    generator = KVCacheGenerator(model, tokenizer, seed=0, dtype=dtype)
    k = lowest_trainable_layer(model.get_decoder())
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(10, 4000, (n,), generator=g).tolist() for n in (7, 12)]
    rows = [p for p in prompts for _ in range(3)]
    params = SamplingParams(max_new_tokens=12, stop_strings=())
    keys = list(range(len(rows)))
    first = generator.generate(rows, params, [3, 5, 7, 4, 9, 2], cache_keys=keys, capture_layer=k)
    observation = [[11, 12, 13, 14], [21, 22], [31, 32, 33], [41], [51, 52, 53, 54, 55], [61, 62]]
    histories = [r + f.token_ids + o for r, f, o in zip(rows, first, observation)]
    second = generator.generate(histories, params, [6, 2, 4, 8, 3, 5], cache_keys=keys, capture_layer=k)
    reused = generator.last_reused_tokens
    responses = [f.token_ids + o + s.token_ids for f, o, s in zip(first, observation, second)]
    masks = [
        [1] * len(f.token_ids) + [0] * len(o) + [1] * len(s.token_ids) for f, o, s in zip(first, observation, second)
    ]
    return rows, responses, masks, [s.frozen_states for s in second], reused


def test_captured_states_are_the_models_own_over_two_turns(frozen_model, smollm2_tokenizer):
    rows, responses, _, states, reused = _two_turns(frozen_model, smollm2_tokenizer)
    assert reused > 0  # turn 2 read only the observation: the first turn's states came from the cache
    for prompt, response, (tokens, hidden) in zip(rows, responses, states):
        assert tokens == prompt + response[:-1]  # everything read, the last sampled token never fed
        reference = _reference_states(frozen_model, tokens)
        torch.testing.assert_close(hidden, reference, atol=2e-5, rtol=1e-4)


def test_captured_prefix_equals_frozen_prefix(frozen_model, smollm2_tokenizer):
    rows, responses, masks, states, _ = _two_turns(frozen_model, smollm2_tokenizer)
    batch = collate_sequences(rows, responses, masks, pad_id=0)
    captured, why = captured_prefix(frozen_model, batch.input_ids, batch.attention_mask, batch.prompt_lengths, states)
    assert why is None and captured.source == "rollouts"
    computed = frozen_prefix(frozen_model, batch.input_ids, batch.attention_mask, batch.prompt_lengths)
    assert captured.layer == computed.layer == LAYERS - TRAINABLE
    torch.testing.assert_close(captured.inverse, computed.inverse)
    torch.testing.assert_close(captured.prompt_valid, computed.prompt_valid)
    valid = computed.prompt_valid[..., None]
    torch.testing.assert_close(captured.prompt_hidden * valid, computed.prompt_hidden * valid, atol=2e-5, rtol=1e-4)
    R = computed.response_hidden.shape[1]
    assert captured.response_hidden.shape == computed.response_hidden.shape
    used = torch.arange(R)[None] < (computed.response_lengths - 1)[:, None]  # the columns that predict a token
    torch.testing.assert_close(
        captured.response_hidden * used[..., None], computed.response_hidden * used[..., None], atol=2e-5, rtol=1e-4
    )


def test_bf16_capture_stays_within_bf16_rounding(frozen_model, smollm2_tokenizer):
    rows, responses, _, states, _ = _two_turns(frozen_model, smollm2_tokenizer, dtype=torch.bfloat16)
    for _prompt, _response, (tokens, hidden) in zip(rows, responses, states):
        assert hidden.dtype == torch.float32  # the residual stream stays fp32
        reference = _reference_states(frozen_model, tokens)
        scale = float(reference.abs().max())
        assert float((hidden - reference).abs().max()) <= 0.05 * scale


def test_states_that_do_not_match_the_batch_are_not_used(frozen_model, smollm2_tokenizer):
    rows, responses, masks, states, _ = _two_turns(frozen_model, smollm2_tokenizer)
    batch = collate_sequences(rows, responses, masks, pad_id=0)
    args = (frozen_model, batch.input_ids, batch.attention_mask, batch.prompt_lengths)
    changed = copy.deepcopy(states)
    changed[2] = ([*changed[2][0][:-1], changed[2][0][-1] + 1], changed[2][1])  # one token differs
    prefix, why = captured_prefix(*args, changed)
    assert prefix is None and "row 2" in why
    short = list(states)
    short[4] = (states[4][0][:-2], states[4][1][:-2])  # a row whose states end early
    assert captured_prefix(*args, short)[0] is None
    assert captured_prefix(*args, [None, *states[1:]])[0] is None


def test_no_states_are_kept_without_a_capture_layer(frozen_model, smollm2_tokenizer):
    generator = KVCacheGenerator(frozen_model, smollm2_tokenizer, seed=0)
    out = generator.generate([[5, 6, 7]] * 2, SamplingParams(max_new_tokens=4, stop_strings=()), cache_keys=[0, 1])
    assert all(g.frozen_states is None for g in out)
    assert generator.fast_decoder.h_cache is None
