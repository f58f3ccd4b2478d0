"""A word-level tokenizer and a tiny from-scratch Llama for the synthetic task.

The synthetic knowledge base (``stratarl.data.synth``) is written in a closed
vocabulary: template English plus invented names. A word-level tokenizer over it has
~1.3k entries for a small KB and ~14k for a medium one instead of SmolLM2's 49k, and
writes ~1.25-1.4x fewer tokens; a model over it trains several times faster per step
(``benchmarks/bench_wordlevel.py``), which is what seed-heavy sweeps need.

Tokenization (a ``tokenizers`` WordLevel model, saved as plain tokenizer.json):

- Added tokens, matched on the raw text before anything else: ``[PAD]``, ``[UNK]``,
  ``<|im_start|>``, ``<|im_end|>`` (EOS) are special; the protocol tags ``<search>``
  ``</search>`` ``<answer>`` ``</answer>`` ``<information>`` ``</information>``
  ``<think>`` ``</think>`` are *normal* added tokens, so ``decode(...,
  skip_special_tokens=True)`` keeps them and the protocol regexes still parse.
- The rest is split by one regex, ``PIECE_PATTERN``: a run of letters, one digit,
  or one other non-space character (punctuation, symbols), each with at most one
  leading space attached (`` Zorvanta``, ``Zorvanta``, `` (``, ``1``); any other
  whitespace character (a second space, a newline) is a piece of its own.
- The decoder concatenates the pieces (``decoders.Fuse``). Since the pieces cover
  the text exactly, ``decode(encode(x)) == x`` for every ``x`` without unknown
  words, hence ``normalize_answer(decode(encode(x))) == normalize_answer(x)`` too.
  An unknown piece decodes as ``[UNK]`` (its leading space is lost).

Every word enters the vocabulary in both spellings, with and without its leading
space, so a word seen only mid-sentence still encodes after a newline or a quote.
Digits are single tokens, so every number encodes ("Doc 10", populations, years).
Case is kept by default (transcripts stay readable; the EM reward lower-cases
anyway); ``lowercase=True`` lower-cases before splitting, which shrinks the
vocabulary a little and makes ``decode(encode(x)) == x.lower()``.
"""

from __future__ import annotations

import re
import string
import unicodedata
from collections import Counter
from collections.abc import Iterable, Sequence

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers

from stratarl.data.examples import Example
from stratarl.retrieval.base import Passage
from stratarl.rollout.parsing import (
    INVALID_ACTION_OBSERVATION,
    TRUNCATION_MARKER,
    information_observation,
)
from stratarl.rollout.prompt import PROMPT_TEMPLATES, normalize_question, render_options

PAD_TOKEN = "[PAD]"
UNK_TOKEN = "[UNK]"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"  # EOS
SPECIAL_TOKENS: tuple[str, ...] = (PAD_TOKEN, UNK_TOKEN, IM_START, IM_END)
PROTOCOL_TAGS: tuple[str, ...] = (
    "<search>",
    "</search>",
    "<answer>",
    "</answer>",
    "<information>",
    "</information>",
    "<think>",
    "</think>",
)
# One piece: optional single space + (letters | one digit | one other non-space char), or one whitespace char.
PIECE_PATTERN = r" ?(?:[^\W\d_]+|\d|[^\w\s]|_)|\s"
# ChatML, as SmolLM2 and Qwen2.5 write it: the Search-R1 prompt is one user message.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
CHAT_ROLES: tuple[str, ...] = ("system", "user", "assistant")
# Pieces every vocabulary holds, whatever the texts: space, newline, tab, digits, ASCII
# punctuation and the chat roles (each with and without a leading space).
BASE_PIECES: tuple[str, ...] = (" ", "\n", "\t", *string.digits, *string.punctuation, *CHAT_ROLES)
# Phrases a scripted or demonstrated agent writes around its tags. The trainer's own
# demonstration thoughts can be passed as ``extra_texts`` too.
DEMONSTRATION_PHRASES: tuple[str, ...] = (
    "<think> I need to look this up. </think>\n<search> query </search>",
    "<think> I have the answer. </think>\n<answer> answer </answer>",
    "<think> I need to find the answer to this question. I need to search for it first. </think>",
    "<think> I need to find out who, what, where, which and when. Now I know the next thing to search. </think>",
    "<think> The information says the answer is this one. So I know it, and I can answer now. </think>",
    "<think> I do not know, let me search again. I found that it was in the city of the country. </think>",
    "<think> I need to search for this. </think>\n<think> The information gives the answer. </think>",
)
_ADDED_RE = re.compile("|".join(re.escape(t) for t in (*SPECIAL_TOKENS, *PROTOCOL_TAGS)))


