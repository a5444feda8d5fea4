"""Read a tag's user content alone: no model, no optimizer, no RNG, no collective.

``load_checkpoint`` returns the user content too, but it restores the RNG states and is
collective. A launcher or a monitor that only wants to know, say, the step a run stopped at
reads the content here: one process, nothing but the index and the content's own tensors
(checksums verified) is read, and nothing in the process changes.
"""

from __future__ import annotations

import os
from typing import Any

from nxd_ckpt.format import INDEX_NAME, _tags
from nxd_ckpt.load._load_model import load_json
from nxd_ckpt.load._reader import CheckpointReader

__all__ = ["read_user_content"]


def read_user_content(path: str | os.PathLike[str], tag: str | None = None) -> Any:
    """The ``user_content`` saved in tag ``tag`` under ``path`` (None: the newest complete
    tag), or None when that tag was saved without one.

    Collective-free and side-effect free: any single process may call it (no process group
    is needed), no RNG state, model or optimizer is touched and a pending ``async_save`` is
    not waited for (an unfinished tag is an error naming it; ``tag=None`` skips it). Errors as
    :func:`~nxd_ckpt.load_checkpoint`'s: a bad tag name, a missing path or tag, an incomplete
    tag, a damaged or hostile index or file (nothing outside the tag is opened). NxD's
    pickled layout is refused (read it with ``load_checkpoint(..., allow_pickle=True)``:
    unpickling executes code).
    """
    tag_dir, name = _tags.resolve_tag_dir(path, tag)
    if not os.path.lexists(tag_dir / INDEX_NAME):  # (a link is refused by the reader)
        raise FileNotFoundError(
            f"tag {name!r} at {tag_dir} has no {INDEX_NAME}: not an nxd checkpoint (NxD's "
            f"pickled layout is read only by load_checkpoint(..., allow_pickle=True))"
        )
    with CheckpointReader(tag_dir) as reader:
        if not reader.index.has_user_content:
            return None
        return load_json(reader, "user_content")
