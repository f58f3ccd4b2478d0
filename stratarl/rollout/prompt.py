"""The Search-R1 "base" prompt template and its tokenization.

Source: Search-R1 ``scripts/data_process/nq_search.py`` (``make_prefix``) and COMPATIBILITY.md.
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
PROMPT_TEMPLATES = {"search_r1": SEARCH_R1_TEMPLATE, "short": SHORT_TEMPLATE}


def resolve_template(template: str) -> str:
    """A template by name (``search_r1``, ``short``) or a literal template containing ``{question}``."""
    if template in PROMPT_TEMPLATES:
        return PROMPT_TEMPLATES[template]
    if "{question}" not in template:
        raise ValueError(f"prompt template {template!r} is neither a known name ({', '.join(PROMPT_TEMPLATES)}) "
                         "nor a template containing {question}")
    return template


def normalize_question(question: str) -> str:
    """Strip the question and append "?" when it does not end with one."""
    if not isinstance(question, str):
        raise TypeError(f"question must be a string, got {type(question).__name__}: {question!r}")
    question = question.strip()
    if not question:
        raise ValueError("question is empty: every example needs a non-empty question text")
    return question if question.endswith("?") else question + "?"


def build_prompt(question: str, template: str = SEARCH_R1_TEMPLATE) -> str:
    """The user message: ``template`` with the normalised question filled in."""
    return template.format(question=normalize_question(question))


def encode_prompt(tokenizer, question: str, template: str = SEARCH_R1_TEMPLATE) -> list[int]:
    """Token ids of the prompt: one user message, the chat template applied when the
    tokenizer has one (``add_generation_prompt=True``), else the raw text."""
    content = build_prompt(question, resolve_template(template))
    if getattr(tokenizer, "chat_template", None):
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": content}], add_generation_prompt=True, tokenize=False
        )
        # The chat template already wrote any special tokens it wants.
        return list(tokenizer(text, add_special_tokens=False)["input_ids"])
    return list(tokenizer(content)["input_ids"])