def _pre_tokenizer():
    return pre_tokenizers.Split(Regex(PIECE_PATTERN), behavior="isolated")


def _spellings(piece: str) -> tuple[str, ...]:
    """A piece and its other spacing (" word" <-> "word"); whitespace pieces have one."""
    if piece.isspace():
        return (piece,)
    bare = piece[1:] if piece.startswith(" ") else piece
    return (bare, " " + bare)


_PIECE_RE = re.compile(PIECE_PATTERN)
# Python's re and the tokenizers (Oniguruma) regex read \w / \s alike except on these.
_DISAGREEING_CATEGORIES = frozenset({"Mn", "Mc", "Me", "Nl", "No", "Pc"})


def _python_re_agrees(text: str) -> bool:
    """True if Python's ``re`` splits ``text`` exactly as the tokenizer's pre-tokenizer.

    They differ only on combining marks and connector punctuation (word characters
    for Oniguruma, not for Python), letter-like and other numbers (the reverse), and
    U+001C..U+001F (whitespace for Python only); texts with any of them take the slow path.
    """
    odd = {c for c in set(text) if not c.isascii() or "\x1c" <= c <= "\x1f"}
    return not any(c.isascii() or unicodedata.category(c) in _DISAGREEING_CATEGORIES for c in odd)


def split_pieces(text: str) -> list[str]:
    """``text`` cut into pieces exactly as the tokenizer cuts it (added tokens aside).

    Python's ``re`` is ~10x faster than the tokenizer's own pre-tokenizer called from
    Python, so it is used whenever both give the same pieces (``_python_re_agrees``).
    """
    if _python_re_agrees(text):
        return _PIECE_RE.findall(text)
    return [piece for piece, _ in _pre_tokenizer().pre_tokenize_str(text)]


def count_pieces(texts: Iterable[str], *, lowercase: bool = False, batch_chars: int = 1 << 20) -> Counter[str]:
    """How often each bare piece (leading space removed) occurs in ``texts``.

    Added tokens (special tokens, protocol tags) are cut out first: they are tokens
    of their own and never go through the word split. Texts are split in batches
    joined by newlines (no piece spans a newline, so the counts are unchanged once
    the joining newlines are taken off).
    """
    counts: Counter[str] = Counter()

    def flush(chunks: list[str]) -> None:
        if not chunks:
            return
        pieces = split_pieces("\n".join(chunks))
        counts.update(p[1:] if p.startswith(" ") and len(p) > 1 else p for p in pieces)
        counts.subtract({"\n": len(chunks) - 1})  # the joining newlines are not in the texts
        if counts["\n"] <= 0:
            del counts["\n"]
        chunks.clear()

    pending: list[str] = []
    size = 0
    for index, text in enumerate(texts):
        if not isinstance(text, str):
            raise TypeError(f"texts[{index}] must be a string, got {type(text).__name__}: {text!r:.80}")
        pending.extend(_ADDED_RE.split(text.lower() if lowercase else text))
        size += len(text)
        if size >= batch_chars:
            flush(pending)
            size = 0
    flush(pending)
    return counts


