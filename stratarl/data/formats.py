"""Dataset formats: how a question file's rows become `Example`s; a new format is one decorated function.

Every loader (``load_examples``, ``load_example_files``, ``stratarl data convert / inspect``, training and
``stratarl eval``) reads rows through this registry: each row goes to the newest registered format whose
``matches(row)`` accepts it, and a row no format claims is read as ``search_r1``. ``--format NAME`` on
``stratarl data`` (``format=`` in Python) reads every row with one format instead.

Built in (each registered in its own module with the decorator a format of your own uses; importing
``stratarl.data`` registers them):

- ``search_r1``: Search-R1's rows (``prompt``, ``reward_model.ground_truth.target``, ``data_source``,
  ``extra_info``; ``scripts/data_process/nq_search.py``) and the variants read by the same code, veRL's
  (``searchR1_`` sources, a system message) and SkyRL's (``env_class``, ``reward_spec``); also plain rows
  with ``question`` and ``golden_answers`` / ``answers`` / ``answer``
  (:func:`stratarl.data.search_r1.search_r1_example`). The default for a row no other format claims.
- ``medqa``: MedQA's multiple-choice rows (``question``, ``options``, ``answer_idx``;
  :func:`stratarl.data.multiple_choice.medqa_example`).
- ``medmcqa``: MedMCQA's multiple-choice rows (``question``, ``opa`` .. ``opd``, ``cop`` 0-3 or 1-4, decided
  per file; :func:`stratarl.data.multiple_choice.medmcqa_example`).

Files are ``.parquet``, ``.jsonl`` or ``.json`` (``read_rows``), a folder of them, or a hub dataset name.
A format of your own, in a module loaded with ``--import`` (``stratarl data inspect my.jsonl --import
my_format.py``)::

    from stratarl.data import Example, register_dataset_format

    @register_dataset_format("trivia", matches=lambda row: "Q" in row and "A" in row)
    def trivia(row: dict, *, row_index: int, id_: str | None = None) -> Example:
        return Example(id=id_ or f"trivia-{row_index}", question=row["Q"], golden_answers=(row["A"],),
                       data_source="trivia")

The function receives the row and, among these keywords, those it names: ``row_index`` (0-based),
``origin`` (the file, for error messages), ``id_`` (the file's own ``id`` column when it is present and
unique in the file, else None), and whatever the format's ``prepare(rows, origin) -> dict`` returns (called
once per file with the rows this format reads). Ids must be unique within a file.
"""

from __future__ import annotations

import inspect
import os
import warnings
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from stratarl.data.examples import DatasetFormatError, Example
from stratarl.registry import Registry

DEFAULT_FORMAT = "search_r1"

RowReader = Callable[..., Example]


@dataclass(frozen=True)
class DatasetFormat:
    """A registered format: ``read(row, **keywords) -> Example``, ``matches(row) -> bool`` (None: used only when
    chosen by name or as the default), ``prepare(rows, origin) -> dict`` of extra keywords for one file (or None)."""

    name: str
    read: RowReader
    matches: Callable[[Any], bool] | None = None
    prepare: Callable[[Sequence[dict], str], dict] | None = None
    keywords: frozenset[str] | None = None
    """The keyword names ``read`` takes (None: any, it takes ``**keywords``)."""


def _keywords(fn: Callable) -> frozenset[str] | None:
    parameters = inspect.signature(fn).parameters.values()
    if any(p.kind is p.VAR_KEYWORD for p in parameters):
        return None
    return frozenset(p.name for p in parameters if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY))


_FORMATS: Registry[DatasetFormat] = Registry(
    "dataset format",
    how_to_add="(a format of your own: register_dataset_format in a module loaded with --import)",
    unknown_error=ValueError,
    source=lambda dataset_format: dataset_format.read,
)


def register_dataset_format(
    name: str,
    *,
    matches: Callable[[Any], bool] | None = None,
    prepare: Callable[[Sequence[dict], str], dict] | None = None,
) -> Callable[[RowReader], RowReader]:
    """Decorator: register ``fn(row, *, row_index, origin, id_, ...) -> Example`` as dataset format ``name``.

    ``matches(row) -> bool``: the rows this format reads when no format is chosen (the newest registered
    format that matches a row reads it); None: only when chosen by name (``--format name``).
    ``prepare(rows, origin) -> dict``: extra keywords for ``fn``, computed once per file from the rows it reads
    (MedMCQA decides there whether ``cop`` counts from 0 or 1). A name registered twice is refused (ValueError).
    """
    _FORMATS.check_name(name)

    def decorator(fn: RowReader) -> RowReader:
        _FORMATS.add(name, DatasetFormat(name, fn, matches, prepare, _keywords(fn)))
        return fn

    return decorator


def dataset_format_names() -> list[str]:
    """The registered dataset formats, sorted (the built-ins and any a loaded module registered)."""
    return _FORMATS.names()


def get_dataset_format(name: str) -> DatasetFormat:
    """The format registered as ``name``; an unknown name raises a ValueError listing the registered ones."""
    return _FORMATS.lookup(name)


def _detectors() -> list[DatasetFormat]:
    """The formats with a ``matches``, newest registered first."""
    return [f for f in reversed(list(_FORMATS.values())) if f.matches is not None]


