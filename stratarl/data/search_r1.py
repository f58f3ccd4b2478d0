"""Question files to and from `Example`: the loaders, the Search-R1 row format (and its veRL / SkyRL variants),
and the Search-R1 writers.

The loaders here (``load_examples``, ``load_example_files``, ``examples_from_rows``) read any format registered
in :mod:`stratarl.data.formats` (``register_dataset_format``): ``search_r1`` (this module's
:func:`search_r1_example`), ``medqa`` and ``medmcqa`` (:mod:`stratarl.data.multiple_choice`), and yours.

Row shape (Search-R1, `scripts/data_process/nq_search.py`; see docs/data.md)::

    data_source: "nq" | "hotpotqa" | ...
    prompt: [{"role": "user", "content": <templated prompt ending in "Question: {q}\\n">}]
    ability: "fact-reasoning"
    reward_model: {"style": "rule", "ground_truth": {"target": [<gold answers>]}}
    extra_info: {"split": "train" | "test", "index": <row index within its source>}
    (often also: id, question, golden_answers, metadata)

Variants read by the same code: veRL's (data_source prefixed ``searchR1_``, a
system message, ``<tool_call>`` tags in the prompt) and SkyRL's (``env_class``
plus ``reward_spec`` instead of ``reward_model``).

Ids: the file's own ``id`` column when present and unique, else
``f"{data_source}-{row}"``. Never ``extra_info.index``: it restarts at 0 for
each source in merged files, so grouping rollouts by it silently mixes questions.
"""

from __future__ import annotations

import dataclasses
import json
import warnings
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

from stratarl.data.examples import DatasetFormatError, Example
from stratarl.data.formats import examples_from_rows, register_dataset_format
from stratarl.rollout.prompt import build_prompt

VERL_PREFIX = "searchR1_"  # the data_source tag of veRL's Search-R1 variant rows
_FILE_SUFFIXES = (".parquet", ".jsonl", ".json")
_QUESTION_MARKER = "Question:"


def extract_question(prompt: str | Sequence[dict]) -> str:
    """Recover the raw question from a templated prompt (a string or a chat message list).

    Takes the last user message, then the text after the last ``Question:`` marker
    (Search-R1, veRL and SkyRL templates all end with it), cut at the first
    chat-template special token (``<|``). A prompt without the marker is returned
    stripped, whole: it is taken to be the question itself.
    """
    if not isinstance(prompt, str):
        users = [m.get("content", "") for m in prompt if isinstance(m, dict) and m.get("role") == "user"]
        if not users:
            raise ValueError("prompt has no user message")
        prompt = users[-1]
    if not isinstance(prompt, str):
        raise ValueError(f"prompt content must be text, got {type(prompt).__name__}")
    text = prompt
    position = text.rfind(_QUESTION_MARKER)
    if position >= 0:
        text = text[position + len(_QUESTION_MARKER) :]
    special = text.find("<|")
    if special >= 0:
        text = text[:special]
    return text.strip()


# --------------------------------------------------------------------------- reading rows


def _as_answers(value: Any, where: str = "", field: str = "golden_answers") -> list[str] | None:
    """Gold answers from any of the shapes seen in the wild: a string, a list, or
    a ``{"target": ...}`` dict (Search-R1's ground_truth). Answers are text: a number is refused
    (``42`` and ``"42.0"`` would be scored differently), naming ``where`` and ``field``."""
    if value is None:
        return None
    if isinstance(value, dict):
        return _as_answers(value.get("target"), where, f"{field}.target")
    if isinstance(value, str):
        return [value]
    items = value.tolist() if hasattr(value, "tolist") else value
    if not isinstance(items, (list, tuple)):
        items = [items]
    for item in items:
        if item is not None and not isinstance(item, str):
            number = isinstance(item, (int, float)) and not isinstance(item, bool)
            shown = str(item) if number else repr(item)[:40]
            kind = "number" if number else type(item).__name__
            raise DatasetFormatError(
                f"{where}: field '{field}': the gold answer {shown} is a {kind}, not text. Fix: "
                f'write gold answers as strings, e.g. ["{shown}"]'
            )
    return [item for item in items if item is not None]


def _nested(row: dict, outer: str, inner: str) -> Any:
    value = row.get(outer)
    return value.get(inner) if isinstance(value, dict) else None


def _row_format(row: dict) -> str:
    if "env_class" in row or "reward_spec" in row:
        return "skyrl"
    source = str(row.get("data_source") or "")
    prompt = row.get("prompt")
    has_system = isinstance(prompt, list) and any(isinstance(m, dict) and m.get("role") == "system" for m in prompt)
    if source.startswith(VERL_PREFIX) or has_system:
        return "verl"
    return "search_r1"


