"""Device/backend selection, init_distributed in both launch modes, move_model_to_device."""

import os
import socket
import sys
import types

import pytest
import torch
import torch.distributed as dist
from torch import nn

from nxd_state import (
    backend_for,
    current_device,
    get_local_world_size,
    init_distributed,
    is_cpu_mode,
    mark_step,
    move_model_to_device,
    resolve_device_type,
)
from nxd_state.device import xla_version_mismatch
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


def device_after_init_on_a_gpu_machine() -> dict[str, str]:
    """In a rank: a job that asked for the CPU on a machine showing a GPU and PJRT_DEVICE."""
    import nxd_state

    dist.destroy_process_group()  # the harness's group; the job makes its own
    for key in ("WORLD_SIZE", "RANK", "LOCAL_RANK"):
        os.environ.pop(key, None)
    torch.cuda.is_available = lambda: True  # this rank's process only
    os.environ.update(NXD_DEVICE="cuda", PJRT_DEVICE="CPU")
    init_distributed(device_type="cpu")
    seen = {
        "resolved": resolve_device_type(),
        "current": str(current_device()),
        "tracker": nxd_state.get_rng_tracker().device_type,
        "cpu_mode": str(is_cpu_mode()),
        "argument": resolve_device_type("xla"),  # an explicit argument still wins
    }
    dist.destroy_process_group()
    seen["after_destroy"] = resolve_device_type()  # the environment again
    init_distributed(device_type="cpu")  # the harness ends with a barrier on the default group
    return seen


def test_the_device_init_distributed_chose_sticks_to_the_process() -> None:
    # Without it: "cuda" everywhere (NXD_DEVICE and the visible GPU) while the job runs gloo on
    # the CPU, its RNG tracker forking the GPU's generator.
    assert run_distributed(device_after_init_on_a_gpu_machine, 1) == [
        {
            "resolved": "cpu",
            "current": "cpu",
            "tracker": "cpu",
            "cpu_mode": "True",
            "argument": "xla",
            "after_destroy": "cuda",
        }
    ]


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


