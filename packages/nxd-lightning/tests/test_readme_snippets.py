"""Every Lightning snippet of the READMEs runs, extracted from the README files themselves.

* packages/nxd-lightning/README.md, "A runnable example": written to ``train.py`` and run as
  the README says (``python train.py``: Lightning's popen launcher starts the second process);
  it must exit 0 having written the sharded checkpoint and the TensorBoard events.
* README.md (root), the nxd-lightning section's fragment: run in 2 ranks (an existing process
  group, as under torchrun) with its free names given: its imports, ``get_model`` (the tiny
  HF Llama), ``loader``, and ``Trainer`` capped at 2 steps (the fragment sets no run length;
  Lightning's default is 1000 epochs). It must train and write ``ckpts/last.ckpt``.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from nxd_state.testing import load_sibling, run_distributed

R = load_sibling(__file__, "_recipe")
PACKAGE = Path(__file__).resolve().parents[1]
ROOT = PACKAGE.parents[1]


def python_blocks(readme: Path, section: str) -> list[str]:
    """The ```python blocks of the ``## <section>`` section of ``readme``."""
    text = readme.read_text()
    start = text.index(f"\n## {section}")
    end = text.find("\n## ", start + 1)
    body = text[start : end if end != -1 else len(text)]
    return re.findall(r"```python\n(.*?)```", body, flags=re.DOTALL)


def test_package_readme_example_runs(tmp_path: Path) -> None:
    (block,) = python_blocks(PACKAGE / "README.md", "A runnable example")
    (tmp_path / "train.py").write_text(block)
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE")}
    env.update(OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo", PYTHONUNBUFFERED="1")
    done = subprocess.run(
        [sys.executable, "train.py"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=float(os.environ.get("NXD_TEST_TIMEOUT", "180")) * 2,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert (tmp_path / "ckpts" / "last.ckpt" / "done").is_file()
    assert list((tmp_path / "logs").rglob("events.out.tfevents.*"))


def run_root_fragment(code: str, folder: str) -> dict[str, Any]:
    import torch
    from lightning.pytorch import Trainer
    from lightning.pytorch.callbacks import ModelCheckpoint

    import nxd_lightning
    from nxd_trainer import NxDConfig

    def capped_trainer(**kwargs: Any) -> Any:
        kwargs.setdefault("max_steps", 2)
        kwargs.setdefault("enable_model_summary", False)
        return Trainer(**kwargs)

    os.chdir(folder)  # the fragment's relative ckpts/ and logs/ (one folder per rank)
    namespace: dict[str, Any] = {
        "torch": torch,
        "Trainer": capped_trainer,
        "ModelCheckpoint": ModelCheckpoint,
        "NxDConfig": NxDConfig,
        "get_model": R.hf_llama,
        "loader": R.loader(),
        **{name: getattr(nxd_lightning, name) for name in nxd_lightning.__all__},
    }
    exec(compile(code, "README.md", "exec"), namespace)
    return {
        "global_step": namespace["trainer"].global_step,
        "tp_layers": R.tp_layers(namespace["module"].model),
    }


def test_root_readme_fragment_runs(tmp_path: Path) -> None:
    readme = ROOT / "README.md"
    if not readme.is_file():
        pytest.skip(f"{readme} is not here (the package is tested outside its repository)")
    (block,) = python_blocks(readme, "nxd-lightning: NxD's Lightning integration")
    results = run_distributed(run_root_fragment, 2, block, str(tmp_path))
    for rank in results:
        assert rank["global_step"] == 2
        assert rank["tp_layers"] > 0  # TP=2 as the fragment's config says
    assert (tmp_path / "ckpts" / "last.ckpt" / "done").is_file()
