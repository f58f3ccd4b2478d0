"""The word-level tokenizer and tiny model for the synthetic task (stratarl.data.wordlevel)."""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from stratarl.data.synth import generate_knowledge_base
from stratarl.data.wordlevel import (
    IM_END,
    PROTOCOL_TAGS,
    SPECIAL_TOKENS,
    build_word_model,
    build_word_tokenizer,
    count_pieces,
    unknown_words,
    word_tokenizer_for_kb,
)
from stratarl.rewards import em_reward, extract_answer, normalize_answer
from stratarl.rollout.generation import Generation, Generator, KVCacheGenerator, SamplingParams, StopMatcher
from stratarl.rollout.parsing import STOP_STRINGS, Action, information_observation, parse_action
from stratarl.rollout.prompt import build_prompt, encode_prompt


@pytest.fixture(scope="module")
def kb():
    return generate_knowledge_base(seed=0, size="small")


@pytest.fixture(scope="module")
def tokenizer(kb):
    return word_tokenizer_for_kb(kb)


def ids_of(tokenizer, text: str) -> list[int]:
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


# --------------------------------------------------------------------------- the split


def test_pieces_keep_one_leading_space_and_split_digits_and_punctuation():
    # Hand-derived from PIECE_PATTERN: letters runs carry one leading space; each digit
    # and each punctuation mark is its own piece; the second space and "\n" stand alone.
    tok = build_word_tokenizer(["Ann's  (1850) city\nX"])
    pieces = tok.convert_ids_to_tokens(ids_of(tok, "Ann's  (1850) city\nX"))
    assert pieces == ["Ann", "'", "s", " ", " (", "1", "8", "5", "0", ")", " city", "\n", "X"]


def test_decode_keeps_spaces_before_punctuation():
    # transformers' clean_up_tokenization_spaces would turn " ." into "." and " 's" into "'s".
    text = "a . b , c ? it 's"
    tok = build_word_tokenizer([text])
    assert tok.decode(ids_of(tok, text)) == text


def test_every_word_gets_both_spellings_and_counts_ignore_the_space():
    tok = build_word_tokenizer(["mid city"])
    vocab = tok.get_vocab()
    assert {"city", " city", "mid", " mid"} <= set(vocab)
    assert unknown_words(tok, "city mid\ncity") == []
    assert count_pieces(["a city", "city"]) == Counter({"city": 2, "a": 1})


def test_piece_counts_do_not_depend_on_batching():
    # By hand: "the", "city" twice each, "x" once, "\n" once (inside the second text),
    # "<search>" is an added token and not counted; "." once.
    texts = ["the city", "x\n<search>the city."]
    expected = Counter({"the": 2, "city": 2, "x": 1, "\n": 1, ".": 1})
    for batch_chars in (1, 5, 1 << 20):
        assert count_pieces(texts, batch_chars=batch_chars) == expected


@pytest.mark.parametrize(
    "text",
    [
        "plain ascii: Ann's  (1850) city\n\tX_y",
        "(1850\u20131910) \u00e9cole caf\u00e9",  # en-dash, precomposed accents: both engines agree
        "e\u0301cole x\u00b2 \u2167 a\u203fb \x1cz",  # combining mark, No, Nl, Pc, \x1c: they do not
    ],
)
def test_split_pieces_matches_the_tokenizers_pre_tokenizer(text):
    from stratarl.data.wordlevel import _pre_tokenizer, split_pieces

    assert split_pieces(text) == [piece for piece, _ in _pre_tokenizer().pre_tokenize_str(text)]
    assert "".join(split_pieces(text)) == text


def test_words_with_combining_marks_are_counted_as_the_tokenizer_splits_them():
    text = "e\u0301cole x\u00b2 \u2167"
    tok = build_word_tokenizer([text])
    assert unknown_words(tok, text) == []
    assert tok.decode(ids_of(tok, text)) == text


def test_digits_and_punctuation_always_encode():
    tok = build_word_tokenizer([])
    assert unknown_words(tok, "Doc 10(: 1,234.5; [7]") == ["Doc"]


def test_unknown_words_become_unk_and_are_reported(tokenizer):
    text = "city qwxyzzy country"
    assert unknown_words(tokenizer, text) == ["qwxyzzy"]
    assert tokenizer.unk_token_id in ids_of(tokenizer, text)
    assert unknown_words(tokenizer, "a [UNK] in the text is not a city") == []


def test_min_freq_and_max_vocab_keep_the_most_frequent_words():
    texts = ["common common common rare mid mid"]
    full = build_word_tokenizer(texts)
    assert unknown_words(full, "rare") == []
    assert unknown_words(build_word_tokenizer(texts, min_freq=2), "common mid rare") == ["rare"]
    # max_vocab = the fixed part + 2: room for one word in both spellings, the most frequent.
    fixed = len(build_word_tokenizer([]))
    capped = build_word_tokenizer(texts, max_vocab=fixed + 2)
    assert len(capped) == fixed + 2
    assert unknown_words(capped, "common mid rare") == ["mid", "rare"]


