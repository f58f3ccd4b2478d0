"""register_dataset_format: the built-in formats are registry entries the loaders dispatch by, and a user's
own format, defined in the user's file and loaded with --import, is read by `stratarl data` (README: a
dataset format of your own)."""

from __future__ import annotations

import json

import pytest

from stratarl.data import formats, load_examples, medmcqa_example, medqa_example, search_r1_example
from stratarl.data.examples import DatasetFormatError, Example
from stratarl.data.formats import dataset_format_names, get_dataset_format, register_dataset_format
from stratarl.data.search_r1 import examples_from_rows
from stratarl.extensions import load_extension

MY_FORMAT = '''
"""A dataset format of the user's own: rows {"Q": question, "A": "answer|other answer"}."""
from stratarl.data import Example, register_dataset_format


@register_dataset_format("trivia", matches=lambda row: "Q" in row and "A" in row)
def trivia(row, *, row_index, id_=None):
    return Example(id=id_ or f"trivia-{row_index}", question=row["Q"], golden_answers=tuple(row["A"].split("|")),
                   data_source="trivia")
'''

TRIVIA_ROWS = [
    {"Q": "Who wrote Hamlet?", "A": "Shakespeare|William Shakespeare"},
    {"Q": "Capital of France?", "A": "Paris"},
]


@pytest.fixture
def users_format(tmp_path, monkeypatch):
    """The user's module loaded as `--import` loads it; its format is unregistered again afterwards."""
    plugin = tmp_path / "my_format.py"
    plugin.write_text(MY_FORMAT)
    monkeypatch.setattr(formats, "_FORMATS", formats._FORMATS.copy())
    load_extension(str(plugin))
    return plugin


@pytest.fixture
def trivia_file(tmp_path):
    path = tmp_path / "trivia.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in TRIVIA_ROWS))
    return path


def test_the_built_in_formats_are_registry_entries():
    assert {"search_r1", "medqa", "medmcqa"} <= set(dataset_format_names())
    assert get_dataset_format("search_r1").read is search_r1_example
    assert get_dataset_format("medqa").read is medqa_example
    assert get_dataset_format("medmcqa").read is medmcqa_example


def test_each_row_goes_to_its_format():
    rows = [
        {"question": "q1", "golden_answers": ["a"], "data_source": "nq"},
        {"question": "q2", "options": {"A": "x", "B": "y"}, "answer_idx": "B"},
        {"question": "q3", "opa": "1", "opb": "2", "opc": "3", "opd": "4", "cop": 0},
        {
            "prompt": [{"role": "user", "content": "Question: q4\n"}],
            "reward_model": {"ground_truth": {"target": ["b"]}},
            "data_source": "searchR1_hotpotqa",
        },
    ]
    examples = examples_from_rows(rows, origin="mixed.jsonl")
    assert [e.metadata["format"] for e in examples] == ["search_r1", "medqa", "medmcqa", "verl"]
    assert [e.golden_answers for e in examples] == [("a",), ("B", "y"), ("A", "1"), ("b",)]


def test_a_users_format_is_read_by_the_loaders(users_format, trivia_file):
    assert "trivia" in dataset_format_names()
    examples = load_examples(trivia_file)
    assert [(e.id, e.question, e.golden_answers, e.data_source) for e in examples] == [
        ("trivia-0", "Who wrote Hamlet?", ("Shakespeare", "William Shakespeare"), "trivia"),
        ("trivia-1", "Capital of France?", ("Paris",), "trivia"),
    ]
    assert [(e.metadata["format"], e.metadata["row"]) for e in examples] == [("trivia", 0), ("trivia", 1)]
    # Rows of the built-in formats in the same file are read as before.
    mixed = examples_from_rows([TRIVIA_ROWS[0], {"question": "q", "golden_answers": ["a"]}], origin="m.jsonl")
    assert [e.metadata["format"] for e in mixed] == ["trivia", "search_r1"]


def test_a_users_format_wins_over_the_built_ins_for_the_rows_it_matches(users_format):
    @register_dataset_format("shouting", matches=lambda row: row.get("data_source") == "loud")
    def shouting(row, *, row_index):
        return Example(id=f"loud-{row_index}", question=row["question"].upper(), golden_answers=("A",))

    rows = [
        {"question": "why", "golden_answers": ["a"], "data_source": "loud"},
        {"question": "why", "golden_answers": ["a"], "data_source": "quiet"},
    ]
    assert [e.question for e in examples_from_rows(rows, origin="f")] == ["WHY", "why"]
    # Chosen by name, one format reads every row.
    assert [e.question for e in examples_from_rows(rows, origin="f", format="shouting")] == ["WHY", "WHY"]
    assert [e.question for e in examples_from_rows(rows, origin="f", format="search_r1")] == ["why", "why"]


def test_ids_must_be_unique(users_format):
    @register_dataset_format("same_id")
    def same_id(row):
        return Example(id="x", question="q", golden_answers=("a",))

    with pytest.raises(DatasetFormatError, match=r"f: rows 0 and 1 have the same id 'x' \(format 'same_id'\)"):
        examples_from_rows([{"a": 1}, {"a": 2}], origin="f", format="same_id")


