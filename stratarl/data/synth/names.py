"""The words a synthetic world is made of: the fixed vocabulary of its templates (occupations,
organisation and work kinds, title nouns) and its invented names, drawn from a seeded RNG or from the
shared name pool."""

from __future__ import annotations

import random

OCCUPATIONS = (
    "painter",
    "composer",
    "architect",
    "engineer",
    "novelist",
    "physician",
    "chemist",
    "sculptor",
    "astronomer",
    "botanist",
    "poet",
    "cartographer",
)
# organisation kind -> description; the first four publish works
ORG_KINDS = {
    "Press": "publishing house",
    "Records": "record label",
    "Pictures": "film studio",
    "Games": "game studio",
    "University": "university",
    "Institute": "research institute",
    "Bank": "bank",
    "Company": "trading company",
}
# work kind -> (publisher kind, creator verb, creator noun)
WORK_KINDS = {
    "novel": ("Press", "wrote", "author"),
    "album": ("Records", "recorded", "performer"),
    "film": ("Pictures", "directed", "director"),
    "game": ("Games", "designed", "designer"),
}
TITLE_NOUNS = (
    "Lantern",
    "River",
    "Garden",
    "Mirror",
    "Harbor",
    "Winter",
    "Crown",
    "Orchard",
    "Tower",
    "Echo",
    "Voyage",
    "Compass",
    "Meadow",
    "Ember",
    "Silence",
    "Signal",
)
_ONSETS = (
    "b",
    "d",
    "f",
    "g",
    "k",
    "l",
    "m",
    "n",
    "p",
    "r",
    "s",
    "t",
    "v",
    "z",
    "br",
    "dr",
    "kr",
    "tr",
    "st",
    "th",
    "sh",
    "qu",
)
_VOWELS = ("a", "e", "i", "o", "u", "a", "e", "i", "o", "u", "ai", "ou")
_CODAS = ("", "", "", "n", "r", "l", "s", "th", "x")
# Words a generated name must not be: English stopwords (a retriever drops them from
# queries) and words of our own templates (a city called "River" or "Games" would be ambiguous).
_RESERVED = {
    "then",
    "there",
    "these",
    "they",
    "this",
    "that",
    "with",
    "will",
    "such",
    "into",
    "their",
    "were",
    "here",
    "born",
    "city",
    "country",
    "capital",
    "town",
    "river",
    "later",
    "lived",
    "founded",
    "surname",
    "company",
    "novel",
    "album",
    "film",
    "game",
    "games",
    "press",
    "records",
    "pictures",
    "bank",
    "university",
    "institute",
    *(noun.lower() for noun in TITLE_NOUNS),
    *OCCUPATIONS,
}
# Seed of the shared name pool (``name_pool``): fixed, so every knowledge base drawn from a pool of
# the same size uses the same words, and one word-level vocabulary covers all of them.
NAME_POOL_SEED = 20_261_201


def _unique_words(rng: random.Random, count: int) -> list[str]:
    """``count`` distinct pronounceable capitalised words of 2-3 syllables."""
    words: list[str] = []
    seen: set[str] = set()
    while len(words) < count:
        syllables = 2 if rng.random() < 0.7 else 3  # short names: fewer tokens per name
        word = "".join(rng.choice(_ONSETS) + rng.choice(_VOWELS) for _ in range(syllables)) + rng.choice(_CODAS)
        word = word.capitalize()
        if word not in seen and word.lower() not in _RESERVED:
            seen.add(word)
            words.append(word)
    return words


def name_pool_words(size: int) -> list[str]:
    """The shared pool of ``size`` invented words (the same list for the same size, in any process)."""
    if size < 50:
        raise ValueError(f"name_pool must be at least 50 words, got {size}")
    return _unique_words(random.Random(NAME_POOL_SEED), size)


def draw_name_words(rng: random.Random, count: int, name_pool: list[str] | None) -> list[str]:
    """``count`` distinct name words: drawn without replacement from ``name_pool`` when given, else invented."""
    if name_pool is None:
        return _unique_words(rng, count)
    if count > len(name_pool):
        raise ValueError(
            f"this world needs {count} distinct name words but name_pool has {len(name_pool)}; "
            "use a larger name_pool or a smaller size"
        )
    return rng.sample(name_pool, count)
