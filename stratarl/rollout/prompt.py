"""The Search-R1 "base" prompt template and its tokenization.

Source: Search-R1 ``scripts/data_process/nq_search.py`` (``make_prefix``); see docs/compatibility.md.
"""

from __future__ import annotations

SEARCH_R1_TEMPLATE = (
    "Answer the given question. You must conduct reasoning inside <think> and </think> first every time "
    "you get new information. After reasoning, if you find you lack some knowledge, you can call a search "
    "engine by <search> query </search> and it will return the top searched results between <information> "
    "and </information>. You can search as many times as your want. If you find no further external "
    "knowledge needed, you can directly provide the answer inside <answer> and </answer>, without detailed "
    "illustrations. For example, <answer> Beijing </answer>. Question: {question}\n"
)


# A short instruction for models trained from scratch (the lab, docs/lab.md): the same protocol tags,
# a tenth of the tokens, so a tiny policy spends its compute on the question and the passages.
SHORT_TEMPLATE = (
    "Answer the question. Search with <search> query </search> as often as you need; the results come "
    "between <information> and </information>. Answer with <answer> name </answer>. Question: {question}\n"
)
# PhantomWiki (docs/benchmarks.md): Search-R1's template plus how to give several answers, since a PhantomWiki
# question lists every correct answer and is scored on the set (stratarl.rewards.phantomwiki).
MULTI_ANSWER_NOTE = (
    "If there are several correct answers, give them all inside one answer, separated by commas, "
    "e.g. <answer> Eli Smock, Gene Smock </answer>. "
)
PHANTOMWIKI_TEMPLATE = SEARCH_R1_TEMPLATE.replace("Question: {question}", MULTI_ANSWER_NOTE + "Question: {question}")
# The closed-book baseline: the same answer format, no search engine (run with rollout.max_turns 0).
CLOSED_BOOK_TEMPLATE = (
    "Answer the given question. You must conduct reasoning inside <think> and </think> first. Then provide the "
    "answer inside <answer> and </answer>, without detailed illustrations. For example, <answer> Beijing </answer>. "
    + MULTI_ANSWER_NOTE
    + "Question: {question}\n"
)
PROMPT_TEMPLATES = {
    "search_r1": SEARCH_R1_TEMPLATE,
    "short": SHORT_TEMPLATE,
    "phantomwiki": PHANTOMWIKI_TEMPLATE,
    "closed_book": CLOSED_BOOK_TEMPLATE,
}


def resolve_template(template: str) -> str:
    """A template by name (``search_r1``, ``short``, ``phantomwiki``, ``closed_book``) or a literal template
    containing ``{question}``."""
    if template in PROMPT_TEMPLATES:
        return PROMPT_TEMPLATES[template]
    if "{question}" not in template:
        raise ValueError(
            f"prompt template {template!r} is neither a known name ({', '.join(PROMPT_TEMPLATES)}) "
            "nor a template containing {question}"
        )
    return template


def normalize_question(question: str) -> str:
    """Strip the question and append "?" when it does not end with one."""
    if not isinstance(question, str):
        raise TypeError(f"question must be a string, got {type(question).__name__}: {question!r}")
    question = question.strip()
    if not question:
        raise ValueError("question is empty: every example needs a non-empty question text")
    return question if question.endswith("?") else question + "?"


def render_options(options: dict[str, str]) -> str:
    """``A. text`` one line per option, in letter order."""
    return "\n".join(f"{letter}. {options[letter]}" for letter in sorted(options))


def build_prompt(question: str, template: str = SEARCH_R1_TEMPLATE, options: dict[str, str] | None = None) -> str:
    """The user message: ``template`` with the normalised question filled in.

    With multiple-choice ``options`` (letter -> text) the question is the stem, stripped, then the
    options one per line (``A. text``); no "?" is appended (stems often end in ":").
    """
    if options:
        stem = question.strip() if isinstance(question, str) else ""
        if not stem:
            raise ValueError(f"question is empty: every example needs a non-empty question text, got {question!r}")
        return template.format(question=f"{stem}\n{render_options(options)}")
    return template.format(question=normalize_question(question))


def encode_messages(tokenizer, messages) -> list[int]:
    """Token ids of a chat prompt, tokenized as Search-R1's ``RLHFDataset`` does.

    With a chat template: the template applied (``add_generation_prompt=True``), then the
    text tokenized with ``add_special_tokens=False`` (the template wrote any special tokens it
    wants). Without one: the message's content alone, also with ``add_special_tokens=False``
    (a tokenizer that adds BOS does not get one here, as in Search-R1). Several messages need a
    chat template (Search-R1 would silently keep only the first).
    """
    messages = [{"role": "user", "content": messages}] if isinstance(messages, str) else list(messages)
    if not messages:
        raise ValueError("prompt has no messages")
    if getattr(tokenizer, "chat_template", None):
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    elif len(messages) == 1:
        text = messages[0]["content"]
    else:
        roles = [m.get("role") for m in messages]
        raise ValueError(
            f"the prompt has {len(messages)} messages ({', '.join(map(str, roles))}) but the tokenizer has "
            "no chat template to join them; use a model with a chat template, or set "
            "rollout.rebuild_prompt=true to build one user message from the question"
        )
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def encode_prompt(
    tokenizer, question: str, template: str = SEARCH_R1_TEMPLATE, options: dict[str, str] | None = None
) -> list[int]:
    """Token ids of the templated question (with its options, if any) as one user message (see ``encode_messages``)."""
    content = build_prompt(question, resolve_template(template), options)
    return encode_messages(tokenizer, [{"role": "user", "content": content}])
