"""Generation backends on the tiny random Llama: KV-cache loop vs HF generate, stop
strings at token level, budgets, and sampling log-probs vs a fresh forward pass."""

from __future__ import annotations

import pytest
import torch

from stratarl.rollout.generation import HFGenerator, KVCacheGenerator, SamplingParams, StopMatcher


def prompts_of(tokenizer):
    texts = ["Hello there, how are", "The capital of France is a city that", "x", "<search> who wrote"]
    return [tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]


def fresh_logprobs(model, prompt, generated, temperature):
    """log_softmax(logits / T) of each generated token, from one unpadded forward pass."""
    ids = torch.tensor([list(prompt) + list(generated)])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0].float()
    logp = torch.log_softmax(logits / temperature, dim=-1)
    positions = torch.arange(len(prompt) - 1, len(prompt) + len(generated) - 1)
    return logp[positions, torch.tensor(generated)]


class TestGreedyBackendsAgree:
    def test_same_tokens_and_logprobs(self, tiny_model, smollm2_tokenizer):
        prompts = prompts_of(smollm2_tokenizer)
        params = SamplingParams(max_new_tokens=12, greedy=True, stop_strings=())
        ours = KVCacheGenerator(tiny_model, smollm2_tokenizer).generate(prompts, params, [12, 5, 12, 1])
        reference = HFGenerator(tiny_model, smollm2_tokenizer).generate(prompts, params, [12, 5, 12, 1])
        for a, b in zip(ours, reference):
            assert a.token_ids == b.token_ids
            assert a.finish_reason == b.finish_reason == "length"
            torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs))
        assert [len(g.token_ids) for g in ours] == [12, 5, 12, 1]

    def test_same_with_stop_strings_and_eos_after(self, varied_model, smollm2_tokenizer):
        tiny_model = varied_model
        prompts = prompts_of(smollm2_tokenizer)
        free = KVCacheGenerator(tiny_model, smollm2_tokenizer).generate(
            prompts, SamplingParams(max_new_tokens=10, greedy=True, stop_strings=())
        )
        # A stop string that spans generated tokens 2..4 of row 1 and ends inside token 4.
        text = smollm2_tokenizer.decode(free[1].token_ids[2:5])
        stop = text[:-1] if len(smollm2_tokenizer.decode(free[1].token_ids[4:5])) > 1 else text
        params = SamplingParams(max_new_tokens=10, greedy=True, stop_strings=(stop,), eos_after=(stop,))
        for drop in (True, False):
            ours = KVCacheGenerator(tiny_model, smollm2_tokenizer, drop_finished=drop).generate(prompts, params)
            reference = HFGenerator(tiny_model, smollm2_tokenizer).generate(prompts, params)
            for a, b in zip(ours, reference):
                assert (a.token_ids, a.finish_reason, a.stop_string) == (b.token_ids, b.finish_reason, b.stop_string)
                torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs))
        row = ours[1]
        # Kept up to and including the token that completes the stop, then EOS appended.
        assert row.finish_reason == "stop" and row.stop_string == stop
        assert row.token_ids == [*free[1].token_ids[:5], smollm2_tokenizer.eos_token_id]
        expected = fresh_logprobs(tiny_model, prompts[1], row.token_ids, 1.0)
        torch.testing.assert_close(torch.tensor(row.logprobs), expected)


class TestSamplingLogprobs:
    @pytest.mark.parametrize(("temperature", "top_p"), [(1.0, 1.0), (0.7, 0.9)])
    def test_equal_fresh_forward(self, tiny_model, smollm2_tokenizer, temperature, top_p):
        prompts = prompts_of(smollm2_tokenizer)
        params = SamplingParams(max_new_tokens=10, temperature=temperature, top_p=top_p, stop_strings=())
        generations = KVCacheGenerator(tiny_model, smollm2_tokenizer, seed=3).generate(prompts, params)
        for prompt, generation in zip(prompts, generations):
            expected = fresh_logprobs(tiny_model, prompt, generation.token_ids, temperature)
            torch.testing.assert_close(torch.tensor(generation.logprobs), expected)

    def test_hf_backend_sampled_logprobs_equal_fresh_forward(self, tiny_model, smollm2_tokenizer):
        prompts = prompts_of(smollm2_tokenizer)
        params = SamplingParams(max_new_tokens=6, temperature=0.7, top_p=0.9, stop_strings=())
        for prompt, generation in zip(
            prompts, HFGenerator(tiny_model, smollm2_tokenizer, seed=3).generate(prompts, params)
        ):
            expected = fresh_logprobs(tiny_model, prompt, generation.token_ids, 0.7)
            torch.testing.assert_close(torch.tensor(generation.logprobs), expected)

    def test_seeded_and_reproducible(self, tiny_model, smollm2_tokenizer):
        prompts = prompts_of(smollm2_tokenizer)
        params = SamplingParams(max_new_tokens=8, stop_strings=())

        def run(seed):
            return [
                g.token_ids
                for g in KVCacheGenerator(tiny_model, smollm2_tokenizer, seed=seed).generate(prompts, params)
            ]

        assert run(1) == run(1)
        assert run(1) != run(2)

    def test_top_p_tiny_keeps_only_argmax(self, tiny_model, smollm2_tokenizer):
        prompts = prompts_of(smollm2_tokenizer)
        greedy = KVCacheGenerator(tiny_model, smollm2_tokenizer).generate(
            prompts, SamplingParams(max_new_tokens=6, greedy=True, stop_strings=())
        )
        nucleus = KVCacheGenerator(tiny_model, smollm2_tokenizer, seed=5).generate(
            prompts, SamplingParams(max_new_tokens=6, top_p=1e-6, stop_strings=())
        )
        assert [g.token_ids for g in greedy] == [g.token_ids for g in nucleus]


