"""NxD's import paths for parallel layers resolve to nxd_layers and work under 2 gloo ranks."""

import torch
import torch.nn.functional as F

from nxd_state.testing import run_distributed


def nxd_script(seed: int) -> dict[str, float]:
    """What an NxD training script does, imported the NxD way."""
    from neuronx_distributed.modules.qkv_linear import GQAQKVColumnParallelLinear
    from neuronx_distributed.parallel_layers import (
        ColumnParallelLinear,
        RowParallelLinear,
        clip_grad_norm,
        parallel_state,
    )
    from neuronx_distributed.parallel_layers.loss_functions import parallel_cross_entropy
    from neuronx_distributed.parallel_layers.random import (
        get_xla_rng_tracker,
        model_parallel_xla_manual_seed,
    )
    from neuronx_distributed.parallel_layers.utils import divide

    parallel_state.initialize_model_parallel(tensor_model_parallel_size=2)
    model_parallel_xla_manual_seed(seed)
    up = ColumnParallelLinear(8, 16, gather_output=False)
    down = RowParallelLinear(16, 8, input_is_parallel=True)
    head = ColumnParallelLinear(8, 32, bias=False, gather_output=False)
    qkv = GQAQKVColumnParallelLinear(8, [8, 4], kv_size_multiplier=2, gather_output=True)
    x = torch.randn(2, 4, 8)
    with get_xla_rng_tracker().fork():  # TP-distinct stream, as for dropout in a TP region
        torch.rand(1)
    hidden = down(F.gelu(up(x)))
    labels = torch.randint(0, 32, (2, 4))
    loss = parallel_cross_entropy(head(hidden), labels).mean()
    loss.backward()
    q, k, v = qkv(x)
    norm = clip_grad_norm([*up.parameters(), *down.parameters(), *head.parameters()], 1.0)
    return {
        "loss": float(loss),
        "norm": float(norm),
        "qkv": [tuple(t.shape) for t in (q, k, v)],
        "heads": divide(8, parallel_state.get_tensor_model_parallel_size()),
    }


def test_nxd_parallel_layers_import_paths() -> None:
    import neuronx_distributed.parallel_layers as pl
    import nxd_layers
    from neuronx_distributed.parallel_layers import layers, mappings, pad

    assert pl.ColumnParallelLinear is nxd_layers.ColumnParallelLinear
    assert layers.ParallelEmbedding is nxd_layers.ParallelEmbedding
    assert pad.pad_model is nxd_layers.pad_model
    assert mappings.gather_from_sequence_parallel_region is (
        nxd_layers.mappings.gather_from_sequence_parallel_region
    )
    results = run_distributed(nxd_script, 2, 1234)
    # Both TP ranks see the same loss and norm (they are reduced over TP), and real numbers.
    assert results[0] == results[1]
    assert results[0]["loss"] > 0
    assert results[0]["norm"] > 0
    assert results[0]["qkv"] == [(2, 4, 8), (2, 4, 4), (2, 4, 4)]
    assert results[0]["heads"] == 4
