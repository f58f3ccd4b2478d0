"""PhantomWiki's closed vocabulary: one word-level vocabulary for every universe, and the set-up check."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from stratarl.config_errors import ConfigError
from stratarl.data.phantomwiki import GENERATOR_ENV, PhantomWikiError, UniverseSpec, find_generator, write_universe
from stratarl.data.phantomwiki_vocabulary import (
    VOCABULARY_FILE,
    closed_words,
    generator_python,
    generator_texts,
    read_vocabulary,
    write_vocabulary,
)
from stratarl.data.search_r1 import load_examples
from stratarl.data.wordlevel import closed_word_tokenizer, count_pieces, task_texts, unknown_in_texts
from stratarl.retrieval.base import Passage
from stratarl.retrieval.corpus import load_corpus, write_corpus
from stratarl.trainer.config import ModelConfig
from stratarl.trainer.setup import load_policy
from stratarl.trainer.task import TaskData

FIXTURE = Path(__file__).parent / "fixtures" / "phantomwiki_seed3"
SPEC = UniverseSpec(seed=3, max_tree_size=12, num_trees=2, questions_per_type=2)


def _generator_python_or_skip() -> Path:
    try:
        return generator_python(find_generator())
    except PhantomWikiError:
        if os.environ.get("CI"):
            raise  # CI builds .venv-phantom (make test): the generator must run there
        pytest.skip("the PhantomWiki generator is not installed here (make phantomwiki)")


def _universe(tmp_path: Path, name: str, prefix: str = "") -> Path:
    """The committed universe in the Search-R1 layout; with ``prefix``, its people renamed (``prefix`` + name):
    another universe, whose names a vocabulary of the first lacks."""
    folder = tmp_path / name
    write_universe(FIXTURE, folder, SPEC)
    if prefix:
        passages = load_corpus(folder / "corpus.jsonl")
        firsts = {p.title.split(" ")[0] for p in passages}
        pattern = re.compile(r"\b(" + "|".join(map(re.escape, sorted(firsts))) + r")\b")
        renamed = [Passage(p.id, pattern.sub(lambda m: prefix + m.group(1).lower(), p.contents)) for p in passages]
        write_corpus(renamed, folder / "corpus.jsonl")
    return folder


def _task(folder: Path) -> TaskData:
    questions = str(folder / "questions.parquet")
    examples = load_examples(questions)
    return TaskData(examples, [], folder / "corpus.jsonl", question_files=[questions])


def _pieces(folder: Path) -> set[str]:
    task = _task(folder)
    return set(count_pieces(task_texts(load_corpus(task.corpus_path), task.train)))


def test_the_words_are_every_string_the_package_ships_but_its_docstrings(tmp_path, monkeypatch):
    # A stand-in package: one module with a docstring and two string constants, one JSON data file.
    package = tmp_path / "phantom_wiki"
    (package / "names").mkdir(parents=True)
    (package / "__init__.py").write_text(
        '"""Docstring prose."""\nTEMPLATE = "The mother-in-law of <subject> is"\nHOBBY = {"kind": "bird watching"}\n'
    )
    (package / "names" / "last_names.json").write_text(json.dumps(["Zorvanta", "Quill"]))
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    words = closed_words(generator_texts(Path(sys.executable)))
    # pieces: letter runs and single punctuation marks; "Docstring" / "prose" are not generator output
    expected = ["The", "mother", "-", "in", "law", "of", "<", "subject", ">", "is", "kind", "bird", "watching"]
    assert words == sorted([*expected, "Zorvanta", "Quill"])
    path = write_vocabulary(tmp_path, words)
    assert path.name == VOCABULARY_FILE and read_vocabulary(path) == words


def test_an_empty_or_missing_word_list_is_one_line_naming_it(tmp_path):
    (tmp_path / "empty.txt").write_text("\n\n")
    with pytest.raises(ValueError, match=r"empty\.txt: no words"):
        read_vocabulary(tmp_path / "empty.txt")
    with pytest.raises(ValueError, match=r"missing\.txt: not a readable word list"):
        read_vocabulary(tmp_path / "missing.txt")


def test_a_closed_vocabulary_is_the_same_for_two_different_universes(tmp_path):
    first, second = _universe(tmp_path, "u3"), _universe(tmp_path, "u99", prefix="Zq")
    words = write_vocabulary(tmp_path, sorted(_pieces(first) | _pieces(second)))
    model_cfg = ModelConfig(name="word-tiny", word_vocabulary=str(words))
    _, tokenizer_a = load_policy(model_cfg, task=_task(first))
    _, tokenizer_b = load_policy(model_cfg, task=_task(second))
    assert tokenizer_a.get_vocab() == tokenizer_b.get_vocab()
    assert "Zqdanilo" in tokenizer_a.get_vocab()  # the second universe's names, spelt by the first's run
    # Without the word list each run builds its own vocabulary, and the two differ.
    _, own_a = load_policy(ModelConfig(name="word-tiny"), task=_task(first))
    _, own_b = load_policy(ModelConfig(name="word-tiny"), task=_task(second))
    assert own_a.get_vocab() != own_b.get_vocab() and "Zqdanilo" not in own_a.get_vocab()


def test_a_word_outside_the_list_fails_set_up_naming_the_file(tmp_path):
    first, second = _universe(tmp_path, "u3"), _universe(tmp_path, "u99", prefix="Zq")
    words = write_vocabulary(tmp_path, sorted(_pieces(first)))
    model_cfg = ModelConfig(name="word-tiny", word_vocabulary=str(words))
    load_policy(model_cfg, task=_task(first))  # covered: no error
    with pytest.raises(ConfigError) as error:
        load_policy(model_cfg, task=_task(second))
    message = str(error.value)
    assert message.count("\n") == 0
    assert message.startswith(f"{second / 'corpus.jsonl'}: words outside the word-level vocabulary")
    assert "'Zq" in message and "Fix:" in message
    # A question word missing (the corpus covered): the questions' file is named.
    corpus_only = set(count_pieces(p.contents for p in load_corpus(first / "corpus.jsonl")))
    protocol = set(closed_word_tokenizer([]).get_vocab())  # the words every closed vocabulary holds anyway
    question_only = sorted(_pieces(first) - corpus_only - protocol)
    assert question_only
    write_vocabulary(tmp_path, sorted(_pieces(first) - {question_only[0]}))
    with pytest.raises(ConfigError, match=rf"^{first / 'questions.parquet'}: words outside .*'{question_only[0]}'"):
        load_policy(model_cfg, task=_task(first))


def test_the_generators_own_words_spell_a_universe_they_were_not_read_from():
    """The committed universe (seed 3, made by the generator) has no word outside the words the installed
    generator ships: names, surnames, occupations, hobbies, relation words and question templates."""
    from stratarl.data.wordlevel import closed_word_tokenizer

    words = closed_words(generator_texts(_generator_python_or_skip()))
    assert len(words) > 5000  # thousands of surnames and first names
    tokenizer = closed_word_tokenizer(words)
    passages = _passages_of_fixture()
    corpus_missing = unknown_in_texts(tokenizer, (p.contents for p in passages))
    questions = [q["question"] for q in json.loads((FIXTURE / "questions.json").read_text())]
    answers = [str(a) for q in json.loads((FIXTURE / "questions.json").read_text()) for a in q["answer"]]
    assert corpus_missing == [] and unknown_in_texts(tokenizer, [*questions, *answers]) == []


def _passages_of_fixture():
    from stratarl.data.phantomwiki import read_universe

    return read_universe(FIXTURE)[0]


@pytest.mark.slow
def test_the_command_writes_the_word_list_and_a_new_universe_needs_no_other_word(tmp_path, stratarl_cli):
    """`stratarl data phantomwiki` on a seed no test used writes vocabulary.txt; a word-tiny run over that
    universe with model.word_vocabulary sets up (no word outside it)."""
    generator = find_generator() if _generator_python_or_skip() else None
    env = dict(os.environ, **{GENERATOR_ENV: str(generator)})
    args = ["data", "phantomwiki", "--out", str(tmp_path), "--seeds", "9917", "--max-tree-size", "12"]
    done = subprocess.run(
        [sys.executable, "-m", "stratarl.cli", *args, "--questions-per-type", "2"],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert done.returncode == 0, done.stderr
    assert "closed vocabulary:" in done.stdout and (tmp_path / VOCABULARY_FILE).is_file()
    task = TaskData(load_examples(str(tmp_path / "train.parquet")), [], tmp_path / "corpus.jsonl")
    model_cfg = ModelConfig(name="word-tiny", word_vocabulary=str(tmp_path / VOCABULARY_FILE))
    _, tokenizer = load_policy(model_cfg, task=task)  # would raise ConfigError on a word outside the list
    assert len(tokenizer) > 10000


def test_a_missing_word_list_stops_set_up_naming_the_config_field(tmp_path):
    folder = _universe(tmp_path, "u3")
    model_cfg = ModelConfig(name="word-tiny", word_vocabulary=str(tmp_path / "none.txt"))
    with pytest.raises(ConfigError, match=r"^config field `model.word_vocabulary`: .*none\.txt: not a readable"):
        load_policy(model_cfg, task=_task(folder))
