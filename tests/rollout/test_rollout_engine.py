"""The rollout engine with a scripted generator (exact protocol checks) and with the
tiny Llama + KV-cache generator (log-probs equal a fresh forward pass)."""

from __future__ import annotations

import pytest
import torch
from rollout_fakes import DictRetriever, FailingRetriever, ScriptedGenerator

from stratarl.retrieval.base import Passage
from stratarl.rollout import (
    INVALID_ACTION_OBSERVATION,
    KVCacheGenerator,
    RolloutConfig,
    RolloutEngine,
    information_observation,
    rollout_metrics,
    transcript,
    transcript_text,
)
from stratarl.rollout.parsing import INFORMATION_SUFFIX, TRUNCATION_MARKER

P1, P2, P3 = (101, 102), (201, 202, 203), (301,)


def run(tokenizer, scripts, retriever=None, **config):
    generator = ScriptedGenerator(tokenizer, scripts)
    engine = RolloutEngine(generator, retriever or DictRetriever(), tokenizer, RolloutConfig(**config))
    return engine.run([list(k) for k in scripts]), generator


def decode(tokenizer, ids):
    return tokenizer.decode(ids, skip_special_tokens=False)


def zero_runs(mask):
    """Number of maximal runs of 0s in a mask (observation blocks)."""
    return sum(1 for i, m in enumerate(mask) if m == 0 and (i == 0 or mask[i - 1] == 1))


def check_invariants(rollout, tokenizer):
    n = len(rollout.response_ids)
    assert len(rollout.response_mask) == len(rollout.sampling_logprobs) == n
    # Turn spans are exactly the runs of 1s, in order; everything else is observation.
    ones = [i for i, m in enumerate(rollout.response_mask) if m == 1]
    assert ones == [i for start, end in rollout.turn_spans for i in range(start, end)]
    for i, m in enumerate(rollout.response_mask):
        if m == 0:
            assert rollout.sampling_logprobs[i] == 0.0
    # Observation blocks = searches + invalid-action feedback that was appended.
    blocks = [t.observation_span for t in rollout.turns if t.observation_span is not None]
    assert zero_runs(rollout.response_mask) == len(blocks)
    info_blocks = [
        s for s in blocks if decode(tokenizer, rollout.response_ids[s[0] : s[1]]).startswith("\n\n<information>")
    ]
    assert rollout.num_searches == len(info_blocks) == len(rollout.queries) == len(rollout.passages)
    assert rollout.response_text == decode(tokenizer, rollout.response_ids)