def _parse_metadata(value: Any) -> dict:
    if isinstance(value, dict):
        return dict(value)
    if isinstance(value, str) and value.strip().startswith("{"):
        try:
            parsed = json.loads(value)
        except json.JSONDecodeError:
            return {"raw_metadata": value}
        return parsed if isinstance(parsed, dict) else {"raw_metadata": parsed}
    return {} if value is None else {"raw_metadata": value}


def _as_messages(value: Any, where: str) -> tuple[dict[str, str], ...] | None:
    """The row's ``prompt`` as chat messages (a bare string is one user message), or None if absent."""
    if value is None:
        return None
    if isinstance(value, str):
        value = [{"role": "user", "content": value}]
    items = value.tolist() if hasattr(value, "tolist") else value
    if not isinstance(items, (list, tuple)) or not items:
        raise DatasetFormatError(
            f"{where}: field 'prompt' = {value!r}: expected a list of chat messages "
            '[{"role": "user", "content": "..."}] or a string'
        )
    messages = []
    for i, message in enumerate(items):
        if not (
            isinstance(message, dict)
            and isinstance(message.get("role"), str)
            and isinstance(message.get("content"), str)
        ):
            raise DatasetFormatError(
                f'{where}: field \'prompt[{i}]\' = {message!r}: expected {{"role": "...", "content": "<text>"}}'
            )
        messages.append({"role": message["role"], "content": message["content"]})
    return tuple(messages)


@register_dataset_format("search_r1")  # no `matches`: the default, for every row no other format claims
def search_r1_example(row: dict, *, row_index: int, origin: str, id_: str | None = None) -> Example:
    """One Search-R1 / veRL / SkyRL row (or a plain ``question`` + ``golden_answers`` row) as an Example:
    the ``search_r1`` dataset format.

    ``origin`` (the file name) and ``row_index`` (0-based) go into error messages.
    ``id_`` overrides the id (the loader passes the file's id when it is unique).
    """
    where = f"{origin}: row {row_index}"
    if not isinstance(row, dict):
        raise DatasetFormatError(f"{where}: expected an object with fields, got {type(row).__name__}")
    extra_info = row.get("extra_info")
    extra = extra_info if isinstance(extra_info, dict) else {}
    question = row.get("question") or extra.get("question")
    if not question and row.get("prompt") is not None:
        try:
            question = extract_question(row["prompt"])
        except ValueError as error:
            raise DatasetFormatError(f"{where}: field 'prompt': {error}") from None
    if not isinstance(question, str) or not question.strip():
        raise DatasetFormatError(
            f"{where}: no question: expected a 'question' column, extra_info.question, or a 'prompt' "
            f"with a user message (columns present: {sorted(row)})"
        )
    # Search-R1's reward reads reward_model.ground_truth.target, so it comes first. Empty answers
    # are kept: Search-R1 scores a prediction that normalises to "" against them (EM 1 for "the").
    answers = None
    for field, value in (
        ("reward_model.ground_truth", _nested(row, "reward_model", "ground_truth")),
        ("reward_spec.ground_truth", _nested(row, "reward_spec", "ground_truth")),
        ("golden_answers", row.get("golden_answers")),
        ("answers", row.get("answers")),
        ("answer", row.get("answer")),
    ):
        answers = [a.strip() for a in _as_answers(value, where, field) or []]
        if answers:
            break
    if not answers:
        raise DatasetFormatError(
            f"{where}: no gold answers: expected a non-empty 'golden_answers' column or "
            f"reward_model.ground_truth.target (columns present: {sorted(row)})"
        )
    raw_source = str(row.get("data_source") or "unknown")
    source = raw_source[len(VERL_PREFIX) :] if raw_source.startswith(VERL_PREFIX) else raw_source
    metadata = _parse_metadata(row.get("metadata"))
    metadata.update(format=_row_format(row), row=row_index)
    if "split" in extra:
        metadata["split"] = extra["split"]
    if "index" in extra:
        metadata["index"] = extra["index"]  # kept for reference only; never a group key
    if raw_source != source:
        metadata["raw_data_source"] = raw_source
    return Example(
        id=id_ if id_ is not None else f"{source}-{row_index}",
        question=question.strip(),
        golden_answers=tuple(answers),
        data_source=source,
        metadata=metadata,
        prompt=_as_messages(row.get("prompt"), where),
    )


# --------------------------------------------------------------------------- reading files


