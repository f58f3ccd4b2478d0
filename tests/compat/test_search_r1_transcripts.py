"""stratarl against transcriptions of Search-R1's own code: turn loop, prompt, reward, data reading.

Every ``search_r1_*`` function below transcribes Search-R1 (github.com/PeterGriffinJin/Search-R1) at
commit a14dc3a4ffc6fe88c1e95038d9738e21ba3f7a06, file and function named in its comment, with
verl / torch / vLLM / HTTP replaced by plain strings and lists (the logic is kept line for line).
A scripted model plays the same turn texts to both; the tests check that stratarl, with the same
max_turns, gives the same turns, searches, observations, response text and reward. A change on
either side that breaks compatibility fails here.
"""

from __future__ import annotations

import re
import string

import pytest

from stratarl.data.search_r1 import load_examples
from stratarl.retrieval.base import Passage
from stratarl.rewards import em_reward
from stratarl.rollout.collect import encode_prompts
from stratarl.rollout.engine import RolloutConfig, RolloutEngine
from stratarl.rollout.generation import Generation, Generator
from stratarl.rollout.prompt import build_prompt, encode_messages

SEARCH_R1_COMMIT = "a14dc3a4ffc6fe88c1e95038d9738e21ba3f7a06"
EOS = "<EOS>"  # in a scripted turn: the model ends the turn with its end-of-sequence token


# --------------------------------------------------------------------------- transcriptions


def search_r1_make_prefix(question: str) -> str:
    # scripts/data_process/nq_search.py, make_prefix(dp, template_type='base')
    return f"""Answer the given question. \
You must conduct reasoning inside <think> and </think> first every time you get new information. \
After reasoning, if you find you lack some knowledge, you can call a search engine by <search> query </search> and it will return the top searched results between <information> and </information>. \
You can search as many times as your want. \
If you find no further external knowledge needed, you can directly provide the answer inside <answer> and </answer>, without detailed illustrations. For example, <answer> Beijing </answer>. Question: {question}\n"""


def search_r1_nq_search_row(example: dict, idx: int, split: str) -> dict:
    # scripts/data_process/nq_search.py, make_map_fn(split).process_fn(example, idx); datasets.map keeps
    # the FlashRAG columns (id, question, golden_answers) beside the new ones.
    example = dict(example)
    example["question"] = example["question"].strip()
    if example["question"][-1] != "?":
        example["question"] += "?"
    question = search_r1_make_prefix(example["question"])
    solution = {"target": example["golden_answers"]}
    return {
        **example,
        "data_source": "nq",
        "prompt": [{"role": "user", "content": question}],
        "ability": "fact-reasoning",
        "reward_model": {"style": "rule", "ground_truth": solution},
        "extra_info": {"split": split, "index": idx},
    }


def search_r1_prompt_ids(tokenizer, chat: list[dict]) -> list[int]:
    # verl/utils/dataset/rl_dataset.py, RLHFDataset.__getitem__, then
    # verl/utils/torch_functional.py, tokenize_and_postprocess_data (add_special_tokens=False; padding left out)
    if tokenizer.chat_template:
        prompt_with_chat_template = tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
    else:
        prompt_with_chat_template = chat[0]["content"]
    return list(tokenizer(prompt_with_chat_template, add_special_tokens=False)["input_ids"])


def search_r1_normalize_answer(s):
    # verl/utils/reward_score/qa_em.py, normalize_answer
    def remove_articles(text):
        return re.sub(r"\b(a|an|the)\b", " ", text)

    def white_space_fix(text):
        return " ".join(text.split())

    def remove_punc(text):
        exclude = set(string.punctuation)
        return "".join(ch for ch in text if ch not in exclude)

    return white_space_fix(remove_articles(remove_punc(s.lower())))


