"""The packed row → right-padded batch of the Megatron policy (train_workers/megatron/policy.py), checked by hand."""

from __future__ import annotations

import pytest
import torch

from train_workers.megatron.policy import causal_mask, stage_batch, unpack_right_padded
from train_workers.packing import empty_microbatch, pack_microbatch


def test_megatron_unpack_puts_each_sequence_at_the_start_of_its_row():
    mb = pack_microbatch([[11, 12], [21, 22, 23]], [[13, 14, 15], [24]], [1.0, -1.0],
                         [torch.zeros(3), torch.zeros(1)], [0, 1])
    ids, row, col = unpack_right_padded(mb.input_ids, mb.position_ids)
    assert ids.tolist() == [[11, 12, 13, 14, 15], [21, 22, 23, 24, 0]]
    assert row.tolist() == [0, 0, 0, 0, 0, 1, 1, 1, 1] and col.tolist() == [0, 1, 2, 3, 4, 0, 1, 2, 3]
    # logits predicting the response tokens: sequence 0 at columns 1..3, sequence 1 at column 2
    assert list(zip(row[mb.logit_positions].tolist(), col[mb.logit_positions].tolist())) == [
        (0, 1), (0, 2), (0, 3), (1, 2)]
    assert ids[row[mb.logit_positions], col[mb.logit_positions] + 1].tolist() == mb.targets.tolist()


def test_megatron_unpack_placeholder_and_refusals():
    mb = empty_microbatch()
    ids, row, col = unpack_right_padded(mb.input_ids, mb.position_ids)
    assert ids.shape == (1, 1) and row.tolist() == [0] and col.tolist() == [0]
    with pytest.raises(ValueError, match="must count 0, 1, 2"):
        unpack_right_padded(torch.tensor([[5, 6, 7]]), torch.tensor([[0, 2, 3]]))
    with pytest.raises(ValueError, match="must start at 0"):
        unpack_right_padded(torch.tensor([[5, 6]]), torch.tensor([[1, 2]]))
    with pytest.raises(ValueError, match=r"expected one packed row"):
        unpack_right_padded(torch.zeros(2, 3, dtype=torch.long), torch.zeros(2, 3, dtype=torch.long))


def test_megatron_causal_mask_masks_the_future_only():
    m = causal_mask(2, 3, torch.device("cpu"))
    assert m.shape == (2, 1, 3, 3)
    assert m[1, 0].tolist() == [[False, True, True], [False, False, True], [False, False, False]]


def test_megatron_stage_batch_padded_to_the_step_shape():
    """Pipeline stages pad every micro-batch of a step to one [R, S]; the picked (row, column) of each response
    token's logits are unchanged and the added rows and columns are padding (0)."""
    mb = pack_microbatch([[11, 12], [21, 22, 23]], [[13, 14, 15], [24]], [1.0, -1.0],
                         [torch.zeros(3), torch.zeros(1)], [0, 1])
    batch = stage_batch(mb.input_ids, mb.position_ids, mb.logit_positions, mb.targets)
    padded = batch.padded(3, 7)
    assert padded.ids.tolist() == [[11, 12, 13, 14, 15, 0, 0], [21, 22, 23, 24, 0, 0, 0], [0] * 7]
    assert torch.equal(padded.rows, batch.rows) and torch.equal(padded.cols, batch.cols)
    assert padded.ids[padded.rows, padded.cols + 1].tolist() == mb.targets.tolist()
    with pytest.raises(ValueError, match=r"micro-batch \[2, 5\] does not fit the step's shape \[1, 7\]"):
        batch.padded(1, 7)
