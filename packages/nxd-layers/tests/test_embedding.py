"""ParallelEmbedding against torch.nn.Embedding holding the same table, on 2 and 4 gloo ranks.

NxD's semantics pinned here: ``padding_idx`` third positionally (NxD's code) and
``init_method`` third (NxD's reference page); the sequence-parallel output ``[s/tp, b, h]``
(the ``[b, s, h]`` lookup transposed to sequence-first before the reduce-scatter);
``shard_across_embedding`` (columns split, weight ``(V, D/tp)``, partition dim 1); ``pad`` (NxD's
padded sizes and per-rank weight shapes); ``max_norm`` with ``nn.Embedding``'s renormalisation
(the whole row's norm when its columns are split); ``scale_grad_by_freq`` and ``sparse``.

Tolerance: fp32, torch's defaults (rtol=1.3e-6, atol=1e-5): a lookup copies rows exactly and
the sum over TP adds zeros, so outputs and gradients differ at most by the order of a few
additions; renormalised rows are one multiply each (a few ulps).
"""

from __future__ import annotations

import re
from collections.abc import Callable

import pytest
import torch
from torch import nn

import nxd_state
from nxd_layers import ParallelEmbedding, full_tensor
from nxd_state.testing import run_distributed, run_named_checks

FP32 = {"rtol": 1.3e-6, "atol": 1e-5}  # see the module docstring
EXACT = {"rtol": 0.0, "atol": 0.0}
B, S, V, D = 2, 8, 64, 16


def _tp() -> tuple[int, int]:
    return nxd_state.get_tensor_model_parallel_size(), nxd_state.get_tensor_model_parallel_rank()


def _raises(fn: Callable[[], object], *fragments: str) -> None:
    with pytest.raises(ValueError, match=re.escape(fragments[0])) as info:
        fn()
    for fragment in fragments[1:]:
        assert fragment in str(info.value), (fragment, str(info.value))


def _ids(vocab: int = V) -> torch.Tensor:
    ids = torch.randint(0, vocab, (B, S))
    ids[0, 0], ids[1, 1], ids[1, 2] = 3, vocab - 1, 0  # padding row, both ends of the table
    return ids


def _load(par: ParallelEmbedding, ref: nn.Embedding) -> None:
    tp, rank = _tp()
    with torch.no_grad():
        par.weight.copy_(ref.weight.chunk(tp, dim=par.weight_partition_dim)[rank])


def _compare(par: ParallelEmbedding, ref: nn.Embedding, seq_layout: str = "none") -> None:
    """Forward both on the same ids, backward with the same upstream gradient (sliced to the
    parallel output's layout), compare the output and the gathered weight gradient."""
    tp, rank = _tp()
    ids = _ids()
    out_ref, out_par = ref(ids), par(ids)
    g = torch.randn(B, S, D)
    (out_ref * g).sum().backward()
    expected, g_par = out_ref, g
    if seq_layout == "seq_first":  # [s/tp, b, h]
        expected = out_ref.transpose(0, 1).chunk(tp, dim=0)[rank]
        g_par = g.transpose(0, 1).chunk(tp, dim=0)[rank]
    elif seq_layout == "batch_first":  # [b, s/tp, h]
        expected, g_par = out_ref.chunk(tp, dim=1)[rank], g.chunk(tp, dim=1)[rank]
    torch.testing.assert_close(out_par, expected, **FP32)
    (out_par * g_par).sum().backward()
    grad = par.weight.grad.to_dense() if par.weight.grad.is_sparse else par.weight.grad
    ref_grad = ref.weight.grad.to_dense() if ref.weight.grad.is_sparse else ref.weight.grad
    torch.testing.assert_close(full_tensor(par.weight, grad), ref_grad, **FP32)


