"""nxd-optim installed alone: a ZeRO-1 AdamW step in a world of one equals torch's AdamW, and
its sharded state (safetensors, which needs numpy) saves and loads back."""

import copy
import math
import os
import sys
import tempfile

import torch
import torch.distributed as dist

import nxd_state
from nxd_optim import NeuronZero1Optimizer

# The same AdamW arithmetic on a flat fp32 buffer instead of per tensor: elementwise ops, so any
# difference is a kernel's rounding (~1 ulp of values O(0.1)); a wrong step differs by ~lr.
TOL = {"rtol": 1e-6, "atol": 1e-7}


def main() -> None:
    for key in ("WORLD_SIZE", "RANK", "LOCAL_RANK"):
        os.environ.pop(key, None)
    nxd_state.init_distributed(device_type="cpu")
    nxd_state.initialize_model_parallel(tensor_model_parallel_size=1)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    reference = copy.deepcopy(model)
    zero1 = NeuronZero1Optimizer(model.parameters(), torch.optim.AdamW, lr=1e-2, max_norm=math.inf)
    plain = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(1))
    for _ in range(2):
        for net, optimizer in ((model, zero1), (reference, plain)):
            optimizer.zero_grad()
            net(x).square().mean().backward()
            optimizer.step()
    for (name, param), ref in zip(model.named_parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(param, ref, **TOL, msg=name)
    assert zero1.grad_norm is not None
    assert zero1.grad_norm > 0

    with tempfile.TemporaryDirectory() as folder:
        zero1.save_sharded_state_dict(folder)
        again = NeuronZero1Optimizer(model.parameters(), torch.optim.AdamW, lr=1e-2)
        again.load_sharded_state_dict(folder)
    saved, loaded = zero1.state_dict(), again.state_dict()
    torch.testing.assert_close(loaded["state"], saved["state"], rtol=0, atol=0)
    nxd_state.destroy_model_parallel()
    dist.destroy_process_group()
    print("nxd-optim smoke: ok", file=sys.stderr)


if __name__ == "__main__":
    main()
