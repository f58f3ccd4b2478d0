"""The stop rule every backend applies after each new token (see ``stratarl.rollout.generator``): EOS,
then a stop string matched on the decoded text of the row's tail, then the row's token budget."""

from __future__ import annotations

from collections.abc import Sequence

from stratarl.rollout.generator import FinishReason


class StopMatcher:
    """Detects stop strings in a row's generated tokens by decoding only its tail.

    Each stop string of L characters spans at most L tokens (byte-level BPE tokens
    decode to at least one character of ASCII text), so decoding the last
    ``max L + 1`` tokens sees any stop completed by the newest token. Earlier
    stops cannot be in the window: the row would already have stopped.
    """

    def __init__(self, tokenizer, stop_strings: Sequence[str], candidates: frozenset[int] | None = None):
        self.tokenizer = tokenizer
        self.stop_strings = tuple(stop_strings)
        self.window = max((len(s) for s in self.stop_strings), default=0) + 1
        self.candidates = candidates

    def check(self, token_ids: Sequence[int]) -> str | None:
        """The stop string completed by the last token, if any."""
        if not self.stop_strings:
            return None
        if self.candidates is not None and token_ids[-1] not in self.candidates:
            return None  # this token cannot complete a stop string: skip the decode
        text = self.tokenizer.decode(
            list(token_ids[-self.window :]), skip_special_tokens=False, clean_up_tokenization_spaces=False
        )
        found = [(text.find(s) + len(s), s) for s in self.stop_strings if s in text]
        return min(found)[1] if found else None


def stop_candidates(tokenizer, stop_strings: Sequence[str]) -> frozenset[int] | None:
    """Ids of the tokens that can complete one of ``stop_strings``, or None (check every token).

    A token completes a stop string only if its own text holds the string's last
    character. When every last character is ASCII this holds for a token decoded on
    its own too (an ASCII byte always decodes to itself, in byte-level BPE,
    SentencePiece byte fallback and word-level vocabularies alike), so one decode of
    the vocabulary up front lets the generator skip the per-row tail decode for
    almost every token (48 of SmolLM2's 49,152 tokens hold a ``>``).
    """
    last_chars = {s[-1] for s in stop_strings}
    if not last_chars or any(not c.isascii() for c in last_chars):
        return None
    texts = tokenizer.batch_decode(
        [[i] for i in range(len(tokenizer))], skip_special_tokens=False, clean_up_tokenization_spaces=False
    )
    return frozenset(i for i, text in enumerate(texts) if any(c in text for c in last_chars))


def eos_token_ids(model, tokenizer) -> set[int]:
    """Every id that ends a sequence: the tokenizer's EOS and the model's generation config EOS."""
    ids: set[int] = set()
    candidates = [getattr(tokenizer, "eos_token_id", None)]
    generation_config = getattr(model, "generation_config", None)
    if generation_config is not None:
        candidates.append(generation_config.eos_token_id)
    for value in candidates:
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, (list, tuple)):
            ids.update(int(v) for v in value)
    if not ids:
        raise ValueError("the tokenizer has no eos_token_id; set tokenizer.eos_token before generating")
    return ids


def finish_of(
    token_ids: list[int], limit: int, eos_ids: set[int], matcher: StopMatcher
) -> tuple[FinishReason, str | None] | None:
    """Why a row ends after its newest token (EOS, then stop string, then budget), or None."""
    if token_ids[-1] in eos_ids:
        return "eos", None
    stop = matcher.check(token_ids)
    if stop is not None:
        return "stop", stop
    if len(token_ids) >= limit:
        return "length", None
    return None


def special_token_ids(model, tokenizer) -> tuple[set[int], int, int]:
    """(every EOS id, the EOS id a generator appends, the pad id): the tokenizer's EOS and pad when set,
    else the smallest EOS id, and EOS as padding."""
    eos_ids = eos_token_ids(model, tokenizer)
    eos_id = tokenizer.eos_token_id if tokenizer.eos_token_id is not None else min(eos_ids)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos_id
    return eos_ids, eos_id, pad_id
