"""Search-R1 corpus files: one JSON passage per line, ``{"id": "0", "contents": "\\"Title\\"\\ntext"}``."""

from __future__ import annotations

import gzip
import hashlib
import json
import mmap
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import IO

import numpy as np

from stratarl.retrieval.base import Passage

CORPUS_LINE_EXAMPLE = '{"id": "0", "contents": "\\"Title\\"\\nPassage text."}'


class CorpusError(ValueError):
    """A corpus file that cannot be read; the message names the file, the line and the fix."""


def _open_text(path: Path, mode: str) -> IO[str]:
    if path.suffix == ".gz":
        return gzip.open(path, mode + "t", encoding="utf-8")  # type: ignore[return-value]  # a text mode: IO[str]
    return open(path, mode, encoding="utf-8")


def _open_binary(path: Path) -> IO[bytes]:
    return gzip.open(path, "rb") if path.suffix == ".gz" else open(path, "rb")  # type: ignore[return-value]  # the stub: GzipFile


def _lines(handle: IO[bytes], path: Path) -> Iterator[bytes]:
    try:
        yield from handle
    except (gzip.BadGzipFile, EOFError, OSError) as error:
        if isinstance(error, (gzip.BadGzipFile, EOFError)) or "gzip" in str(error).lower():
            raise CorpusError(
                f"{path}: not a readable gzip file ({error}). Fix: compress it with gzip, or name a "
                "plain-text corpus .jsonl"
            ) from None
        raise


def _passage_from_record(record: object, path: Path, line_number: int) -> Passage:
    """One parsed JSON line → Passage.

    Accepts Search-R1's ``{"id", "contents"}`` and, as FlashRAG-style corpora do,
    ``{"id", "title", "text"}`` (rendered as ``'"<title>"\\n<text>'``, the same layout).
    """
    where = f"{path}, line {line_number}"
    if not isinstance(record, dict):
        raise CorpusError(
            f"{where}: expected a JSON object, got {type(record).__name__}. "
            f"Each line must look like {CORPUS_LINE_EXAMPLE}"
        )
    if "id" not in record:
        raise CorpusError(f"{where}: missing field 'id'. Each line must look like {CORPUS_LINE_EXAMPLE}")
    passage_id = record["id"]
    if isinstance(passage_id, bool) or not isinstance(passage_id, (str, int)):
        raise CorpusError(f"{where}: field 'id' must be a string or an integer, got {passage_id!r}")
    if "contents" in record:
        contents = record["contents"]
    elif "title" in record and "text" in record:
        contents = f'"{record["title"]}"\n{record["text"]}'
    else:
        raise CorpusError(
            f"{where}: missing field 'contents' (fields present: {sorted(record)}). "
            f"Each line must look like {CORPUS_LINE_EXAMPLE}"
        )
    if not isinstance(contents, str):
        raise CorpusError(f"{where}: field 'contents' must be a string, got {type(contents).__name__}")
    return Passage(id=str(passage_id), contents=contents)


