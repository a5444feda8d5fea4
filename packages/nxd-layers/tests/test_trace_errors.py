"""The trace API's failure behaviour: bad arguments raise in the caller before any worker
starts; what a worker finds wrong (func's result, layers built for another TP degree) comes
back as a WorkerError naming the rank; a worker killed mid-call raises WorkerDiedError within
a bound instead of hanging, and ends the other workers; a save folder missing a rank, or an
archive holding pickled data, is refused before loading.
"""

from __future__ import annotations

import os
import shutil
import signal
import threading
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn

from nxd_layers import ColumnParallelLinear, RowParallelLinear
from nxd_layers.trace import (
    WorkerDiedError,
    WorkerError,
    parallel_model_load,
    parallel_model_save,
    parallel_model_trace,
)

X = torch.randn(2, 4, 16, generator=torch.Generator().manual_seed(0))
BOUND_S = 120.0  # an error must arrive well within this on a loaded 2-core machine


class Mlp(nn.Module):
    """Column -> ReLU -> Row, with ``rounds`` extra matmuls to make a call last a while."""

    def __init__(self, rounds: int = 0, group: dist.ProcessGroup | None = None) -> None:
        super().__init__()
        self.up = ColumnParallelLinear(16, 32, gather_output=False, tensor_parallel_group=group)
        self.down = RowParallelLinear(32, 16, input_is_parallel=True, tensor_parallel_group=group)
        self.spin = nn.Parameter(torch.eye(256) * 0.5)
        self.rounds = rounds

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.down(self.up(x).relu())
        h = torch.ones(256, 256)
        for _ in range(self.rounds):  # captured as `rounds` matmuls
            h = torch.tanh(h @ self.spin)
        return y + h.mean()


def mlp() -> tuple[nn.Module, None]:
    return Mlp(), None


def slow_mlp() -> tuple[nn.Module, None]:
    return Mlp(rounds=400), None


def mlp_no_aliases() -> tuple[nn.Module, dict]:
    """NxD's ``get_model``: ``(model, input_output_alias)`` with no aliases."""
    return Mlp(), {}


def returns_an_int() -> tuple[int, None]:
    return 42, None


def returns_aliases() -> tuple[nn.Module, dict]:
    """NxD's ``input_output_alias`` with an entry (a parameter aliased to output 1)."""
    model = Mlp()
    return model, {next(model.parameters()): 1}


def returns_bare_module() -> nn.Module:
    return Mlp()


def built_for_one_rank() -> tuple[nn.Module, None]:
    """Layers sharded over a group of one rank, traced with tp_degree=2."""
    singles = [dist.new_group([r]) for r in range(dist.get_world_size())]
    return Mlp(group=singles[dist.get_rank()]), None


def dies_on_rank_1() -> tuple[nn.Module, None]:
    if dist.get_rank() == 1:
        os._exit(3)
    return Mlp(), None


def _gone(pid: int, wait_s: float = 30.0) -> bool:
    """Whether process ``pid`` ended (or is a zombie) within ``wait_s``."""
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        status = Path(f"/proc/{pid}/status")
        if status.exists() and "State:\tZ" in status.read_text():
            return True
        time.sleep(0.2)
    return False


def test_bad_arguments_raise_before_any_worker() -> None:
    with pytest.raises(ValueError, match="module-level function"):
        parallel_model_trace(lambda: (Mlp(), None), X, tp_degree=2)
    with pytest.raises(ValueError, match="tp_degree must be a positive int, got 0"):
        parallel_model_trace(mlp, X, tp_degree=0)
    with pytest.raises(ValueError, match="max_parallel_compilations must be None or a positive"):
        parallel_model_trace(mlp, X, tp_degree=2, max_parallel_compilations=0)
    with pytest.raises(ValueError, match="example_inputs must be a tensor or a tuple/list"):
        parallel_model_trace(mlp, 42, tp_degree=2)
    with pytest.raises(ValueError, match=r"compiler_args has unknown keys \['opt'\]"):
        parallel_model_trace(mlp, X, tp_degree=2, compiler_args={"opt": 3})
    with pytest.raises(ValueError, match="parallel_model_save takes the TensorParallelModel"):
        parallel_model_save(nn.Linear(2, 2), "unused")