def search_r1_compute_score_em(solution_str, ground_truth, format_score=0.0, score=1.0):
    # verl/utils/reward_score/qa_em.py, extract_solution + em_check + compute_score_em (prints left out).
    # solution_str is prompt + response, decoded (verl/trainer/main_ppo.py, RewardManager.__call__).
    matches = list(re.finditer(r"<answer>(.*?)</answer>", solution_str, re.DOTALL))
    if len(matches) <= 1:
        return 0
    answer = matches[-1].group(1).strip()
    golden_answers = ground_truth["target"]
    if isinstance(golden_answers, str):
        golden_answers = [golden_answers]
    normalized_prediction = search_r1_normalize_answer(answer)
    for golden_answer in golden_answers:
        if search_r1_normalize_answer(golden_answer) == normalized_prediction:
            return score
    return format_score


SEARCH_R1_INVALID = "\nMy previous action is invalid. \
If I want to search, I should put the query between <search> and </search>. \
If I want to give the final answer, I should put the answer between <answer> and </answer>. Let me try again.\n"


def search_r1_postprocess_response(resp: str) -> str:
    # search_r1/llm_agent/generation.py, _postprocess_responses (after decode with skip_special_tokens=True)
    return (
        resp.split("</search>")[0] + "</search>"
        if "</search>" in resp
        else resp.split("</answer>")[0] + "</answer>"
        if "</answer>" in resp
        else resp
    )


def search_r1_postprocess_prediction(prediction: str):
    # search_r1/llm_agent/generation.py, postprocess_predictions (one prediction)
    match = re.search(r"<(search|answer)>(.*?)</\1>", prediction, re.DOTALL)
    return (match.group(1), match.group(2).strip()) if match else (None, "")


def search_r1_passages2string(retrieval_result) -> str:
    # search_r1/llm_agent/generation.py, _passages2string
    format_reference = ""
    for idx, doc_item in enumerate(retrieval_result):
        content = doc_item["document"]["contents"]
        title = content.split("\n")[0]
        text = "\n".join(content.split("\n")[1:])
        format_reference += f"Doc {idx + 1}(Title: {title}) {text}\n"
    return format_reference


def search_r1_rollout(model_turns: list[str], server, max_turns: int, topk: int = 3) -> dict:
    """search_r1/llm_agent/generation.py, run_llm_loop + execute_predictions, for one rollout.

    ``model_turns`` are the texts the model generates turn by turn; ``server(payload)`` answers a
    /retrieve request ({"queries", "topk", "return_scores"}) as Search-R1's _batch_search receives it.
    """
    turns = iter(model_turns)
    response, queries, observations, requests, generations = "", [], [], [], 0
    active = True

    def generate() -> tuple[str, str | None, str]:
        nonlocal generations
        generations += 1
        text = search_r1_postprocess_response(next(turns).replace(EOS, ""))  # skip_special_tokens=True
        return (text, *search_r1_postprocess_prediction(text))

    for _step in range(max_turns):
        if not active:
            break
        text, action, content = generate()
        if action == "answer":
            next_obs, active = "", False
        elif action == "search":
            payload = {"queries": [content], "topk": topk, "return_scores": True}
            requests.append(payload)
            result = server(payload)["result"][0]
            next_obs = f"\n\n<information>{search_r1_passages2string(result).strip()}</information>\n\n"
            queries.append(content)
        else:
            next_obs = SEARCH_R1_INVALID
        response += text + next_obs
        if next_obs:
            observations.append(next_obs)
    if active:  # final LLM rollout: execute_predictions(..., do_search=False); its observation is dropped
        text, action, _ = generate()
        response += text
    return {
        "turns": generations,
        "queries": queries,
        "observations": observations,
        "response": response,
        "requests": requests,
    }


# --------------------------------------------------------------------------- the shared world

