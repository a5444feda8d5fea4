"""The on-disk format: one folder per tag, safetensors data files and one JSON index.

::

    <path>/<tag>/nxd-ckpt.json               {"format": "nxd-ckpt", "format_version": 1, ...}:
                                             nxd-ckpt wrote this tag (retention deletes only these)
    <path>/<tag>/checkpoint                  written when the first save into the tag begins
    <path>/<tag>/done                        written once the index names a complete save
    <path>/<tag>/index.json                  CheckpointIndex (this module), the commit point
    <path>/<tag>/data-<save_id>/dp_rank_DD_tp_rank_TT_pp_rank_PP.safetensors
    <path>/<tag>/data-<save_id>/manifest_rank_RRRRR.json   what one rank wrote

Every tensor is described by its *global* shape (what one process holding the whole model
would have) and a list of chunks, each a box of the global tensor stored under a key of one
safetensors file. Chunks of a tensor are disjoint and cover it exactly, so a rank under any
TP/PP/DP layout reads the boxes it needs by intersecting them with the chunks. Each chunk
carries CRC-32s of its rows in blocks of ``crc_rows`` rows (verified on every read, and a
partial read widens to whole blocks); each file carries its size, the CRC-32 of its
safetensors header and a file CRC-32 over the header and every block CRC, in file order.

Saving into an existing tag writes a new ``data-<save_id>`` folder and replaces
``index.json`` atomically once that data is complete; the old data is removed afterwards.
"""

from nxd_ckpt.format._index import CheckpointIndex, read_index
from nxd_ckpt.format._records import (
    DONE_MARKER,
    FORMAT_NAME,
    FORMAT_VERSION,
    INDEX_NAME,
    START_MARKER,
    TAG_MARKER,
    ChunkRecord,
    ContainmentError,
    FileRecord,
    FormatError,
    TensorRecord,
)

__all__ = [
    "DONE_MARKER",
    "FORMAT_NAME",
    "FORMAT_VERSION",
    "INDEX_NAME",
    "START_MARKER",
    "TAG_MARKER",
    "CheckpointIndex",
    "ChunkRecord",
    "ContainmentError",
    "FileRecord",
    "FormatError",
    "TensorRecord",
    "read_index",
]
