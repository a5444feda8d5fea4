"""``read_user_content``: the saved content comes back exactly, and reading it changes nothing
(no RNG restore, no process group, the model untouched)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from nxd_ckpt import read_user_content, save_checkpoint


def test_reads_the_content_of_a_tag_and_of_the_newest(tmp_path: Path) -> None:
    model = nn.Linear(3, 2)
    first = {"total_steps": 3, "losses": [1.5, 1.25], "mask": torch.arange(4)}
    save_checkpoint(tmp_path, "a", model=model, user_content=first)
    save_checkpoint(tmp_path, "b", model=model, user_content={"total_steps": 7})
    save_checkpoint(tmp_path, "c", model=model)  # no content

    got = read_user_content(tmp_path, "a")
    assert (got["total_steps"], got["losses"]) == (3, [1.5, 1.25])
    torch.testing.assert_close(got["mask"], first["mask"], rtol=0, atol=0)  # stored as is
    assert read_user_content(tmp_path, "b") == {"total_steps": 7}
    assert read_user_content(tmp_path) is None  # "c", the newest, holds none
    assert read_user_content(str(tmp_path / "b"), "") == {"total_steps": 7}


def test_has_no_side_effects(tmp_path: Path) -> None:
    model = nn.Linear(3, 2)
    torch.manual_seed(1)
    save_checkpoint(tmp_path, "t", model=model, user_content={"step": 1})
    torch.manual_seed(2)  # a different RNG state than the saved one
    rng = torch.get_rng_state()
    weights = {k: v.clone() for k, v in model.state_dict().items()}

    assert read_user_content(tmp_path, "t") == {"step": 1}
    assert torch.equal(torch.get_rng_state(), rng)  # load_checkpoint would restore seed 1's
    assert not torch.distributed.is_initialized()
    for k, v in model.state_dict().items():
        assert torch.equal(v, weights[k]), k


def test_errors_name_the_path_and_tag(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="does not exist"):
        read_user_content(tmp_path / "nowhere")
    save_checkpoint(tmp_path, "t", model=nn.Linear(2, 2), user_content={"step": 1})
    with pytest.raises(FileNotFoundError, match=r"tag 'u' not found .*\['t'\]"):
        read_user_content(tmp_path, "u")
    (tmp_path / "t" / "done").unlink()
    with pytest.raises(RuntimeError, match="incomplete"):
        read_user_content(tmp_path, "t")