# A /retrieve server's answers (Search-R1's response shape); "many results" returns more than topk,
# as Search-R1's SerpAPI server does (organic + related results).
HITS = {
    "hamlet author": [
        ("0", '"Hamlet"\nHamlet is a tragedy written by William Shakespeare.'),
        ("1", '"Shakespeare"\nWilliam Shakespeare was an English playwright.'),
    ],
    "capital of france": [("2", '"Paris"\nParis is the capital of France.')],
    "many results": [(str(10 + i), f'"Result {i}"\nline one of {i}\nline two of {i}') for i in range(5)],
    "": [("3", '"Empty"\nWhat an empty query finds.')],
}


def server(payload: dict) -> dict:
    return {
        "result": [
            [{"document": {"id": i, "contents": c}, "score": 1.0} for i, c in HITS.get(q, [])]
            for q in payload["queries"]
        ]
    }


class ServerRetriever:
    """stratarl's side of the same server: what RemoteRetriever makes of its reply, with the requests kept."""

    def __init__(self):
        self.requests: list[dict] = []

    def search(self, queries: list[str], k: int) -> list[list[Passage]]:
        payload = {"queries": list(queries), "topk": k, "return_scores": True}
        self.requests.append(payload)
        return [
            [Passage(hit["document"]["id"], hit["document"]["contents"]) for hit in hits]
            for hits in server(payload)["result"]
        ]


class ScriptedModel(Generator):
    """Generates each prompt's scripted turns in order, as token ids (EOS where the text says so)."""

    def __init__(self, tokenizer, turns_by_prompt: dict[tuple[int, ...], list[str]]):
        self.tokenizer, self.turns_by_prompt = tokenizer, turns_by_prompt
        self.played = dict.fromkeys(turns_by_prompt, 0)

    def generate(self, prompts, params, max_new_tokens=None) -> list[Generation]:
        out = []
        for history in prompts:
            prompt = next(p for p in self.turns_by_prompt if tuple(history[: len(p)]) == p)
            text = self.turns_by_prompt[prompt][self.played[prompt]]
            self.played[prompt] += 1
            ids = list(self.tokenizer(text.replace(EOS, ""), add_special_tokens=False)["input_ids"])
            if text.endswith(EOS):
                ids.append(self.tokenizer.eos_token_id)
                out.append(Generation(ids, [0.0] * len(ids), "eos", None))
                continue
            stop = next((s for s in params.stop_strings if text.endswith(s)), None)
            if stop in params.eos_after:
                ids.append(self.tokenizer.eos_token_id)  # stratarl's EOS after </answer>
            out.append(Generation(ids, [0.0] * len(ids), "stop" if stop else "length", stop))
        return out


# (question, golds, the model's turns, max_turns); each turn ends where a model stops: at </search>,
# </answer> or EOS (a turn without any is one that ran out of tokens).
SCENARIOS = {
    "search then answer": (
        "who wrote hamlet",
        ["William Shakespeare"],
        [
            "<think>I need the author.</think>\n<search> hamlet author </search>",
            "<think>Found it.</think>\n<answer> William Shakespeare </answer>",
        ],
        2,
    ),
    "two searches, both turns used, answer in the final turn": (
        "capital of france",
        ["Paris"],
        ["<search>capital of france</search>", "<search> hamlet author </search>", "<answer>Paris</answer>"],
        2,
    ),
    "searching in the final turn runs no search": (
        "capital of france",
        ["Paris"],
        [
            "<search>capital of france</search>",
            "<search>capital of france</search>",
            "<search>capital of france</search>",
        ],
        2,
    ),
    "max_turns 0: one turn that cannot search": (
        "capital of france",
        ["Paris"],
        ["<search>capital of france</search>"],
        0,
    ),
    "invalid, then search, then answer": (
        "who wrote hamlet",
        ["Shakespeare"],
        ["I think it is", "<search>hamlet author</search>", "<answer>Shakespeare</answer>"],
        4,
    ),
    "EOS without an action gets the feedback and goes on": (
        "who wrote hamlet",
        ["Shakespeare"],
        ["no idea" + EOS, "<answer>shakespeare</answer>"],
        4,
    ),
    "EOS in the final turn ends the rollout": ("who wrote hamlet", ["Shakespeare"], ["hmm" + EOS, "still no" + EOS], 1),
    "every hit the server returns is shown": (
        "what is there",
        ["Result 4"],
        ["<search>many results</search>", "<answer>Result 4</answer>"],
        1,
    ),
    "an empty query is still a search": (
        "what is empty",
        ["nothing"],
        ["<search> </search>", "<answer>nothing</answer>"],
        1,
    ),
    "an empty gold answer: EM 1 for 'the'": ("what is it", ["", "Paris"], ["<answer> the </answer>"], 2),
    "a wrong answer": ("capital of france", ["Paris"], ["<answer>Lyon</answer>"], 2),
    "never valid": ("who wrote hamlet", ["Shakespeare"], ["a", "b", "c"], 2),
}


