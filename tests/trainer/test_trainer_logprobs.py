"""Chunked selective log-softmax against the full log-softmax oracle."""

from __future__ import annotations

import pytest
import torch

from stratarl.trainer.batch import collate_sequences
from stratarl.trainer.logprobs import chunked_head_logprobs, response_logprobs, selective_log_softmax


def test_selective_log_softmax_matches_full():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(7, 11, generator=g)
    targets = torch.randint(0, 11, (7,), generator=g)
    expected = torch.log_softmax(logits, -1).gather(-1, targets[:, None]).squeeze(-1)
    torch.testing.assert_close(selective_log_softmax(logits, targets), expected)


def test_selective_log_softmax_hand_case():
    # logits [0, log 3]: softmax = [1/4, 3/4], so log p(1) = log 0.75 and log p(0) = log 0.25.
    logits = torch.tensor([[0.0, torch.log(torch.tensor(3.0))], [0.0, torch.log(torch.tensor(3.0))]])
    out = selective_log_softmax(logits, torch.tensor([1, 0]))
    torch.testing.assert_close(out, torch.log(torch.tensor([0.75, 0.25])))


@pytest.mark.parametrize("chunk", [1, 3, 5, 100])
def test_chunking_is_invisible_in_values_and_gradients(chunk):
    g = torch.Generator().manual_seed(1)
    head = torch.nn.Linear(8, 13, bias=False)
    hidden = torch.randn(10, 8, generator=g, requires_grad=True)
    targets = torch.randint(0, 13, (10,), generator=g)
    weights = torch.randn(10, generator=g)
    lp, ent = chunked_head_logprobs(hidden, head, targets, chunk_tokens=chunk, with_entropy=True)
    (lp * weights).sum().add(ent.sum()).backward()
    got_h, got_w = hidden.grad.clone(), head.weight.grad.clone()
    hidden.grad, head.weight.grad = None, None
    logits = head(hidden)
    full = torch.log_softmax(logits, -1).gather(-1, targets[:, None]).squeeze(-1)
    full_ent = -(torch.softmax(logits, -1) * torch.log_softmax(logits, -1)).sum(-1)
    (full * weights).sum().add(full_ent.sum()).backward()
    torch.testing.assert_close(lp, full.detach())
    torch.testing.assert_close(ent, full_ent.detach())
    torch.testing.assert_close(got_h, hidden.grad)
    torch.testing.assert_close(got_w, head.weight.grad)


def test_empty_selection_gives_empty_tensors():
    head = torch.nn.Linear(4, 6)
    lp, ent = chunked_head_logprobs(torch.zeros(0, 4), head, torch.zeros(0, dtype=torch.long))
    assert lp.shape == (0,) and ent.shape == (0,)


def test_shape_errors_are_clear():
    head = torch.nn.Linear(4, 6)
    with pytest.raises(ValueError, match=r"hidden \[N, H\]"):
        chunked_head_logprobs(torch.zeros(2, 3, 4), head, torch.zeros(2, dtype=torch.long))


def test_response_logprobs_match_full_forward(tiny_model):
    # Two rows of different prompt/response lengths, right-padded, with an observation token (mask 0).
    batch = collate_sequences([[5, 6, 7], [8, 9]], [[10, 11, 12, 13], [14, 15]], [[1, 1, 0, 1], [1, 1]], pad_id=0)
    with torch.no_grad():
        out = response_logprobs(
            tiny_model,
            batch.input_ids,
            batch.attention_mask,
            batch.prompt_lengths,
            batch.response_mask,
            chunk_tokens=2,
            with_entropy=True,
        )
        for b, (prompt, response) in enumerate([([5, 6, 7], [10, 11, 12, 13]), ([8, 9], [14, 15])]):
            ids = torch.tensor([prompt + response])
            logp = torch.log_softmax(tiny_model(input_ids=ids).logits[0].float(), -1)
            for j, token in enumerate(response):
                if batch.response_mask[b, j]:
                    torch.testing.assert_close(out["logprobs"][b, j], logp[len(prompt) + j - 1, token])
                else:  # observation tokens: never scored
                    assert out["logprobs"][b, j] == 0 and out["entropy"][b, j] == 0
    assert out["logprobs"].shape == (2, 4)
    assert out["logprobs"][1, 2:].eq(0).all()  # padding