class TestEosAndBudgets:
    def test_eos_is_kept_and_ends_the_row(self, varied_model, smollm2_tokenizer):
        tiny_model = varied_model
        prompts = prompts_of(smollm2_tokenizer)
        free = KVCacheGenerator(tiny_model, smollm2_tokenizer).generate(
            prompts, SamplingParams(max_new_tokens=6, greedy=True, stop_strings=())
        )
        # Declare the row-0 token at step 3 to be the EOS: the row must end right there.
        fake_eos = free[0].token_ids[3]
        generator = KVCacheGenerator(tiny_model, smollm2_tokenizer)
        generator.eos_ids = {fake_eos}
        out = generator.generate(prompts, SamplingParams(max_new_tokens=6, greedy=True, stop_strings=()))
        first = free[0].token_ids.index(fake_eos)
        assert out[0].token_ids == free[0].token_ids[: first + 1]
        assert out[0].finish_reason == "eos"

    def test_zero_budget_rows(self, tiny_model, smollm2_tokenizer):
        prompts = prompts_of(smollm2_tokenizer)[:2]
        params = SamplingParams(max_new_tokens=4, greedy=True, stop_strings=())
        for backend in (KVCacheGenerator, HFGenerator):
            out = backend(tiny_model, smollm2_tokenizer).generate(prompts, params, [0, 3])
            assert out[0].token_ids == [] and out[0].finish_reason == "length"
            assert len(out[1].token_ids) == 3

    def test_bad_input_is_a_clear_error(self, tiny_model, smollm2_tokenizer):
        generator = KVCacheGenerator(tiny_model, smollm2_tokenizer)
        with pytest.raises(ValueError, match="prompt 1 is empty"):
            generator.generate([[1, 2], []], SamplingParams(max_new_tokens=2))
        with pytest.raises(ValueError, match="max_new_tokens has 1 entries for 2 prompts"):
            generator.generate([[1], [2]], SamplingParams(max_new_tokens=2), [1])

    @pytest.mark.parametrize(
        ("kwargs", "message"),
        [
            ({"temperature": 0.0}, "temperature must be > 0"),
            ({"top_p": 0.0}, "top_p"),
            ({"max_new_tokens": 0}, "max_new_tokens"),
            ({"stop_strings": ("",)}, "empty string"),
            ({"eos_after": ("</x>",)}, "must also be in stop_strings"),
        ],
    )
    def test_params_validation(self, kwargs, message):
        with pytest.raises(ValueError, match=message):
            SamplingParams(**kwargs)


class TestStopMatcher:
    def test_stop_spanning_and_inside_tokens(self, smollm2_tokenizer):
        matcher = StopMatcher(smollm2_tokenizer, ["</search>", "</answer>"])
        ids = smollm2_tokenizer("<search> q </search>", add_special_tokens=False)["input_ids"]
        # No prefix of the tokens completes the stop except the full sequence.
        assert [matcher.check(ids[: i + 1]) for i in range(len(ids))] == [None] * (len(ids) - 1) + ["</search>"]
        # "</answer>." ends inside a token when the final piece merges punctuation.
        ids = smollm2_tokenizer("x</answer>.\n", add_special_tokens=False)["input_ids"]
        hits = [matcher.check(ids[: i + 1]) for i in range(len(ids))]
        assert hits[-1] == "</answer>" and hits.count(None) >= 1


class TestInverseCdfSampler:
    def test_frequencies_follow_the_weights_and_zero_weights_never_come(self):
        from stratarl.rollout.generation import sample_categorical

        # Unnormalised weights with zeros at both ends and inside; 200k draws per row.
        weights = torch.tensor([[0.0, 1.0, 0.0, 6.0, 3.0, 0.0], [0.0, 0.0, 0.0, 0.0, 0.0, 2.0]])
        generator = torch.Generator().manual_seed(0)
        draws = sample_categorical(weights.repeat_interleave(100_000, dim=0), generator).view(2, -1)
        first = torch.bincount(draws[0], minlength=6).double() / draws.shape[1]
        torch.testing.assert_close(
            first, torch.tensor([0.0, 0.1, 0.0, 0.6, 0.3, 0.0], dtype=torch.float64), atol=5e-3, rtol=0
        )  # 5 standard errors at n = 100k
        assert (draws[1] == 5).all()

    def test_seeded_draws_repeat(self):
        from stratarl.rollout.generation import sample_categorical

        probs = torch.softmax(torch.randn(8, 50, generator=torch.Generator().manual_seed(1)), -1)
        a = sample_categorical(probs, torch.Generator().manual_seed(7))
        b = sample_categorical(probs, torch.Generator().manual_seed(7))
        assert torch.equal(a, b) and a.dtype == torch.long and a.shape == (8,)

    @pytest.mark.parametrize("bad", [float("nan"), float("inf"), 0.0])
    def test_invalid_weights_are_an_error(self, bad):
        from stratarl.rollout.generation import sample_categorical

        weights = torch.tensor([[0.5, 0.5], [bad, 0.0 if bad == 0.0 else 1.0]])
        with pytest.raises(ValueError, match="finite and non-negative"):
            sample_categorical(weights, None)