def test_bad_arguments_are_clear_errors():
    with pytest.raises(ValueError, match="max_vocab=10 is smaller"):
        build_word_tokenizer(["x"], max_vocab=10)
    with pytest.raises(ValueError, match="min_freq must be >= 1"):
        build_word_tokenizer(["x"], min_freq=0)
    with pytest.raises(TypeError, match=r"texts\[1\] must be a string"):
        build_word_tokenizer(["x", None])


def test_same_texts_give_the_same_vocabulary(kb):
    assert word_tokenizer_for_kb(kb).get_vocab() == word_tokenizer_for_kb(kb).get_vocab()


# --------------------------------------------------------------------------- coverage of the task


def test_every_passage_question_and_answer_round_trips_without_unk(tokenizer, kb):
    unk = tokenizer.unk_token_id
    texts = [p.contents for p in kb.passages]
    texts += [e.question for e in kb.train + kb.test]
    texts += [hop["query"] for e in kb.train + kb.test for hop in e.metadata["hops"]]
    for text in texts:
        ids = ids_of(tokenizer, text)
        assert unk not in ids, (text, unknown_words(tokenizer, text))
        assert tokenizer.decode(ids) == text
    for example in kb.train + kb.test:
        for gold in example.golden_answers:
            decoded = tokenizer.decode(ids_of(tokenizer, f"<answer> {gold} </answer>"))
            assert normalize_answer(extract_answer(decoded)) == normalize_answer(gold)


def test_lowercase_mode_round_trips_up_to_case(kb):
    tok = word_tokenizer_for_kb(kb, lowercase=True)
    assert len(tok) < len(word_tokenizer_for_kb(kb))
    for passage in kb.passages[:100]:
        decoded = tok.decode(ids_of(tok, passage.contents))
        assert decoded == passage.contents.lower()
        assert normalize_answer(decoded) == normalize_answer(passage.contents)
    # Tags and special tokens are matched before lower-casing and keep their ids.
    assert ids_of(tok, "<search>") == [tok.convert_tokens_to_ids("<search>")]


def test_trainer_demonstration_phrases_are_covered(tokenizer):
    from stratarl.trainer.warmstart.render import ANSWER_THOUGHT, SEARCH_THOUGHT

    assert unknown_words(tokenizer, SEARCH_THOUGHT + ANSWER_THOUGHT) == []


# --------------------------------------------------------------------------- protocol


@pytest.mark.parametrize("tag", PROTOCOL_TAGS + SPECIAL_TOKENS)
def test_tags_and_special_tokens_are_single_tokens(tokenizer, tag):
    ids = ids_of(tokenizer, f"city {tag} country{tag}city")
    assert ids.count(tokenizer.convert_tokens_to_ids(tag)) == 2
    assert ids_of(tokenizer, tag) == [tokenizer.convert_tokens_to_ids(tag)]


def test_tags_survive_skipping_special_tokens_and_eos_is_im_end(tokenizer, kb):
    answer = f"<answer> {kb.test[0].golden_answers[0]} </answer>"
    ids = [*ids_of(tokenizer, answer), tokenizer.eos_token_id]
    assert tokenizer.eos_token == IM_END
    assert tokenizer.decode(ids, skip_special_tokens=True) == answer
    assert tokenizer.decode(ids) == answer + IM_END
    assert tokenizer.pad_token_id != tokenizer.eos_token_id


def test_rendered_prompt_is_one_user_message_containing_the_question(tokenizer, kb):
    question = kb.test[0].question
    ids = encode_prompt(tokenizer, question)
    assert tokenizer.unk_token_id not in ids
    text = tokenizer.decode(ids)
    assert text == f"<|im_start|>user\n{build_prompt(question)}<|im_end|>\n<|im_start|>assistant\n"
    assert question in text


def test_scripted_trajectory_parses_to_the_same_actions(tokenizer, kb):
    example = next(e for e in kb.train if len(e.metadata["hops"]) == 2)
    by_id = {p.id: p for p in kb.passages}
    response: list[int] = []
    for hop in example.metadata["hops"]:
        turn = f"<think> I need to look this up. </think>\n<search> {hop['query']} </search>"
        turn_ids = ids_of(tokenizer, turn)
        # What the engine and the generator see: the decoded turn and its stop string.
        assert parse_action(tokenizer.decode(turn_ids)) == Action("search", hop["query"])
        assert StopMatcher(tokenizer, STOP_STRINGS).check(turn_ids) == "</search>"
        assert StopMatcher(tokenizer, STOP_STRINGS).check(turn_ids[:-1]) is None
        observation = information_observation([by_id[hop["passage_id"]]])
        assert unknown_words(tokenizer, observation) == []
        response += turn_ids + ids_of(tokenizer, observation)
    final = f"<think> I have the answer. </think>\n<answer> {example.golden_answers[0]} </answer>"
    response += [*ids_of(tokenizer, final), tokenizer.eos_token_id]
    text = tokenizer.decode(response, skip_special_tokens=False)
    assert parse_action(tokenizer.decode(ids_of(tokenizer, final))) == Action("answer", example.golden_answers[0])
    assert em_reward(text, example.golden_answers) == 1.0