def test_temperature_scales_logits(tiny_model):
    batch = collate_sequences([[5, 6]], [[7, 8]], [[1, 1]], pad_id=0)
    with torch.no_grad():
        out = response_logprobs(
            tiny_model,
            batch.input_ids,
            batch.attention_mask,
            batch.prompt_lengths,
            batch.response_mask,
            temperature=0.5,
        )
        logits = tiny_model(input_ids=torch.tensor([[5, 6, 7, 8]])).logits[0].float() / 0.5
        expected = torch.log_softmax(logits, -1)[[1, 2], [7, 8]]
    torch.testing.assert_close(out["logprobs"][0], expected)


# Six rows, three distinct prompts (a GRPO-like batch), responses of different lengths with
# observation tokens (mask 0) inside: sharing the prompt pass must change nothing.
SHARED_PROMPTS = [[5, 6, 7, 8, 9], [5, 6, 7, 8, 9], [11, 12, 13], [5, 6, 7, 8, 9], [11, 12, 13], [20, 21]]
SHARED_RESPONSES = [[30, 31, 32], [33], [34, 35, 36, 37, 38], [39, 40], [41, 42, 43], [44, 45, 46]]
SHARED_MASKS = [[1, 1, 1], [1], [1, 0, 0, 1, 1], [1, 1], [1, 1, 1], [1, 0, 1]]


def _both_ways(model, pad_id):
    batch = collate_sequences(SHARED_PROMPTS, SHARED_RESPONSES, SHARED_MASKS, pad_id)
    results = {}
    for share in (False, True):
        model.zero_grad()
        out = response_logprobs(
            model,
            batch.input_ids,
            batch.attention_mask,
            batch.prompt_lengths,
            batch.response_mask,
            with_entropy=True,
            return_hidden=True,
            share_prompts=share,
        )
        # Only policy positions count (the critic reads hidden states under the mask too).
        hidden = out["hidden"][batch.response_mask.bool()]
        (out["logprobs"].sum() + out["entropy"].sum() + hidden.square().mean()).backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        results[share] = (out, grads)
    return batch, results


@pytest.mark.parametrize("lora", [False, True])
def test_shared_prompt_pass_equals_the_plain_pass(tiny_model, smollm2_tokenizer, lora):
    import copy

    model = copy.deepcopy(tiny_model).train()
    if lora:
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=2, target_modules=["q_proj", "v_proj", "down_proj"]))
        with torch.no_grad():
            for name, param in model.named_parameters():
                if "lora_B" in name:
                    param.normal_(std=0.1)
    batch, results = _both_ways(model, smollm2_tokenizer.pad_token_id)
    (plain, plain_grads), (shared, shared_grads) = results[False], results[True]
    mask = batch.response_mask.bool()
    for key in ("logprobs", "entropy"):
        torch.testing.assert_close(shared[key], plain[key])
        assert (shared[key][~mask] == 0).all()
    torch.testing.assert_close(shared["hidden"][mask], plain["hidden"][mask])
    assert plain_grads.keys() == shared_grads.keys() and plain_grads
    for name, grad in plain_grads.items():
        torch.testing.assert_close(shared_grads[name], grad, msg=name)


def test_shared_prompt_pass_is_used_only_when_it_saves_work(tiny_model, smollm2_tokenizer):
    from stratarl.trainer.logprobs import _shared_prompt_hidden

    batch = collate_sequences(SHARED_PROMPTS, SHARED_RESPONSES, SHARED_MASKS, smollm2_tokenizer.pad_token_id)
    decoder = tiny_model.get_decoder()
    args = (batch.input_ids, batch.attention_mask, batch.prompt_lengths, batch.response_mask.shape[1])
    with torch.no_grad():
        assert _shared_prompt_hidden(decoder, *args) is not None
        distinct = collate_sequences(
            SHARED_PROMPTS[2:4], SHARED_RESPONSES[2:4], SHARED_MASKS[2:4], smollm2_tokenizer.pad_token_id
        )
        assert (
            _shared_prompt_hidden(
                decoder,
                distinct.input_ids,
                distinct.attention_mask,
                distinct.prompt_lengths,
                distinct.response_mask.shape[1],
            )
            is None
        )


