"""NxD's ``optimizer_config`` and ``mixed_precision_config``: one validated dataclass each.

These are the only classes for the two concepts: nxd-trainer's ``NxDConfig`` holds them (and
re-exports them as ``nxd_trainer.OptimizerConfig`` / ``MixedPrecisionConfig``), nxd-train and
the Lightning integration reach them through it, and :class:`~nxd_optim.NxDOptimizer` takes
them as ``config=`` and ``mixed_precision=``. NxD's dicts map onto them key for key
(:meth:`OptimizerConfig.from_nxd`, :meth:`MixedPrecisionConfig.from_nxd`): a dict's keys are
the fields, ``None`` gives the defaults, an unknown key is an error naming the closest valid one.

NxD's mixed-precision defaults depend on ZeRO-1: master weights and fp32 gradient accumulation
are on exactly when ``zero_one_enabled`` is (:meth:`MixedPrecisionConfig.resolved`).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from nxd_optim.checks import as_bool, check_positive_number, parse_section

__all__ = ["MixedPrecisionConfig", "OptimizerConfig"]

_MIXED_PRECISION_KEYS = ("use_master_weights", "use_fp32_grad_acc", "use_master_weights_in_ckpt")


@dataclass(kw_only=True)
class OptimizerConfig:
    """NxD's ``optimizer_config``: how :class:`~nxd_optim.NxDOptimizer` reduces, clips and
    shards. For the step g <- (1/n) Σ_DP g, g <- g · min(1, c/‖g‖_p): ``zero_one_enabled``
    picks the reduction (all-reduce, or ZeRO-1's reduce-scatter), ``grad_clipping`` and
    ``max_grad_norm`` = c the clip, ``norm_type`` = p."""

    zero_one_enabled: bool = False
    """ZeRO-1: shard optimizer state (and fp32 master weights) over the data-parallel group;
    gradients are reduce-scattered instead of all-reduced."""

    grad_clipping: bool = True
    """Measure the global gradient norm (over DP, TP and PP; the optimizer's ``grad_norm``)
    and clip it to ``max_grad_norm`` before stepping. Off: no norm (``grad_norm`` None)."""

    max_grad_norm: float = 1.0
    """c, the norm gradients are clipped to when ``grad_clipping`` is on: g <- g · min(1,
    c/‖g‖). Positive; ``math.inf`` measures the norm and leaves the gradients as they are."""

    norm_type: float = 2.0
    """nxd: p of the clipping p-norm, positive (``math.inf`` for the max norm)."""

    bucket_cap_mb: float = 25.0
    """nxd: largest flat bucket, in MiB, of the data-parallel gradient all-reduce (without
    ZeRO-1). Positive."""

    def __new__(cls, *args: Any, **kwargs: Any) -> OptimizerConfig:
        # The mixed-precision keys lived here once: say where they went, not just "unexpected".
        moved = sorted(set(kwargs) & set(_MIXED_PRECISION_KEYS))
        if moved:
            raise TypeError(
                f"OptimizerConfig got {moved}: these are mixed_precision_config keys, held by "
                f"nxd_optim.MixedPrecisionConfig; pass NxDOptimizer(..., config=OptimizerConfig"
                f"(...), mixed_precision=MixedPrecisionConfig({moved[0]}=...)) or "
                f"build_optimizer(..., mixed_precision_config={{...}})"
            )
        return super().__new__(cls)

    def __post_init__(self) -> None:
        section = "optimizer_config"
        self.zero_one_enabled = as_bool(section, "zero_one_enabled", self.zero_one_enabled)
        self.grad_clipping = as_bool(section, "grad_clipping", self.grad_clipping)
        if self.grad_clipping:
            check_positive_number(
                section,
                "max_grad_norm",
                self.max_grad_norm,
                " (math.inf: measure the norm, clip nothing) when grad_clipping is on",
            )
        check_positive_number(section, "norm_type", self.norm_type, " (or math.inf)")
        check_positive_number(section, "bucket_cap_mb", self.bucket_cap_mb)

    @property
    def bucket_cap_bytes(self) -> int:
        """``bucket_cap_mb`` in bytes (at least 1)."""
        return max(1, int(self.bucket_cap_mb * 2**20))

    @classmethod
    def from_nxd(cls, value: Any = None) -> OptimizerConfig:
        """NxD's ``optimizer_config`` dict (keys: the fields), ``None`` (the defaults) or an
        instance (itself). Unknown keys are an error naming the closest valid one."""
        return parse_section(cls, "optimizer_config", value)


@dataclass(kw_only=True)
class MixedPrecisionConfig:
    """NxD's ``mixed_precision_config``: θ32 <- step(θ32, g), θ <- bf16(θ32) with master
    weights; G = Σ_i float32(g_i) over micro-batches with fp32 accumulation.

    ``None`` fields take NxD's defaults once ZeRO-1 is known (:meth:`resolved`, which
    :class:`~nxd_optim.NxDOptimizer` and nxd-trainer's ``NxDConfig`` call): master weights and
    fp32 accumulation are on exactly when ZeRO-1 is. Only bf16/fp16 parameters are affected.
    """

    use_master_weights: bool | None = None
    """For bf16/fp16 parameters the optimizer steps fp32 copies and casts them back
    (default: ``zero_one_enabled``). nxd also supports this without ZeRO-1."""

    use_fp32_grad_acc: bool | None = None
    """Accumulate micro-batch gradients in fp32 buffers, not in the parameters' dtype
    (default: ``zero_one_enabled``)."""

    use_master_weights_in_ckpt: bool = False
    """Put the fp32 master weights in the optimizer's state dict (else they are rebuilt from
    the model's parameters on load). Needs master weights."""

    def __post_init__(self) -> None:
        section = "mixed_precision_config"
        for name in ("use_master_weights", "use_fp32_grad_acc"):
            value = getattr(self, name)
            if value is not None:
                setattr(self, name, as_bool(section, name, value))
        self.use_master_weights_in_ckpt = as_bool(
            section, "use_master_weights_in_ckpt", self.use_master_weights_in_ckpt
        )

    def resolved(self, zero_one_enabled: bool) -> MixedPrecisionConfig:
        """A copy with NxD's defaults filled in from ``zero_one_enabled`` (given values kept);
        a contradiction (master weights saved but none kept) is an error."""
        out = replace(
            self,
            use_master_weights=(
                zero_one_enabled if self.use_master_weights is None else self.use_master_weights
            ),
            use_fp32_grad_acc=(
                zero_one_enabled if self.use_fp32_grad_acc is None else self.use_fp32_grad_acc
            ),
        )
        if out.use_master_weights_in_ckpt and not out.use_master_weights:
            raise ValueError(
                "mixed_precision_config['use_master_weights_in_ckpt'] is True but "
                "'use_master_weights' is False: there are no master weights to save"
            )
        return out

    @property
    def master_weights(self) -> bool:
        """``use_master_weights`` once :meth:`resolved` (an error before)."""
        return self._flag("use_master_weights")

    @property
    def fp32_grad_acc(self) -> bool:
        """``use_fp32_grad_acc`` once :meth:`resolved` (an error before)."""
        return self._flag("use_fp32_grad_acc")

    def _flag(self, name: str) -> bool:
        value = getattr(self, name)
        if value is None:
            raise ValueError(
                f"mixed_precision_config[{name!r}] is None (NxD's default, which depends on "
                f"ZeRO-1): call .resolved(zero_one_enabled) first"
            )
        return bool(value)

    @classmethod
    def from_nxd(cls, value: Any = None) -> MixedPrecisionConfig:
        """NxD's ``mixed_precision_config`` dict (keys: the fields), ``None`` (the defaults,
        unresolved) or an instance (itself). Unknown keys are an error naming the closest."""
        return parse_section(cls, "mixed_precision_config", value)
