"""NxD's import path for LoRA resolves to nxd_lora, on TP=2 layers under a real process group."""

import torch

from nxd_state.testing import run_distributed


def nxd_script_lora() -> list[str]:
    from neuronx_distributed import parallel_state
    from neuronx_distributed.modules.lora import LoraConfig, LoRAModel
    from neuronx_distributed.modules.lora.model import LoraModel
    from nxd_layers import ColumnParallelLinear, RowParallelLinear

    parallel_state.initialize_model_parallel(tensor_model_parallel_size=2)
    torch.manual_seed(0)
    model = torch.nn.Sequential()
    model.add_module("up_proj", ColumnParallelLinear(8, 16, gather_output=False))
    model.add_module("down_proj", RowParallelLinear(16, 8, input_is_parallel=True))
    lora = LoRAModel(
        model,
        LoraConfig(enable_lora=True, lora_rank=2, lora_alpha=4, target_modules=["proj"]),
    )
    assert LoraModel is LoRAModel
    lora(torch.randn(3, 8)).sum().backward()
    return sorted(n for n, p in lora.module.named_parameters() if p.grad is not None)


def test_nxd_lora_import_path() -> None:
    expected = sorted(
        f"{layer}.lora_{ab}.weight" for layer in ("up_proj", "down_proj") for ab in "AB"
    )
    assert run_distributed(nxd_script_lora, 2) == [expected, expected]
