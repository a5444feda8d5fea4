"""The reference's sample on one XLA device (torch-xla's CPU client, world 1): config, TP
layers at TP=1, the optimizer wrapper with ZeRO-1, activation checkpointing, run_train.

Losses must equal the one-process CPU run of the same recipe: XLA compiles the step into
fused kernels whose fp32 sums are ordered differently, round-off only (``_recipe.TOL``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from nxd_state.testing import load_sibling

pytestmark = pytest.mark.xla


R = load_sibling(__file__, "_recipe")


@pytest.fixture
def xla_world(monkeypatch: pytest.MonkeyPatch) -> Any:
    import torch.distributed as dist

    import nxd_state

    for key in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("NXD_DEVICE", "xla")
    yield
    nxd_state.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()


@pytest.mark.parametrize("checkpointing", [None, "full"])
def test_sample_on_xla_equals_cpu(xla_world: None, checkpointing: str | None) -> None:
    import torch_xla

    import nxd_state
    import nxd_trainer as nxd
    from nxd_trainer.testing import Block

    nxd_config = nxd.neuronx_distributed_config(
        pipeline_config={"transformer_layer_cls": Block},
        optimizer_config={"zero_one_enabled": True, "max_grad_norm": R.MAX_GRAD_NORM},
        activation_checkpoint_config=checkpointing,
    )
    model = nxd.initialize_parallel_model(nxd_config, R.get_model, tensor_parallel=True)
    device = nxd_state.current_device()
    assert device.type == "xla"
    assert {p.device.type for p in model.parameters()} == {"xla"}
    optimizer = nxd.initialize_parallel_optimizer(
        nxd_config, torch.optim.AdamW, model.parameters(), **R.ADAMW
    )
    losses = []
    for ids in R.batches():
        ids = ids.to(device)
        loss = model.run_train(ids, ids)
        optimizer.step()
        optimizer.zero_grad()
        torch_xla.sync()
        losses.append(float(loss.cpu()))
    expected = R.reference_run()
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(expected["losses"]), **R.TOL)
    for name, param in model.named_parameters():
        torch.testing.assert_close(param.cpu(), expected["params"][name], **R.TOL, msg=name)


def _xla_job(ckpt: Path, steps: range, zero1: bool) -> tuple[list[float], dict[str, torch.Tensor]]:
    """The sample on the XLA device with auto-resume and a checkpoint after every step."""
    import torch_xla

    import nxd_state
    import nxd_trainer as nxd

    nxd_state.destroy_model_parallel()
    nxd_config = nxd.neuronx_distributed_config(
        optimizer_config={"zero_one_enabled": zero1, "max_grad_norm": R.MAX_GRAD_NORM},
    )
    model = nxd.initialize_parallel_model(nxd_config, R.get_model, tensor_parallel=True)
    optimizer = nxd.initialize_parallel_optimizer(
        nxd_config, torch.optim.AdamW, model.parameters(), **R.ADAMW
    )
    device = nxd_state.current_device()
    done = 0
    if nxd.has_checkpoint(ckpt):
        done = nxd.load_checkpoint(ckpt, model=model, optimizer=optimizer)["total_steps"]
    losses = []
    for step in steps:
        assert step == done, (step, done)
        ids = R.batches()[step].to(device)
        loss = model.run_train(ids, ids)
        optimizer.step()
        optimizer.zero_grad()
        torch_xla.sync()
        losses.append(float(loss.cpu()))
        done += 1
        nxd.save_checkpoint(
            ckpt,
            f"step_{done}",
            model=model,
            optimizer=optimizer,
            user_content={"total_steps": done},
        )
    return losses, {n: p.detach().cpu() for n, p in model.named_parameters()}


@pytest.mark.parametrize("zero1", [False, True], ids=["plain", "zero1"])
def test_checkpoint_round_trip_on_xla(xla_world: None, tmp_path: Path, zero1: bool) -> None:
    """Saved from the XLA device after step 1, loaded by a new model and optimizer: steps 2-3
    equal the uninterrupted XLA run exactly (the same compiled graphs on the same values)."""
    full, params = _xla_job(tmp_path / "full", range(R.STEPS), zero1)
    _xla_job(tmp_path / "resumed", range(1), zero1)
    resumed, resumed_params = _xla_job(tmp_path / "resumed", range(1, R.STEPS), zero1)
    assert resumed == full[1:]
    for name, value in params.items():
        torch.testing.assert_close(resumed_params[name], value, rtol=0, atol=0, msg=name)