class TestProtocol:
    def test_search_then_answer(self, smollm2_tokenizer):
        tok = smollm2_tokenizer
        scripts = {
            P1: [
                "<think>need info</think><search> capital of France </search>",
                "<think>got it</think><answer> Paris </answer>",
            ]
        }
        (rollout,), generator = run(tok, scripts)
        check_invariants(rollout, tok)
        assert rollout.queries == ["capital of France"]
        assert [p.id for p in rollout.passages[0]] == [
            "capital of France#0",
            "capital of France#1",
            "capital of France#2",
        ]
        assert (rollout.answered, rollout.answer, rollout.end_reason) == (True, "Paris", "answer")
        assert not rollout.truncated and not rollout.hit_max_turns
        # Text lines up with the mask: policy runs are the scripted turns (+ EOS after the
        # answer), the observation run is the byte-exact information block.
        first, second = rollout.turn_spans
        obs_start, obs_end = rollout.turns[0].observation_span
        assert decode(tok, rollout.response_ids[slice(*first)]) == scripts[P1][0]
        assert decode(tok, rollout.response_ids[obs_start:obs_end]) == information_observation(rollout.passages[0])
        assert decode(tok, rollout.response_ids[slice(*second)]) == scripts[P1][1] + tok.eos_token
        assert (first[1], obs_end) == (obs_start, second[0])
        # Each turn's log-probs landed on its own tokens (scripted as -(j+1)/100).
        for start, end in rollout.turn_spans:
            assert rollout.sampling_logprobs[start:end] == [-(j + 1) / 100 for j in range(end - start)]
        # Turn 2's input is prompt + the exact response tokens so far (no re-tokenization).
        assert generator.calls[1]["inputs"][0] == list(P1) + rollout.response_ids[: second[0]]

    def test_invalid_action_gets_feedback_and_continues(self, smollm2_tokenizer):
        tok = smollm2_tokenizer
        (rollout,), _ = run(tok, {P1: ["I think it is Paris.", "<answer>Paris</answer>"]})
        check_invariants(rollout, tok)
        assert rollout.invalid_actions == 1 and rollout.num_searches == 0 and rollout.answered
        span = rollout.turns[0].observation_span
        assert decode(tok, rollout.response_ids[span[0] : span[1]]) == INVALID_ACTION_OBSERVATION

    def test_eos_without_action_is_invalid_and_the_loop_goes_on(self, smollm2_tokenizer):
        # Search-R1 (generation.py, a14dc3a): a turn without an action gets the feedback, whatever ended it,
        # and its decode with skip_special_tokens=True drops the EOS token before the next turn.
        tok = smollm2_tokenizer
        (rollout,), generator = run(tok, {P1: ["just text<EOS>", "<answer>x</answer>"]})
        check_invariants(rollout, tok)
        assert (rollout.end_reason, rollout.answer, rollout.invalid_actions) == ("answer", "x", 1)
        first = rollout.turns[0]
        assert (
            first.finish_reason == "eos" and decode(tok, rollout.response_ids[first.start : first.end]) == "just text"
        )
        assert decode(tok, rollout.response_ids[slice(*first.observation_span)]) == INVALID_ACTION_OBSERVATION
        assert tok.eos_token_id not in generator.calls[1]["inputs"][0]

    def test_a_turn_of_eos_alone_keeps_its_token(self, smollm2_tokenizer):
        # Dropping it would leave an empty policy turn and merge two observations into one run of the mask.
        tok = smollm2_tokenizer
        (rollout,), _ = run(tok, {P1: ["<EOS>", "<answer>x</answer>"]})
        check_invariants(rollout, tok)
        first = rollout.turns[0]
        assert rollout.response_ids[first.start : first.end] == [tok.eos_token_id] and rollout.answer == "x"

    def test_eos_without_action_ends_the_rollout_with_stop_on_eos(self, smollm2_tokenizer):
        (rollout,), _ = run(smollm2_tokenizer, {P1: ["just text<EOS>", "<answer>x</answer>"]}, stop_on_eos=True)
        check_invariants(rollout, smollm2_tokenizer)
        assert (rollout.end_reason, rollout.answered, rollout.answer) == ("eos", False, None)
        assert rollout.response_ids[-1] == smollm2_tokenizer.eos_token_id and rollout.response_mask[-1] == 1

    def test_eos_in_the_last_turn_ends_the_rollout(self, smollm2_tokenizer):
        (rollout,), _ = run(smollm2_tokenizer, {P1: ["just text<EOS>"]}, max_turns=0)
        assert (rollout.end_reason, rollout.answered, len(rollout.turns)) == ("eos", False, 1)
        assert rollout.response_ids[-1] == smollm2_tokenizer.eos_token_id and 0 not in rollout.response_mask

    def test_max_turns_counts_search_turns_then_one_final_turn(self, smollm2_tokenizer):
        # Search-R1's run_llm_loop: `for step in range(max_turns)` may search, then one final turn without.
        tok = smollm2_tokenizer
        retriever = DictRetriever()
        scripts = {P1: ["<search>a</search>", "<search>b</search>", "<search>c</search>"]}
        (rollout,), generator = run(tok, scripts, retriever, max_turns=2)
        assert len(generator.calls) == 3 and rollout.queries == ["a", "b"]
        assert [c[0] for c in retriever.calls] == [["a"], ["b"]]
        assert (rollout.hit_max_turns, rollout.end_reason) == (True, "max_turns")

    def test_last_turn_search_is_not_run(self, smollm2_tokenizer):
        tok = smollm2_tokenizer
        retriever = DictRetriever()
        (rollout,), _generator = run(tok, {P1: ["<search>a</search>", "<search>b</search>"]}, retriever, max_turns=1)
        check_invariants(rollout, tok)
        assert rollout.queries == ["a"] and [c[0] for c in retriever.calls] == [["a"]]
        assert (rollout.hit_max_turns, rollout.answered, rollout.end_reason) == (True, False, "max_turns")
        assert rollout.turns[-1].action.kind == "search" and rollout.turns[-1].observation_span is None
        assert rollout.response_mask[-1] == 1  # ends on the policy's own tokens, no observation

    def test_last_turn_invalid_gets_no_feedback(self, smollm2_tokenizer):
        (rollout,), _ = run(smollm2_tokenizer, {P1: ["hmm"]}, max_turns=0)
        assert rollout.invalid_actions == 1 and rollout.hit_max_turns and 0 not in rollout.response_mask

    def test_batch_of_mixed_rollouts_in_one_call_per_turn(self, smollm2_tokenizer):
        tok = smollm2_tokenizer
        scripts = {
            P1: ["<search>q1</search>", "<answer>a</answer>"],
            P2: ["<answer>b</answer>"],
            P3: ["<search>q3</search>", "<search>q4</search>", "<answer>c</answer>"],
        }
        retriever = DictRetriever()
        rollouts, generator = run(tok, scripts, retriever)
        assert [c["batch"] for c in generator.calls] == [3, 2, 1]  # live rollouts batched per turn
        assert [c[0] for c in retriever.calls] == [["q1", "q3"], ["q4"]]  # one retriever call per turn
        assert [r.num_searches for r in rollouts] == [1, 0, 2]
        assert [r.answer for r in rollouts] == ["a", "b", "c"]
        for rollout in rollouts:
            check_invariants(rollout, tok)
        metrics = rollout_metrics(rollouts)
        assert metrics["rollout/search_calls_mean"] == pytest.approx(1.0)
        assert metrics["rollout/answered_rate"] == 1.0 and metrics["rollout/tool_errors"] == 0.0
        assert metrics["rollout/turns_mean"] == pytest.approx(2.0)