def format_of_row(
    row: Any, detectors: Sequence[DatasetFormat] | None = None, *, origin: str = "a row", row_index: int | None = None
) -> DatasetFormat:
    """The format that reads ``row``: the newest registered one whose ``matches`` accepts it, else ``search_r1``."""
    if isinstance(row, dict):
        for dataset_format in _detectors() if detectors is None else detectors:
            matches = dataset_format.matches
            with _reported(origin, row_index, f"the `matches` of dataset format {dataset_format.name!r}"):
                found = matches is not None and matches(row)
            if found:
                return dataset_format
    return get_dataset_format(DEFAULT_FORMAT)


@contextmanager
def _reported(origin: str, row_index: int | None, what: str) -> Iterator[None]:
    """A user's reader, ``matches`` or ``prepare`` that raises (anything but a `DatasetFormatError`, which names
    its own row) becomes one `DatasetFormatError` line naming the file, the row and the format
    (``STRATARL_DEBUG=1`` keeps the traceback)."""
    try:
        yield
    except DatasetFormatError:
        raise
    except Exception as error:
        if os.environ.get("STRATARL_DEBUG"):
            raise
        where = f"{origin}: row {row_index}" if row_index is not None else origin
        what_raised = " ".join(str(error).split())[:300] or "no message"
        raise DatasetFormatError(
            f"{where}: {what} raised {type(error).__name__}: {what_raised}. Fix: correct the format's code, or the "
            "row it cannot read (STRATARL_DEBUG=1 shows the traceback)"
        ) from None


class _Reader:
    """One format's reads within one file: the keywords it names, and its ``prepare`` result."""

    def __init__(self, dataset_format: DatasetFormat, extra: dict) -> None:
        named = dataset_format.keywords
        self.format = dataset_format
        self.extra = extra if named is None else {k: v for k, v in extra.items() if k in named}
        self.row_index, self.origin, self.id_ = (
            named is None or key in named for key in ("row_index", "origin", "id_")
        )

    def __call__(self, row: dict, row_index: int, origin: str, id_: str | None) -> Example:
        keywords = dict(self.extra)
        if self.row_index:
            keywords["row_index"] = row_index
        if self.origin:
            keywords["origin"] = origin
        if self.id_:
            keywords["id_"] = id_
        with _reported(origin, row_index, f"dataset format {self.format.name!r}"):
            example = self.format.read(row, **keywords)
        if not isinstance(example, Example):
            raise DatasetFormatError(
                f"{origin}: row {row_index}: dataset format {self.format.name!r} returned a "
                f"{type(example).__name__}, not an Example. Fix: return stratarl.data.Example(...) from the reader"
            )
        metadata = example.metadata
        if "format" not in metadata:
            metadata["format"] = self.format.name
        if "row" not in metadata:
            metadata["row"] = row_index
        return example


def examples_from_rows(rows: Sequence[Any], *, origin: str, format: str | None = None) -> list[Example]:
    """Rows → Examples, each row read by its format (``format``: every row by that one), with unique ids.

    Ids: the file's own ``id`` column when present and unique, else the format's (the built-ins:
    ``f"{data_source}-{row}"``). Never ``extra_info.index``: it restarts at 0 for each source in merged
    files, so grouping rollouts by it silently mixes questions.
    """
    chosen = get_dataset_format(format) if format is not None else None
    for i, row in enumerate(rows):
        if not isinstance(row, dict):
            raise DatasetFormatError(f"{origin}: row {i}: expected an object with fields, got {type(row).__name__}")
    file_ids = [row.get("id") if isinstance(row, dict) else None for row in rows]
    use_file_ids = all(i is not None and str(i) != "" for i in file_ids) and len({str(i) for i in file_ids}) == len(
        rows
    )
    if not use_file_ids and any(i is not None for i in file_ids):
        warnings.warn(
            f"{origin}: the 'id' column is missing in some rows or has duplicates (common in merged "
            "multi-source files); using '<data_source>-<row>' ids instead",
            stacklevel=3,
        )
    detectors = _detectors()
    formats = [chosen or format_of_row(row, detectors, origin=origin, row_index=i) for i, row in enumerate(rows)]
    readers: dict[str, _Reader] = {}
    for dataset_format in {f.name: f for f in formats}.values():
        extra = {}
        if dataset_format.prepare is not None:
            own_rows = [row for row, f in zip(rows, formats) if f.name == dataset_format.name]
            with _reported(origin, None, f"the `prepare` of dataset format {dataset_format.name!r}"):
                extra = dict(dataset_format.prepare(own_rows, origin))
        readers[dataset_format.name] = _Reader(dataset_format, extra)
    examples = [
        readers[dataset_format.name](row, i, origin, str(file_ids[i]) if use_file_ids else None)
        for i, (row, dataset_format) in enumerate(zip(rows, formats))
    ]
    seen: dict[str, int] = {}
    for i, example in enumerate(examples):
        if example.id in seen:
            raise DatasetFormatError(
                f"{origin}: rows {seen[example.id]} and {i} have the same id {example.id!r} "
                f"(format {formats[i].name!r}). Fix: give each row its own id"
            )
        seen[example.id] = i
    return examples