@pytest.fixture(scope="module")
def tok(smollm2_tokenizer):
    return smollm2_tokenizer


def _example_file(tmp_path, question, golds):
    import pyarrow as pa
    import pyarrow.parquet as pq

    row = search_r1_nq_search_row({"id": "test_0", "question": question, "golden_answers": golds}, 0, "test")
    path = tmp_path / "test.parquet"
    pq.write_table(pa.Table.from_pylist([row]), path)
    return path, row


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_scripted_rollout_replays_identically(name, tok, tmp_path):
    question, golds, model_turns, max_turns = SCENARIOS[name]
    path, row = _example_file(tmp_path, question, golds)
    reference = search_r1_rollout(model_turns, server, max_turns)
    reference_prompt = search_r1_prompt_ids(tok, row["prompt"])
    reference_reward = search_r1_compute_score_em(
        tok.decode(reference_prompt) + reference["response"], row["reward_model"]["ground_truth"]
    )

    (example,) = load_examples(path)
    (prompt,) = encode_prompts(tok, [example])
    retriever = ServerRetriever()
    model = ScriptedModel(tok, {tuple(prompt): model_turns})
    (rollout,) = RolloutEngine(model, retriever, tok, RolloutConfig(max_turns=max_turns, topk=3)).run([prompt])

    assert prompt == reference_prompt
    assert len(rollout.turns) == reference["turns"] == sum(model.played.values())
    assert rollout.queries == reference["queries"] and retriever.requests == reference["requests"]
    observations = [
        tok.decode(rollout.response_ids[slice(*t.observation_span)])
        for t in rollout.turns
        if t.observation_span is not None
    ]
    assert observations == reference["observations"]
    assert tok.decode(rollout.response_ids, skip_special_tokens=True) == reference["response"]
    assert em_reward(rollout.response_text, example.golden_answers) == reference_reward


def test_scenarios_cover_both_rewards_and_the_final_turn(tok):
    # The replay test is only as strong as its scenarios: they must reach each branch of Search-R1's loop.
    results = [search_r1_rollout(turns, server, max_turns) for _, _, turns, max_turns in SCENARIOS.values()]
    assert {len(r["queries"]) for r in results} >= {0, 1, 2}
    assert any(r["turns"] == max_turns + 1 for r, (_, _, _, max_turns) in zip(results, SCENARIOS.values()))
    assert any(SEARCH_R1_INVALID in r["observations"] for r in results)
    assert any(len(r["requests"]) and len(server(r["requests"][0])["result"][0]) > 3 for r in results)


# --------------------------------------------------------------------------- prompt


def test_prompt_text_equals_make_prefix():
    for question in ["who wrote hamlet", "  capital of france?  ", "Is it?"]:
        normalized = search_r1_nq_search_row({"question": question, "golden_answers": ["x"]}, 0, "train")["question"]
        assert build_prompt(question) == search_r1_make_prefix(normalized)