def _read_jsonl(path: Path) -> list[dict]:
    rows = []
    with path.open(encoding="utf-8") as handle:
        for number, line in enumerate(handle, start=1):
            if not line.strip():
                continue
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as error:
                raise DatasetFormatError(f"{path}: line {number}: not valid JSON ({error.msg})") from None
    return rows


def _read_json(path: Path) -> list[dict]:
    text = path.read_text(encoding="utf-8")
    try:
        data = json.loads(text)
    except json.JSONDecodeError as error:
        if error.msg == "Extra data" and text.lstrip().startswith("{"):
            return _read_jsonl(path)  # one object a line under a .json name (MedMCQA's own release)
        raise DatasetFormatError(
            f"{path}: not valid JSON ({error.msg} at line {error.lineno}); a file with one object per "
            "line should be named .jsonl"
        ) from None
    if isinstance(data, dict) and isinstance(data.get("data"), list):
        data = data["data"]
    if not isinstance(data, list):
        raise DatasetFormatError(f'{path}: expected a JSON list of rows (or {{"data": [...]}})')
    return data


def _read_parquet(path: Path) -> list[dict]:
    import pyarrow.parquet as pq  # start-up cost: pyarrow takes ~0.2 s to import; only parquet files need it

    try:
        return pq.read_table(path).to_pylist()
    except Exception as error:  # noqa: BLE001  pyarrow raises several types for a corrupt file
        raise DatasetFormatError(f"{path}: not a readable parquet file ({error})") from None


def read_rows(path: str | Path) -> list[dict]:
    """The raw rows of a .parquet / .jsonl / .json file."""
    path = Path(path)
    readers = {".parquet": _read_parquet, ".jsonl": _read_jsonl, ".json": _read_json}
    if path.suffix not in readers:
        raise DatasetFormatError(f"{path}: unknown file type {path.suffix!r}; expected one of {', '.join(readers)}")
    return readers[path.suffix](path)


def _looks_like_path(name: str) -> bool:
    return name.endswith(_FILE_SUFFIXES) or name.startswith((".", "/", "~")) or "\\" in name or name.count("/") > 1


def _resolve_dir(directory: Path, split: str | None) -> Path:
    split = split or "train"
    for suffix in _FILE_SUFFIXES:
        candidate = directory / f"{split}{suffix}"
        if candidate.is_file():
            return candidate
    raise FileNotFoundError(
        f"{directory}: no {split}.parquet / {split}.jsonl / {split}.json in this folder; pass a file or a split that exists"
    )


def _load_hub(name: str, split: str | None) -> list[dict]:
    try:
        import datasets  # optional dependency (the `hub` extra)
    except ImportError:
        raise FileNotFoundError(
            f"{name!r} is not a local file or folder, and loading it as a Hugging Face hub dataset needs the "
            "'datasets' package (pip install datasets); or download the parquet files and pass their path"
        ) from None
    return list(datasets.load_dataset(name, split=split or "train"))


def require_rows(rows: Sequence[dict], origin: str) -> None:
    """Refuse a question file with no rows (every command that reads one: convert, inspect, training)."""
    if not rows:
        raise DatasetFormatError(f"{origin}: contains no rows. Fix: pass a question file with at least one row")


def load_examples(
    path_or_name: str | Path, *, split: str | None = None, limit: int | None = None, format: str | None = None
) -> list[Example]:
    """Load questions as Examples from a file, a folder, or a hub dataset name.

    - a ``.parquet`` / ``.jsonl`` / ``.json`` file: every row; with ``split``, only
      rows whose ``extra_info.split`` equals it;
    - a folder: its ``{split}.parquet`` (or .jsonl / .json), ``split`` defaulting to "train";
    - anything else is taken as a hub dataset (``datasets.load_dataset(name, split=split or "train")``),
      which needs the optional ``datasets`` package and a network.

    ``limit`` keeps the first ``limit`` examples (after the split filter). Each row is read by its registered
    dataset format (:mod:`stratarl.data.formats`), or every row by ``format`` when given.
    """
    if limit is not None and limit < 0:
        raise ValueError(f"limit must be >= 0, got {limit}")
    path = Path(path_or_name).expanduser()
    filter_split = None
    if path.is_dir():
        path = _resolve_dir(path, split)
    elif path.is_file():
        filter_split = split
    elif _looks_like_path(str(path_or_name)):
        raise FileNotFoundError(f"{path}: no such file or folder")
    if path.is_file():
        rows, origin = read_rows(path), str(path)
    else:
        rows, origin = _load_hub(str(path_or_name), split), str(path_or_name)
    require_rows(rows, origin)
    examples = examples_from_rows(rows, origin=origin, format=format)
    if filter_split is not None:
        kept = [e for e in examples if e.metadata.get("split") == filter_split]
        if not kept:
            splits = sorted({str(e.metadata.get("split")) for e in examples})
            raise DatasetFormatError(f"{origin}: no rows with extra_info.split == {split!r} (splits present: {splits})")
        examples = kept
    return examples[:limit] if limit is not None else examples


