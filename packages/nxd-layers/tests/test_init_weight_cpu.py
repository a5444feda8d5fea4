"""NxD's re-initialisation hooks on 2 gloo ranks (TP=2): ``init_weight_cpu()`` on
``ColumnParallelLinear`` / ``RowParallelLinear`` / ``ParallelEmbedding`` and
``initialize_weight_biases()`` on ``GQAQKVColumnParallelLinear``.

NxD's models build on the meta device, materialise the parameters empty, and call these hooks
(``init_weights(module)`` as NxDPPModel's ``param_init_fn``). Proven here, for every layer:

* meta build + ``to_empty`` + the hook under seed s equals the layer built eagerly under seed
  s (every parameter and kept master), so delayed initialisation gives the eager model;
* the hook re-draws in place: the parameter objects stay (an optimizer built before still
  holds them), Column/Row/Embedding biases are left alone (NxD's models zero them after);
* the gathered weight is ``init_method`` applied to the full tensor in one process
  (``normal_(std=0.02)`` on a ``(out, in)`` tensor; ``normal_`` with the padding row zeroed
  for the embedding), with stride 2, ``pad`` and both embedding shardings;
* a meta parameter and a ``pad_model``-padded one are refused by name.

Tolerance: exact everywhere: the same float32 draws from the same generator, sliced and cast
(no arithmetic).
"""

from __future__ import annotations

import functools

import pytest
import torch
from torch import nn

from nxd_state.testing import run_distributed, run_named_checks

TP = 2
EXACT = {"rtol": 0.0, "atol": 0.0}
SEED = 1234


def _normal_002(weight: torch.Tensor) -> None:
    nn.init.normal_(weight, std=0.02)


def _layers() -> dict[str, functools.partial]:
    """Constructors of the layers under test (device and seeds are the test's)."""
    from nxd_layers import (
        ColumnParallelLinear,
        GQAQKVColumnParallelLinear,
        ParallelEmbedding,
        RowParallelLinear,
    )

    gqa = functools.partial(
        GQAQKVColumnParallelLinear, 8, [4 * 2, 1 * 2], head_dim=2, kv_size_multiplier=2,
        keep_master_weight=True, gather_output=False,
    )  # fmt: skip
    return {
        "column stride 2": functools.partial(
            ColumnParallelLinear, 6, 8, stride=2, init_method=_normal_002, keep_master_weight=True
        ),
        "column gathered, pad": functools.partial(
            ColumnParallelLinear, 6, 5, gather_output=True, pad=True, keep_master_weight=True
        ),
        "row pad": functools.partial(RowParallelLinear, 5, 6, pad=True, keep_master_weight=True),
        "embedding vocab": functools.partial(ParallelEmbedding, 10, 4, 3),
        "embedding columns, pad": functools.partial(
            ParallelEmbedding, 6, 5, shard_across_embedding=True, pad=True
        ),
        "gqa": gqa,
        "gqa fused": functools.partial(gqa, fuse_qkv=True),
        "gqa no bias": functools.partial(gqa, bias=False),
    }


def _reinit(layer: nn.Module) -> None:
    """NxD's ``init_weights(module)``: the GQA hook, else ``init_weight_cpu``."""
    from nxd_layers import GQAQKVColumnParallelLinear

    if isinstance(layer, GQAQKVColumnParallelLinear):
        layer.initialize_weight_biases()
    else:
        layer.init_weight_cpu()


def _masters(layer: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v for k, v in vars(layer).items() if k.startswith("master_") and v is not None}


def check_meta_then_reinit_equals_eager(name: str, build: functools.partial) -> None:
    torch.manual_seed(SEED)
    eager = build()
    delayed = build(device="meta")
    with pytest.raises(ValueError, match="on the meta device; materialise it first"):
        _reinit(delayed)
    delayed = delayed.to_empty(device="cpu")
    torch.manual_seed(SEED)
    _reinit(delayed)
    eager_state, delayed_state = eager.state_dict(), delayed.state_dict()
    assert sorted(eager_state) == sorted(delayed_state), name
    for key, value in eager_state.items():
        if key.startswith("bias") and not key.startswith("bias_"):
            continue  # Column/Row/Embedding: the hook leaves the bias alone (checked below)
        torch.testing.assert_close(delayed_state[key], value, **EXACT, msg=f"{name} {key}")
    masters = _masters(eager)
    assert sorted(_masters(delayed)) == sorted(masters), name
    for key, value in masters.items():
        torch.testing.assert_close(_masters(delayed)[key], value, **EXACT, msg=f"{name} {key}")


