"""PhantomWiki's closed vocabulary: every word its generator can write, for any universe seed.

PhantomWiki draws every name, surname, occupation, hobby, relation word and question template from fixed lists
shipped in the ``phantom-wiki`` package (its ``facts/family/names/*.json`` files and the string constants of its
modules). A word-level policy whose vocabulary is those words (plus the protocol's own texts) can spell every
universe, including universes generated after it was trained, and every run over PhantomWiki data gets the same
vocabulary whatever its universes and seeds (docs/wordlevel.md).

The words are read by the generator's own interpreter (``.venv-phantom``: its Python differs from the project's),
with a script that imports nothing of the package: it parses each module's source (``ast``) and keeps every string
literal that is not a docstring, and every string of each JSON data file. Each text is then cut into pieces by the
word-level tokenizer's split (:func:`stratarl.data.wordlevel.count_pieces`), so a template such as
``"The mother-in-law of <subject> is"`` gives ``The``, ``mother``, ``-``, ``in``, ``law``... Digits and punctuation are
in every word-level vocabulary anyway. The result is written, one word a line in sorted order, as
``vocabulary.txt`` beside a run's data (``stratarl data phantomwiki``).
"""

from __future__ import annotations

import json
import subprocess
from collections.abc import Sequence
from pathlib import Path

from stratarl.data.phantomwiki import GENERATOR_VERSION, PhantomWikiError, find_generator
from stratarl.data.wordlevel import count_pieces

VOCABULARY_FILE = "vocabulary.txt"
"""The closed vocabulary's file name in a data folder."""

EXTRACT_SCRIPT = r"""
import ast, json, pathlib, sys
import phantom_wiki

root = pathlib.Path(phantom_wiki.__file__).parent
texts = []

def strings(value):
    if isinstance(value, str):
        yield value
    elif isinstance(value, dict):
        for key, item in value.items():
            yield from strings(key)
            yield from strings(item)
    elif isinstance(value, list):
        for item in value:
            yield from strings(item)

for path in sorted(root.rglob("*")):
    if path.suffix == ".json":
        texts.extend(strings(json.loads(path.read_text(encoding="utf-8"))))
    elif path.suffix == ".py":
        tree = ast.parse(path.read_text(encoding="utf-8"))
        docstrings = set()
        for node in ast.walk(tree):
            body = getattr(node, "body", None)
            if isinstance(body, list) and body and isinstance(body[0], ast.Expr):
                if isinstance(body[0].value, ast.Constant):
                    docstrings.add(id(body[0].value))
        for node in ast.walk(tree):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings:
                texts.append(node.value)
json.dump({"version": getattr(phantom_wiki, "__version__", None), "texts": texts}, sys.stdout)
"""


def generator_python(generator: Path | None = None) -> Path:
    """The interpreter of the generator's environment: ``python`` beside its command (``.venv-phantom/bin``)."""
    command = generator or find_generator()
    python = command.parent / "python"
    if not python.is_file():
        raise PhantomWikiError(
            f"no Python interpreter beside the PhantomWiki generator {command} (looked for {python}). Fix: run "
            "`make phantomwiki`, or point STRATARL_PHANTOMWIKI_GENERATE at the command inside the environment"
        )
    return python


def generator_texts(python: Path | None = None, *, timeout: float = 120) -> list[str]:
    """Every string the installed generator ships (module string literals, JSON data), read by ``python``."""
    python = python or generator_python()
    try:
        done = subprocess.run(
            [str(python), "-c", EXTRACT_SCRIPT], capture_output=True, text=True, timeout=timeout, check=False
        )
    except (OSError, subprocess.TimeoutExpired) as error:
        raise PhantomWikiError(f"{python}: could not read the generator's words ({error}). Fix: rerun it") from None
    if done.returncode != 0:
        tail = " | ".join((done.stderr or "").strip().splitlines()[-2:])
        raise PhantomWikiError(
            f"{python}: reading the generator's words failed ({tail}). Fix: run `make phantomwiki` (phantom-wiki "
            f"{GENERATOR_VERSION} in .venv-phantom)"
        )
    return list(json.loads(done.stdout)["texts"])


def closed_words(texts: Sequence[str]) -> list[str]:
    """The word-level pieces of ``texts`` (leading space removed), sorted, whitespace pieces left out."""
    return sorted(piece for piece in count_pieces(texts) if not piece.isspace())


def write_vocabulary(out_dir: str | Path, words: Sequence[str]) -> Path:
    """Write ``words`` one a line as ``out_dir/vocabulary.txt``; returns its path."""
    path = Path(out_dir) / VOCABULARY_FILE
    path.write_text("".join(f"{word}\n" for word in words), encoding="utf-8")
    return path


def read_vocabulary(path: str | Path) -> list[str]:
    """The words of a vocabulary file (one a line; blank lines skipped). Raises ValueError naming the file."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as error:
        raise ValueError(
            f"{path}: not a readable word list ({error.__class__.__name__}). Fix: point at the vocabulary.txt "
            "that `stratarl data phantomwiki` writes"
        ) from None
    words = [line for line in text.split("\n") if line.strip()]
    if not words:
        raise ValueError(f"{path}: no words. Fix: regenerate it with `stratarl data phantomwiki`")
    return words
