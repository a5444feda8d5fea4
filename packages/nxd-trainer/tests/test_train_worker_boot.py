"""A worker interrupted while it imports exits 130 with nothing on stderr (its launcher says it).

The interrupt is made deterministic: a stand-in ``nxd_trainer`` package, first on the path,
sends SIGINT to its own process while it is being imported, where the real package imports
torch. Under ``python -m`` Python's default handler prints a traceback there (the case CI
caught at random); under the launcher's boot the worker ends quietly.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from nxd_trainer.train.launch import WORKER_BOOT, worker_command

# Python's own startup handler first: a process started from a background job inherits SIGINT
# ignored, and Python then installs none (the failure would not show).
_INTERRUPTED_IMPORT = """\
import os, signal, time
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)
os.kill(os.getpid(), signal.SIGINT)
time.sleep(30)  # the signal arrives while the package is still being imported
"""


def _stand_in(tmp_path: Path) -> dict[str, str]:
    package = tmp_path / "nxd_trainer"
    (package / "train").mkdir(parents=True)
    (package / "__init__.py").write_text(_INTERRUPTED_IMPORT)
    (package / "train" / "__init__.py").write_text("")
    (package / "train" / "__main__.py").write_text("raise SystemExit(0)\n")
    return {**os.environ, "PYTHONPATH": str(tmp_path)}


@pytest.mark.parametrize("signal_name", ["SIGINT", "SIGTERM"])
def test_worker_interrupted_while_importing_is_quiet(tmp_path: Path, signal_name: str) -> None:
    env = _stand_in(tmp_path)
    (tmp_path / "nxd_trainer" / "__init__.py").write_text(
        _INTERRUPTED_IMPORT.replace("SIGINT", signal_name)
    )
    done = subprocess.run(
        [sys.executable, "-u", "-c", WORKER_BOOT, "--steps", "1"],
        env=env, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode == 130, done.stderr
    assert done.stderr == ""


def test_plain_module_run_would_print_a_traceback(tmp_path: Path) -> None:
    """The stand-in reproduces the failure the boot avoids (so the test above can fail)."""
    done = subprocess.run(
        [sys.executable, "-u", "-m", "nxd_trainer.train"],
        env=_stand_in(tmp_path), capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert "KeyboardInterrupt" in done.stderr


def test_worker_command_keeps_the_arguments() -> None:
    boot = worker_command(["-u", "-m", "nxd_trainer.train", "--steps", "3", "--tp", "2"])
    assert boot == ["-u", "-c", WORKER_BOOT, "--steps", "3", "--tp", "2"]
    with pytest.raises(AssertionError, match="unexpected worker command"):
        worker_command(["train.py", "--steps", "3"])


def test_worker_boot_runs_the_module(tmp_path: Path) -> None:
    """Without a signal the boot runs ``nxd_trainer.train`` as ``__main__`` with its arguments."""
    package = tmp_path / "nxd_trainer"
    (package / "train").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "train" / "__init__.py").write_text("")
    (package / "train" / "__main__.py").write_text("import sys\nprint(__name__, sys.argv[1:])\n")
    done = subprocess.run(
        [sys.executable, "-u", "-c", WORKER_BOOT, "--steps", "3"],
        env={**os.environ, "PYTHONPATH": str(tmp_path)}, capture_output=True, text=True,
        timeout=60,
    )  # fmt: skip
    assert done.stdout.strip() == "__main__ ['--steps', '3']", done.stderr