class TestBudgets:
    def test_turn_budget(self, smollm2_tokenizer):
        tok = smollm2_tokenizer
        long_turn = "word " * 40
        scripts = {P1: [long_turn, long_turn, "<answer>x</answer>", "<answer> a long final answer </answer>"]}
        (rollout,), generator = run(tok, scripts, max_tokens_per_turn=7)
        assert all(b <= 7 for call in generator.calls for b in call["budgets"])
        # Cut turns are invalid actions; "<answer>x</answer>" is exactly 7 tokens, so it
        # answers, and EOS is not appended because the turn's budget is spent.
        assert [end - start for start, end in rollout.turn_spans] == [7, 7, 7]
        assert rollout.invalid_actions == 2 and rollout.answered and rollout.response_ids[-1] != tok.eos_token_id
        check_invariants(rollout, tok)

    def test_observation_cap_with_visible_marker(self, smollm2_tokenizer):
        tok = smollm2_tokenizer
        retriever = DictRetriever(text_words=200)
        (rollout,), _ = run(tok, {P1: ["<search>q</search>", "<answer>x</answer>"]}, retriever, max_obs_tokens=40)
        start, end = rollout.turns[0].observation_span
        text = decode(tok, rollout.response_ids[start:end])
        assert end - start == 40
        assert text.startswith("\n\n<information>Doc 1(Title:")
        assert text.endswith(TRUNCATION_MARKER + INFORMATION_SUFFIX)
        assert rollout.truncated_observations == 1 and rollout.answered
        check_invariants(rollout, tok)

    def test_total_budget(self, smollm2_tokenizer):
        tok = smollm2_tokenizer
        scripts = {P1: ["<search>q</search>", "<answer>x</answer>"]}
        (rollout,), generator = run(tok, scripts, DictRetriever(text_words=50), max_total_tokens=30)
        assert rollout.total_length == 30
        assert (rollout.truncated, rollout.end_reason, rollout.answered) == (True, "max_length", False)
        check_invariants(rollout, tok)
        # Per-call budgets never exceed the room left.
        assert generator.calls[0]["budgets"] == [30 - len(P1)]

    def test_prompt_too_long_is_a_clear_error(self, smollm2_tokenizer):
        with pytest.raises(ValueError, match="max_total_tokens=2"):
            run(smollm2_tokenizer, {P2: ["x"]}, max_total_tokens=2)

    @pytest.mark.parametrize(("field", "value"), [("max_turns", -1), ("topk", 0), ("max_obs_tokens", 3)])
    def test_config_validation(self, field, value):
        with pytest.raises(ValueError, match=f"RolloutConfig.{field}"):
            RolloutConfig(**{field: value})


class TestRetrieverCalls:
    def test_topk_is_asked_and_every_returned_hit_is_shown(self, smollm2_tokenizer):
        # Search-R1 sends topk to the server and formats every hit it returns (_passages2string);
        # its SerpAPI server returns up to 7 for topk 3.
        class Generous(DictRetriever):
            def search(self, queries, k):
                self.calls.append((list(queries), k))
                return [[Passage(f"{q}#{i}", f'"T{i}"\nfact {i}.') for i in range(7)] for q in queries]

        tok = smollm2_tokenizer
        retriever = Generous()
        (rollout,), _ = run(tok, {P1: ["<search>q</search>", "<answer>x</answer>"]}, retriever, topk=3)
        assert retriever.calls == [(["q"], 3)]
        assert [p.id for p in rollout.passages[0]] == [f"q#{i}" for i in range(7)]
        observation = decode(tok, rollout.response_ids[slice(*rollout.turns[0].observation_span)])
        assert (
            observation == information_observation(rollout.passages[0]) and 'Doc 7(Title: "T6") fact 6.' in observation
        )


