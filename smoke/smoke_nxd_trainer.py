"""nxd-trainer installed alone (no extra): NxD's training API in a world of one (config, model
and optimizer wrappers, two steps, a checkpoint saved and loaded back)."""

import os
import sys
import tempfile

import torch
import torch.distributed as dist

import nxd_state
import nxd_trainer as nxd
from nxd_trainer.testing import TinyLM


def get_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return TinyLM(vocab=64, hidden=16, layers=2, heads=4)


def main() -> None:
    for key in ("WORLD_SIZE", "RANK", "LOCAL_RANK"):
        os.environ.pop(key, None)
    nxd_state.init_distributed(device_type="cpu")
    config = nxd.neuronx_distributed_config(
        tensor_parallel_size=1, optimizer_config={"grad_clipping": True, "max_grad_norm": 1.0}
    )
    model = nxd.initialize_parallel_model(config, get_model)
    optimizer = nxd.initialize_parallel_optimizer(
        config, torch.optim.AdamW, model.parameters(), lr=1e-2
    )
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(1))
    losses = []
    for _ in range(2):
        losses.append(model.run_train(input_ids=ids, labels=ids).item())
        optimizer.step()
        optimizer.zero_grad()
    assert losses[1] < losses[0], losses
    with tempfile.TemporaryDirectory() as folder:
        nxd.save_checkpoint(
            folder, "step2", model=model, optimizer=optimizer, user_content={"s": 2}
        )
        trained = {name: p.detach().clone() for name, p in model.named_parameters()}
        fresh = nxd.initialize_parallel_model(config, get_model)
        fresh_optimizer = nxd.initialize_parallel_optimizer(
            config, torch.optim.AdamW, fresh.parameters(), lr=1e-2
        )
        content = nxd.load_checkpoint(folder, model=fresh, optimizer=fresh_optimizer)
        assert content == {"s": 2}, content
    for name, param in fresh.named_parameters():
        torch.testing.assert_close(param.detach(), trained[name], rtol=0, atol=0, msg=name)
    nxd_state.destroy_model_parallel()
    dist.destroy_process_group()
    print("nxd-trainer smoke: ok", file=sys.stderr)


if __name__ == "__main__":
    main()
