"""BM25's text processing: texts → term ids, the same tokens as ``bm25s.tokenize``.

Lower-case → words of 2+ word characters → drop stop words → stem (PyStemmer's Snowball stemmers) →
term ids. One tokeniser, `BM25Tokenizer`, serves the in-memory index, the streamed index build and the
queries, so all three see the same terms.
"""

from __future__ import annotations

import re
from itertools import islice

import numpy as np
import Stemmer
from bm25s.tokenization import _infer_stopwords

_WORD = re.compile(r"(?u)\b\w\w+\b")  # scikit-learn's / bm25s's token pattern


def make_stemmer(name: str | None):
    """A PyStemmer stemmer for language ``name`` (None: no stemming); `ValueError` listing the valid names."""
    if name is None:
        return None
    try:
        return Stemmer.Stemmer(name)
    except KeyError:
        raise ValueError(
            f"unknown stemmer {name!r}; valid PyStemmer languages: {', '.join(sorted(Stemmer.algorithms()))} (or None)"
        ) from None


def stopword_set(stopwords: str | None) -> frozenset[str]:
    """bm25s's stop-word list named ``stopwords`` (``"en"``, ...; None: none) as a set."""
    return frozenset(_infer_stopwords(stopwords))


class BM25Tokenizer:
    """Texts → term ids, with the same text processing as ``bm25s.tokenize`` (which rebuilds the stop-word
    set once per text: most of its time). Each distinct word is stemmed once.

    ``terms`` (stem → term id): None starts an empty vocabulary that grows in first-occurrence order, so
    tokenising a corpus chunk by chunk gives exactly the ids of tokenising it at once (building an index).
    A given vocabulary (an index's, for queries) is never changed: stems outside it map to -1.
    Not thread-safe (PyStemmer objects are not).
    """

    def __init__(self, *, stopwords: frozenset[str], stemmer, terms: dict[str, int] | None = None) -> None:
        self.stopwords = stopwords
        self.stemmer = stemmer
        self.grows = terms is None
        self.terms: dict[str, int] = {} if terms is None else terms
        self.word_index: dict[str, int] = {}  # each distinct word seen → its position in term_of_word
        self.term_of_word: list[int] = []  # the term id of each distinct word (-1: not in a fixed vocabulary)

    def word_positions(self, texts: list[str]) -> tuple[list[int], list[int]]:
        """The texts' words as positions in `term_of_word`, all texts in one flat list, and each text's count."""
        stopwords, word_index = self.stopwords, self.word_index
        known = len(word_index)
        flat: list[int] = []
        lengths: list[int] = []
        for text in texts:
            before = len(flat)
            for word in _WORD.findall(text.lower()):
                if word in stopwords:
                    continue
                position = word_index.get(word)
                if position is None:
                    position = word_index[word] = len(word_index)
                flat.append(position)
            lengths.append(len(flat) - before)
        self._add_words(list(islice(word_index, known, None)))
        return flat, lengths

    def _add_words(self, words: list[str]) -> None:
        stems = self.stemmer.stemWords(words) if self.stemmer is not None else words
        if self.grows:
            self.term_of_word.extend(self.terms.setdefault(stem, len(self.terms)) for stem in stems)
        else:
            self.term_of_word.extend(self.terms.get(stem, -1) for stem in stems)

    def term_arrays(self, texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
        """The texts' term ids one text after another (int32) and each text's count (int64), with a growing
        vocabulary: the input of `count_term_pairs`."""
        flat, lengths = self.word_positions(texts)
        lookup = np.asarray(self.term_of_word, dtype=np.int32)
        return lookup[np.asarray(flat, dtype=np.int64)], np.asarray(lengths, dtype=np.int64)


def tokenize_to_ids(
    texts: list[str], *, stopwords: frozenset[str], stemmer, vocab: dict[str, int] | None = None
) -> tuple[list[list[int]], dict[str, int]]:
    """The term ids of each text (`BM25Tokenizer`) and the vocabulary (stem → term id).

    With ``vocab`` (the index's term → id), unknown terms are dropped and ``vocab`` itself is returned,
    unchanged; without it a new vocabulary is built from the texts and returned.
    """
    tokenizer = BM25Tokenizer(stopwords=stopwords, stemmer=stemmer, terms=vocab)
    flat, lengths = tokenizer.word_positions(texts)
    term_of_word = tokenizer.term_of_word
    docs, start = [], 0
    for length in lengths:
        docs.append([term_of_word[i] for i in flat[start : start + length] if term_of_word[i] >= 0])
        start += length
    return docs, tokenizer.terms
