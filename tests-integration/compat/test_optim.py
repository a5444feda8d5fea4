"""NxD's import path for ZeRO-1 resolves to nxd_optim and matches one process (gloo, DP=2)."""

import copy

import torch
from torch import nn

from nxd_state.testing import run_distributed


def _grouped(model: nn.Module) -> list[dict]:
    no_decay = ["bias", "1."]
    named = list(model.named_parameters())
    return [
        {
            "params": [p for n, p in named if not any(d in n for d in no_decay)],
            "weight_decay": 0.01,
        },
        {"params": [p for n, p in named if any(d in n for d in no_decay)], "weight_decay": 0.0},
    ]


def nxd_script_zero1() -> list[float]:
    from neuronx_distributed import parallel_state
    from neuronx_distributed.optimizer import NeuronZero1Optimizer

    parallel_state.initialize_model_parallel(tensor_model_parallel_size=1)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 6), nn.LayerNorm(6))
    reference = copy.deepcopy(model)
    optimizer = NeuronZero1Optimizer(  # the arguments of the NxD documentation's example
        _grouped(model),
        torch.optim.AdamW,
        lr=1e-2,
        pin_layout=False,
        sharding_groups=parallel_state.get_data_parallel_group(as_list=True),
        grad_norm_groups=parallel_state.get_tensor_model_parallel_group(as_list=True),
    )
    rank = parallel_state.get_data_parallel_rank()
    x = torch.randn(4, 4, generator=torch.Generator().manual_seed(1))
    model(x[rank * 2 : rank * 2 + 2]).pow(2).mean().backward()
    optimizer.step()
    # the same step in one process: whole batch, clip to 1.0 (the torch-xla default), AdamW
    ref_optimizer = torch.optim.AdamW(_grouped(reference), lr=1e-2)
    reference(x).pow(2).mean().backward()
    ref_norm = torch.nn.utils.clip_grad_norm_(reference.parameters(), 1.0)
    ref_optimizer.step()
    for p, q in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)  # fp32 re-association only
    return [float(optimizer.grad_norm), float(ref_norm)]


def test_nxd_zero1_import_path_matches_one_process() -> None:
    results = run_distributed(nxd_script_zero1, 2)
    norm, ref_norm = results[0]
    assert results[0] == results[1]
    assert abs(norm - ref_norm) <= 1e-5 * ref_norm  # same gradient, summed in another order
