"""load_corpus / write_corpus / passages_fingerprint: format, round trip, and errors that name file and line."""

from __future__ import annotations

import gzip
import json

import pytest

from stratarl.retrieval.base import Passage
from stratarl.retrieval.corpus import CorpusError, load_corpus, passages_fingerprint, write_corpus


def test_round_trip_keeps_ids_contents_and_order(tmp_path, small_passages):
    path = write_corpus(small_passages, tmp_path / "corpus.jsonl")
    assert load_corpus(path) == small_passages


def test_gzip_round_trip(tmp_path, small_passages):
    path = write_corpus(small_passages, tmp_path / "corpus.jsonl.gz")
    with gzip.open(path, "rt", encoding="utf-8") as handle:
        assert json.loads(handle.readline()) == small_passages[0].to_document()
    assert load_corpus(path) == small_passages


def test_search_r1_line_gives_title_and_text(tmp_path):
    # The wiki-18 corpus stores the quoted title on the first line of "contents".
    (tmp_path / "c.jsonl").write_text(
        json.dumps({"id": "7", "contents": '"Ada Lovelace"\nFirst programmer.\nMore.'}) + "\n"
    )
    (passage,) = load_corpus(tmp_path / "c.jsonl")
    assert (passage.id, passage.title, passage.text) == ("7", "Ada Lovelace", "First programmer.\nMore.")


def test_integer_ids_become_strings_and_blank_lines_are_skipped(tmp_path):
    (tmp_path / "c.jsonl").write_text('{"id": 3, "contents": "a"}\n\n   \n{"id": "x", "contents": "b"}\n')
    assert load_corpus(tmp_path / "c.jsonl") == [Passage("3", "a"), Passage("x", "b")]


def test_title_text_records_are_rendered_in_search_r1_layout(tmp_path):
    (tmp_path / "c.jsonl").write_text(json.dumps({"id": "1", "title": "T", "text": "body"}) + "\n")
    assert load_corpus(tmp_path / "c.jsonl") == [Passage("1", '"T"\nbody')]


@pytest.mark.parametrize(
    ("bad_line", "expected"),
    [
        ('{"id": "1", "contents": ', "invalid JSON"),
        ('["1", "text"]', "expected a JSON object, got list"),
        ('{"contents": "text"}', "missing field 'id'"),
        ('{"id": "1", "body": "text"}', "missing field 'contents'"),
        ('{"id": "1", "contents": 5}', "'contents' must be a string"),
        ('{"id": null, "contents": "a"}', "'id' must be a string or an integer"),
    ],
)
def test_broken_line_error_names_file_and_line(tmp_path, bad_line, expected):
    path = tmp_path / "broken.jsonl"
    path.write_text('{"id": "0", "contents": "ok"}\n' + bad_line + "\n")
    with pytest.raises(CorpusError) as info:
        load_corpus(path)
    message = str(info.value)
    assert f"{path}, line 2" in message
    assert expected in message


def test_missing_and_empty_files_are_clear_errors(tmp_path):
    with pytest.raises(CorpusError, match="corpus file not found"):
        load_corpus(tmp_path / "nope.jsonl")
    (tmp_path / "empty.jsonl").write_text("\n")
    with pytest.raises(CorpusError, match="no passages"):
        load_corpus(tmp_path / "empty.jsonl")


def test_fingerprint_depends_on_content_and_order_only(tmp_path, small_passages):
    a = passages_fingerprint(load_corpus(write_corpus(small_passages, tmp_path / "a.jsonl")))
    b = passages_fingerprint(load_corpus(write_corpus(small_passages, tmp_path / "sub" / "b.jsonl")))
    assert a == b == passages_fingerprint(small_passages)
    assert passages_fingerprint(small_passages[::-1]) != a
    edited = [Passage(small_passages[0].id, small_passages[0].contents + "!"), *small_passages[1:]]
    assert passages_fingerprint(edited) != a
    # Length-prefixing keeps field boundaries: ("ab", "c") and ("a", "bc") differ.
    assert passages_fingerprint([Passage("ab", "c")]) != passages_fingerprint([Passage("a", "bc")])