def test_unknown_and_duplicate_formats_are_one_line_errors_that_list_the_registered_ones(users_format):
    with pytest.raises(ValueError) as unknown:
        examples_from_rows(TRIVIA_ROWS, origin="f", format="trivai")
    message = str(unknown.value)
    assert message.startswith(
        "unknown dataset format 'trivai'; registered: medmcqa, medqa, phantomwiki, search_r1, trivia"
    )
    assert "\n" not in message
    with pytest.raises(ValueError) as duplicate:
        register_dataset_format("medqa")(lambda row: None)
    message = str(duplicate.value)
    assert message.startswith("dataset format 'medqa' is already registered (by medqa_example)")
    assert "registered: medmcqa, medqa, phantomwiki, search_r1, trivia" in message and "\n" not in message
    assert get_dataset_format("medqa").read is medqa_example  # the refused one replaced nothing
    load_extension(str(users_format))  # the same file again (e.g. --import twice): loaded once, no error


def test_data_inspect_and_convert_read_a_users_format_with_import(tmp_path, trivia_file, stratarl_cli):
    plugin = tmp_path / "my_format.py"
    plugin.write_text(MY_FORMAT)
    inspect = stratarl_cli("data", "inspect", trivia_file, "--import", plugin)
    assert inspect.returncode == 0, inspect.stderr
    assert "2 questions" in inspect.stdout and "by format: trivia=2" in inspect.stdout
    assert "question='Who wrote Hamlet?' answers=['Shakespeare', 'William Shakespeare']" in inspect.stdout

    out = tmp_path / "trivia.parquet"
    convert = stratarl_cli("--import", plugin, "data", "convert", trivia_file, out)
    assert convert.returncode == 0, convert.stderr
    converted = load_examples(out)  # Search-R1 rows now: read without the user's module
    assert [(e.id, e.golden_answers, e.metadata["format"]) for e in converted] == [
        ("trivia-0", ("Shakespeare", "William Shakespeare"), "search_r1"),
        ("trivia-1", ("Paris",), "search_r1"),
    ]

    # Without the module the rows are read as Search-R1 rows, which they are not: one line naming the row.
    without = stratarl_cli("data", "inspect", trivia_file)
    assert without.returncode == 2 and "Traceback" not in without.stderr
    assert "row 0: no question" in without.stderr
    unknown = stratarl_cli("data", "inspect", trivia_file, "--format", "trivia")
    assert unknown.returncode == 2 and "Traceback" not in unknown.stderr
    assert unknown.stderr.strip() == (
        "error: unknown dataset format 'trivia'; registered: medmcqa, medqa, phantomwiki, search_r1 "
        "(a format of your own: register_dataset_format in a module loaded with --import)"
    )
    chosen = stratarl_cli(
        "data", "convert", trivia_file, tmp_path / "t.jsonl", "--format", "trivia", f"--import={plugin}"
    )
    assert chosen.returncode == 0, chosen.stderr


def test_the_readme_retriever_and_format_are_right_and_register_by_name(monkeypatch, tmp_path):
    """README's "A retriever or a dataset format of your own" snippet, run as written."""
    import re
    from pathlib import Path

    from stratarl.retrieval import build_retriever, factory

    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    (code,) = [block for block in re.findall(r"```python\n(.*?)```", readme, re.S) if "my_task.py" in block]
    monkeypatch.setattr(formats, "_FORMATS", formats._FORMATS.copy())
    monkeypatch.setattr(factory, "_RETRIEVERS", factory._RETRIEVERS.copy())
    exec(compile(code, "README.md", "exec"), {})
    notes = tmp_path / "notes.txt"
    notes.write_text("Hamlet was written by Shakespeare\nParis is the capital of France\n")
    retriever = build_retriever({"kind": "notes", "path": str(notes)})
    hits = retriever.search(["who wrote hamlet", "capital of france", "nothing"], 1)
    assert [[p.text for p in h] for h in hits] == [
        ["Hamlet was written by Shakespeare"],
        ["Paris is the capital of France"],
        [],
    ]
    examples = examples_from_rows(TRIVIA_ROWS, origin="trivia.jsonl")
    assert [e.golden_answers for e in examples] == [("Shakespeare", "William Shakespeare"), ("Paris",)]
    assert {e.metadata["format"] for e in examples} == {"trivia"}


def test_a_users_reader_matches_or_prepare_that_raises_is_one_line_naming_the_row(users_format):
    """Before: the reader's own exception reached the user as a traceback."""

    @register_dataset_format("fragile", matches=lambda row: row["kind"] == "fragile")  # KeyError on other rows
    def fragile(row, *, row_index):
        return Example(id=f"f-{row_index}", question=row["question"].upper(), golden_answers=("a",))

    with pytest.raises(DatasetFormatError) as read:
        examples_from_rows([{"kind": "fragile", "question": None}], origin="f.jsonl", format="fragile")
    assert str(read.value).startswith(
        "f.jsonl: row 0: dataset format 'fragile' raised AttributeError: 'NoneType' object has no attribute 'upper'"
    )
    with pytest.raises(DatasetFormatError, match=r"f.jsonl: row 0: the `matches` of dataset format 'fragile' raised"):
        examples_from_rows([{"question": "q", "golden_answers": ["a"]}], origin="f.jsonl")

    def bad_prepare(rows, origin):
        raise RuntimeError("no vocabulary")

    register_dataset_format("prepared", prepare=bad_prepare)(lambda row: None)
    with pytest.raises(DatasetFormatError, match="f.jsonl: the `prepare` of dataset format 'prepared' raised Runtime"):
        examples_from_rows([{"a": 1}], origin="f.jsonl", format="prepared")
    register_dataset_format("not_an_example")(lambda row: {"question": "q"})
    with pytest.raises(DatasetFormatError, match="returned a dict, not an Example"):
        examples_from_rows([{"a": 1}], origin="f.jsonl", format="not_an_example")
    for error in (read,):
        assert "\n" not in str(error.value) and "Fix:" in str(error.value)
