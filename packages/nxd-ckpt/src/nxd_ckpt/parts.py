"""Stored parts: a module says under which names its parameters are stored in checkpoints.

A parameter's *global tensor* is what nxd-ckpt assembles from its sharding attributes (TP
blocks, GQA K/V de-replicated, a fused ``weight_qkv`` as ``[Q; K; V]``). Some layers hold a
degree-dependent layout of tensors that have a degree-independent identity: a GQA projection
swapped in only when TP exceeds the KV heads holds ``weight_q/k/v`` (or one fused
``weight_qkv``) where every other degree holds ``q_proj.weight``, ``k_proj.weight`` and
``v_proj.weight``. Such a module declares, in the attribute ``nxd_checkpoint_parts``,

    {local parameter name: (StoredPart(name_1, rows_1), …, StoredPart(name_n, rows_n))}

meaning global tensor = concat(T_1, …, T_n) along dim 0, T_i of ``rows_i`` rows stored under
``name_i`` (relative to the module's *parent*: a sibling's name, so the declaration does not
depend on where the model puts the module). One part without ``rows`` is a rename. A save
stores the parts (each rank's blocks cut at the part boundaries); a load reads them, or, for
checkpoints written before the declaration, the parameter's own name, or a part's
``aliases`` (older names, relative to the parent too). Optimizer state follows the same
names (``<part name>/exp_avg`` …, ZeRO-1 shards included). NxD's own checkpoints and the
legacy per-rank files keep the module's own names.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["CHECKPOINT_PARTS", "StoredPart"]

CHECKPOINT_PARTS = "nxd_checkpoint_parts"
"""The module attribute holding the declaration (see the module docstring)."""


@dataclass(frozen=True)
class StoredPart:
    """Rows ``[start, start + rows)`` of a parameter's global tensor, stored as ``name``
    (``start``: the rows of the parts before it)."""

    name: str
    """Stored name, relative to the declaring module's parent (``"q_proj.weight"``)."""
    rows: int | None = None
    """Rows of the part along dim 0; None: all of them (only for a single part)."""
    aliases: tuple[str, ...] = ()
    """Older stored names of the part (relative to the parent too), read when ``name`` is
    not in a checkpoint."""

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name or self.name.startswith("."):
            raise ValueError(f"StoredPart name must be a relative dotted name, got {self.name!r}")
        if self.rows is not None and (
            isinstance(self.rows, bool) or not isinstance(self.rows, int) or self.rows <= 0
        ):
            raise ValueError(f"StoredPart {self.name!r}: rows must be a positive int or None")
        if not isinstance(self.aliases, tuple) or not all(
            isinstance(a, str) and a for a in self.aliases
        ):
            raise ValueError(f"StoredPart {self.name!r}: aliases must be a tuple of names")
