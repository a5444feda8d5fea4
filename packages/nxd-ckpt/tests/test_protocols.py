"""The checkpoint protocols of :mod:`nxd_state.shards` that nxd-ckpt checks for schedulers
and for an optimizer wrapper stepping fp32 masters: an object implementing them is saved and
loaded through them, whatever its class.

* ``JsonCheckpointState``: a user schedule with ``checkpoint_json`` / ``load_checkpoint_json``
  (and no ``state_dict``) round-trips, its class name recorded; torch's ``LRScheduler`` goes
  through the one adapter (``json_checkpoint_state``); an object with neither is refused.
* ``MasterWeightsState``: ``NxDOptimizer`` without ZeRO-1 implements it (declared), and
  nxd-ckpt reads its masters through it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from nxd_ckpt import load_checkpoint, save_checkpoint
from nxd_state.shards import JsonCheckpointState, MasterWeightsState, json_checkpoint_state
from nxd_state.testing import run_distributed


class WarmupSchedule:
    """lr = peak · min(1, (t + 1) / warmup): a user schedule with JSON checkpoint state."""

    def __init__(self, optimizer: torch.optim.Optimizer, peak: float, warmup: int) -> None:
        self.optimizer, self.peak, self.warmup = optimizer, peak, warmup
        self.t = 0
        self.history = torch.zeros(0)

    def step(self) -> None:
        self.t += 1
        lr = self.peak * min(1.0, (self.t + 1) / self.warmup)
        self.history = torch.cat([self.history, torch.tensor([lr])])
        for group in self.optimizer.param_groups:
            group["lr"] = lr

    def checkpoint_json(self) -> dict[str, Any]:
        return {"t": self.t, "peak": self.peak, "warmup": self.warmup, "history": self.history}

    def load_checkpoint_json(self, state: dict[str, Any]) -> None:
        self.t, self.peak, self.warmup = state["t"], state["peak"], state["warmup"]
        self.history = state["history"].clone()


def _model_and_schedule(seed: int) -> tuple[nn.Module, torch.optim.Optimizer, WarmupSchedule]:
    torch.manual_seed(seed)
    model = nn.Linear(4, 3)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    return model, optimizer, WarmupSchedule(optimizer, peak=0.1 * (seed + 1), warmup=10)


def test_a_user_scheduler_with_the_protocol_round_trips(tmp_path: Path) -> None:
    model, optimizer, schedule = _model_and_schedule(seed=0)
    assert isinstance(schedule, JsonCheckpointState)
    assert json_checkpoint_state(schedule) is schedule  # no adapter: the object itself
    for _ in range(3):
        schedule.step()
    save_checkpoint(tmp_path, "t3", model=model, optimizer=optimizer, scheduler=schedule)
    index = json.loads((tmp_path / "t3" / "index.json").read_text())
    assert index["scheduler_class"] == "WarmupSchedule"

    model2, optimizer2, schedule2 = _model_and_schedule(seed=1)
    load_checkpoint(tmp_path, "t3", model=model2, optimizer=optimizer2, scheduler=schedule2)
    assert (schedule2.t, schedule2.peak, schedule2.warmup) == (3, schedule.peak, 10)
    assert torch.equal(schedule2.history, schedule.history)
    schedule.step()
    schedule2.step()
    assert optimizer2.param_groups[0]["lr"] == optimizer.param_groups[0]["lr"]


def test_torch_schedulers_go_through_the_state_dict_adapter(tmp_path: Path) -> None:
    model = nn.Linear(4, 3)
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    adapted = json_checkpoint_state(scheduler)
    assert not isinstance(scheduler, JsonCheckpointState)
    assert isinstance(adapted, JsonCheckpointState)
    assert adapted.checkpoint_json() == scheduler.state_dict()


def test_an_object_without_checkpoint_state_is_refused(tmp_path: Path) -> None:
    model = nn.Linear(4, 3)
    with pytest.raises(TypeError, match="object has no checkpoint state"):
        save_checkpoint(tmp_path, "x", model=model, scheduler=object())
    assert not (tmp_path / "x" / "index.json").exists()
    save_checkpoint(tmp_path, "y", model=model, scheduler=WarmupSchedule(None, 1.0, 2))  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="object has no checkpoint state"):
        load_checkpoint(tmp_path, "y", model=model, scheduler=object())


def non_zero1_masters() -> None:
    import nxd_state
    from nxd_ckpt.layout._context import current_context
    from nxd_ckpt.layout._optim_common import resolve_optimizer
    from nxd_layers import ColumnParallelLinear
    from nxd_optim import NxDOptimizer, build_optimizer

    nxd_state.initialize_model_parallel(tensor_model_parallel_size=1)
    model = nn.Sequential(ColumnParallelLinear(8, 16, dtype=torch.bfloat16), nn.LayerNorm(16))
    optimizer = build_optimizer(
        {"zero_one_enabled": False, "grad_clipping": False},
        torch.optim.AdamW,
        model.parameters(),
        mixed_precision_config={"use_master_weights": True, "use_master_weights_in_ckpt": True},
        lr=1e-2,
    )
    assert issubclass(NxDOptimizer, MasterWeightsState)  # declared, not only structural
    assert isinstance(optimizer, MasterWeightsState)
    layout = optimizer.master_checkpoint_layout()
    assert layout.inner is optimizer.optimizer
    assert layout.masters_in_checkpoint
    assert set(layout.masters) == {p for p in model.parameters() if p.dtype == torch.bfloat16}
    view = resolve_optimizer(optimizer, model, current_context())
    assert view.kind == "plain"
    assert view.optimizer is optimizer
    assert view.inner is layout.inner
    assert view.masters_in_ckpt
    assert view.model_param == {id(m): p for p, m in layout.masters.items()}


def test_nxd_optimizer_without_zero1_is_recognised_by_the_protocol() -> None:
    run_distributed(non_zero1_masters, 1)
