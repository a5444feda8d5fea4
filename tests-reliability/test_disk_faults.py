"""A full disk (ENOSPC) or a read-only folder during a save, on 2 ranks at TP=2.

The fault is injected at the system-call wrappers of the rank processes (the machine cannot
mount a small tmpfs, and the tests run as root, for whom ``chmod`` blocks nothing):

* full disk: ``os.write`` raises ``OSError(ENOSPC)`` once the process has written a byte
  budget in the checkpoint folder, on one rank or on both (a shared filesystem fills for all);
* read-only: ``os.open`` for writing, ``os.mkdir``, ``os.rename``/``os.replace`` and
  ``open(..., "w")`` under the folder raise ``OSError(EROFS)`` on every rank.

Each case proves: the save raises on **every** rank (no rank left waiting for a peer's
manifest), with an ``OSError`` whose message says what failed (no space / read-only); no tag
of the failed save looks complete (no ``done``), and the previous tag still loads, with its
values, as the newest complete one.
"""

from __future__ import annotations

import builtins
import errno
import os
from pathlib import Path
from typing import Any

import pytest
import torch

from nxd_state.testing import run_distributed

TIMEOUT = 180.0  # harness deadline: a rank left waiting fails the test instead of hanging it


def _model(seed: int) -> torch.nn.Module:
    from nxd_layers import ColumnParallelLinear, RowParallelLinear

    torch.manual_seed(seed)
    return torch.nn.Sequential(
        ColumnParallelLinear(64, 128, gather_output=False),
        RowParallelLinear(128, 64, input_is_parallel=True),
    )


class _Faults:
    """Patches the process's write paths under ``root``; ``undo()`` restores them."""

    def __init__(self, root: str, kind: str, budget: int) -> None:
        self.root, self.kind, self.budget, self.written = os.path.realpath(root), kind, budget, 0
        self.fds: set[int] = set()
        self.saved = {
            "open": os.open,
            "write": os.write,
            "mkdir": os.mkdir,
            "rename": os.rename,
            "replace": os.replace,
            "builtin_open": builtins.open,
        }
        os.open = self._open  # type: ignore[assignment]
        os.write = self._write  # type: ignore[assignment]
        if kind == "readonly":
            os.mkdir = self._refuse("mkdir")  # type: ignore[assignment]
            os.rename = self._refuse("rename")  # type: ignore[assignment]
            os.replace = self._refuse("replace")  # type: ignore[assignment]
            builtins.open = self._builtin_open  # type: ignore[assignment]

    def _under(self, path: Any) -> bool:
        try:
            return os.path.realpath(os.fspath(path)).startswith(self.root)
        except TypeError:
            return False

    def _erofs(self, path: Any) -> OSError:
        return OSError(errno.EROFS, os.strerror(errno.EROFS), os.fspath(path))

    def _open(self, path: Any, flags: int, *args: Any, **kwargs: Any) -> int:
        writing = flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT)
        if self.kind == "readonly" and writing and self._under(path):
            raise self._erofs(path)
        fd = self.saved["open"](path, flags, *args, **kwargs)
        if writing and self._under(path):
            self.fds.add(fd)
        return fd

    def _write(self, fd: int, data: Any) -> int:
        if self.kind == "enospc" and fd in self.fds:
            if self.written + len(data) > self.budget:
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            self.written += len(data)
        return self.saved["write"](fd, data)

    def _refuse(self, name: str) -> Any:
        real = self.saved[name]

        def call(path: Any, *args: Any, **kwargs: Any) -> Any:
            if self._under(path):
                raise self._erofs(path)
            return real(path, *args, **kwargs)

        return call

    def _builtin_open(self, path: Any, mode: str = "r", *args: Any, **kwargs: Any) -> Any:
        if any(c in mode for c in "wax+") and self._under(path):
            raise self._erofs(path)
        return self.saved["builtin_open"](path, mode, *args, **kwargs)

    def undo(self) -> None:
        os.open, os.write = self.saved["open"], self.saved["write"]  # type: ignore[assignment]
        os.mkdir, os.rename = self.saved["mkdir"], self.saved["rename"]  # type: ignore[assignment]
        os.replace = self.saved["replace"]  # type: ignore[assignment]
        builtins.open = self.saved["builtin_open"]  # type: ignore[assignment]


def save_on_failing_disk(
    root: str, kind: str, fault_ranks: list[int], budget: int, async_save: bool
) -> dict[str, Any]:
    import torch.distributed as dist

    import nxd_ckpt
    import nxd_state

    nxd_state.initialize_model_parallel(tensor_model_parallel_size=2)
    good = _model(0)
    nxd_ckpt.save_checkpoint(root, "good", model=good, user_content={"step": 1})
    faults = _Faults(root, kind, budget) if dist.get_rank() in fault_ranks else None
    error: BaseException | None = None
    try:
        nxd_ckpt.save_checkpoint(
            root, "bad", model=_model(1), user_content={"step": 2}, async_save=async_save
        )
        nxd_ckpt.finalize_checkpoint()
    except Exception as caught:
        error = caught
    finally:
        if faults is not None:
            faults.undo()
    if error is None:
        raise AssertionError(f"rank {dist.get_rank()}: the save on a {kind} disk did not raise")
    complete = nxd_ckpt.has_checkpoint(root)
    loaded = _model(2)
    content = nxd_ckpt.load_checkpoint(root, model=loaded)  # tag=None: newest complete
    for (name, a), b in zip(good.state_dict().items(), loaded.state_dict().values()):
        assert torch.equal(a, b), name
    return {
        "type": type(error).__name__,
        "is_oserror": isinstance(error, OSError),
        "message": str(error),
        "chain": " <- ".join(
            str(e) for e in (error, error.__cause__, error.__context__) if e is not None
        ),
        "complete": complete,
        "step": content["step"],
    }


CASES = [
    pytest.param("enospc", [1], 1024, False, "No space left", id="enospc-rank1"),
    pytest.param("enospc", [0, 1], 1024, False, "No space left", id="enospc-all-ranks"),
    pytest.param("enospc", [0], 40_000, False, "No space left", id="enospc-rank0-late"),
    pytest.param("enospc", [1], 1024, True, "No space left", id="enospc-rank1-async"),
    pytest.param("readonly", [0, 1], 0, False, "Read-only file system", id="readonly"),
]


@pytest.mark.parametrize(("kind", "ranks", "budget", "async_save", "words"), CASES)
def test_failing_disk_is_an_error_on_every_rank_and_keeps_the_previous_tag(
    tmp_path: Path, kind: str, ranks: list[int], budget: int, async_save: bool, words: str
) -> None:
    root = tmp_path / "ckpt"
    results = run_distributed(
        save_on_failing_disk, 2, str(root), kind, ranks, budget, async_save, timeout=TIMEOUT
    )
    for rank, result in enumerate(results):
        assert result["step"] == 1, (rank, result)  # the previous tag is the newest complete
        if rank in ranks:  # the rank that hit the fault says what happened
            assert result["is_oserror"], (rank, result)
            assert words in result["chain"], (rank, result)
        else:  # its peer fails too, naming the failed rank
            assert "rank" in result["message"], (rank, result)
    assert not (root / "bad" / "done").exists()
    # The failed save's data folder (partial files) is removed; the tag stays incomplete.
    assert not list((root / "bad").glob("data-*")), sorted((root / "bad").iterdir())
