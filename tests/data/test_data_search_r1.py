"""Search-R1 / veRL / SkyRL question files: loading, ids, broken files, writing."""

from __future__ import annotations

import importlib.util
import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from stratarl.data.examples import Example
from stratarl.data.search_r1 import (
    DatasetFormatError,
    extract_question,
    load_example_files,
    load_examples,
    read_rows,
    write_search_r1_jsonl,
    write_search_r1_parquet,
)
from stratarl.rollout.prompt import build_prompt

INSTRUCTION_VERL = (
    "Answer the given question. ... call a search engine by <tool_call> query </tool_call> and it will return "
    "the top searched results between <tool_response> and </tool_response>. ... Question: "
)


def search_r1_row(text, answers, source="nq", index=0, split="train", **extra):
    """A row as Search-R1's nq_search.py writes it (plus the raw columns HF copies keep)."""
    row = {
        "data_source": source,
        "prompt": [{"role": "user", "content": build_prompt(text)}],
        "ability": "fact-reasoning",
        "reward_model": {"style": "rule", "ground_truth": {"target": list(answers)}},
        "extra_info": {"split": split, "index": index},
    }
    row.update(extra)
    return row


def verl_row(question, answers, source="nq", index=0):
    """A row as veRL's preprocess_search_r1_dataset.py writes it."""
    return {
        "data_source": "searchR1_" + source,
        "prompt": [
            {"role": "system", "content": "You are a helpful and harmless assistant."},
            {"role": "user", "content": INSTRUCTION_VERL + question},
        ],
        "ability": "fact-reasoning",
        "reward_model": {"style": "rule", "ground_truth": {"target": list(answers)}},
        "extra_info": {"index": index, "need_tools_kwargs": True, "question": question, "split": "train"},
        "metadata": None,
    }


def skyrl_row(question, answers, source="nq", index=0):
    """A row as SkyRL's searchr1_dataset.py writes it: env_class + reward_spec."""
    row = verl_row(question, answers, source, index)
    row["env_class"] = "search"
    row["reward_spec"] = row.pop("reward_model")
    del row["extra_info"]["question"]  # force the prompt path
    return row


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


def write_parquet(path, rows):
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


class TestExtractQuestion:
    def test_search_r1_template_round_trip(self):
        assert extract_question(build_prompt("who wrote hamlet")) == "who wrote hamlet?"

    def test_message_list_takes_last_user_message(self):
        messages = [{"role": "system", "content": "Question: wrong"}, {"role": "user", "content": "x Question: right?"}]
        assert extract_question(messages) == "right?"

    def test_chat_rendered_prompt_is_cut_at_special_token(self):
        rendered = "<|im_start|>user\nAnswer... Question: where is Kesh?\n<|im_end|>\n<|im_start|>assistant\n"
        assert extract_question(rendered) == "where is Kesh?"

    def test_last_marker_wins_and_plain_text_passes(self):
        assert extract_question("Question: example. Question: real one?") == "real one?"
        assert extract_question("  plain question  ") == "plain question"

    def test_no_user_message_raises(self):
        with pytest.raises(ValueError, match="no user message"):
            extract_question([{"role": "system", "content": "Question: x"}])


