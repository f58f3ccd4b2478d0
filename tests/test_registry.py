"""stratarl.registry.Registry: what the algorithm-part, retriever-kind and dataset-format registries share."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from stratarl.registry import Registry


def first():
    return 1


def second():
    return 2


def test_a_name_is_registered_once_and_the_same_object_again_is_allowed():
    table = Registry("widget")
    assert table.decorator("a")(first) is first
    table.add("a", first)  # a module imported twice registers the same function again
    with pytest.raises(ValueError) as taken:
        table.add("a", second)
    assert str(taken.value) == "widget 'a' is already registered (by first); pick another name (registered: a)"
    assert table.lookup("a") is first


def test_an_unknown_name_lists_the_registered_ones_in_one_line():
    table = Registry("retriever kind", listed_as="valid kinds", how_to_add="(add yours)", unknown_error=ValueError)
    table.add("dense", second)
    table.add("bm25", first)
    with pytest.raises(ValueError) as unknown:
        table.lookup("splade")
    assert str(unknown.value) == "unknown retriever kind 'splade'; valid kinds: bm25, dense (add yours)"
    assert table.names() == ["bm25", "dense"] and list(table) == ["dense", "bm25"]  # sorted; registration order
    with pytest.raises(KeyError) as empty:
        Registry("widget").lookup("x")
    assert empty.value.args == ("unknown widget 'x'; registered: ",)


def test_names_must_be_non_empty_strings():
    for name in ("", None, 3):
        with pytest.raises(ValueError, match="a widget name is a non-empty string"):
            Registry("widget").decorator(name)


def test_entries_that_wrap_what_the_user_registered_compare_by_source():
    table = Registry("format", source=lambda entry: entry.read)
    table.add("f", SimpleNamespace(read=first, matches=None))
    table.add("f", SimpleNamespace(read=first, matches=bool))  # the same function, new settings: replaced
    assert table.lookup("f").matches is bool
    with pytest.raises(ValueError, match="already registered"):
        table.add("f", SimpleNamespace(read=second))


def test_a_copy_keeps_the_settings_and_leaves_the_original_alone():
    table = Registry("widget", listed_as="valid widgets", unknown_error=ValueError)
    table.add("a", first)
    copy = table.copy()
    copy.add("b", second)
    assert isinstance(copy, Registry) and copy.names() == ["a", "b"] and table.names() == ["a"]
    with pytest.raises(ValueError, match="valid widgets: a, b"):
        copy.lookup("c")