def test_nxd_get_model_and_compiler_flags_run_on_the_portable_route(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """``(model, {})`` (NxD's empty input_output_alias) loads nothing, and neuronx-cc flags
    in ``compiler_args`` are ignored with a warning instead of needing torch-neuronx: the
    program equals the one traced from ``(model, None)`` without flags (same seed, same
    kernels: exact)."""
    with caplog.at_level("WARNING", logger="nxd_layers.trace._api"):
        nxd_style = parallel_model_trace(
            mlp_no_aliases, X, tp_degree=2, compiler_args="--model-type=transformer -O1"
        )
    assert "neuronx-cc flags: ignored" in caplog.text
    assert "--model-type=transformer" in caplog.text
    plain = parallel_model_trace(mlp, X, tp_degree=2)
    try:
        torch.testing.assert_close(nxd_style(X), plain(X), rtol=0, atol=0)
    finally:
        nxd_style.close()
        plain.close()


@pytest.mark.parametrize(
    ("func", "error", "message"),
    [
        (returns_an_int, WorkerError, "model a torch.nn.Module, got int"),
        (returns_bare_module, WorkerError, "must return (model, input_output_alias)"),
        (returns_aliases, WorkerError, "non-empty input_output_alias map"),
        (built_for_one_rank, WorkerError, "sharded over 1 rank(s), but tp_degree=2"),
        (dies_on_rank_1, WorkerDiedError, "TP worker rank 1"),
    ],
)
def test_func_errors_come_back_from_the_workers(func: object, error: type, message: str) -> None:
    start = time.monotonic()
    with pytest.raises(error) as info:
        parallel_model_trace(func, X, tp_degree=2)
    assert message in str(info.value)
    assert time.monotonic() - start < BOUND_S


def _call_until_error(model: object, start: float) -> None:
    while time.monotonic() - start < BOUND_S:  # the kill lands during one of these calls
        model(X)  # type: ignore[operator]


def test_worker_killed_mid_call_raises_instead_of_hanging() -> None:
    """SIGKILL rank 1 while calls run: the pending call raises WorkerDiedError (the pipe of the
    dead worker closes), rank 0 is ended too, and the model refuses further calls."""
    model = parallel_model_trace(slow_mlp, X, tp_degree=2)
    try:
        model(X)  # a complete call first
        pids = list(model._pool._pids)
        timer = threading.Timer(0.3, os.kill, (pids[1], signal.SIGKILL))
        start = time.monotonic()
        timer.start()
        with pytest.raises(WorkerDiedError, match="died") as info:
            _call_until_error(model, start)
        assert info.value.rank in (0, 1)
        assert time.monotonic() - start < BOUND_S
        assert all(_gone(pid) for pid in pids)
        with pytest.raises(RuntimeError, match="gone after an earlier failure"):
            model(X)
    finally:
        timer.cancel()
        model.close()


def test_save_folder_checks(tmp_path: Path) -> None:
    """A folder missing a rank's program, or holding a pickled archive, is refused before a
    worker starts; the complete folder loads and runs."""
    with parallel_model_trace(mlp, X, tp_degree=2) as model:
        expected = model(X)
        parallel_model_save(model, tmp_path / "ok")
    missing = tmp_path / "missing"
    shutil.copytree(tmp_path / "ok", missing)
    (missing / "tp_1.pt2").unlink()
    with pytest.raises(FileNotFoundError, match=r"rank 1 of tp_degree=2 is missing \['tp_1.pt2'\]"):
        parallel_model_load(missing)
    with pytest.raises(FileNotFoundError, match=r"has no manifest\.json"):
        parallel_model_load(tmp_path)
    pickled = tmp_path / "pickled"
    shutil.copytree(tmp_path / "ok", pickled)
    program = torch.export.export(nn.Linear(2, 2), (torch.ones(1, 2),))  # keeps sample inputs
    torch.export.save(program, str(pickled / "tp_0.pt2"))
    with pytest.raises(ValueError, match=r"refusing to load .*tp_0\.pt2: .*pickled sample inputs"):
        parallel_model_load(pickled)
    with parallel_model_load(tmp_path / "ok") as loaded:
        torch.testing.assert_close(loaded(X), expected, rtol=0, atol=0)  # the same program
