"""NxD's ``get_batch_on_this_context_parallel_rank`` at CP 2: the zigzag slice of every
``(batch, sequence)`` tensor, the whole batch at CP 1, a clear error for a bad length."""

from __future__ import annotations

import torch

from nxd_state.testing import run_distributed


def slice_batch(cp: int, seq: int) -> dict:
    import nxd_state
    from neuronx_distributed.utils.batch_utils import get_batch_on_this_context_parallel_rank

    nxd_state.initialize_model_parallel(context_parallel_size=cp)
    ids = torch.arange(2 * seq).view(2, seq)
    batch = {"input_ids": ids, "labels": ids + 100, "scalar": torch.tensor(3.0)}
    try:
        out = get_batch_on_this_context_parallel_rank(batch)
    except ValueError as error:
        return {"error": str(error)}
    return {k: v.tolist() for k, v in out.items()}


def test_zigzag_slice_at_cp2() -> None:
    # seq 8 at CP 2: chunks of 2; rank 0 holds chunks 0 and 3, rank 1 chunks 1 and 2.
    want = {0: [0, 1, 6, 7], 1: [2, 3, 4, 5]}
    for rank, out in enumerate(run_distributed(slice_batch, 2, 2, 8)):
        cols = want[rank]
        assert out["input_ids"] == [cols, [8 + c for c in cols]]
        assert out["labels"] == [[100 + c for c in cols], [108 + c for c in cols]]
        assert out["scalar"] == 3.0  # not a sequence: passed through


def test_bad_length_names_both_values() -> None:
    for out in run_distributed(slice_batch, 2, 2, 6):
        assert (
            "sequence length 6 is not divisible by 2 x context_parallel_size(2) = 4"
            in (out["error"])
        )
