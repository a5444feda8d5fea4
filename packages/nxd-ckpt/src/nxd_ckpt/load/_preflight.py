"""Check every byte a load will copy before the first copy, and agree on it across ranks.

A rank's reads are the global boxes its model and optimizer tensors need, plus its RNG
states, scheduler state and user content. Each box is read and checked as the load will read
it (file size and header CRC on opening, the CRC of every row block it covers, chunk
coverage), one chunk at a time, and dropped: peak memory is one chunk's rows, not a copy of
the state. The data is read twice (the second time mostly from the page cache); that is the
price of never leaving a model half loaded. Then one all-reduce of ``world + files`` flags
(which rank failed, which files are damaged) tells every rank, so every rank raises and each
error names the damaged files.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch.distributed as dist

from nxd_ckpt.format import FormatError
from nxd_ckpt.format._boxes import Box
from nxd_ckpt.layout._context import sum_counts
from nxd_ckpt.load._reader import CheckpointReader, DamagedFileError

__all__ = ["verify_reads"]


def verify_reads(
    reader: CheckpointReader,
    reads: Iterable[tuple[str, str, Box]],
    then: Callable[[], None] | None = None,
) -> int:
    """Check each ``(category, name, box)`` of ``reads``, then run ``then`` (reads into new
    objects that change nothing, e.g. the optimizer state), collectively: every rank calls
    it, and every rank raises if any rank found a problem. Returns the boxes checked here."""
    files = sorted(reader.index.files)
    error: BaseException | None = None
    damaged: set[str] = set()
    count = 0
    try:
        for category, name, box in reads:
            reader.check_box(category, name, box)
            count += 1
        if then is not None:
            then()
    except DamagedFileError as caught:
        error, damaged = caught, {caught.file}
    except Exception as caught:  # raised below, after the peers hear of it
        error = caught
    if not (dist.is_available() and dist.is_initialized()):
        if error is not None:
            raise error
        return count
    world, rank = dist.get_world_size(), dist.get_rank()
    flags = [0] * (world + len(files))
    flags[rank] = int(error is not None)
    for index, file in enumerate(files):
        flags[world + index] = int(file in damaged)
    summed = sum_counts(flags)
    if error is not None:
        raise error
    failed = [r for r in range(world) if summed[r]]
    if failed:
        bad = [file for index, file in enumerate(files) if summed[world + index]]
        where = f"damaged file(s) {[str(reader.tag_dir / f) for f in bad]}" if bad else "errors"
        raise FormatError(
            f"checking {reader.tag_dir} before loading failed on rank(s) {failed}: {where} "
            f"(see their errors); nothing was loaded"
        )
    return count
