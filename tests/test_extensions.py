"""`--import` (stratarl.extensions): a module that cannot load is one error line naming it, what it raised and
where, never a traceback: a syntax error, an exception while it runs, a name it registers that is taken."""

from __future__ import annotations

import pytest

from stratarl.cli import main
from stratarl.extensions import ExtensionError, load_extension
from stratarl.retrieval.factory import get_retriever_builder

MODULES = {
    "raises.py": ('x = 1\nraise RuntimeError("no GPU here")\n', "raised RuntimeError while loading", "line 2"),
    "syntax.py": ("def f(:\n    pass\n", "a syntax error", "line 1"),
    "twice.py": (
        "from stratarl.retrieval import register_retriever\n\n@register_retriever('bm25')\ndef b(**spec):\n    return None\n",
        "retriever kind 'bm25' is already registered",
        "line 3",
    ),
}


@pytest.mark.parametrize("name", sorted(MODULES))
def test_a_module_that_fails_to_load_is_one_line(tmp_path, name, capsys, monkeypatch):
    monkeypatch.delenv("STRATARL_DEBUG", raising=False)
    text, words, line = MODULES[name]
    module = tmp_path / name
    module.write_text(text)
    with pytest.raises(ExtensionError) as error:
        load_extension(str(module))
    message = str(error.value)
    assert message.startswith(f"--import {module}") and words in message and line in message and "\n" not in message
    assert main(["--import", str(module), "train", "x.yaml"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: --import {module}") and len(err.strip().splitlines()) == 1
    assert get_retriever_builder("bm25").__module__ == "stratarl.retrieval.factory"  # the built-in stays


def test_a_dotted_module_that_raises_is_one_line(tmp_path, monkeypatch):
    monkeypatch.delenv("STRATARL_DEBUG", raising=False)
    (tmp_path / "i54_broken_parts.py").write_text("import math\nmath.sqrt(-1)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ExtensionError, match=r"--import i54_broken_parts: the module raised ValueError .*line 2"):
        load_extension("i54_broken_parts")


def test_stratarl_debug_keeps_the_traceback(tmp_path, monkeypatch):
    monkeypatch.setenv("STRATARL_DEBUG", "1")
    module = tmp_path / "raises_debug.py"
    module.write_text('raise RuntimeError("no GPU here")\n')
    with pytest.raises(RuntimeError, match="no GPU here"):
        load_extension(str(module))