def test_rollout_engine_runs_over_the_word_tokenizer_without_unk(tokenizer, kb):
    from stratarl.rollout.engine import RolloutConfig, RolloutEngine

    example = next(e for e in kb.train if len(e.metadata["hops"]) == 2)
    hops = example.metadata["hops"]
    turns = [f"<search> {h['query']} </search>" for h in hops] + [
        "<think> I have the answer. </think>",
        f"<answer> {example.golden_answers[0]} </answer>",
    ]
    by_id = {p.id: p for p in kb.passages}

    class Scripted(Generator):
        played = 0

        def generate(self, prompts, params, max_new_tokens=None):
            ids = ids_of(tokenizer, turns[self.played])
            self.played += 1
            return [Generation(ids, [0.0] * len(ids), "stop")]

    class GoldRetriever:
        def search(self, queries, k):
            return [[by_id[next(h["passage_id"] for h in hops if h["query"] == q)]] for q in queries]

    engine = RolloutEngine(Scripted(), GoldRetriever(), tokenizer, RolloutConfig(max_turns=3, topk=1))
    [rollout] = engine.run([encode_prompt(tokenizer, example.question)])
    assert rollout.queries == [h["query"] for h in hops]
    assert rollout.invalid_actions == 1 and rollout.answer == example.golden_answers[0]
    assert tokenizer.unk_token_id not in rollout.response_ids  # observations and feedback included
    assert em_reward(rollout.response_text, example.golden_answers) == 1.0


# --------------------------------------------------------------------------- save / load, model


def test_save_and_load_round_trip_writes_no_pickles(tokenizer, kb, tmp_path):
    from stratarl.models import load_tokenizer

    tokenizer.save_pretrained(tmp_path)
    assert (tmp_path / "tokenizer.json").is_file()
    assert not [p for p in tmp_path.iterdir() if p.suffix in (".bin", ".pkl", ".pt", ".model")]
    loaded = load_tokenizer(str(tmp_path))
    assert loaded.get_vocab() == tokenizer.get_vocab()
    assert (loaded.eos_token_id, loaded.pad_token_id, loaded.unk_token_id) == (
        tokenizer.eos_token_id,
        tokenizer.pad_token_id,
        tokenizer.unk_token_id,
    )
    question = kb.test[1].question
    assert encode_prompt(loaded, question) == encode_prompt(tokenizer, question)
    text = kb.passages[7].contents + "  \n<search> city , city . country ? </search>"
    assert ids_of(loaded, text) == ids_of(tokenizer, text)
    assert loaded.decode(ids_of(loaded, text)) == text


def test_word_model_forward_backward_and_generation(tokenizer, kb, tmp_path):
    from stratarl.models import load_model

    model = build_word_model(tokenizer, hidden_size=32, num_layers=2, num_heads=4)
    assert model.config.vocab_size == len(tokenizer)
    assert model.config.intermediate_size == 128  # 4 * hidden_size
    ids = torch.tensor([encode_prompt(tokenizer, kb.test[0].question)])
    out = model(input_ids=ids, labels=ids)
    assert out.logits.shape == (1, ids.shape[1], len(tokenizer))
    assert torch.isfinite(out.loss)
    out.loss.backward()
    assert model.model.embed_tokens.weight.grad.abs().sum() > 0
    # A saved folder (model + tokenizer) loads back to the same function.
    model.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    with torch.no_grad():
        torch.testing.assert_close(load_model(str(tmp_path))(input_ids=ids).logits, model(input_ids=ids).logits)
    # The generator's EOS / PAD handling works with this tokenizer.
    [generation] = KVCacheGenerator(model, tokenizer, seed=0).generate(
        [ids[0].tolist()], SamplingParams(max_new_tokens=5)
    )
    assert 1 <= len(generation.token_ids) <= 5


def test_word_model_rejects_indivisible_heads(tokenizer):
    with pytest.raises(ValueError, match="divisible by num_heads"):
        build_word_model(tokenizer, hidden_size=30, num_heads=4)


def test_templates_added_later_leave_the_vocabulary_alone():
    """The phantomwiki and closed_book templates came after the lab's vocabulary: its words stay out of it, so
    the lab's tokens (and the demo) are what they were."""
    from stratarl.data.wordlevel import WORD_LEVEL_TEMPLATES, protocol_texts
    from stratarl.rollout.prompt import MULTI_ANSWER_NOTE, PROMPT_TEMPLATES

    assert set(PROMPT_TEMPLATES) > set(WORD_LEVEL_TEMPLATES) == {"search_r1", "short"}
    assert not any("separated by commas" in text for text in protocol_texts())
    assert "separated by commas" in MULTI_ANSWER_NOTE
