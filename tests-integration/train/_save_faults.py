"""Save faults for the nxd-train tests, installed in every process of a run as its
``sitecustomize`` (copied under that name into a folder on ``PYTHONPATH``: Python imports it at
start-up, so the workers the launcher spawns get it too). ``NXD_TEST_SAVE_FAULT`` says which:

* ``slow_copy:S``: the background copy of the parameters and optimizer state (nxd-ckpt's
  ``async_copy="before_step"``) starts S seconds late, so the optimizer step after a save has
  to wait for it;
* ``slow_write:S``: each rank's write of a tag starts S seconds late (a save stays in flight);
* ``fail_write:TAG:RANK``: rank RANK's write of tag TAG fails with ENOSPC, as on a full disk.

Not a test module: nothing here runs unless that variable is set.
"""

from __future__ import annotations

import os

_SPEC = os.environ.get("NXD_TEST_SAVE_FAULT")


def _install(spec: str) -> None:
    import errno
    import time
    from typing import Any

    from nxd_ckpt.save import _save

    kind, _, arg = spec.partition(":")
    real_copy, real_write = _save.copy_deferred, _save.write_rank

    def slow_copy(copies: Any) -> None:
        time.sleep(float(arg))
        real_copy(copies)

    def slow_write(plan: Any, tag_dir: Any, data_dir: Any, *args: Any) -> Any:
        time.sleep(float(arg))
        return real_write(plan, tag_dir, data_dir, *args)

    def failing_write(plan: Any, tag_dir: Any, data_dir: Any, *args: Any) -> Any:
        tag, _, rank = arg.partition(":")
        if tag_dir.name == tag and os.environ.get("RANK") == rank:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(data_dir))
        return real_write(plan, tag_dir, data_dir, *args)

    if kind == "slow_copy":
        _save.copy_deferred = slow_copy
    elif kind == "slow_write":
        _save.write_rank = slow_write
    elif kind == "fail_write":
        _save.write_rank = failing_write
    else:
        raise ValueError(f"NXD_TEST_SAVE_FAULT: unknown fault {spec!r}")


if _SPEC and "RANK" in os.environ:  # the workers (the launcher saves nothing)
    _install(_SPEC)