def check_reinit_in_place(name: str, build: functools.partial) -> None:
    torch.manual_seed(SEED)
    eager = build()
    torch.manual_seed(SEED + 1)
    layer = build()
    params = dict(layer.named_parameters())
    optimizer = torch.optim.SGD(layer.parameters(), lr=0.1)
    bias = getattr(layer, "bias", None)
    if bias is not None:
        with torch.no_grad():
            bias.fill_(0.25)
    torch.manual_seed(SEED)
    _reinit(layer)
    assert dict(layer.named_parameters()) == params  # the same objects
    assert all(p is q for p, q in zip(optimizer.param_groups[0]["params"], layer.parameters()))
    for key, value in eager.state_dict().items():
        if bias is not None and key == "bias":
            assert bool((layer.bias == 0.25).all()), name
            continue
        torch.testing.assert_close(layer.state_dict()[key], value, **EXACT, msg=f"{name} {key}")


def check_full_weights_are_init_method_on_the_full_tensor() -> None:
    """The gathered weight after the hook = ``init_method`` on the unsharded tensor."""
    from nxd_layers import ColumnParallelLinear, ParallelEmbedding, full_tensor

    layers = _layers()
    column = layers["column stride 2"]()
    torch.manual_seed(SEED)
    column.init_weight_cpu()
    torch.manual_seed(SEED)
    expected = torch.empty(8, 6)
    _normal_002(expected)
    torch.testing.assert_close(full_tensor(column.weight), expected, **EXACT)  # stride 2 undone
    torch.testing.assert_close(column.master_weight, expected, **EXACT)
    padded = ColumnParallelLinear(6, 5, pad=True, gather_output=False, init_method=_normal_002)
    torch.manual_seed(SEED)
    padded.init_weight_cpu()
    torch.manual_seed(SEED)
    expected = torch.empty(5, 6)
    _normal_002(expected)
    full = full_tensor(padded.weight)
    torch.testing.assert_close(full[:5], expected, **EXACT)
    assert not full[5:].any()  # NxD's pad: the appended row stays zero
    by_columns = ParallelEmbedding(10, 4, 3, shard_across_embedding=True)
    for embedding, dim in ((layers["embedding vocab"](), 0), (by_columns, 1)):
        torch.manual_seed(SEED)
        embedding.init_weight_cpu()
        torch.manual_seed(SEED)
        table = torch.empty(10, 4).normal_()
        table[3] = 0.0  # padding_idx, zeroed as nn.Embedding does
        torch.testing.assert_close(full_tensor(embedding.weight), table, **EXACT)
        assert embedding.weight.partition_dim == dim


def check_refusals() -> None:
    from nxd_layers import ColumnParallelLinear, RowParallelLinear, pad_model

    class Attention(nn.Module):  # 3 heads of 2 at TP=2: pad_model pads to 4 heads
        def __init__(self) -> None:
            super().__init__()
            self.q = ColumnParallelLinear(4, 6, gather_output=False)
            self.o = RowParallelLinear(6, 4, input_is_parallel=True)

    model = nn.Sequential(Attention())
    pad_model(model, TP, 3, wrapped_classes=(Attention,))
    with pytest.raises(ValueError, match="padded by pad_model; initialise the layer before"):
        model[0].q.init_weight_cpu()
    with pytest.raises(ValueError, match=r"RowParallelLinear.init_weight_cpu: .*pad_model"):
        model[0].o.init_weight_cpu()


def init_weight_checks() -> list[str]:
    import nxd_state

    nxd_state.initialize_model_parallel(tensor_model_parallel_size=TP)
    checks = {}
    for name, build in _layers().items():
        checks[f"{name}: meta + hook = eager"] = functools.partial(
            check_meta_then_reinit_equals_eager, name, build
        )
        checks[f"{name}: in place"] = functools.partial(check_reinit_in_place, name, build)
    checks["init_method on the full tensor"] = check_full_weights_are_init_method_on_the_full_tensor
    checks["refusals"] = check_refusals
    return run_named_checks(checks, context=f"tp={TP}")


def test_reinit_hooks_redraw_the_constructors_weights() -> None:
    results = run_distributed(init_weight_checks, TP)
    assert len(results) == TP
    assert results[0] == results[1]
    assert len(results[0]) == 2 * len(_layers()) + 2