@pytest.mark.parametrize("keep", [False, True])
@pytest.mark.parametrize("with_entropy", [False, True])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_closed_form_head_backward_equals_autograd(with_entropy, temperature, keep, monkeypatch):
    # _HeadLogprobs' hand-written backward against autograd through the plain formulas,
    # with a bias, a temperature and several chunks; the entropy term is weighted too.
    # keep: the log-softmax saved for backward, or recomputed there.
    import stratarl.trainer.logprobs as logprobs

    monkeypatch.setattr(logprobs, "HEAD_KEEP_BYTES", 2**30 if keep else 0)
    g = torch.Generator().manual_seed(3)
    head = torch.nn.Linear(6, 11, bias=True)
    torch.nn.init.normal_(head.bias, generator=g)
    hidden = torch.randn(9, 6, generator=g, requires_grad=True)
    targets = torch.randint(0, 11, (9,), generator=g)
    w_lp, w_ent = torch.randn(9, generator=g), torch.randn(9, generator=g)
    lp, ent = chunked_head_logprobs(
        hidden, head, targets, chunk_tokens=4, temperature=temperature, with_entropy=with_entropy
    )
    ((lp * w_lp).sum() + (ent * w_ent).sum()).backward()
    got = [t.grad.clone() for t in (hidden, head.weight, head.bias)]
    for t in (hidden, head.weight, head.bias):
        t.grad = None
    logp = torch.log_softmax(head(hidden) / temperature, -1)
    full = logp.gather(-1, targets[:, None]).squeeze(-1)
    full_ent = -(logp.exp() * logp).sum(-1) if with_entropy else torch.zeros(9)
    ((full * w_lp).sum() + (full_ent * w_ent).sum()).backward()
    torch.testing.assert_close(lp, full.detach())
    torch.testing.assert_close(ent, full_ent.detach())
    for mine, reference in zip(got, (hidden.grad, head.weight.grad, head.bias.grad)):
        torch.testing.assert_close(mine, reference)


def _brute_force_chunks(lengths, prompt_width, token_flops, pair_flops, pass_flops):
    # Every way to cut the rows sorted longest first into contiguous chunks (2^(B-1) of them).
    import itertools

    order = sorted(range(len(lengths)), key=lambda b: -lengths[b])
    best = None
    for cuts in itertools.product([False, True], repeat=len(order) - 1):
        chunks, current = [], [order[0]]
        for row, cut in zip(order[1:], cuts):
            if cut:
                chunks.append(current)
                current = []
            current.append(row)
        chunks.append(current)
        cost = sum(
            pass_flops + len(c) * lengths[c[0]] * (token_flops + pair_flops * (prompt_width + lengths[c[0]]))
            for c in chunks
        )
        best = cost if best is None else min(best, cost)
    return best


@pytest.mark.parametrize("pass_flops", [0.0, 50.0, 400.0, 1e9])
def test_response_chunks_are_the_cheapest_split(pass_flops):
    from stratarl.trainer.logprobs import response_chunks

    lengths = [7, 1, 30, 12, 12, 29, 3, 18]
    chunks = response_chunks(lengths, 5, token_flops=2.0, pair_flops=0.1, pass_flops=pass_flops)
    assert sorted(b for c in chunks for b in c) == list(range(len(lengths)))
    cost = sum(
        pass_flops + len(c) * max(lengths[b] for b in c) * (2.0 + 0.1 * (5 + max(lengths[b] for b in c)))
        for c in chunks
    )
    assert cost == pytest.approx(_brute_force_chunks(lengths, 5, 2.0, 0.1, pass_flops))
    if pass_flops == 1e9:
        assert len(chunks) == 1


def test_chunked_response_pass_equals_the_plain_pass(tiny_model, smollm2_tokenizer, monkeypatch):
    # No per-pass cost: the response pass splits into several chunks of rows; values and
    # gradients must equal the plain pass all the same.
    import copy

    from stratarl.infra import flops

    monkeypatch.setattr(flops, "PASS_OVERHEAD_FLOPS_PER_LAYER", 0.0)
    model = copy.deepcopy(tiny_model).train()
    with flops.record_decoder_calls(model) as record:
        batch, results = _both_ways(model, smollm2_tokenizer.pad_token_id)
    # Layer 0 ran once for the plain pass, once for the shared prompts, then once per response chunk.
    assert sum(1 for call in record.calls if call[0] == 0) > 3
    (plain, plain_grads), (shared, shared_grads) = results[False], results[True]
    mask = batch.response_mask.bool()
    for key in ("logprobs", "entropy"):
        torch.testing.assert_close(shared[key], plain[key])
    torch.testing.assert_close(shared["hidden"][mask], plain["hidden"][mask])
    for name, grad in plain_grads.items():
        torch.testing.assert_close(shared_grads[name], grad, msg=name)