class TestLoadFormats:
    def test_search_r1_parquet(self, tmp_path):
        rows = [
            search_r1_row("who wrote hamlet", ["Shakespeare"], index=0),
            search_r1_row("capital of france", ["Paris", "paris city"], source="triviaqa", index=1, split="test"),
        ]
        examples = load_examples(write_parquet(tmp_path / "d.parquet", rows))
        assert [e.question for e in examples] == ["who wrote hamlet?", "capital of france?"]
        assert examples[1].golden_answers == ("Paris", "paris city")
        assert [e.data_source for e in examples] == ["nq", "triviaqa"]
        assert [e.id for e in examples] == ["nq-0", "triviaqa-1"]
        assert examples[1].metadata["split"] == "test" and examples[1].metadata["format"] == "search_r1"

    def test_raw_question_wins_over_prompt_and_reward_target_over_golden_answers(self, tmp_path):
        # Search-R1's reward (verl/trainer/main_ppo.py, a14dc3a) scores against reward_model.ground_truth.
        row = search_r1_row("templated", ["a"], question="raw question", golden_answers=["gold"])
        (example,) = load_examples(write_jsonl(tmp_path / "d.jsonl", [row]))
        assert example.question == "raw question"
        assert example.golden_answers == ("a",)
        assert example.prompt == tuple(row["prompt"])  # the file's own prompt, kept as it is

    def test_empty_gold_answers_are_kept(self, tmp_path):
        (example,) = load_examples(write_jsonl(tmp_path / "d.jsonl", [search_r1_row("q", ["", "Paris"])]))
        assert example.golden_answers == ("", "Paris")

    def test_malformed_prompt_names_row_and_field(self, tmp_path):
        row = {**search_r1_row("q", ["a"]), "prompt": [{"role": "user", "content": 3}]}
        with pytest.raises(DatasetFormatError, match=r"d.jsonl: row 0: field 'prompt"):
            load_examples(write_jsonl(tmp_path / "d.jsonl", [row]))

    def test_verl_variant(self, tmp_path):
        (example,) = load_examples(write_parquet(tmp_path / "v.parquet", [verl_row("who is kesh", ["K"])]))
        assert example.question == "who is kesh"  # from extra_info.question
        assert example.data_source == "nq"
        assert example.metadata["raw_data_source"] == "searchR1_nq"
        assert example.metadata["format"] == "verl"

    def test_skyrl_variant(self, tmp_path):
        (example,) = load_examples(write_jsonl(tmp_path / "s.jsonl", [skyrl_row("who is kesh?", ["K", "Kesh"])]))
        assert example.question == "who is kesh?"  # recovered from the tool-call template
        assert example.golden_answers == ("K", "Kesh")
        assert example.metadata["format"] == "skyrl"

    def test_json_list_and_string_ground_truth(self, tmp_path):
        path = tmp_path / "d.json"
        path.write_text(
            json.dumps(
                [
                    {"question": "q1", "reward_model": {"ground_truth": {"target": "one"}}},
                    {"question": "q2", "answer": ["two"]},
                ]
            )
        )
        assert [e.golden_answers for e in load_examples(path)] == [("one",), ("two",)]

    def test_split_filter_limit_and_folder(self, tmp_path):
        rows = [search_r1_row(f"q{i}", ["a"], index=i, split="train" if i % 2 else "test") for i in range(6)]
        path = write_parquet(tmp_path / "all.parquet", rows)
        assert [e.question for e in load_examples(path, split="test")] == ["q0?", "q2?", "q4?"]
        assert [e.question for e in load_examples(path, split="train", limit=2)] == ["q1?", "q3?"]
        write_parquet(tmp_path / "test.parquet", rows[:2])
        assert len(load_examples(tmp_path, split="test")) == 2


class TestIds:
    def test_merged_sources_never_group_by_index(self, tmp_path):
        # Merged nq + hotpotqa: extra_info.index restarts at 0, the file's ids collide too.
        rows = [search_r1_row(f"nq {i}", ["a"], source="nq", index=i, id=f"train_{i}") for i in range(3)]
        rows += [search_r1_row(f"hp {i}", ["b"], source="hotpotqa", index=i, id=f"train_{i}") for i in range(3)]
        with pytest.warns(UserWarning, match="duplicates"):
            examples = load_examples(write_parquet(tmp_path / "m.parquet", rows))
        ids = [e.id for e in examples]
        assert len(set(ids)) == 6
        assert ids[0] == "nq-0" and ids[3] == "hotpotqa-3"
        assert examples[0].metadata["index"] == examples[3].metadata["index"] == 0  # kept, but not the id

    def test_ids_stay_unique_across_files(self, tmp_path):
        # Two sources, each with ids unique inside its own file but equal across files.
        nq = write_parquet(tmp_path / "nq_train.parquet", [search_r1_row("a", ["x"], id="train_0")])
        hp = write_parquet(
            tmp_path / "hotpot_train.parquet", [search_r1_row("b", ["y"], source="hotpotqa", id="train_0")]
        )
        assert [e.id for e in load_example_files([nq])] == ["train_0"]  # no collision: ids untouched
        with pytest.warns(UserWarning, match="collide"):
            examples = load_example_files([nq, hp])
        assert [e.id for e in examples] == ["nq_train/train_0", "hotpot_train/train_0"]
        with pytest.warns(UserWarning, match="collide"):
            assert [e.id for e in load_example_files([nq, nq])] == ["0/train_0", "1/train_0"]

    def test_unique_file_ids_are_kept(self, tmp_path):
        rows = [search_r1_row(f"q{i}", ["a"], index=0, id=f"x{i}") for i in range(3)]
        assert [e.id for e in load_examples(write_jsonl(tmp_path / "d.jsonl", rows))] == ["x0", "x1", "x2"]


