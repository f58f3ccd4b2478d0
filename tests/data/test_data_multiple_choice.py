"""MedQA and MedMCQA files in the layouts the datasets ship, read with no conversion; the
multiple-choice reward chosen by data source; `stratarl data inspect` and `stratarl train` on them."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import types
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from stratarl.data import DatasetFormatError, load_examples, write_examples
from stratarl.rewards import answer_match, em_reward, get_reward, reward_for_source
from stratarl.rollout.generation import Generator
from stratarl.rollout.prompt import build_prompt

TINY = Path(__file__).resolve().parents[2] / "configs" / "tiny.yaml"

# jind11/MedQA data_clean/questions/US/*.jsonl (5 options; GBaker/MedQA-USMLE-4-options has the same keys).
MEDQA_ROWS = [
    {
        "question": "A 23-year-old pregnant woman at 22 weeks gestation presents with burning upon urination. "
        "Which of the following is the best treatment for this patient?",
        "answer": "Nitrofurantoin",
        "options": {
            "A": "Ampicillin",
            "B": "Ceftriaxone",
            "C": "Ciprofloxacin",
            "D": "Doxycycline",
            "E": "Nitrofurantoin",
        },
        "meta_info": "step2&3",
        "answer_idx": "E",
        "metamap_phrases": ["pregnant woman", "burning"],
    },
    {
        "question": "Which vitamin deficiency causes scurvy?",
        "answer": "Vitamin C",
        "options": {"A": "Vitamin A", "B": "Vitamin C", "C": "Vitamin D", "D": "Vitamin K"},
        "meta_info": "step1",
        "answer_idx": "B",
        "metamap_phrases": [],
    },
]
# The original MedMCQA release (github.com/medmcqa/medmcqa README, train.json: one object a line, cop 1-4).
MEDMCQA_RELEASE_ROWS = [
    {
        "question": "Which of the following terms best describes these hematologic findings?",
        "exp": "Leukemoid reactions resemble leukemia.",
        "cop": 1,
        "opa": "Leukemoid reaction",
        "opb": "Leukopenia",
        "opc": "Myeloid metaplasia",
        "opd": "Neutrophilia",
        "subject_name": "Pathology",
        "topic_name": "Acute Inflammation",
        "id": "4e1715fe-0bc3-494e-b6eb-2d4617245aef",
        "choice_type": "single",
    },
    {
        "question": "Drug of choice for absence seizures:",
        "exp": None,
        "cop": 4,
        "opa": "Phenytoin",
        "opb": "Carbamazepine",
        "opc": "Phenobarbital",
        "opd": "Ethosuximide",
        "subject_name": "Pharmacology",
        "topic_name": None,
        "id": "b1",
        "choice_type": "single",
    },
]


def _hub_rows():
    """openlifescienceai/medmcqa on the hub: the same columns, cop a ClassLabel 0-3."""
    return [{**row, "cop": row["cop"] - 1} for row in MEDMCQA_RELEASE_ROWS]


def _jsonl(path: Path, rows) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


class TestMedQA:
    def test_jsonl_as_it_ships(self, tmp_path):
        first, second = load_examples(_jsonl(tmp_path / "US_train.jsonl", MEDQA_ROWS))
        assert first.golden_answers == ("E", "Nitrofurantoin") and second.golden_answers == ("B", "Vitamin C")
        assert (first.data_source, first.id, first.metadata["answer_letter"]) == ("medqa", "medqa-0", "E")
        assert list(first.metadata["options"]) == list("ABCDE") and first.prompt is None
        assert first.question == MEDQA_ROWS[0]["question"]

    def test_hub_parquet_with_options_as_a_struct(self, tmp_path):
        # A parquet struct column holds every key of every row: 4-option rows get E = None.
        path = tmp_path / "medqa.parquet"
        pq.write_table(pa.Table.from_pylist(MEDQA_ROWS), path)
        _, second = load_examples(path)
        assert second.metadata["options"] == MEDQA_ROWS[1]["options"]

    def test_bigbio_options_list(self, tmp_path):
        row = {**MEDQA_ROWS[1], "options": [{"key": k, "value": v} for k, v in MEDQA_ROWS[1]["options"].items()]}
        (example,) = load_examples(_jsonl(tmp_path / "q.jsonl", [row]))
        assert example.golden_answers == ("B", "Vitamin C")

    def test_options_are_listed_under_the_question(self, tmp_path):
        (example, _) = load_examples(_jsonl(tmp_path / "q.jsonl", MEDQA_ROWS))
        prompt = build_prompt(example.question, options=example.metadata["options"])
        assert prompt.endswith(
            "Question: " + MEDQA_ROWS[0]["question"] + "\nA. Ampicillin\nB. Ceftriaxone\n"
            "C. Ciprofloxacin\nD. Doxycycline\nE. Nitrofurantoin\n"
        )

    @pytest.mark.parametrize(
        ("field", "value", "message"),
        [
            ("answer_idx", "F", "field 'answer_idx' = 'F': not one of the option letters A, B, C, D, E"),
            ("options", ["A"], "field 'options'"),
            ("question", "", "field 'question'"),
        ],
    )
    def test_bad_rows_name_file_row_and_field(self, tmp_path, field, value, message):
        rows = [MEDQA_ROWS[1], {**MEDQA_ROWS[0], field: value}]
        with pytest.raises(DatasetFormatError, match=rf"q.jsonl: row 1: {message}"):
            load_examples(_jsonl(tmp_path / "q.jsonl", rows))


class TestMedMCQA:
    def test_original_release_json_lines_one_based(self, tmp_path):
        first, second = load_examples(_jsonl(tmp_path / "train.json", MEDMCQA_RELEASE_ROWS))
        assert first.golden_answers == ("A", "Leukemoid reaction") and second.golden_answers == ("D", "Ethosuximide")
        assert first.id == "4e1715fe-0bc3-494e-b6eb-2d4617245aef" and first.data_source == "medmcqa"
        assert first.metadata["subject_name"] == "Pathology"

    def test_hub_parquet_zero_based(self, tmp_path):
        path = tmp_path / "validation.parquet"
        pq.write_table(pa.Table.from_pylist(_hub_rows()), path)
        first, second = load_examples(path)
        assert first.golden_answers == ("A", "Leukemoid reaction") and second.golden_answers == ("D", "Ethosuximide")

    def test_ambiguous_file_is_read_zero_based_with_a_warning(self, tmp_path):
        row = {**MEDMCQA_RELEASE_ROWS[0], "cop": 2}
        with pytest.warns(UserWarning, match="all 1-3"):
            (example,) = load_examples(_jsonl(tmp_path / "q.jsonl", [row]))
        assert example.golden_answers == ("C", "Myeloid metaplasia")

    def test_unlabelled_test_split_is_a_clear_error(self, tmp_path):
        rows = [*_hub_rows(), {**_hub_rows()[0], "cop": -1, "id": "t3"}]
        with pytest.raises(DatasetFormatError, match=r"row 2: field 'cop' = -1: .*validation split"):
            load_examples(_jsonl(tmp_path / "test.jsonl", rows))

    def test_missing_option_names_its_field(self, tmp_path):
        rows = [{**MEDMCQA_RELEASE_ROWS[1], "opc": ""}]
        with pytest.raises(DatasetFormatError, match=r"row 0: field 'opc'"):
            load_examples(_jsonl(tmp_path / "q.jsonl", rows))


def test_hub_names_load_through_datasets(monkeypatch):
    # The hub path is datasets.load_dataset(name, split=split); a stand-in module records the call (no network).
    calls = []
    fake = types.ModuleType("datasets")
    fake.load_dataset = lambda name, split: calls.append((name, split)) or _hub_rows()
    monkeypatch.setitem(sys.modules, "datasets", fake)
    examples = load_examples("openlifescienceai/medmcqa", split="validation")
    assert calls == [("openlifescienceai/medmcqa", "validation")]
    assert [e.golden_answers for e in examples] == [("A", "Leukemoid reaction"), ("D", "Ethosuximide")]


def test_written_as_search_r1_rows_and_read_back(tmp_path):
    examples = load_examples(_jsonl(tmp_path / "q.jsonl", MEDQA_ROWS))
    again = load_examples(write_examples(examples, tmp_path / "medqa_search_r1.parquet"))
    assert [(e.data_source, e.golden_answers) for e in again] == [(e.data_source, e.golden_answers) for e in examples]
    # The written prompt lists the options, and is what the policy sees when the file is read back.
    assert again[0].prompt[0]["content"] == build_prompt(examples[0].question, options=examples[0].metadata["options"])


class TestRewardBySource:
    def test_multiple_choice_sources_score_letter_or_text(self):
        golds = ("E", "Nitrofurantoin")
        response = "<answer> E. Nitrofurantoin </answer>"
        assert em_reward(response, golds) == 0.0  # EM alone would miss it
        assert reward_for_source("medqa", em_reward)(response, golds) == 1.0
        assert reward_for_source("medmcqa", em_reward)("<answer>nitrofurantoin</answer>", golds) == 1.0
        assert reward_for_source("medqa", em_reward)("<answer>A. Nitrofurantoin</answer>", golds) == 0.0
        assert reward_for_source("nq", em_reward) is em_reward
        assert answer_match("medqa", "(e)", golds) == 1.0 and answer_match("nq", "(e)", golds) == 1.0
        assert answer_match("nq", "E. Nitrofurantoin", golds) == 0.0
        assert get_reward("multiple_choice")(response, golds) == 1.0

    def test_collect_and_eval_use_it(self, smollm2_tokenizer, tmp_path):
        from stratarl.evaluation.greedy import score_rollout
        from stratarl.retrieval.base import Passage
        from stratarl.retrieval.timed import TimedRetriever
        from stratarl.rollout.collect import Scoring, collect
        from stratarl.rollout.generation import Generation
        from stratarl.trainer.config import config_from_dict

        tok = smollm2_tokenizer
        examples = load_examples(_jsonl(tmp_path / "q.jsonl", MEDQA_ROWS))

        class Answers(Generator):
            def generate(self, prompts, params, max_new_tokens=None):
                ids = list(tok("<answer> E. Nitrofurantoin </answer>", add_special_tokens=False)["input_ids"])
                return [Generation(ids, [0.0] * len(ids), "stop", "</answer>") for _ in prompts]

        class Nothing:
            def search(self, queries, k):
                return [[Passage("0", '"x"\ny')] for _ in queries]

        cfg = config_from_dict({"rollout": {"max_turns": 1}})
        scoring = Scoring.from_names(cfg.algo.reward, cfg.algo.stratum_key, cfg.algo.stratum_cap)
        batch = collect(Answers(), TimedRetriever(Nothing()), tok, examples, cfg.rollout, scoring, group_size=1)
        assert cfg.algo.reward == "em" and batch.rewards == [1.0, 0.0] and batch.em == [1.0, 0.0]
        assert [score_rollout(r, e)["em"] for r, e in zip(batch.rollouts, batch.examples)] == [1.0, 0.0]
        # The prompt the policy saw lists the options.
        assert "E. Nitrofurantoin" in tok.decode(batch.rollouts[0].prompt_ids)


def _stratarl(*args, cwd=None, timeout=300):
    return subprocess.run(
        [sys.executable, "-m", "stratarl.cli", *map(str, args)],
        capture_output=True,
        text=True,
        cwd=cwd,
        timeout=timeout,
        env=dict(os.environ),
    )


def test_data_inspect_reads_both_layouts(tmp_path):
    medqa = _stratarl("data", "inspect", _jsonl(tmp_path / "US_test.jsonl", MEDQA_ROWS))
    assert medqa.returncode == 0, medqa.stderr
    assert "2 questions" in medqa.stdout and "by format: medqa=2" in medqa.stdout
    assert "answers=['E', 'Nitrofurantoin']" in medqa.stdout
    medmcqa = _stratarl("data", "inspect", _jsonl(tmp_path / "dev.json", MEDMCQA_RELEASE_ROWS))
    assert medmcqa.returncode == 0, medmcqa.stderr
    assert "by data_source: medmcqa=2" in medmcqa.stdout and "answers=['D', 'Ethosuximide']" in medmcqa.stdout


@pytest.mark.slow
def test_train_on_medqa_and_medmcqa_files(tmp_path):
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text(
        "".join(
            json.dumps({"id": str(i), "contents": f'"{title}"\n{text}'}) + "\n"
            for i, (title, text) in enumerate(
                [
                    ("Nitrofurantoin", "Nitrofurantoin is safe for cystitis in pregnancy."),
                    ("Scurvy", "Scurvy is caused by a lack of vitamin C."),
                    ("Ethosuximide", "Ethosuximide treats absence seizures."),
                ]
            )
        )
    )
    medqa = _jsonl(tmp_path / "US_train.jsonl", MEDQA_ROWS)
    medmcqa = tmp_path / "validation.parquet"
    pq.write_table(pa.Table.from_pylist(_hub_rows()), medmcqa)
    run_dir = tmp_path / "run"
    out = _stratarl(
        "train",
        TINY,
        "data.source=files",
        f"data.train_files=[{medqa},{medmcqa}]",
        f"data.test_files=[{medmcqa}]",
        f"data.corpus={corpus}",
        "trainer.steps=1",
        "eval.before_after=true",
        f"trainer.output_dir={tmp_path / 'runs'}",
        "--run-dir",
        run_dir,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert "step 1/1" in out.stdout
    after = json.loads((run_dir / "eval" / "after.json").read_text())
    assert after["per_source"]["medmcqa"]["count"] == 2
    record = json.loads((run_dir / "eval" / "after_transcripts.jsonl").read_text().splitlines()[0])
    assert (
        "findings?\nA. Leukemoid reaction\nB. Leukopenia\nC. Myeloid metaplasia\nD. Neutrophilia\n" in record["prompt"]
    )