def _bos_tokenizer():
    """A tokenizer without a chat template whose default encoding adds BOS (id 0), like many base models."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    words = sorted(set(re.findall(r"\w+|[^\w\s]", search_r1_make_prefix("who wrote hamlet?"))))
    vocab = {"<s>": 0, "</s>": 1, "<unk>": 2, **{w: i + 3 for i, w in enumerate(words)}}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Split(r"\w+|[^\w\s]", behavior="isolated")
    backend.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 0)])
    return PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<s>", eos_token="</s>", unk_token="<unk>")


def test_no_chat_template_no_special_tokens():
    tokenizer = _bos_tokenizer()
    chat = [{"role": "user", "content": search_r1_make_prefix("who wrote hamlet?")}]
    assert tokenizer(chat[0]["content"])["input_ids"][0] == 0  # the tokenizer would add BOS by default
    ids = encode_messages(tokenizer, chat)
    assert ids == search_r1_prompt_ids(tokenizer, chat) and ids[0] != 0


def test_chat_template_prompt_equals_rl_dataset(tok):
    chat = [
        {"role": "system", "content": "You are a search agent."},
        {"role": "user", "content": search_r1_make_prefix("who wrote hamlet?")},
    ]
    assert encode_messages(tok, chat) == search_r1_prompt_ids(tok, chat)


def test_several_messages_without_chat_template_is_a_clear_error():
    chat = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "who wrote hamlet?"}]
    with pytest.raises(ValueError, match="2 messages .*rollout.rebuild_prompt=true"):
        encode_messages(_bos_tokenizer(), chat)


# --------------------------------------------------------------------------- data reading


def test_the_files_own_prompt_is_used_and_rebuild_prompt_rebuilds_it(tok, tmp_path):
    # A row written by scripts/data_process/nq.py: the same columns, a prompt without search.
    nq_prefix = (
        "Answer the given question. You should first have a reasoning process in mind and then provides "
        "the answer. Show your reasoning in <think> </think> tags and return the final answer in <answer> "
        "</answer> tags, for example <answer> Beijing </answer>. Question: who wrote hamlet?\n"
    )
    import json

    row = {
        **search_r1_nq_search_row({"question": "who wrote hamlet", "golden_answers": ["Shakespeare"]}, 0, "train"),
        "prompt": [{"role": "user", "content": nq_prefix}],
    }
    path = tmp_path / "nq.jsonl"
    path.write_text(json.dumps(row) + "\n")
    (example,) = load_examples(path)
    assert example.question == "who wrote hamlet?"
    assert encode_prompts(tok, [example]) == [search_r1_prompt_ids(tok, row["prompt"])]
    rebuilt = encode_prompts(tok, [example], rebuild=True)
    assert rebuilt == [
        search_r1_prompt_ids(tok, [{"role": "user", "content": search_r1_make_prefix("who wrote hamlet?")}])
    ]


def test_golds_are_read_as_the_reward_reads_them(tmp_path):
    path, row = _example_file(tmp_path, "what is it", ["", "Paris", "  Paris city "])
    (example,) = load_examples(path)
    # Stripping changes no score: normalize_answer collapses whitespace.
    assert [search_r1_normalize_answer(g) for g in example.golden_answers] == [
        search_r1_normalize_answer(g) for g in row["reward_model"]["ground_truth"]["target"]
    ]


# --------------------------------------------------------------------------- reward extraction


@pytest.mark.parametrize(
    ("response", "golds"),
    [
        ("<answer> Paris </answer>", ["Paris"]),
        ("<answer>paris.</answer>", ["Paris"]),
        ("<answer>The Paris</answer>", ["paris"]),
        ("<answer>Lyon</answer> then <answer>Paris</answer>", ["Paris"]),
        ("<answer>Paris</answer> then <answer>Lyon</answer>", ["Paris"]),
        ("no answer at all", ["Paris"]),
        ("<answer>unclosed", ["Paris"]),
        ("<answer>\nParis\n</answer>", ["Paris"]),
        ("<answer>the</answer>", ["", "Paris"]),
        ("<answer></answer>", [""]),
        ("<answer>Paris</answer>", "Paris"),
    ],
)
def test_em_reward_equals_compute_score_em(response, golds, tok):
    prompt = tok.decode(search_r1_prompt_ids(tok, [{"role": "user", "content": search_r1_make_prefix("q?")}]))
    assert em_reward(response, golds) == search_r1_compute_score_em(prompt + response, {"target": golds})


# --------------------------------------------------------------------------- crossing stop tags

# Search-R1's rollout passes no stop strings to vLLM: a turn generates to EOS or its token budget, then
# _postprocess_responses cuts the text after the first </search> anywhere in it, else after the first
# </answer>. stratarl's generator stops at the first stop string to complete. The two turns differ only
# when </answer> completes before a later </search>: Search-R1 keeps the text up to that </search>,
# stratarl the text up to </answer>. Each case: what the model would write in one turn, unstopped ->
# (Search-R1's action, stratarl's action); an action is (kind, content), kind None / "invalid" for neither.
CROSSING = {
    "(a) answer, then a search": ("<answer>x</answer> then <search>q</search>", ("answer", "x"), ("answer", "x")),
    "(a2) answer, another answer, then a search": (
        "<answer>x</answer> <answer>y</answer> <search>q</search>",
        ("answer", "x"),
        ("answer", "x"),
    ),
    "(b) answer nested inside an open search": (
        "<search>q <answer>x</answer> </search>",
        ("search", "q <answer>x</answer>"),
        ("answer", "x"),
    ),
    "(c) search nested inside an open answer": (
        "<answer>x <search>q</search> </answer>",
        ("search", "q"),
        ("search", "q"),
    ),
    "(d) mismatched close, no later </search>": ("<search>q</answer> more", (None, ""), ("invalid", "")),
    "(d2) mismatched close, a later </search>": (
        "<search>q</answer> more</search>",
        ("search", "q</answer> more"),
        ("invalid", ""),
    ),
    "(e) a stray </answer>, then a search": (
        "<think>done</answer></think> <search>q</search>",
        ("search", "q"),
        ("invalid", ""),
    ),
    "(f) a stray </answer>, an answer, then a search": (
        "x</answer> <answer>y</answer> <search>q</search>",
        ("answer", "y"),
        ("invalid", ""),
    ),
    "(g) a stray </answer>, a stray </search>": ("x</answer> y</search>", (None, ""), ("invalid", "")),
    "(h) answer closed by </search>": ("<answer>x</search> y</answer>", (None, ""), ("invalid", "")),
    "(i) search first, then an answer: no crossing": (
        "<search>q</search> <answer>x</answer>",
        ("search", "q"),
        ("search", "q"),
    ),
}


def stratarl_turn(tok, generation: str) -> str:
    """The text of stratarl's turn: the tokens up to the one that completes a stop string (StopMatcher)."""
    from stratarl.rollout.parsing import STOP_STRINGS
    from stratarl.rollout.stopping import StopMatcher

    ids = list(tok(generation, add_special_tokens=False)["input_ids"])
    matcher = StopMatcher(tok, STOP_STRINGS)
    end = next((k for k in range(1, len(ids) + 1) if matcher.check(ids[:k]) is not None), len(ids))
    return tok.decode(ids[:end], skip_special_tokens=False)


