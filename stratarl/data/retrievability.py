"""How well a retriever finds each hop's passage with that hop's query (synthetic benchmark)."""

from __future__ import annotations

from collections.abc import Sequence

from stratarl.data.examples import Example
from stratarl.retrieval.base import Retriever


def hop_recall(
    examples: Sequence[Example], retriever: Retriever, *, ks: Sequence[int] = (1, 3), batch_size: int = 1024
) -> dict[str, dict]:
    """Recall@k of each hop's ``passage_id`` when searching its ``query``.

    recall@k(group) = (# hops in group whose passage is in the top k) / (# hops in group)

    Groups: ``"all"``, each ``question_type`` and each ``"<question_type>/hop<n>"`` (n from 1).
    Returns ``{group: {"hops": n, "top<k>": recall, ...}}``. Examples need ``metadata["hops"]``.
    """
    if not ks or min(ks) < 1:
        raise ValueError(f"ks must be positive integers, got {ks}")
    records = []  # (groups, query, passage_id)
    for example in examples:
        hops = example.metadata.get("hops")
        if not hops:
            raise ValueError(f"example {example.id!r} has no metadata['hops']; hop recall needs synthetic examples")
        question_type = example.metadata.get("question_type", "unknown")
        for position, hop in enumerate(hops, start=1):
            groups = ("all", question_type, f"{question_type}/hop{position}")
            records.append((groups, hop["query"], str(hop["passage_id"])))
    k_max = max(ks)
    found: list[int] = []  # rank (0-based) of the needed passage, or k_max when absent
    for start in range(0, len(records), batch_size):
        batch = records[start : start + batch_size]
        results = retriever.search([query for _, query, _ in batch], k_max)
        for (_, _, needed), hits in zip(batch, results):
            ids = [hit.id for hit in hits]
            found.append(ids.index(needed) if needed in ids else k_max)
    table: dict[str, dict] = {}
    for (groups, _, _), rank in zip(records, found):
        for group in groups:
            row = table.setdefault(group, {"hops": 0, **{f"top{k}": 0 for k in ks}})
            row["hops"] += 1
            for k in ks:
                row[f"top{k}"] += rank < k
    for row in table.values():
        for k in ks:
            row[f"top{k}"] = row[f"top{k}"] / row["hops"]
    return dict(sorted(table.items(), key=lambda item: (item[0] != "all", item[0])))


def format_recall_table(table: dict[str, dict]) -> str:
    """A Markdown table of ``hop_recall``'s result."""
    columns = [key for key in next(iter(table.values())) if key != "hops"]
    lines = ["| hops | n | " + " | ".join(columns) + " |", "|---|---:|" + "---:|" * len(columns)]
    for group, row in table.items():
        lines.append(f"| {group} | {row['hops']} | " + " | ".join(f"{row[c]:.3f}" for c in columns) + " |")
    return "\n".join(lines)
