"""PhantomWiki as a data source: the committed generator output, the Search-R1 layout, the generator itself."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from stratarl.data.examples import DatasetFormatError
from stratarl.data.phantomwiki import (
    ATTRIBUTION,
    GENERATOR_ENV,
    PhantomWikiError,
    UniverseSpec,
    article_passage,
    find_generator,
    parse_seeds,
    read_universe,
    write_universe,
)
from stratarl.data.search_r1 import load_examples
from stratarl.retrieval.base import Passage
from stratarl.retrieval.bm25 import BM25Retriever
from stratarl.retrieval.corpus import load_corpus

FIXTURE = Path(__file__).parent / "fixtures" / "phantomwiki_seed3"
SPEC = UniverseSpec(seed=3, max_tree_size=12, num_trees=2, questions_per_type=2)


def _generator_or_skip() -> Path:
    try:
        return find_generator()
    except PhantomWikiError:
        if os.environ.get("CI"):
            raise  # CI builds .venv-phantom (make test): the generator must run there
        pytest.skip("the PhantomWiki generator is not installed here (make phantomwiki)")


def test_raw_questions_are_read_by_the_registered_format():
    examples = load_examples(str(FIXTURE / "questions.json"))
    assert len(examples) == 16
    assert {e.data_source for e in examples} == {"phantomwiki"}
    assert {e.metadata["format"] for e in examples} == {"phantomwiki"}
    child = next(e for e in examples if e.question == "Who is the child of Ramiro Duquette?")
    assert child.golden_answers == ("Laurel Duquette", "Wyatt Duquette", "Zelma Duquette")
    assert child.metadata["difficulty"] == 1 and child.metadata["question_type"] == "difficulty_1"
    assert child.metadata["template_type"] == 1 and child.metadata["aggregation"] is False
    # the prompt asks for every answer, comma-separated, and keeps Search-R1's protocol
    content = child.prompt[0]["content"]
    assert "separated by commas" in content and "<search> query </search>" in content
    assert content.endswith("Question: Who is the child of Ramiro Duquette?\n")
    counts = {d: sum(e.metadata["difficulty"] == d for e in examples) for d in (1, 2, 4)}
    assert counts == {1: 6, 2: 9, 4: 1}


def test_articles_become_passages_with_the_title_first_and_no_heading():
    passage = article_passage(
        {"title": "Eli Smock", "article": "# Eli Smock\n\n## Family\nThe son of Eli Smock is Bo."}, 0, "x"
    )
    assert passage == Passage("0", '"Eli Smock"\n## Family\nThe son of Eli Smock is Bo.')


def test_universe_round_trips_through_the_search_r1_layout(tmp_path):
    counts = write_universe(FIXTURE, tmp_path, SPEC, seconds=1.0)
    assert counts["articles"] == 24 and counts["questions"] == 16
    assert counts["per_difficulty"] == {"1": 6, "2": 9, "4": 1}
    record = json.loads((tmp_path / "universe.json").read_text())
    assert record["attribution"] == ATTRIBUTION and record["generator"]["version"] == "1.0.3"
    assert record["generator"]["arguments"][:2] == ["--seed", "3"]
    raw = {e.question: e for e in load_examples(str(FIXTURE / "questions.json"))}
    loaded = load_examples(str(tmp_path / "questions.parquet"))
    assert [e.id for e in loaded] == [f"phantomwiki-3-{i}" for i in range(16)]  # stable, not the generator's UUIDs
    for example in loaded:
        assert example.data_source == "phantomwiki"
        assert example.golden_answers == raw[example.question].golden_answers
        assert example.metadata["difficulty"] == raw[example.question].metadata["difficulty"]
        assert example.metadata["universe"] == "phantomwiki-3"
        assert example.prompt == raw[example.question].prompt
    corpus = load_corpus(tmp_path / "corpus.jsonl")
    assert len(corpus) == 24 and corpus[0].title == "Danilo Colin"


def test_bm25_finds_a_persons_article_by_name(tmp_path):
    write_universe(FIXTURE, tmp_path, SPEC)
    retriever = BM25Retriever.from_passages(load_corpus(tmp_path / "corpus.jsonl"))
    [hits] = retriever.search(["Ramiro Duquette"], 3)
    assert hits[0].title == "Ramiro Duquette"
    assert "The child of Ramiro Duquette" in hits[0].text or "Ramiro Duquette" in hits[0].text


def test_a_question_without_its_answers_names_the_field(tmp_path):
    rows = json.loads((FIXTURE / "questions.json").read_text())
    del rows[2]["answer"]
    rows[2]["prolog"] = rows[2]["prolog"]  # still claimed by the format
    (tmp_path / "questions.json").write_text(json.dumps(rows))
    shutil.copy(FIXTURE / "articles.json", tmp_path / "articles.json")
    with pytest.raises(DatasetFormatError, match="row 2"):
        read_universe(tmp_path)


def test_bad_answer_and_difficulty_values_are_refused_with_the_row():
    rows = json.loads((FIXTURE / "questions.json").read_text())
    from stratarl.data.phantomwiki import phantomwiki_example

    with pytest.raises(DatasetFormatError, match="row 4: field 'answer'"):
        phantomwiki_example(dict(rows[0], answer=[]), row_index=4, origin="q.json")
    with pytest.raises(DatasetFormatError, match="row 4: field 'difficulty'"):
        phantomwiki_example(dict(rows[0], difficulty="hard"), row_index=4, origin="q.json")


def test_missing_or_broken_generator_output_is_one_clear_error(tmp_path):
    with pytest.raises(PhantomWikiError, match="articles.json: missing"):
        read_universe(tmp_path)
    (tmp_path / "articles.json").write_text("{not json")
    with pytest.raises(PhantomWikiError, match="not readable JSON"):
        read_universe(tmp_path)


def test_a_generator_path_that_is_not_executable_is_refused(tmp_path, monkeypatch):
    monkeypatch.setenv(GENERATOR_ENV, str(tmp_path / "nowhere"))
    with pytest.raises(PhantomWikiError, match="not an executable file"):
        find_generator()


def test_universe_spec_and_seed_lists():
    assert parse_seeds("7") == [7]
    assert parse_seeds("1,5-7,5") == [1, 5, 6, 7]
    for bad in ("x", "9-3", "", "-2"):
        with pytest.raises(ValueError, match="Fix"):
            parse_seeds(bad)
    with pytest.raises(ValueError, match="num_trees"):
        UniverseSpec(seed=1, num_trees=0)
    assert "--easy-mode" in UniverseSpec(seed=1, easy_mode=True).arguments()
    assert UniverseSpec(seed=1, question_depth=6).arguments()[-2:] == ["--question-depth", "6"]


@pytest.mark.slow
def test_the_published_generator_runs_and_reproduces_the_committed_universe(tmp_path):
    """The generator itself, through `stratarl data phantomwiki`: the committed fixture is what it writes for
    seed 3 (the question ids aside, which it draws at random)."""
    generator = _generator_or_skip()
    env = dict(os.environ, **{GENERATOR_ENV: str(generator)})
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "stratarl.cli",
            "data",
            "phantomwiki",
            "--out",
            str(tmp_path),
            "--seeds",
            "3",
            "--max-tree-size",
            "12",
            "--num-trees",
            "2",
            "--questions-per-type",
            "2",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert done.returncode == 0, done.stderr
    assert "phantomwiki-3: 24 articles, 16 questions (d1: 6, d2: 9, d4: 1)" in done.stdout
    universe = tmp_path / "u3"
    assert json.loads((universe / "raw" / "articles.json").read_text()) == json.loads(
        (FIXTURE / "articles.json").read_text()
    )
    fresh = [
        {k: v for k, v in q.items() if k not in ("id", "solution_traces")}
        for q in json.loads((universe / "raw" / "questions.json").read_text())
    ]
    committed = [
        {k: v for k, v in q.items() if k not in ("id", "solution_traces")}
        for q in json.loads((FIXTURE / "questions.json").read_text())
    ]
    assert fresh == committed
    assert len(load_examples(str(universe / "questions.parquet"))) == 16


def test_the_command_fails_in_one_line_without_the_generator(tmp_path):
    env = dict(os.environ, **{GENERATOR_ENV: str(tmp_path / "missing")})
    done = subprocess.run(
        [sys.executable, "-m", "stratarl.cli", "data", "phantomwiki", "--out", str(tmp_path / "o"), "--seeds", "1"],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert done.returncode == 2
    assert done.stderr.strip().count("\n") == 0 and "STRATARL_PHANTOMWIKI_GENERATE" in done.stderr
    assert not (tmp_path / "o" / "u1").exists()


def _renamed_universe(source: Path, target: Path, prefix: str) -> Path:
    """A copy of a universe folder whose people carry ``prefix`` in their names (a second, disjoint universe)."""
    target.mkdir(parents=True)
    lines = (source / "corpus.jsonl").read_text().splitlines()
    renamed = []
    for line in lines:
        row = json.loads(line)
        title, _, text = row["contents"].partition("\n")
        renamed.append(json.dumps({"id": row["id"], "contents": f'"{prefix}{title.strip(chr(34))}"\n{text}'}))
    (target / "corpus.jsonl").write_text("\n".join(renamed) + "\n")
    shutil.copy(source / "questions.parquet", target / "questions.parquet")
    record = json.loads((source / "universe.json").read_text())
    record["spec"]["seed"] = 99
    (target / "universe.json").write_text(json.dumps(record))
    return target


def test_one_runs_data_keeps_training_and_test_universes_apart(tmp_path):
    from stratarl.data.phantomwiki import combine_universes

    first = tmp_path / "u3"
    write_universe(FIXTURE, first, SPEC)
    second = _renamed_universe(first, tmp_path / "u99", "Zz")
    summary = combine_universes([first], [second], tmp_path / "run")
    assert summary["articles"] == 48
    assert summary["train"]["universes"] == ["phantomwiki-3"] and summary["test"]["universes"] == ["phantomwiki-99"]
    corpus = load_corpus(tmp_path / "run" / "corpus.jsonl")
    assert [p.id for p in corpus] == [str(i) for i in range(48)]
    # the solutions' passage ids follow the renumbering: the test universe's point at its own (renamed) people
    titles = {p.id: p.title for p in corpus}
    test_hops = [h for e in load_examples(str(tmp_path / "run" / "test.parquet")) for h in e.metadata.get("hops", [])]
    assert test_hops and all(titles[h["passage_id"]].startswith("Zz") for h in test_hops)
    train_hops = [h for e in load_examples(str(tmp_path / "run" / "train.parquet")) for h in e.metadata.get("hops", [])]
    assert train_hops and not any(titles[h["passage_id"]].startswith("Zz") for h in train_hops)
    assert len(load_examples(str(tmp_path / "run" / "train.parquet"))) == 16
    assert {e.metadata["split"] for e in load_examples(str(tmp_path / "run" / "test.parquet"))} == {"test"}
    with pytest.raises(PhantomWikiError, match="both a training and a test universe"):
        combine_universes([first], [first], tmp_path / "bad")
    with pytest.raises(PhantomWikiError, match="'Danilo Colin' is a person of both"):
        combine_universes([first, _renamed_universe(first, tmp_path / "u98", "")], [], tmp_path / "bad2")


@pytest.mark.slow
def test_a_run_trains_on_a_phantomwiki_universe_with_the_set_reward(tmp_path, stratarl_cli):
    """`stratarl train` on the committed universe (files source, BM25 over its articles, set F1), with the held-out
    eval scored as PhantomWiki's and reported per difficulty."""
    write_universe(FIXTURE, tmp_path / "u3", SPEC)
    universe = tmp_path / "u3"
    done = stratarl_cli(
        "train",
        Path(__file__).resolve().parents[2] / "configs" / "tiny.yaml",
        "data.source=files",
        f"data.train_files=[{universe / 'questions.parquet'}]",
        f"data.test_files=[{universe / 'questions.parquet'}]",
        f"data.corpus={universe / 'corpus.jsonl'}",
        "algo.reward=f1",
        "trainer.steps=2",
        f"trainer.output_dir={tmp_path / 'runs'}",
        "eval.before_after=true",
        "data.max_eval_examples=6",
    )
    assert done.returncode == 0, done.stderr[-2000:]
    [run] = list((tmp_path / "runs").iterdir())
    evals = sorted((run / "eval").glob("*.json")) if (run / "eval").is_dir() else []
    assert evals, sorted(p.name for p in run.iterdir())
    result = json.loads(evals[-1].read_text())
    assert set(result["per_source"]) == {"phantomwiki"}
    assert set(result["per_type"]) <= {"difficulty_1", "difficulty_2", "difficulty_4"} and result["per_type"]


