"""Collation, row selection and token-budgeted micro-batches."""

from __future__ import annotations

import pytest
import torch

from stratarl.trainer.batch import collate_sequences, micro_batches, mini_batch_rows, scatter_response_values


def _batch():
    return collate_sequences(
        [[1, 2, 3], [4], [5, 6]], [[7, 8], [9, 10, 11, 12], []], [[1, 0], [1, 1, 0, 1], []], pad_id=0
    )


def test_collate_layout():
    b = _batch()
    assert b.input_ids.tolist() == [[1, 2, 3, 7, 8], [4, 9, 10, 11, 12], [5, 6, 0, 0, 0]]
    assert b.attention_mask.tolist() == [[1, 1, 1, 1, 1], [1, 1, 1, 1, 1], [1, 1, 0, 0, 0]]
    assert b.response_mask.tolist() == [[1, 0, 0, 0], [1, 1, 0, 1], [0, 0, 0, 0]]
    assert b.prompt_lengths.tolist() == [3, 1, 2] and b.response_lengths.tolist() == [2, 4, 0]
    assert b.num_policy_tokens == 4


def test_select_trims_padding_and_keeps_order():
    b = _batch()
    s = b.select([2, 0])
    assert s.input_ids.tolist() == [[5, 6, 0, 0, 0][:5], [1, 2, 3, 7, 8]]
    assert s.response_mask.shape == (2, 2)
    only_short = b.select([2])
    assert only_short.input_ids.shape == (1, 2) and only_short.response_mask.shape == (1, 0)


def test_collate_rejects_mismatched_masks():
    with pytest.raises(ValueError, match="row 0: 2 response tokens but 1 mask"):
        collate_sequences([[1]], [[2, 3]], [[1]], pad_id=0)
    with pytest.raises(ValueError, match="empty prompt"):
        collate_sequences([[]], [[2]], [[1]], pad_id=0)


def test_scatter_response_values():
    out = scatter_response_values([[0.5, -1.0], [2.0]], torch.tensor([2, 1]))
    assert out.tolist() == [[0.5, -1.0], [2.0, 0.0]]


def test_micro_batches_respect_budget_and_cover_rows():
    lengths = torch.tensor([10, 3, 7, 7, 2, 9])
    parts = micro_batches(lengths, token_budget=20)
    assert sorted(r for p in parts for r in p) == list(range(6))
    for p in parts:
        assert len(p) * max(int(lengths[r]) for r in p) <= 20 or len(p) == 1
    # Sorted by length: rows of similar length share a micro-batch.
    assert parts[0] == [0, 5]


def test_micro_batch_of_an_overlong_row_is_alone():
    parts = micro_batches(torch.tensor([50, 1]), token_budget=10)
    assert parts == [[0], [1]]


def test_mini_batch_rows_partition():
    g = torch.Generator().manual_seed(0)
    parts = mini_batch_rows(10, 3, g)
    assert sorted(r for p in parts for r in p) == list(range(10))
    assert sorted(len(p) for p in parts) == [3, 3, 4]
    with pytest.raises(ValueError, match="trainer.mini_batches=11"):
        mini_batch_rows(10, 11, g)