class TestToolErrors:
    @pytest.mark.parametrize(
        "retriever", [FailingRetriever(ConnectionError("retriever down")), FailingRetriever(TimeoutError("timed out"))]
    )
    def test_failure_becomes_observation(self, smollm2_tokenizer, retriever):
        tok = smollm2_tokenizer
        (rollout,), _ = run(tok, {P1: ["<search>q</search>", "<answer>x</answer>"]}, retriever)
        start, end = rollout.turns[0].observation_span
        text = decode(tok, rollout.response_ids[start:end])
        assert text.startswith("\n\n<information>Search failed (") and type(retriever.error).__name__ in text
        assert (rollout.tool_errors, rollout.num_searches, rollout.passages, rollout.answered) == (1, 1, [[]], True)
        assert rollout_metrics([rollout])["rollout/tool_errors"] == 1.0
        check_invariants(rollout, tok)

    def test_wrong_number_of_result_lists(self, smollm2_tokenizer):
        class Short:
            def search(self, queries, k):
                return []

        (rollout,), _ = run(smollm2_tokenizer, {P1: ["<search>q</search>", "<answer>x</answer>"]}, Short())
        assert rollout.tool_errors == 1
        assert "retriever returned 0 result lists for 1 queries" in rollout.response_text


class TestTranscript:
    def test_transcript_records_everything(self, smollm2_tokenizer):
        tok = smollm2_tokenizer
        (rollout,), _ = run(tok, {P1: ["<search>q</search>", "<answer>x</answer>"]})
        record = transcript(rollout, tok, reward=1.0, golds=["x"])
        assert [t["action"] for t in record["turns"]] == ["search", "answer"]
        assert record["turns"][0]["observation"].startswith("\n\n<information>")
        assert record["searches"][0]["query"] == "q" and len(record["searches"][0]["passages"]) == 3
        assert (record["answer"], record["reward"], record["num_searches"]) == ("x", 1.0, 1)
        assert [s[2] for s in record["mask_segments"]] == [1, 0, 1]
        text = transcript_text(rollout, tok, reward=1.0)
        assert "[observation" in text and "mask=0" in text and "reward=1.0" in text


class TestWithTinyModel:
    def test_sampling_logprobs_equal_fresh_forward(self, tiny_model, smollm2_tokenizer):
        """The first PPO step is exactly on-policy: the log-probs stored at sampling
        time equal a fresh forward pass over prompt + response (observations included)."""
        tok = smollm2_tokenizer
        temperature = 0.8
        generator = KVCacheGenerator(tiny_model, tok, seed=0)
        engine = RolloutEngine(
            generator, DictRetriever(), tok, RolloutConfig(max_turns=2, max_tokens_per_turn=6, temperature=temperature)
        )
        prompts = [
            tok("Question: who?", add_special_tokens=False)["input_ids"],
            tok("x y z", add_special_tokens=False)["input_ids"],
        ]
        rollouts = engine.run(prompts)
        # The third turn read only the new feedback: the rest of each history (all but turn 2's
        # last token, never fed) came from the prefix cache.
        third_turn_reused = 0
        for prompt, rollout in zip(prompts, rollouts):
            mask = rollout.response_mask
            last_feedback_end = max(i for i, m in enumerate(mask) if m == 0) + 1
            last_feedback_len = last_feedback_end - max(i for i in range(last_feedback_end) if mask[i] == 1) - 1
            third_turn_reused += len(prompt) + last_feedback_end - last_feedback_len - 1
        assert generator.last_reused_tokens == third_turn_reused
        for prompt, rollout in zip(prompts, rollouts):
            check_invariants(rollout, tok)
            # The random model writes no tags: every turn but the last gets invalid feedback.
            assert rollout.invalid_actions == 3 and zero_runs(rollout.response_mask) == 2 and rollout.hit_max_turns
            ids = torch.tensor([prompt + rollout.response_ids])
            with torch.no_grad():
                logits = tiny_model(input_ids=ids).logits[0, len(prompt) - 1 : -1].float()
            logp = torch.log_softmax(logits / temperature, dim=-1).gather(
                -1, torch.tensor(rollout.response_ids)[:, None]
            )[:, 0]
            mask = torch.tensor(rollout.response_mask, dtype=torch.bool)
            torch.testing.assert_close(torch.tensor(rollout.sampling_logprobs)[mask], logp[mask])