# NxD's device helpers: cpu mode, mark_step, local world size -----------------------------------
@pytest.fixture
def plain_env(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    for key in ("NXD_DEVICE", "NXD_CPU_MODE", "PJRT_DEVICE", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(key, raising=False)
    return monkeypatch


def test_nxd_cpu_mode_forces_the_cpu(plain_env: pytest.MonkeyPatch) -> None:
    plain_env.setenv("PJRT_DEVICE", "CPU")  # would select xla
    assert not is_cpu_mode()
    plain_env.setenv("NXD_CPU_MODE", "1")
    assert resolve_device_type() == "cpu"
    assert is_cpu_mode()
    assert resolve_device_type("xla") == "xla"  # an explicit argument still wins
    plain_env.setenv("NXD_CPU_MODE", "0")
    assert resolve_device_type() == "xla"


@pytest.mark.skipif(torch.cuda.is_available(), reason="with a GPU the default device is cuda")
def test_cpu_mode_without_the_variable_on_a_cpu_only_machine(
    plain_env: pytest.MonkeyPatch,
) -> None:
    assert is_cpu_mode()


def test_cpu_mode_conflicts_and_bad_values_are_clear(plain_env: pytest.MonkeyPatch) -> None:
    plain_env.setenv("NXD_CPU_MODE", "1")
    plain_env.setenv("NXD_DEVICE", "xla")
    with pytest.raises(ValueError, match=r"NXD_CPU_MODE=1 asks for the CPU but NXD_DEVICE='xla'"):
        is_cpu_mode()
    plain_env.setenv("NXD_DEVICE", "cpu")
    assert is_cpu_mode()
    plain_env.delenv("NXD_DEVICE")
    plain_env.setenv("NXD_CPU_MODE", "yes")
    with pytest.raises(ValueError, match=r"NXD_CPU_MODE must be an integer .* got 'yes'"):
        is_cpu_mode()


class FakeTorchXla(types.ModuleType):
    """Stands in for torch_xla: records the graph cuts mark_step asks for."""

    def __init__(self, with_sync: bool) -> None:
        super().__init__("torch_xla")
        self.cuts: list[str] = []
        if with_sync:
            self.sync = lambda: self.cuts.append("torch_xla.sync")


def test_mark_step_is_a_no_op_off_xla(plain_env: pytest.MonkeyPatch) -> None:
    fake = FakeTorchXla(with_sync=True)
    plain_env.setitem(sys.modules, "torch_xla", fake)
    plain_env.setenv("NXD_DEVICE", "cpu")
    mark_step()
    plain_env.setenv("NXD_DEVICE", "xla")
    plain_env.setenv("NXD_CPU_MODE", "0")
    mark_step("cpu")
    assert fake.cuts == []


def test_mark_step_cuts_the_graph_on_xla(plain_env: pytest.MonkeyPatch) -> None:
    plain_env.setenv("NXD_DEVICE", "xla")
    fake = FakeTorchXla(with_sync=True)
    plain_env.setitem(sys.modules, "torch_xla", fake)
    mark_step()
    assert fake.cuts == ["torch_xla.sync"]
    # A torch-xla without torch_xla.sync: xla_model.mark_step.
    old = FakeTorchXla(with_sync=False)
    xla_model = types.ModuleType("torch_xla.core.xla_model")
    xla_model.mark_step = lambda: old.cuts.append("xm.mark_step")  # type: ignore[attr-defined]
    plain_env.setitem(sys.modules, "torch_xla", old)
    plain_env.setitem(sys.modules, "torch_xla.core", types.ModuleType("torch_xla.core"))
    plain_env.setitem(sys.modules, "torch_xla.core.xla_model", xla_model)
    mark_step()
    assert old.cuts == ["xm.mark_step"]


def test_local_world_size_from_torchrun_or_one(plain_env: pytest.MonkeyPatch) -> None:
    assert not dist.is_initialized()
    assert get_local_world_size() == 1
    plain_env.setenv("LOCAL_WORLD_SIZE", "3")
    assert get_local_world_size() == 3
    for bad in ("0", "four"):
        plain_env.setenv("LOCAL_WORLD_SIZE", bad)
        with pytest.raises(
            ValueError, match=rf"LOCAL_WORLD_SIZE must be a positive integer, got '{bad}'"
        ):
            get_local_world_size()


def local_world_sizes() -> tuple[int, int]:
    from_torchrun = get_local_world_size()  # the harness exports LOCAL_WORLD_SIZE as torchrun does
    os.environ.pop("LOCAL_WORLD_SIZE")
    return from_torchrun, get_local_world_size()


def test_local_world_size_falls_back_to_the_world_of_one_node() -> None:
    assert run_distributed(local_world_sizes, 2) == [(2, 2), (2, 2)]


@pytest.mark.parametrize(
    ("torch_version", "xla_version"),
    [("2.9.0", "2.9.0"), ("2.9.1+cpu", "2.9.0"), ("2.9.0+cu128", "2.9.0rc2"), ("2.9", "2.9.0")],
)
def test_torch_and_torch_xla_of_one_minor_agree(torch_version: str, xla_version: str) -> None:
    assert xla_version_mismatch(torch_version, xla_version) is None


def test_torch_xla_beside_another_torch_names_both_and_the_fix() -> None:
    message = xla_version_mismatch("2.15.0+cu130", "2.9.0")
    assert message == (
        "torch-xla 2.9.0 needs torch 2.9.x, but torch 2.15.0+cu130 is installed: "
        "pip install 'torch==2.9.*' (or install 'nxd-state[xla]', which pins both)"
    )
    assert "\n" not in message
    # a minor of 10 is not 1.0 (numbers, not strings, are compared)
    assert xla_version_mismatch("2.1.0", "2.10.0") is not None


def test_unreadable_versions_are_not_refused() -> None:
    """Only a pair known to disagree is refused: no guess on a version that does not parse."""
    assert xla_version_mismatch("main", "2.9.0") is None
    assert xla_version_mismatch("2.15.0", "nightly") is None


def test_choosing_xla_beside_a_mismatched_torch_refuses_before_importing_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The installed versions are read from metadata; torch_xla, whose import would die on an
    undefined symbol, is never imported."""
    import importlib
    import importlib.metadata

    real_version, real_import = importlib.metadata.version, importlib.import_module

    def version(name: str) -> str:
        return "2.9.0" if name == "torch-xla" else real_version(name)

    def import_module(name: str, package: str | None = None) -> types.ModuleType:
        assert not name.startswith("torch_xla"), f"{name} imported"
        return real_import(name, package)

    monkeypatch.setattr(importlib.metadata, "version", version)
    monkeypatch.setattr(importlib, "import_module", import_module)
    monkeypatch.setattr(torch, "__version__", "2.15.0")
    with pytest.raises(
        ImportError, match=r"^torch-xla 2\.9\.0 needs torch 2\.9\.x, but torch 2\.15"
    ):
        current_device("xla")