def build_vocabulary(counts: Counter[str], *, min_freq: int = 1, max_vocab: int | None = None) -> dict[str, int]:
    """token -> id: special tokens, protocol tags, ``BASE_PIECES``, then the words of
    ``counts`` seen at least ``min_freq`` times, most frequent first (ties by text),
    each in both spellings, while the total stays within ``max_vocab``."""
    if min_freq < 1:
        raise ValueError(f"min_freq must be >= 1, got {min_freq}")
    vocab: dict[str, int] = {}
    for token in (*SPECIAL_TOKENS, *PROTOCOL_TAGS):
        vocab[token] = len(vocab)
    for piece in BASE_PIECES:
        for spelling in _spellings(piece):
            vocab.setdefault(spelling, len(vocab))
    if max_vocab is not None and max_vocab < len(vocab):
        raise ValueError(
            f"max_vocab={max_vocab} is smaller than the fixed part of the vocabulary ({len(vocab)} "
            "tokens: special tokens, protocol tags, digits, punctuation); "
            f"use max_vocab >= {len(vocab)} or None"
        )
    ranked = sorted((piece for piece, n in counts.items() if n >= min_freq), key=lambda p: (-counts[p], p))
    for piece in ranked:
        new = [s for s in _spellings(piece) if s not in vocab]
        if max_vocab is not None and len(vocab) + len(new) > max_vocab:
            break
        for spelling in new:
            vocab[spelling] = len(vocab)
    return vocab


def build_word_tokenizer(
    texts: Iterable[str], *, min_freq: int = 1, max_vocab: int | None = None, lowercase: bool = False
):
    """A word-level ``PreTrainedTokenizerFast`` whose vocabulary covers ``texts``.

    See the module docstring for the split, the decoder and the vocabulary rules.
    ``max_vocab`` caps ``len(tokenizer)`` (rare words beyond it become ``[UNK]``);
    EOS is ``<|im_end|>``, PAD ``[PAD]``, no BOS; the chat template is ChatML.
    Save with ``save_pretrained`` (tokenizer.json, no pickles); load with
    ``stratarl.models.load_tokenizer(folder)`` or ``AutoTokenizer.from_pretrained``.
    """
    from transformers import PreTrainedTokenizerFast  # start-up cost: transformers takes ~1 s to import

    vocab = build_vocabulary(count_pieces(texts, lowercase=lowercase), min_freq=min_freq, max_vocab=max_vocab)
    backend = Tokenizer(models.WordLevel(vocab, unk_token=UNK_TOKEN))
    if lowercase:
        backend.normalizer = normalizers.Lowercase()
    backend.pre_tokenizer = _pre_tokenizer()
    backend.decoder = decoders.Fuse()
    # normalized=False: added tokens match the raw text; no lstrip/rstrip, so spaces around tags survive decode.
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    backend.add_tokens([AddedToken(t, special=False, normalized=False) for t in PROTOCOL_TAGS])
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        unk_token=UNK_TOKEN,
        pad_token=PAD_TOKEN,
        eos_token=IM_END,
        chat_template=CHAT_TEMPLATE,
        # transformers' clean-up would turn "a ." into "a." and break decode(encode(x)) == x.
        clean_up_tokenization_spaces=False,
    )


WORD_LEVEL_TEMPLATES = ("search_r1", "short")
"""The prompt templates whose words are in every word-level vocabulary."""


def protocol_texts() -> list[str]:
    """Everything the Search-R1 protocol itself writes: the prompt template, the
    observation framing, the invalid-action message, the truncation and tool-error text."""
    sample = [Passage(id="0", contents='"Title"\ntext'), Passage(id="1", contents='"Title"\ntext')]
    return [
        # The two templates the vocabulary was built with from the start: a template added later (phantomwiki,
        # closed_book) must not change the vocabulary, and so the lab's tokens, of every existing word-level run.
        *(PROMPT_TEMPLATES[name].replace("{question}", "") for name in WORD_LEVEL_TEMPLATES),
        information_observation(sample),
        INVALID_ACTION_OBSERVATION,
        TRUNCATION_MARKER,
        # stratarl.rollout.parsing.tool_error_observation's fixed words
        "Search failed (RuntimeError: connection refused). No results.",
        *DEMONSTRATION_PHRASES,
    ]


def task_texts(passages: Iterable[Passage], examples: Iterable[Example]) -> Iterable[str]:
    """The texts a rollout over this corpus and these questions can show: passage
    contents, normalised questions, gold answers, multiple-choice options as the prompt
    lists them, and the query and answer of every hop in ``metadata["hops"]``."""
    # A passage's "Doc i(Title: ...)" rendering has the same pieces up to leading spaces,
    # and every word enters the vocabulary in both spellings.
    for passage in passages:
        yield passage.contents
    for example in examples:
        yield normalize_question(example.question)
        yield from example.golden_answers
        if example.metadata.get("options"):
            yield render_options(example.metadata["options"])
        for hop in example.metadata.get("hops") or ():
            yield str(hop.get("query", ""))
            yield str(hop.get("answer", ""))