def _searches(question: str) -> list[tuple[str, str]] | None:
    corpus, examples = read_universe(FIXTURE, universe="phantomwiki-3")
    titles = {passage.id: passage.title for passage in corpus}
    example = next(e for e in examples if e.question == question)
    hops = example.metadata.get("hops")
    assert example.metadata["searches_needed"] == (None if hops is None else len(hops))
    return None if hops is None else [(h["query"], titles[h["passage_id"]]) for h in hops]


class TestSolutionSearches:
    """The articles a question needs, read off the committed universe by hand (tests/data/fixtures)."""

    def test_a_stated_relation_needs_the_named_persons_article(self):
        # "The husband of Jesse Kiel is Lance Kiel." is in Jesse Kiel's article
        assert _searches("Who is the husband of Jesse Kiel?") == [("Jesse Kiel", "Jesse Kiel")]

    def test_a_person_found_by_an_attribute_is_searched_by_its_value(self):
        # Lance Kiel's article: "The date of birth of Lance Kiel is 0189-03-08." and his hobby
        assert _searches("What is the hobby of the person whose date of birth is 0189-03-08?") == [
            ("0189-03-08", "Lance Kiel")
        ]

    def test_a_composed_relation_reads_every_article_along_the_family_chain(self):
        # Lance Kiel -daughter-> Ramona Colin -son-> Mckinley Colin -daughter-> Yvette Song (the answer):
        # the great-granddaughter needs Lance's, Ramona's and Mckinley's articles, not Yvette's
        assert _searches("Who is the great-granddaughter of the person whose date of birth is 0189-03-08?") == [
            ("0189-03-08", "Lance Kiel"),
            ("Ramona Colin", "Ramona Colin"),
            ("Mckinley Colin", "Mckinley Colin"),
        ]

    def test_an_attribute_of_related_people_reads_each_of_them(self):
        # Lance's daughter is Ramona Colin: her hobby is in her own article
        assert _searches("What is the hobby of the daughter of Lance Kiel?") == [
            ("Lance Kiel", "Lance Kiel"),
            ("Ramona Colin", "Ramona Colin"),
        ]
        # three children, each article read once, in the order of the generator's solutions
        reads = _searches("What is the date of birth of the child of Ramiro Duquette?")
        assert reads is not None and reads[0] == ("Ramiro Duquette", "Ramiro Duquette")
        assert sorted(reads[1:]) == [(n, n) for n in ("Laurel Duquette", "Wyatt Duquette", "Zelma Duquette")]

    def test_counting_questions_get_no_plan(self):
        assert _searches("How many children does Ramiro Duquette have?") is None

    def test_the_last_search_tells_every_answer(self):
        _, examples = read_universe(FIXTURE, universe="phantomwiki-3")
        example = next(e for e in examples if e.question == "Who is the child of Ramiro Duquette?")
        assert example.metadata["hops"][-1]["answer"] == "Laurel Duquette, Wyatt Duquette, Zelma Duquette"