def check_vocab_sharded(sequence_parallel: bool) -> None:
    """NxD's positional padding_idx; SP output [s/tp, b, h] as NxD's Llama expects."""
    tp, rank = _tp()
    ref = nn.Embedding(V, D, padding_idx=3)
    par = ParallelEmbedding(V, D, 3, sequence_parallel_enabled=sequence_parallel)
    _load(par, ref)
    assert par.weight.shape == (V // tp, D)
    assert (par.weight.tensor_model_parallel, par.weight.partition_dim) == (True, 0)
    assert (par.start_index, par.end_index) == (rank * V // tp, (rank + 1) * V // tp)
    assert par.padding_idx == (3 if rank == 0 else None)  # an index into this rank's weight
    _compare(par, ref, "seq_first" if sequence_parallel else "none")
    assert torch.count_nonzero(ref.weight.grad[3]) == 0  # the padding row gets no gradient


def check_sequence_dimension_one() -> None:
    """nxd's extension: sequence_dimension=1 keeps the batch first, [b, s/tp, h]."""
    ref = nn.Embedding(V, D)
    par = ParallelEmbedding(V, D, sequence_parallel_enabled=True, sequence_dimension=1)
    _load(par, ref)
    _compare(par, ref, "batch_first")


def check_shard_across_embedding(sequence_parallel: bool) -> None:
    tp, _ = _tp()
    ref = nn.Embedding(V, D, padding_idx=3)
    par = ParallelEmbedding(
        V, D, 3, shard_across_embedding=True, sequence_parallel_enabled=sequence_parallel
    )
    _load(par, ref)
    assert par.weight.shape == (V, D // tp)
    assert (par.weight.tensor_model_parallel, par.weight.partition_dim) == (True, 1)
    assert par.padding_idx == 3
    _compare(par, ref, "seq_first" if sequence_parallel else "none")


def check_init_and_reference_layout() -> None:
    """The table is nn.Embedding's from the same seed (padding row zeroed), whatever the TP
    degree; init_method third (the reference page's layout) with dtype and device after it."""
    for shard_embed in (False, True):
        torch.manual_seed(7)
        par = ParallelEmbedding(V, D, padding_idx=5, shard_across_embedding=shard_embed)
        torch.manual_seed(7)
        ref = nn.Embedding(V, D, padding_idx=5)
        torch.testing.assert_close(full_tensor(par.weight), ref.weight.detach(), **EXACT)
    calls = []

    def init(weight: torch.Tensor) -> None:
        calls.append(tuple(weight.shape))
        nn.init.constant_(weight, 0.5)

    ref_layout = ParallelEmbedding(V, D, init, torch.bfloat16, "cpu")
    assert calls == [(V, D)]  # the full table, once
    assert ref_layout.weight.dtype == torch.bfloat16
    assert ref_layout.padding_idx is None
    assert ref_layout.max_norm is None
    assert torch.all(ref_layout.weight == 0.5)
    assert ParallelEmbedding(V, D, init, torch.float32).weight.dtype == torch.float32
    _raises(lambda: ParallelEmbedding(V, D, init, init_method=init), "init_method given twice")
    _raises(lambda: ParallelEmbedding(V, D, init, 2.0), "must be a torch.dtype")


def check_pad() -> None:
    """NxD's padded sizes: rows (vocabulary) or columns (embedding) up to a multiple of TP."""
    tp, rank = _tp()
    odd_v, odd_d = 4 * tp + 1, 2 * tp + 1
    _raises(lambda: ParallelEmbedding(odd_v, D), f"num_embeddings({odd_v})", "pad=True")
    _raises(
        lambda: ParallelEmbedding(V, odd_d, shard_across_embedding=True), f"embedding_dim({odd_d})"
    )
    vocab = ParallelEmbedding(odd_v, D, pad=True)
    assert (vocab.num_embeddings, vocab.pad_size) == (5 * tp, tp - 1)
    assert vocab.weight.shape == (5, D)
    full = full_tensor(vocab.weight)
    assert torch.count_nonzero(full[odd_v:]) == 0
    ids = torch.arange(odd_v).reshape(1, odd_v)
    torch.testing.assert_close(vocab(ids)[0], full[:odd_v], **FP32)
    cols = ParallelEmbedding(V, odd_d, shard_across_embedding=True, pad=True)
    assert (cols.embedding_dim, cols.pad_size) == (3 * tp, tp - 1)
    assert cols.weight.shape == (V, 3)
    ref = nn.Embedding(V, odd_d)
    with torch.no_grad():
        widened = torch.nn.functional.pad(ref.weight, (0, tp - 1))
        cols.weight.copy_(widened.chunk(tp, dim=1)[rank])
    ids = _ids()
    torch.testing.assert_close(cols(ids), ref(ids), **FP32)  # padded columns dropped
    # NxD's loading hook pads an unpadded full table before it is sliced.
    state = {"w": ref.weight.detach().clone()}
    cols.preshard_hook(state, "w")
    torch.testing.assert_close(state["w"], widened.detach(), **EXACT)
    _raises(lambda: cols.preshard_hook({"w": widened.detach()}, "w"), "unpadded")


def check_max_norm(shard_embed: bool, norm_type: float) -> None:
    """Looked-up rows renormalised in place as nn.Embedding does; the norm is the whole row's
    even when its columns live on different ranks. Rows not looked up stay untouched."""
    ref = nn.Embedding(V, D, max_norm=1.5, norm_type=norm_type)
    with torch.no_grad():
        ref.weight.mul_(2.0)  # most rows above max_norm
    par = ParallelEmbedding(
        V, D, max_norm=1.5, norm_type=norm_type, shard_across_embedding=shard_embed
    )
    _load(par, ref)
    _compare(par, ref)
    torch.testing.assert_close(full_tensor(par.weight), ref.weight.detach(), **FP32)


def check_grad_options() -> None:
    """scale_grad_by_freq (ids repeated, some outside this rank's rows) and sparse."""
    for kwargs in ({"scale_grad_by_freq": True}, {"sparse": True}):
        for shard_embed in (False, True):
            ref = nn.Embedding(V, D, padding_idx=3, **kwargs)
            par = ParallelEmbedding(V, D, 3, shard_across_embedding=shard_embed, **kwargs)
            _load(par, ref)
            _compare(par, ref)


def check_meta_and_errors() -> None:
    tp, _ = _tp()
    meta = ParallelEmbedding(V, D, device="meta")
    assert meta.weight.is_meta
    assert meta.weight.shape == (V // tp, D)
    assert (meta.weight.tensor_model_parallel, meta.weight.partition_dim) == (True, 0)
    _raises(lambda: ParallelEmbedding(V, D, padding_idx=V), f"padding_idx({V})")
    _raises(lambda: ParallelEmbedding(V, D, 2.5), "padding_idx must be an int or None")
    _raises(lambda: ParallelEmbedding(V, D, max_norm=-1.0), "max_norm")
    _raises(lambda: ParallelEmbedding(V, D, use_spmd_rank=True), "use_spmd_rank")
    _raises(lambda: ParallelEmbedding(V, D, sequence_dimension=2), "sequence_dimension")
    par = ParallelEmbedding(V, D, sequence_parallel_enabled=True)
    _raises(lambda: par(torch.zeros(2, 2)), "integer ids")
    _raises(lambda: par(torch.zeros(B, S, 1, dtype=torch.long)), "[batch, sequence]")
    assert ParallelEmbedding(V, D, padding_idx=-1)._global_padding_idx == V - 1  # as torch


CHECKS: dict[str, Callable[[], None]] = {
    "vocab_sharded": lambda: check_vocab_sharded(sequence_parallel=False),
    "vocab_sharded_sequence_parallel": lambda: check_vocab_sharded(sequence_parallel=True),
    "sequence_dimension_one": check_sequence_dimension_one,
    "shard_across_embedding": lambda: check_shard_across_embedding(sequence_parallel=False),
    "shard_across_embedding_sp": lambda: check_shard_across_embedding(sequence_parallel=True),
    "init_and_reference_layout": check_init_and_reference_layout,
    "pad": check_pad,
    "max_norm_vocab": lambda: check_max_norm(shard_embed=False, norm_type=2.0),
    "max_norm_embedding_dim": lambda: check_max_norm(shard_embed=True, norm_type=2.0),
    "max_norm_embedding_dim_l1": lambda: check_max_norm(shard_embed=True, norm_type=1.0),
    "grad_options": check_grad_options,
    "meta_and_errors": check_meta_and_errors,
}


def run_checks(tp: int) -> list[str]:
    nxd_state.initialize_model_parallel(tensor_model_parallel_size=tp)
    return run_named_checks(CHECKS, seed=300, context=f"tp={tp}")


@pytest.mark.parametrize("tp", [2, 4])
def test_embedding_matches_torch(tp: int) -> None:
    """Every check of CHECKS on ``tp`` ranks (one spawn); a failure names its check."""
    assert run_distributed(run_checks, tp, tp) == [list(CHECKS)] * tp
