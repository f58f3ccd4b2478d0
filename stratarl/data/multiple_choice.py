"""Medical multiple-choice question files (MedQA, MedMCQA) as they ship, to `Example`.

MedQA (jind11/MedQA ``data_clean/questions/*/*.jsonl``; GBaker/MedQA-USMLE-4-options on the hub)::

    {"question": "...", "options": {"A": "...", ..., "E": "..."}, "answer_idx": "E", "answer": "<text>",
     "meta_info": "step2&3", ...}

(bigbio's layout, ``options: [{"key": "A", "value": "..."}, ...]``, is read too.)

MedMCQA (openlifescienceai/medmcqa on the hub; the original release's ``train.json``, one object a line)::

    {"id": "...", "question": "...", "opa": "...", "opb": "...", "opc": "...", "opd": "...", "cop": 1,
     "choice_type": "single", "exp": "...", "subject_name": "...", "topic_name": "..."}

``cop`` is 1-4 in the original release (its ``dataset.py`` subtracts 1) and 0-3 on the hub (a ClassLabel
a-d). A file holding a 0 is read 0-based, one holding a 4 1-based; a file with only 1-3 is ambiguous and read
0-based (the hub's convention) with a warning.

Each row becomes an Example whose question is the stem, whose gold answers are the right option's letter
and text (the multiple-choice reward accepts either), with ``metadata["options"]`` (letter -> text) that
the prompt lists under the stem (``stratarl.rollout.prompt.build_prompt``).
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from typing import Any

from stratarl.data.examples import DatasetFormatError, Example
from stratarl.data.formats import register_dataset_format

LETTERS = "ABCDEFGHIJ"
MEDMCQA_OPTION_FIELDS = ("opa", "opb", "opc", "opd")


def row_kind(row: Any) -> str | None:
    """``"medqa"``, ``"medmcqa"`` or None (not a multiple-choice row)."""
    if not isinstance(row, dict):
        return None
    if "cop" in row and all(f in row for f in MEDMCQA_OPTION_FIELDS):
        return "medmcqa"
    if "options" in row and "answer_idx" in row:
        return "medqa"
    return None


def is_medqa_row(row: Any) -> bool:
    """A MedQA row: ``options`` and ``answer_idx`` (and not MedMCQA's fields)."""
    return isinstance(row, dict) and "answer_idx" in row and row_kind(row) == "medqa"


def is_medmcqa_row(row: Any) -> bool:
    """A MedMCQA row: ``cop`` and ``opa`` .. ``opd``."""
    return isinstance(row, dict) and "cop" in row and row_kind(row) == "medmcqa"


def _stem(row: dict, where: str) -> str:
    question = row.get("question")
    if not isinstance(question, str) or not question.strip():
        raise DatasetFormatError(f"{where}: field 'question' = {question!r}: expected the question text")
    return question.strip()


def _medqa_options(value: Any, where: str) -> dict[str, str]:
    if isinstance(value, (list, tuple)):  # bigbio: [{"key": "A", "value": "..."}]
        if not all(isinstance(o, dict) and "key" in o and "value" in o for o in value):
            raise DatasetFormatError(
                f"{where}: field 'options' = {value!r}: expected a letter -> text map "
                '{"A": "...", ...} or a list of {"key": "A", "value": "..."}'
            )
        value = {o["key"]: o["value"] for o in value}
    if not isinstance(value, dict) or not value:
        raise DatasetFormatError(
            f'{where}: field \'options\' = {value!r}: expected a letter -> text map {{"A": "...", "B": "...", ...}}'
        )
    options = {str(k).strip().upper(): v for k, v in value.items() if v is not None}  # parquet structs pad with None
    for letter, text in options.items():
        if letter not in LETTERS or not isinstance(text, str) or not text.strip():
            raise DatasetFormatError(
                f"{where}: field 'options.{letter}' = {text!r}: expected option letters A-J with non-empty texts"
            )
    return {k: options[k].strip() for k in sorted(options)}


def _example(
    kind: str,
    row: dict,
    where: str,
    row_index: int,
    id_: str | None,
    stem: str,
    options: dict[str, str],
    letter: str,
    extra: dict,
) -> Example:
    source = str(row.get("data_source") or kind)
    metadata = {
        "format": kind,
        "row": row_index,
        "options": options,
        "answer_letter": letter,
        **{k: v for k, v in extra.items() if v is not None},
    }
    return Example(
        id=id_ if id_ is not None else f"{source}-{row_index}",
        question=stem,
        golden_answers=(letter, options[letter]),
        data_source=source,
        metadata=metadata,
    )


@register_dataset_format("medqa", matches=is_medqa_row)
def medqa_example(row: dict, *, row_index: int, origin: str, id_: str | None = None) -> Example:
    """One MedQA row (question, options letter -> text, answer_idx) as an Example."""
    where = f"{origin}: row {row_index}"
    stem = _stem(row, where)
    options = _medqa_options(row.get("options"), where)
    letter = str(row.get("answer_idx") or "").strip().upper()
    if letter not in options:
        raise DatasetFormatError(
            f"{where}: field 'answer_idx' = {row.get('answer_idx')!r}: not one of the "
            f"option letters {', '.join(options)}"
        )
    return _example("medqa", row, where, row_index, id_, stem, options, letter, {"meta_info": row.get("meta_info")})


def medmcqa_cop_base(rows: Sequence[dict], origin: str) -> int:
    """0 if the file's ``cop`` values are 0-3 (the hub's), 1 if 1-4 (the original release's)."""
    values = {row.get("cop") for row in rows if row_kind(row) == "medmcqa"}
    if 0 in values and 4 in values:
        raise DatasetFormatError(
            f"{origin}: field 'cop' holds both 0 and 4: expected 0-3 (the hub's "
            "MedMCQA) or 1-4 (the original release) in one file"
        )
    if 4 in values:
        return 1
    if 0 not in values and values <= {1, 2, 3}:
        warnings.warn(
            f"{origin}: MedMCQA 'cop' values are all 1-3, so the file may be 0-based (the hub's 0-3) or "
            "1-based (the original release's 1-4); reading it 0-based",
            stacklevel=4,
        )
    return 0


def medmcqa_prepare(rows: Sequence[dict], origin: str) -> dict:
    """The file-level keywords of MedMCQA rows: ``cop_base`` (see :func:`medmcqa_cop_base`)."""
    return {"cop_base": medmcqa_cop_base(rows, origin)}


@register_dataset_format("medmcqa", matches=is_medmcqa_row, prepare=medmcqa_prepare)
def medmcqa_example(row: dict, *, row_index: int, origin: str, cop_base: int, id_: str | None = None) -> Example:
    """One MedMCQA row (question, opa..opd, cop with ``cop_base`` 0 or 1) as an Example."""
    where = f"{origin}: row {row_index}"
    stem = _stem(row, where)
    options = {}
    for letter, name in zip(LETTERS, MEDMCQA_OPTION_FIELDS):
        text = row.get(name)
        if not isinstance(text, str) or not text.strip():
            raise DatasetFormatError(f"{where}: field {name!r} = {text!r}: expected the option's text")
        options[letter] = text.strip()
    cop = row.get("cop")
    index = cop - cop_base if isinstance(cop, int) and not isinstance(cop, bool) else None
    if index is None or not 0 <= index < len(MEDMCQA_OPTION_FIELDS):
        expected = "1-4 (this file is 1-based)" if cop_base else "0-3 (this file is 0-based)"
        raise DatasetFormatError(
            f"{where}: field 'cop' = {cop!r}: expected the right option as {expected}; "
            "MedMCQA's test split ships without answers (cop -1): evaluate on its "
            "validation split"
        )
    return _example(
        "medmcqa",
        row,
        where,
        row_index,
        id_,
        stem,
        options,
        LETTERS[index],
        {k: row.get(k) for k in ("subject_name", "topic_name", "choice_type")},
    )