class TestBrokenFiles:
    def test_missing_answers_names_file_and_row(self, tmp_path):
        rows = [search_r1_row("ok", ["a"]), {"data_source": "nq", "question": "no gold", "golden_answers": []}]
        path = write_jsonl(tmp_path / "bad.jsonl", rows)
        with pytest.raises(DatasetFormatError, match=r"bad\.jsonl: row 1: no gold answers"):
            load_examples(path)

    def test_missing_question_names_field(self, tmp_path):
        path = write_jsonl(tmp_path / "bad.jsonl", [{"golden_answers": ["a"], "data_source": "nq"}])
        with pytest.raises(DatasetFormatError, match=r"row 0: no question.*'question' column"):
            load_examples(path)

    def test_invalid_json_line(self, tmp_path):
        path = tmp_path / "bad.jsonl"
        path.write_text(json.dumps(search_r1_row("q", ["a"])) + "\n{not json\n")
        with pytest.raises(DatasetFormatError, match=r"bad\.jsonl: line 2: not valid JSON"):
            load_examples(path)

    def test_corrupt_parquet(self, tmp_path):
        path = tmp_path / "bad.parquet"
        path.write_bytes(b"PAR1 this is not parquet")
        with pytest.raises(DatasetFormatError, match="not a readable parquet file"):
            load_examples(path)

    def test_empty_file_unknown_suffix_missing_file(self, tmp_path):
        (tmp_path / "empty.jsonl").write_text("")
        with pytest.raises(DatasetFormatError, match="contains no rows"):
            load_examples(tmp_path / "empty.jsonl")
        (tmp_path / "d.csv").write_text("question,answer\n")
        with pytest.raises(DatasetFormatError, match="unknown file type '.csv'"):
            load_examples(tmp_path / "d.csv")
        with pytest.raises(FileNotFoundError, match="no such file"):
            load_examples(tmp_path / "missing.parquet")

    def test_unknown_split(self, tmp_path):
        path = write_parquet(tmp_path / "d.parquet", [search_r1_row("q", ["a"], split="train")])
        with pytest.raises(DatasetFormatError, match=r"no rows with extra_info.split == 'dev'.*\['train'\]"):
            load_examples(path, split="dev")

    @pytest.mark.skipif(importlib.util.find_spec("datasets") is not None, reason="datasets is installed")
    def test_hub_name_without_datasets_package(self):
        with pytest.raises(FileNotFoundError, match="pip install datasets"):
            load_examples("PeterJinGo/nq_hotpotqa_train")


class TestWriters:
    EXAMPLES = [
        Example("a", "who wrote hamlet", ("Shakespeare",), "nq", {"split": "train", "hops": [{"query": "q"}]}),
        Example("b", "where is Kesh?", ("Kesh", "K"), "synthkb", {"question_type": "single_hop"}),
    ]

    def test_parquet_row_shape_is_search_r1(self, tmp_path):
        rows = read_rows(write_search_r1_parquet(self.EXAMPLES, tmp_path / "o.parquet", split="test"))
        assert rows[0]["prompt"] == [{"role": "user", "content": build_prompt("who wrote hamlet")}]
        assert rows[1]["reward_model"] == {"style": "rule", "ground_truth": {"target": ["Kesh", "K"]}}
        assert rows[1]["extra_info"] == {"split": "test", "index": 1}
        assert rows[0]["ability"] == "fact-reasoning" and rows[1]["data_source"] == "synthkb"

    @pytest.mark.parametrize(
        "writer,name", [(write_search_r1_parquet, "o.parquet"), (write_search_r1_jsonl, "o.jsonl")]
    )
    def test_round_trip(self, tmp_path, writer, name):
        loaded = load_examples(writer(self.EXAMPLES, tmp_path / name))
        assert [(e.id, e.question, e.golden_answers, e.data_source) for e in loaded] == [
            (e.id, e.question, e.golden_answers, e.data_source) for e in self.EXAMPLES
        ]
        assert loaded[0].metadata["hops"] == [{"query": "q"}]
        assert loaded[1].metadata["question_type"] == "single_hop"
        assert loaded[1].metadata["split"] == "train"  # default split when the example has none
