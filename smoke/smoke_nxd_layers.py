"""nxd-layers installed alone: TP=1 parallel layers against torch, and a traced model saved,
loaded and run on CPU (the trace writes its weights with safetensors, which needs numpy)."""

import os
import sys
import tempfile

import torch
import torch.distributed as dist
import torch.nn.functional as F

import nxd_state
from nxd_layers import ColumnParallelLinear, RowParallelLinear, clip_grad_norm
from nxd_layers.trace import parallel_model_load, parallel_model_save, parallel_model_trace


class Mlp(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = ColumnParallelLinear(8, 16, gather_output=False)
        self.down = RowParallelLinear(16, 8, input_is_parallel=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.relu(self.up(x)))


def get_model() -> tuple[torch.nn.Module, None]:
    """``func`` of the trace: every worker builds the model from seed 0."""
    torch.manual_seed(0)
    return Mlp(), None


def main() -> None:
    for key in ("WORLD_SIZE", "RANK", "LOCAL_RANK"):
        os.environ.pop(key, None)
    nxd_state.init_distributed(device_type="cpu")
    nxd_state.initialize_model_parallel(tensor_model_parallel_size=1)
    model, _ = get_model()
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(1))
    up, down = model.up, model.down
    expected = F.linear(torch.relu(F.linear(x, up.weight, up.bias)), down.weight, down.bias)
    out = model(x)
    # at TP=1 each layer is one F.linear: the same kernels in the same order, so equal exactly
    torch.testing.assert_close(out, expected, rtol=0, atol=0)
    out.sum().backward()
    assert clip_grad_norm(model.parameters(), max_norm=1.0) > 0
    with torch.no_grad():
        eager = model(x)
    nxd_state.destroy_model_parallel()
    dist.destroy_process_group()

    traced = parallel_model_trace(get_model, x, tp_degree=1, inline_weights_to_neff=False)
    with tempfile.TemporaryDirectory() as folder:
        try:
            torch.testing.assert_close(traced(x), eager, rtol=0, atol=0)  # the same graph
            parallel_model_save(traced, folder)
        finally:
            traced.close()
        assert os.path.exists(os.path.join(folder, "tp_0.safetensors")), os.listdir(folder)
        with parallel_model_load(folder) as loaded:
            torch.testing.assert_close(loaded(x), eager, rtol=0, atol=0)
    print("nxd-layers smoke: ok", file=sys.stderr)


if __name__ == "__main__":
    main()