@pytest.mark.parametrize("name", list(CROSSING))
def test_crossing_stop_tags(name, tok):
    from stratarl.rollout.parsing import find_stop, parse_action

    generation, reference_action, stratarl_action = CROSSING[name]
    reference_text = search_r1_postprocess_response(generation)
    assert search_r1_postprocess_prediction(reference_text) == reference_action
    text = stratarl_turn(tok, generation)
    # The turn ends with the token that completes its first stop string (text after the stop inside that
    # token stays: "<think>done</answer></" in case (e)).
    stop = find_stop(generation)
    assert generation.startswith(text) and text.startswith(generation[: stop[0]] if stop else generation)
    action = parse_action(text)
    assert (action.kind, action.content) == stratarl_action
    # The turns differ exactly when </answer> completes before a later </search>.
    crossing = (
        "</search>" in generation
        and generation.find("</answer>") != -1
        and generation.find("</answer>") + len("</answer>") <= generation.find("</search>")
    )
    assert (text != reference_text) == crossing


def _crossing_rollouts(tok, tmp_path, generations, golds, max_turns):
    """(Search-R1's rollout and reward, stratarl's rollout and reward) for one question's unstopped turns."""
    path, row = _example_file(tmp_path, "what is it", golds)
    reference = search_r1_rollout(generations, server, max_turns)
    reference_prompt = search_r1_prompt_ids(tok, row["prompt"])
    reference_reward = search_r1_compute_score_em(
        tok.decode(reference_prompt) + reference["response"], row["reward_model"]["ground_truth"]
    )
    (example,) = load_examples(path)
    (prompt,) = encode_prompts(tok, [example])
    model = ScriptedModel(tok, {tuple(prompt): [stratarl_turn(tok, g) for g in generations]})
    config = RolloutConfig(max_turns=max_turns, topk=3)
    (rollout,) = RolloutEngine(model, ServerRetriever(), tok, config).run([prompt])
    return reference, reference_reward, rollout, em_reward(rollout.response_text, example.golden_answers)