def iter_corpus(path: str | Path) -> Iterator[Passage]:
    """Yield the passages of a Search-R1 corpus jsonl (``.jsonl`` or ``.jsonl.gz``) in file order.

    Blank lines are skipped; any other unreadable line raises `CorpusError` naming file and line.
    """
    path = Path(path)
    if not path.is_file():
        raise CorpusError(
            f"corpus file not found: {path}. Pass a Search-R1 corpus jsonl ({CORPUS_LINE_EXAMPLE} per line)"
        )
    with _open_binary(path) as handle:
        for line_number, raw in enumerate(_lines(handle, path), start=1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as error:
                raise CorpusError(
                    f"{path}, line {line_number}: not UTF-8 text (byte {error.start + 1} of the line "
                    "cannot be decoded). Fix: re-encode the file as UTF-8"
                ) from None
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as error:
                raise CorpusError(
                    f"{path}, line {line_number}: invalid JSON ({error.msg} at column {error.colno}). "
                    f"Each line must look like {CORPUS_LINE_EXAMPLE}"
                ) from None
            yield _passage_from_record(record, path, line_number)


def load_corpus(path: str | Path) -> list[Passage]:
    """Read a whole Search-R1 corpus jsonl into memory; an empty corpus is an error."""
    passages = list(iter_corpus(path))
    if not passages:
        raise CorpusError(
            f"{path}: the corpus has no passages; it needs one JSON object per line ({CORPUS_LINE_EXAMPLE})"
        )
    return passages


def write_corpus(passages: Iterable[Passage], path: str | Path) -> Path:
    """Write passages as a Search-R1 corpus jsonl (``{"id", "contents"}`` per line); returns the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with _open_text(path, "w") as handle:
        for passage in passages:
            handle.write(corpus_line(passage))
    return path


def corpus_line(passage: Passage) -> str:
    """One line of a Search-R1 corpus jsonl: ``{"id", "contents"}`` as UTF-8 JSON, then a newline."""
    return json.dumps(passage.to_document(), ensure_ascii=False) + "\n"


def passages_fingerprint(passages: Iterable[Passage]) -> str:
    """SHA-256 over the ids and contents, in order: the identity of a corpus's content.

    Two corpora with the same passages in the same order get the same fingerprint,
    whatever file they came from (so a cache keyed by it survives a copy or a move).
    """
    digest = hashlib.sha256()
    for passage in passages:
        for field in (passage.id, passage.contents):
            encoded = field.encode("utf-8")
            digest.update(len(encoded).to_bytes(8, "little"))
            digest.update(encoded)
    return digest.hexdigest()


def corpus_line_offsets(path: str | Path) -> np.ndarray:
    """Byte offset of every non-blank line of a plain-text corpus jsonl (int64 [N]), in file order."""
    path = Path(path)
    if path.suffix == ".gz":
        raise CorpusError(f"{path}: a gzip corpus cannot be read line by line from disk. Fix: gunzip it first")
    offsets, position = [], 0
    with open(path, "rb") as handle:
        for line in handle:
            if line.strip():
                offsets.append(position)
            position += len(line)
    return np.asarray(offsets, dtype=np.int64)


class CorpusFile(Sequence):
    """The passages of a plain-text corpus jsonl, read from disk when asked for (a memory-mapped file).

    Holds only the file mapping and one int64 offset per passage (8 bytes instead of the ~0.8 kB a
    100-word `Passage` takes in memory): a 21M-passage Wikipedia corpus costs 170 MB of RAM plus the
    pages the OS caches. ``passages[i]`` parses line ``i`` (blank lines not counted); iteration
    streams the file. ``offsets``: from `corpus_line_offsets` (computed here when not given).
    """

    def __init__(self, path: str | Path, offsets: np.ndarray | None = None) -> None:
        self.path = Path(path)
        if not self.path.is_file():
            raise CorpusError(f"corpus file not found: {self.path}")
        self._offsets = corpus_line_offsets(self.path) if offsets is None else offsets
        self._handle = open(self.path, "rb")  # noqa: SIM115  the memory map needs it open for the corpus's life
        size = self.path.stat().st_size
        self._map = mmap.mmap(self._handle.fileno(), 0, access=mmap.ACCESS_READ) if size else b""
        if len(self._offsets) and int(self._offsets[-1]) >= size:
            raise CorpusError(f"{self.path}: the offsets do not match the file (it changed?). Fix: rebuild the index")

    def __len__(self) -> int:
        return len(self._offsets)

    def __getitem__(self, index):
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(len(self)))]
        start = int(self._offsets[index])
        end = self._map.find(b"\n", start)
        raw = self._map[start : end if end >= 0 else len(self._map)]
        try:
            record = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise CorpusError(
                f"{self.path}: passage {index} (byte {start}) is not a JSON line; rebuild the index"
            ) from None
        return _passage_from_record(record, self.path, index + 1)

    def __iter__(self) -> Iterator[Passage]:
        return iter_corpus(self.path)

    def __repr__(self) -> str:
        return f"CorpusFile({str(self.path)!r}, num_passages={len(self)})"
