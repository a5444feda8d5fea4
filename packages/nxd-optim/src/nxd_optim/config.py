"""NxD's ``optimizer_config`` and ``mixed_precision_config`` keys as one validated dataclass."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

__all__ = ["OptimizerConfig"]

_OPTIMIZER_KEYS = ("zero_one_enabled", "grad_clipping", "max_grad_norm")
_MIXED_PRECISION_KEYS = ("use_master_weights", "use_fp32_grad_acc", "use_master_weights_in_ckpt")


@dataclass(kw_only=True)
class OptimizerConfig:
    """How :class:`~nxd_optim.NxDOptimizer` synchronises, clips and keeps precision."""

    zero_one_enabled: bool = False
    """Shard optimizer state (and fp32 master weights) over the data-parallel group (ZeRO-1)."""

    grad_clipping: bool = True
    """Measure the global gradient norm (over DP, TP and PP; the optimizer's ``grad_norm``) and
    clip it to ``max_grad_norm`` before stepping. Off: no norm is computed (``grad_norm`` None)."""

    max_grad_norm: float = 1.0
    """The norm gradients are clipped to when ``grad_clipping`` is on: g <- g · min(1, c/‖g‖).
    ``math.inf`` measures the norm and leaves the gradients as they are."""

    norm_type: float = 2.0
    """p of the p-norm used for clipping (``math.inf`` for the max norm)."""

    use_master_weights: bool = True
    """For bf16/fp16 params, let the optimizer step fp32 copies and cast them back to the model."""

    use_fp32_grad_acc: bool = False
    """Accumulate micro-batch gradients in fp32 buffers instead of in the params' dtype."""

    use_master_weights_in_ckpt: bool = False
    """Save the fp32 master weights in optimizer state dicts (else rebuilt from the params)."""

    bucket_cap_mb: float = 25.0
    """Largest flat bucket, in MiB, for the data-parallel gradient all-reduce (without ZeRO-1)."""

    def __post_init__(self) -> None:
        if self.grad_clipping and not self.max_grad_norm > 0:  # NaN fails too; inf is allowed
            raise ValueError(
                f"max_grad_norm must be positive when grad_clipping is on (math.inf: measure "
                f"the norm, clip nothing), got {self.max_grad_norm}"
            )
        if not self.norm_type > 0:
            raise ValueError(f"norm_type must be positive (or math.inf), got {self.norm_type}")
        if not self.bucket_cap_mb > 0:
            raise ValueError(f"bucket_cap_mb must be positive, got {self.bucket_cap_mb}")

    @property
    def bucket_cap_bytes(self) -> int:
        return max(1, int(self.bucket_cap_mb * 2**20))

    @classmethod
    def from_nxd(
        cls,
        optimizer_config: Mapping[str, Any] | None = None,
        mixed_precision_config: Mapping[str, Any] | None = None,
    ) -> OptimizerConfig:
        """From NxD's dicts: ``optimizer_config`` keys zero_one_enabled / grad_clipping /
        max_grad_norm, ``mixed_precision_config`` keys use_master_weights / use_fp32_grad_acc /
        use_master_weights_in_ckpt. Unknown keys are an error (a typo must not be ignored)."""
        values: dict[str, Any] = {}
        for name, given, known in (
            ("optimizer_config", optimizer_config, _OPTIMIZER_KEYS),
            ("mixed_precision_config", mixed_precision_config, _MIXED_PRECISION_KEYS),
        ):
            extra = sorted(set(given or {}) - set(known) - _EXTRA_KEYS)
            if extra:
                raise ValueError(f"unknown {name} keys {extra}; expected some of {list(known)}")
            values.update(given or {})
        return cls(**values)


_EXTRA_KEYS = (
    frozenset(f.name for f in fields(OptimizerConfig))
    - set(_OPTIMIZER_KEYS)
    - set(_MIXED_PRECISION_KEYS)
)
