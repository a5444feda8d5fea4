"""Device/backend selection, init_distributed in both launch modes, move_model_to_device."""

import os
import socket

import pytest
import torch
import torch.distributed as dist
from torch import nn

from nxd_state import (
    backend_for,
    current_device,
    init_distributed,
    move_model_to_device,
    resolve_device_type,
)
from nxd_state.testing import run_distributed


def test_argument_beats_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NXD_DEVICE", "xla")
    assert resolve_device_type("cpu") == "cpu"
    assert resolve_device_type() == "xla"
    monkeypatch.delenv("NXD_DEVICE")
    monkeypatch.setenv("PJRT_DEVICE", "CPU")
    assert resolve_device_type() == "xla"
    monkeypatch.delenv("PJRT_DEVICE")
    assert resolve_device_type() == ("cuda" if torch.cuda.is_available() else "cpu")


def test_backends_per_device() -> None:
    assert backend_for("cpu") == "gloo"
    assert backend_for("xla") == "xla"
    assert current_device("cpu") == torch.device("cpu")


def test_unknown_device_type_names_the_choices(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NXD_DEVICE", "tpu9")
    with pytest.raises(
        ValueError,
        match=r"device type 'tpu9' is not supported; expected one of \['cpu', 'cuda', 'xla'\]",
    ):
        resolve_device_type()


@pytest.mark.skipif(
    torch.cuda.is_available(), reason="checks the error raised when no GPU is visible"
)
def test_cuda_without_gpu_is_a_clear_error() -> None:
    with pytest.raises(RuntimeError, match=r"torch\.cuda\.is_available\(\) is False"):
        resolve_device_type("cuda")


def reinit(mode: str, port: int) -> tuple[int, int, str]:
    """Tear down the harness's group, then initialise as a user script would."""
    dist.destroy_process_group()
    if mode == "single":
        for key in ("WORLD_SIZE", "RANK", "LOCAL_RANK"):
            os.environ.pop(key, None)
    else:  # torchrun sets these; RANK/WORLD_SIZE are already in the rank's environment
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    init_distributed(device_type="cpu")
    init_distributed(device_type="cpu")  # a second call is a no-op
    value = torch.ones(1)
    dist.all_reduce(value)
    return dist.get_rank(), dist.get_world_size(), f"{dist.get_backend()}:{value.item():.0f}"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_init_distributed_env_and_single_process() -> None:
    assert run_distributed(reinit, 2, "env", free_port()) == [(0, 2, "gloo:2"), (1, 2, "gloo:2")]
    assert run_distributed(reinit, 1, "single", 0) == [(0, 1, "gloo:1")]


def test_move_model_to_device_keeps_parallel_attributes() -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    model[0].weight.tensor_model_parallel = True
    model[0].weight.partition_dim = 0
    previous = torch.__future__.get_overwrite_module_params_on_conversion()
    torch.__future__.set_overwrite_module_params_on_conversion(True)  # .to() swaps Parameters
    try:
        moved = move_model_to_device(model, torch.device("meta"))
    finally:
        torch.__future__.set_overwrite_module_params_on_conversion(previous)
    assert moved[0].weight.device.type == "meta"
    assert moved[0].weight.tensor_model_parallel is True
    assert moved[0].weight.partition_dim == 0
    assert not hasattr(moved[1].weight, "tensor_model_parallel")
