"""nxd-ckpt installed alone: a checkpoint saved by 2 TP ranks loads into one process (model,
optimizer and user content resharded), and the `nxd-ckpt` command verifies it."""

import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist

import nxd_ckpt
import nxd_state
from nxd_layers import ColumnParallelLinear, RowParallelLinear, full_tensor
from nxd_state.testing import run_distributed


def build() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    nxd_state.model_parallel_manual_seed(0)
    model = torch.nn.Sequential(
        ColumnParallelLinear(8, 16, gather_output=False),
        RowParallelLinear(16, 8, input_is_parallel=True),
    )
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def step(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(1))
    model(x).square().mean().backward()
    optimizer.step()


def save_at_tp2(folder: str) -> dict[str, torch.Tensor]:
    """On each of 2 ranks: train a step at TP=2, save; the full tensors, gathered."""
    nxd_state.initialize_model_parallel(tensor_model_parallel_size=2)
    model, optimizer = build()
    step(model, optimizer)
    nxd_ckpt.save_checkpoint(
        folder, "step1", model=model, optimizer=optimizer, user_content={"step": 1}
    )
    full = {}
    for name, param in model.named_parameters():
        full[name] = full_tensor(param)
        full[f"{name}.exp_avg"] = full_tensor(param, optimizer.state[param]["exp_avg"])
    return full


def main() -> None:
    with tempfile.TemporaryDirectory() as folder:
        expected = run_distributed(save_at_tp2, 2, folder)[0]
        for key in ("WORLD_SIZE", "RANK", "LOCAL_RANK"):
            os.environ.pop(key, None)
        nxd_state.init_distributed(device_type="cpu")
        nxd_state.initialize_model_parallel(tensor_model_parallel_size=1)
        model, optimizer = build()
        step(model, optimizer)  # state to overwrite
        content = nxd_ckpt.load_checkpoint(folder, model=model, optimizer=optimizer)
        assert content == {"step": 1}, content
        # stored values are copied bit for bit: the loaded tensors equal the gathered shards
        for name, param in model.named_parameters():
            torch.testing.assert_close(param.detach(), expected[name], rtol=0, atol=0)
            exp_avg = optimizer.state[param]["exp_avg"]
            torch.testing.assert_close(exp_avg, expected[f"{name}.exp_avg"], rtol=0, atol=0)
        command = Path(sys.executable).with_name("nxd-ckpt")
        info = subprocess.run(
            [str(command), "info", folder, "--verify"], capture_output=True, text=True, check=True
        )
        assert "step1" in info.stdout, info.stdout
    nxd_state.destroy_model_parallel()
    dist.destroy_process_group()
    print("nxd-ckpt smoke: ok", file=sys.stderr)


if __name__ == "__main__":
    main()
