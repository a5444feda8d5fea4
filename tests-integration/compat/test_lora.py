"""LoRA the NxD way on TP=2 layers (2 gloo ranks) equals the unsharded adapter.

``get_lora_model(model, LoraConfig(enable_lora=True, ..., merge_sharded_lora=True))`` wraps the
q/v ``ColumnParallelLinear`` and o ``RowParallelLinear`` of a small block. The reference is the
same block in plain torch on the full base weights (NxD's ``master_weight``) with
``y = x W^T + (alpha / r) · x A^T B^T`` on the full adapter, which ``state_dict()`` returns under
``merge_sharded_lora`` (NxD's gathered adapter, NxD's key names). Two SGD steps later (B starts at
zero, so the steps are what make the adapter matter) the outputs, every adapter gradient (each
rank's shard against its share of the reference gradient), and the merged state dict agree.

Tolerance: float32, the same products summed in another order (row-parallel partial sums and
the all-reduces): rtol 1e-5, atol 1e-6.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from nxd_state.testing import run_distributed

TP = 2
TOL = {"rtol": 1e-5, "atol": 1e-6}
RANK, ALPHA, LR, STEPS = 4, 8.0, 0.5, 2


class Block(nn.Module):
    """y = o(q(x) * v(x)): q, v column-parallel (gather_output=False), o row-parallel."""

    def __init__(self) -> None:
        super().__init__()
        from neuronx_distributed.parallel_layers import ColumnParallelLinear, RowParallelLinear

        self.q_proj = ColumnParallelLinear(
            8, 16, bias=False, gather_output=False, keep_master_weight=True
        )
        self.v_proj = ColumnParallelLinear(
            8, 16, bias=False, gather_output=False, keep_master_weight=True
        )
        self.o_proj = RowParallelLinear(
            16, 8, bias=False, input_is_parallel=True, keep_master_weight=True
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.o_proj(self.q_proj(x) * self.v_proj(x))


def _reference(base: dict[str, torch.Tensor], adapter: dict[str, torch.Tensor], x: torch.Tensor):
    scale = ALPHA / RANK

    def lora(name: str, h: torch.Tensor) -> torch.Tensor:
        a, b = adapter[f"{name}.lora_A.weight"], adapter[f"{name}.lora_B.weight"]
        return F.linear(h, base[name]) + scale * F.linear(F.linear(h, a), b)

    return lora("o_proj", lora("q_proj", x) * lora("v_proj", x))


def lora_parity() -> dict[str, object]:
    from neuronx_distributed.modules.lora import LoraConfig, get_lora_model
    from neuronx_distributed.parallel_layers import parallel_state
    from neuronx_distributed.parallel_layers.random import model_parallel_xla_manual_seed

    parallel_state.initialize_model_parallel(tensor_model_parallel_size=TP)
    rank = parallel_state.get_tensor_model_parallel_rank()
    model_parallel_xla_manual_seed(0)
    block = Block()
    base = {n: getattr(block, n).master_weight.clone() for n in ("q_proj", "v_proj", "o_proj")}
    assert get_lora_model(block, None) is block  # NxD: no config, no LoRA
    config = LoraConfig(
        enable_lora=True,
        lora_rank=RANK,
        lora_alpha=ALPHA,
        lora_dropout=0.0,
        target_modules=["q_proj", "v_proj", "o_proj"],
        merge_sharded_lora=True,
    )
    model = get_lora_model(block, config)
    trainable = sorted(n for n, p in model.named_parameters() if p.requires_grad)
    names = [f"{m}.lora_{ab}.weight" for m in ("o_proj", "q_proj", "v_proj") for ab in "AB"]
    assert trainable == names  # NxD freezes the base
    full = model.state_dict()  # merge_sharded_lora: the whole adapter, on every rank
    adapter = {k: v.clone().requires_grad_() for k, v in full.items() if k in names}
    shapes = {k: tuple(v.shape) for k, v in adapter.items()}
    assert shapes == {
        "q_proj.lora_A.weight": (RANK, 8),
        "q_proj.lora_B.weight": (16, RANK),
        "v_proj.lora_A.weight": (RANK, 8),
        "v_proj.lora_B.weight": (16, RANK),
        "o_proj.lora_A.weight": (RANK, 16),
        "o_proj.lora_B.weight": (8, RANK),
    }
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=LR)
    ref_optimizer = torch.optim.SGD(adapter.values(), lr=LR)
    params = dict(model.named_parameters())
    gen = torch.Generator().manual_seed(1)
    for step in range(STEPS):
        x, target = torch.randn(3, 5, 8, generator=gen), torch.randn(3, 5, 8, generator=gen)
        y = model(x)
        torch.testing.assert_close(y, _reference(base, adapter, x), **TOL, msg=f"output {step}")
        F.mse_loss(y, target).backward()
        F.mse_loss(_reference(base, adapter, x), target).backward()
        for name in names:
            want = adapter[name].grad
            sharded_dim = {"q_proj.lora_B": 0, "v_proj.lora_B": 0, "o_proj.lora_A": 1}
            dim = sharded_dim.get(name.rsplit(".", 1)[0])
            if dim is not None:  # the rank's shard (NxD: Column's B by rows, Row's A by columns)
                want = want.chunk(TP, dim=dim)[rank]
            torch.testing.assert_close(params[name].grad, want, **TOL, msg=f"{name} {step}")
        optimizer.step()
        ref_optimizer.step()
        optimizer.zero_grad()
        ref_optimizer.zero_grad()
    merged = model.state_dict()
    for name in names:
        torch.testing.assert_close(merged[name], adapter[name].detach(), **TOL, msg=name)
    assert any(adapter[n].detach().abs().max() > 0 for n in names if "lora_B" in n)
    return {"keys": sorted(merged), "gqa_keys": _gqa_adapter_keys(config)}


def _gqa_adapter_keys(config) -> list[str]:
    """The keys of the gathered adapter of a LoRA-wrapped GQA QKV projection."""
    from neuronx_distributed.modules.lora import get_lora_model
    from neuronx_distributed.modules.qkv_linear import GQAQKVColumnParallelLinear

    model = nn.Sequential()
    model.add_module(
        "qkv_proj", GQAQKVColumnParallelLinear(8, [8, 4], bias=False, gather_output=False)
    )
    config.target_modules = ["qkv_proj"]
    return sorted(get_lora_model(model, config).state_dict())


@pytest.fixture(scope="module")
def lora_results() -> list[dict[str, object]]:
    return run_distributed(lora_parity, TP)


def test_nxd_lora_matches_unsharded_adapter(lora_results: list[dict[str, object]]) -> None:
    adapter_keys = sorted(
        f"{m}.lora_{ab}.weight" for m in ("q_proj", "v_proj", "o_proj") for ab in "AB"
    )
    for result in lora_results:
        assert [k for k in result["keys"] if k != "lora_config"] == adapter_keys


def test_nxd_lora_gqa_adapter_keys(lora_results: list[dict[str, object]]) -> None:
    want = ["qkv_proj.lora_A.weight"] + [f"qkv_proj.lora_B.weight_{p}" for p in "kqv"]
    for result in lora_results:
        assert [k for k in result["gqa_keys"] if k != "lora_config"] == sorted(want)


def _lora_on_an_nxd_model() -> list[str]:
    import neuronx_distributed as nxd
    from neuronx_distributed.modules.lora import LoraConfig, get_lora_model
    from nxd_trainer.testing import TinyLM

    config = nxd.neuronx_distributed_config(tensor_parallel_size=2)
    model = nxd.initialize_parallel_model(config, TinyLM)
    wrapped = get_lora_model(model, LoraConfig(enable_lora=True, target_modules=["q_proj"]))
    assert wrapped is model  # NxD keeps the NxDModel and puts LoRA on what it wraps
    return model.module.lora_module_names


def test_get_lora_model_wraps_the_module_inside_an_nxd_model() -> None:
    names = run_distributed(_lora_on_an_nxd_model, 2)
    assert names[0] == names[1]
    assert names[0]
    assert all(name.endswith("q_proj") for name in names[0])