def word_tokenizer_for_task(
    passages: Iterable[Passage],
    examples: Iterable[Example],
    *,
    extra_texts: Sequence[str] = (),
    min_freq: int = 1,
    max_vocab: int | None = None,
    lowercase: bool = False,
):
    """The word-level tokenizer of a task: vocabulary from ``task_texts`` + ``protocol_texts``
    + ``extra_texts`` (e.g. a trainer's demonstration phrases), so nothing a rollout over
    this corpus and these questions produces maps to ``[UNK]``."""
    texts = [*protocol_texts(), *extra_texts]
    return build_word_tokenizer(
        (*texts, *task_texts(passages, examples)), min_freq=min_freq, max_vocab=max_vocab, lowercase=lowercase
    )


def closed_word_tokenizer(words: Sequence[str], *, extra_texts: Sequence[str] = ()):
    """The word-level tokenizer of a closed vocabulary: ``protocol_texts``, every prompt template of
    ``PROMPT_TEMPLATES``, ``extra_texts`` (e.g. a trainer's demonstration thoughts) and ``words`` ONLY (e.g.
    PhantomWiki's generator words, :mod:`stratarl.data.phantomwiki_vocabulary`), never a run's own corpus or
    questions: every run over data drawn from that closed vocabulary gets the same tokens, whatever its data."""
    templates = [PROMPT_TEMPLATES[name].replace("{question}", "") for name in sorted(PROMPT_TEMPLATES)]
    return build_word_tokenizer((*protocol_texts(), *templates, *extra_texts, *words))


def unknown_in_texts(tokenizer, texts: Iterable[str], *, limit: int = 5) -> list[str]:
    """Up to ``limit`` distinct words of ``texts`` that ``tokenizer`` maps to its unknown token, in the order
    met (``unknown_words`` of each text; empty: ``tokenizer`` spells every text)."""
    found: dict[str, None] = {}
    for text in texts:
        for word in unknown_words(tokenizer, text):
            found.setdefault(word)
            if len(found) >= limit:
                return list(found)
    return list(found)


def word_tokenizer_for_kb(kb, **kwargs):
    """``word_tokenizer_for_task`` over a ``SyntheticKB``: its passages, train and test questions."""
    return word_tokenizer_for_task(kb.passages, [*kb.train, *kb.test], **kwargs)


def unknown_words(tokenizer, text: str) -> list[str]:
    """The spans of ``text`` that ``tokenizer`` maps to its unknown token (empty: full coverage)."""
    encoding = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    unk = tokenizer.unk_token_id
    spans = [
        text[start:end]
        for token, (start, end) in zip(encoding["input_ids"], encoding["offset_mapping"])
        if token == unk
    ]
    return [span.lstrip(" ") or span for span in spans if span != UNK_TOKEN]


def build_word_model(
    tokenizer,
    *,
    hidden_size: int = 128,
    num_layers: int = 4,
    num_heads: int = 4,
    intermediate_size: int | None = None,
    max_position_embeddings: int = 4096,
    seed: int = 0,
):
    """A randomly initialised Llama-style causal LM over ``tokenizer`` (``build_tiny_model``
    with sizes for learning the synthetic task from scratch: 4 layers of width 128,
    MLP width ``4 * hidden_size`` unless given, tied embeddings)."""
    from stratarl.models import build_tiny_model  # torch: only the model builder needs it

    if hidden_size % num_heads:
        raise ValueError(f"hidden_size={hidden_size} must be divisible by num_heads={num_heads}")
    return build_tiny_model(
        tokenizer,
        hidden_size=hidden_size,
        num_layers=num_layers,
        num_heads=num_heads,
        intermediate_size=intermediate_size or 4 * hidden_size,
        max_position_embeddings=max_position_embeddings,
        seed=seed,
    )