def test_hidden_only_pass_skips_the_head_and_keeps_the_states(tiny_model, smollm2_tokenizer):
    batch = collate_sequences(SHARED_PROMPTS, SHARED_RESPONSES, SHARED_MASKS, smollm2_tokenizer.pad_token_id)
    args = (tiny_model, batch.input_ids, batch.attention_mask, batch.prompt_lengths, batch.response_mask)
    with torch.no_grad():
        full = response_logprobs(*args, return_hidden=True)
        hidden_only = response_logprobs(*args, return_hidden=True, with_logprobs=False)
    assert set(hidden_only) == {"hidden"}
    torch.testing.assert_close(hidden_only["hidden"], full["hidden"])


def test_a_frozen_head_under_bf16_autocast_runs_on_one_bf16_copy_in_both_passes():
    """Under CPU bf16 autocast a frozen LM head's weight is cast once per weight version (autocast alone casts
    it at every call, and the closed-form backward ran its GEMMs in fp32): the log-probs are autocast's, the
    gradient is that of the bf16 forward, and an in-place change of the weight makes a new copy."""
    import stratarl.infra.precision as precision

    g = torch.Generator().manual_seed(5)
    head = torch.nn.Linear(16, 300, bias=False).requires_grad_(False)
    hidden = torch.randn(40, 16, generator=g, requires_grad=True)
    targets = torch.randint(0, 300, (40,), generator=g)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        copy = precision.low_precision_head_weight(head.weight)
        assert copy.dtype == torch.bfloat16 and precision.low_precision_head_weight(head.weight) is copy
        lp, _ = chunked_head_logprobs(hidden, head, targets, chunk_tokens=16)
        reference = torch.log_softmax(head(hidden).float(), -1).gather(-1, targets[:, None]).squeeze(-1)
    assert lp.dtype == torch.float32
    torch.testing.assert_close(lp, reference, rtol=0, atol=0)
    lp.sum().backward()
    mine, hidden.grad = hidden.grad.clone(), None
    # autograd through the bf16 forward: the product, its input gradient, in bf16
    logits = torch.nn.functional.linear(hidden.to(torch.bfloat16), head.weight.to(torch.bfloat16)).float()
    torch.log_softmax(logits, -1).gather(-1, targets[:, None]).sum().backward()
    assert mine.dtype == torch.float32
    torch.testing.assert_close(mine, hidden.grad, rtol=2e-2, atol=2e-3)
    with torch.no_grad():
        head.weight.mul_(2.0)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        new = precision.low_precision_head_weight(head.weight)
    assert new is not copy and torch.equal(new, head.weight.to(torch.bfloat16))


def test_a_trainable_head_or_no_autocast_keeps_the_weight_itself():
    import stratarl.infra.precision as precision

    trainable = torch.nn.Linear(8, 20, bias=False)
    frozen = torch.nn.Linear(8, 20, bias=False).requires_grad_(False)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert precision.low_precision_head_weight(trainable.weight) is trainable.weight
    assert precision.low_precision_head_weight(frozen.weight) is frozen.weight


def test_the_head_copy_follows_the_tensor_not_its_address():
    """A new weight in memory a freed one used (same address, same version counter) is not served the freed
    one's copy: here two tensors over one numpy buffer, rewritten in between without torch seeing it."""
    import numpy as np

    import stratarl.infra.precision as precision

    buffer = np.ones((64, 32), dtype=np.float32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        old = torch.from_numpy(buffer)
        address, version = old.data_ptr(), old._version
        assert torch.equal(precision.low_precision_head_weight(old), torch.ones(64, 32, dtype=torch.bfloat16))
        del old
        buffer[:] = 2.0
        new = torch.from_numpy(buffer)
        assert (new.data_ptr(), new._version) == (address, version)
        assert torch.equal(precision.low_precision_head_weight(new), torch.full((64, 32), 2.0, dtype=torch.bfloat16))
