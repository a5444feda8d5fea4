"""The reference's sample on one XLA device (torch-xla's CPU client, world 1): config, TP
layers at TP=1, the optimizer wrapper with ZeRO-1, activation checkpointing, run_train.

Losses must equal the one-process CPU run of the same recipe: XLA compiles the step into
fused kernels whose fp32 sums are ordered differently, round-off only (``_recipe.TOL``).
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

pytestmark = pytest.mark.xla


def _load_recipe() -> Any:
    name = "nxd_trainer_tests_recipe"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, Path(__file__).with_name("_recipe.py"))
        assert spec is not None
        assert spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


R = _load_recipe()


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