def test_crossing_stop_tags_can_end_a_rollout_a_turn_earlier_with_another_reward(tok, tmp_path):
    # Case (b) in a turn that may search: stratarl answers x and ends; Search-R1 searches for
    # "q <answer>x</answer>" and answers y in the next turn.
    generations = ["<search>q <answer>x</answer> </search>", "<answer>y</answer>"]
    reference, reference_reward, rollout, reward = _crossing_rollouts(tok, tmp_path, generations, ["y"], 2)
    assert (reference["turns"], reference["queries"], reference_reward) == (2, ["q <answer>x</answer>"], 1)
    assert (len(rollout.turns), rollout.queries, rollout.answer, rollout.end_reason, reward) == (
        1,
        [],
        "x",
        "answer",
        0,
    )


def test_crossing_stop_tags_in_the_final_turn_score_the_same(tok, tmp_path):
    # Case (b) in the final turn: Search-R1 runs no search and ends; its reward reads the last <answer>,
    # the x inside the query. stratarl answers x.
    generations = ["<search>q <answer>x</answer> </search>"]
    reference, reference_reward, rollout, reward = _crossing_rollouts(tok, tmp_path, generations, ["x"], 0)
    assert (reference["turns"], reference["queries"], reference_reward) == (1, [], 1)
    assert (len(rollout.turns), rollout.answer, rollout.end_reason, reward) == (1, "x", "answer", 1)


def test_crossing_stop_tags_can_change_the_reward_of_the_same_action(tok):
    # Case (a2): both answer x and end the rollout, but Search-R1's turn holds a second answer, and its
    # reward reads the last <answer> of prompt + response.
    generation = CROSSING["(a2) answer, another answer, then a search"][0]
    prompt = tok.decode(search_r1_prompt_ids(tok, [{"role": "user", "content": search_r1_make_prefix("q?")}]))
    reference_response = search_r1_postprocess_response(generation)
    assert search_r1_compute_score_em(prompt + reference_response, {"target": ["y"]}) == 1
    assert em_reward(stratarl_turn(tok, generation), ["y"]) == 0


def test_crossing_stop_tags_can_end_search_r1s_rollout_a_turn_earlier(tok, tmp_path):
    # Case (f): Search-R1 answers y and ends; stratarl's turn "x</answer>" is invalid and it goes on.
    generations = ["x</answer> <answer>y</answer> <search>q</search>", "<answer>z</answer>"]
    reference, reference_reward, rollout, reward = _crossing_rollouts(tok, tmp_path, generations, ["y"], 2)
    assert (reference["turns"], reference["observations"], reference_reward) == (1, [], 1)
    assert (len(rollout.turns), rollout.invalid_actions, rollout.answer, reward) == (2, 1, "z", 0)