def test_a_warm_start_demonstration_replays_the_solution_and_names_every_answer(tmp_path, smollm2_tokenizer):
    from stratarl.trainer.warmstart.demos import render_demonstrations

    write_universe(FIXTURE, tmp_path, SPEC)
    examples = [e for e in load_examples(str(tmp_path / "questions.parquet")) if e.metadata.get("hops")]
    retriever = BM25Retriever.from_passages(load_corpus(tmp_path / "corpus.jsonl"))
    demos = render_demonstrations(
        examples,
        smollm2_tokenizer,
        retriever,
        num_demos=len(examples),
        topk=3,
        max_obs_tokens=400,
        no_search_fraction=0.0,
        wrong_hop_fraction=0.0,
        seed=0,
    )
    by_id = {d.example_id: d for d in demos}
    child = next(e for e in examples if e.question == "Who is the child of Ramiro Duquette?")
    demo = by_id[child.id]  # its one search finds Ramiro Duquette's article, so the demonstration is kept
    assert demo.kind == "correct" and demo.meta["searches"] == ["Ramiro Duquette"]
    assert demo.meta["answer"] == "Laurel Duquette, Wyatt Duquette, Zelma Duquette"
    assert smollm2_tokenizer.decode(demo.response_ids).endswith(
        "<answer> Laurel Duquette, Wyatt Duquette, Zelma Duquette </answer><|im_end|>"
    )


def test_the_searches_do_not_depend_on_the_order_the_generator_lists_solutions_in():
    """The generator lists solutions in a different order on every run; the plan must be the same."""
    import json as _json

    from stratarl.data.phantomwiki_solutions import relation_graph, solution_reads

    articles = _json.loads((FIXTURE / "articles.json").read_text())
    row = next(
        r
        for r in _json.loads((FIXTURE / "questions.json").read_text())
        if r["question"] == "What is the date of birth of the child of Ramiro Duquette?"
    )
    traces = _json.loads(row["solution_traces"])
    assert len(traces) >= 2
    graph = relation_graph(articles)
    plans = {
        tuple(solution_reads(dict(row, solution_traces=_json.dumps(order)), graph) or ())
        for order in (traces, traces[::-1], traces[1:] + traces[:1])
    }
    assert len(plans) == 1