def load_example_files(
    paths: Sequence[str | Path], *, split: str | None = None, limit: int | None = None, format: str | None = None
) -> list[Example]:
    """``load_examples`` over several files, concatenated, with ids unique across them.

    Two files often reuse ids (NQ and HotpotQA both have ``train_0``; two files of one
    source both get ``nq-0``). When ids collide, every id is prefixed with its file's
    stem (``nq_train/train_0``), or with the file's position if stems collide too
    (``0/train_0``), and a warning says so. ``limit`` applies per file.
    """
    per_file = [load_examples(path, split=split, limit=limit, format=format) for path in paths]
    merged = [e for examples in per_file for e in examples]
    if len({e.id for e in merged}) == len(merged):
        return merged
    stems = [Path(str(path)).stem for path in paths]
    prefixes = stems if len(set(stems)) == len(stems) else [str(i) for i in range(len(paths))]
    warnings.warn(
        f"example ids collide across {list(map(str, paths))}; prefixing each id with its file ({', '.join(prefixes)})",
        stacklevel=2,
    )
    return [
        dataclasses.replace(e, id=f"{prefix}/{e.id}") for prefix, examples in zip(prefixes, per_file) for e in examples
    ]


# --------------------------------------------------------------------------- writing


def search_r1_row(example: Example, index: int, *, split: str | None = None) -> dict:
    """An Example as a Search-R1 row (the columns nq_search.py writes, plus id /
    question / golden_answers and our metadata as a JSON string)."""
    metadata = {
        k: v for k, v in example.metadata.items() if k not in ("format", "row", "split", "index", "raw_data_source")
    }
    prompt = example.prompt or [
        {"role": "user", "content": build_prompt(example.question, options=example.metadata.get("options"))}
    ]
    return {
        "id": example.id,
        "question": example.question,
        "golden_answers": list(example.golden_answers),
        "data_source": example.data_source,
        "prompt": list(prompt),
        "ability": "fact-reasoning",
        "reward_model": {"style": "rule", "ground_truth": {"target": list(example.golden_answers)}},
        "extra_info": {"split": split or str(example.metadata.get("split", "train")), "index": index},
        "metadata": json.dumps(metadata, sort_keys=True, default=str) if metadata else None,
    }


# Output row formats by name; a veRL or SkyRL writer is one more entry here.
ROW_FORMATS: dict[str, Callable[..., dict]] = {"search_r1": search_r1_row}


def to_rows(examples: Iterable[Example], *, row_format: str = "search_r1", split: str | None = None) -> list[dict]:
    if row_format not in ROW_FORMATS:
        raise ValueError(f"unknown row format {row_format!r}; valid: {sorted(ROW_FORMATS)}")
    make_row = ROW_FORMATS[row_format]
    return [make_row(example, index, split=split) for index, example in enumerate(examples)]


def write_search_r1_parquet(examples: Iterable[Example], path: str | Path, *, split: str | None = None) -> Path:
    """Write Examples as a Search-R1 parquet file (readable by veRL's RLHFDataset and by `load_examples`)."""
    import pyarrow as pa  # start-up cost: pyarrow takes ~0.2 s to import; only parquet files need it
    import pyarrow.parquet as pq  # start-up cost, as pyarrow above

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(to_rows(examples, split=split)), path)
    return path


def write_search_r1_jsonl(examples: Iterable[Example], path: str | Path, *, split: str | None = None) -> Path:
    """Write Examples as Search-R1 rows, one JSON object per line."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", encoding="utf-8") as handle:
        for row in to_rows(examples, split=split):
            handle.write(json.dumps(row, ensure_ascii=False) + "\n")
    return path


def write_examples(examples: Iterable[Example], path: str | Path, *, split: str | None = None) -> Path:
    """Write by suffix: ``.parquet`` or ``.jsonl``."""
    suffix = Path(path).suffix
    if suffix == ".parquet":
        return write_search_r1_parquet(examples, path, split=split)
    if suffix == ".jsonl":
        return write_search_r1_jsonl(examples, path, split=split)
    raise ValueError(f"{path}: cannot write {suffix!r} files; use .parquet or .jsonl")
