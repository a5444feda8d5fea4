"""NxD's ``LoraConfig``: what to adapt, how, and how the adapter is saved and loaded.

A LoRA layer computes ``Y = X W^T + s · dropout(X) A^T B^T``, with ``A`` of shape ``(r, in)``,
``B`` of shape ``(out, r)`` and the scale ``s = lora_alpha / r`` (``lora_alpha / sqrt(r)`` with
rsLoRA). The field names are NxD's; :meth:`LoraConfig.to_peft_dict` and
:meth:`LoraConfig.from_peft_dict` translate to and from PEFT's ``adapter_config.json``.
"""

from __future__ import annotations

import logging
import math
import re
from collections.abc import Mapping
from dataclasses import asdict, dataclass, fields
from typing import Any

__all__ = ["BIAS_MODES", "INIT_MODES", "LoraConfig"]

logger = logging.getLogger(__name__)

BIAS_MODES = ("none", "all", "lora_only")
INIT_MODES = ("default", "gaussian")
# Fields that describe the adapter itself (saved with it, and compared when loading one).
_ADAPTER_FIELDS = (
    "lora_rank",
    "lora_alpha",
    "lora_dropout",
    "bias",
    "target_modules",
    "use_rslora",
    "init_lora_weights",
    "modules_to_save",
)
# Fields that say how the adapter was saved (NxD stores them next to the adapter fields).
_SAVE_FIELDS = ("save_lora_base", "merge_lora", "save_lora_config_adapter")


@dataclass(kw_only=True)
class LoraConfig:
    """LoRA settings with NxD's names, validated on creation."""

    enable_lora: bool = False
    """NxD's flag and default, accepted and not consulted: as in NxD's current code (its
    trainer and ``get_lora_model``), every given ``LoraConfig`` is applied, whatever this says;
    to train without LoRA pass ``lora_config=None``. Ints 0 / 1 (NxD's scripts pass int flags)
    become bools."""

    lora_rank: int = 16
    """``r``, the inner dimension of ``B A``: a positive integer."""

    lora_alpha: float = 8.0
    """``alpha``: the adapter output is scaled by ``alpha / r`` (``alpha / sqrt(r)`` for rsLoRA)."""

    lora_dropout: float = 0.0
    """Dropout probability applied to the adapter's input, in ``[0, 1)``."""

    bias: str = "none"
    """Which biases train: ``"none"``, ``"all"`` (every bias) or ``"lora_only"`` (LoRA layers')."""

    target_modules: list[str] | str | None = None
    """The modules that get LoRA: a list entry selects the module of that name or whose dotted
    name ends in ``"." + entry``; a string is a regular expression the whole name must match
    (NxD's and PEFT's rule). ``None``: the model type's default (``q_proj``/``v_proj`` for
    Llama-family models)."""

    use_rslora: bool = False
    """Rank-stabilised LoRA: scale by ``lora_alpha / sqrt(lora_rank)``, not ``/ lora_rank``."""

    init_lora_weights: str = "default"
    """``"default"``: A kaiming-uniform(a=sqrt(5)), B zero; ``"gaussian"``: A ~ N(0, 1/r), B zero
    (embeddings: A zero, B ~ N(0, 1) in both modes, as in PEFT)."""

    modules_to_save: list[str] | None = None
    """Keywords of non-LoRA modules that also train and are saved with the adapter."""

    lora_verbose: bool = False
    """Log the wrapped model and its trainable-parameter count."""

    load_lora_from_ckpt: bool = False
    """Load the adapter (and its config) from ``lora_save_dir``/``lora_load_tag`` on wrapping."""

    lora_save_dir: str = "lora_adapter"
    """Folder the adapter is saved to and loaded from."""

    lora_load_tag: str | None = None
    """Sub-folder of ``lora_save_dir`` holding the adapter to load (``None``: the folder itself)."""

    merge_lora: bool = False
    """With ``save_lora_base``: save the base with the adapter merged in, and no adapter."""

    save_lora_base: bool = False
    """Save the base model's weights as well as the adapter."""

    save_lora_config_adapter: bool = True
    """Store the config inside the adapter checkpoint; if False, also as
    ``<lora_save_dir>/adapter_config.json``."""

    merge_sharded_lora: bool = False
    """``state_dict()`` returns the adapter alone with every TP-sharded tensor all-gathered to
    its full size (a collective over TP: call it on every rank), named as in the unsharded
    model (a GQA QKV adapter keeps its ``lora_B.weight_q/_k/_v`` names with one copy of each
    K/V head). As in NxD, this turns ``save_lora_base`` and ``merge_lora`` off."""

    def __post_init__(self) -> None:
        if not isinstance(self.enable_lora, bool):
            if isinstance(self.enable_lora, int) and self.enable_lora in (0, 1):
                self.enable_lora = bool(self.enable_lora)  # NxD's scripts pass int flags
            else:
                raise TypeError(f"enable_lora must be a bool, got {self.enable_lora!r}")
        if isinstance(self.lora_rank, bool) or not isinstance(self.lora_rank, int):
            raise TypeError(f"lora_rank must be an int, got {self.lora_rank!r}")
        if self.lora_rank <= 0:
            raise ValueError(f"lora_rank must be a positive integer, got {self.lora_rank}")
        if not self.lora_alpha > 0:
            raise ValueError(f"lora_alpha must be positive, got {self.lora_alpha}")
        if not 0.0 <= self.lora_dropout < 1.0:
            raise ValueError(f"lora_dropout must be in [0, 1), got {self.lora_dropout}")
        if self.bias not in BIAS_MODES:
            raise ValueError(f"bias must be one of {BIAS_MODES}, got {self.bias!r}")
        if self.init_lora_weights not in INIT_MODES:
            raise ValueError(
                f"init_lora_weights must be one of {INIT_MODES}, got {self.init_lora_weights!r}"
            )
        self.target_modules = _target_modules(self.target_modules)
        self.modules_to_save = _keyword_list("modules_to_save", self.modules_to_save)
        if self.merge_sharded_lora and (self.save_lora_base or self.merge_lora):
            logger.info(
                "merge_sharded_lora=True saves the gathered adapter only: "
                "save_lora_base and merge_lora are turned off"
            )
            self.save_lora_base = self.merge_lora = False
        if self.merge_lora and not self.save_lora_base:
            raise ValueError(
                "merge_lora=True needs save_lora_base=True (the merged base is what is saved); "
                "got save_lora_base=False"
            )

    @property
    def scaling(self) -> float:
        """``s = lora_alpha / r``, or ``lora_alpha / sqrt(r)`` with rsLoRA."""
        if self.use_rslora:
            return self.lora_alpha / math.sqrt(self.lora_rank)
        return self.lora_alpha / self.lora_rank

    @property
    def save_mode(self) -> str:
        """``"adapter"``, ``"base_and_adapter"`` or ``"merged"``, from the two save flags
        (``merge_sharded_lora`` saves the adapter alone, as in NxD). The one place the mode is
        decided: ``save_lora``, ``state_dict`` and checkpoints (``checkpoint_tensors``) read it."""
        if self.merge_sharded_lora or not self.save_lora_base:
            return "adapter"
        return "merged" if self.merge_lora else "base_and_adapter"

    def selected_fields_to_save(self) -> dict[str, Any]:
        """The fields saved with an adapter (NxD's ``selected_fields_to_save``)."""
        values = asdict(self)
        return {name: values[name] for name in (*_ADAPTER_FIELDS, *_SAVE_FIELDS)}

    def adapter_fields(self) -> dict[str, Any]:
        """The fields that describe the adapter itself (rank, alpha, targets, ...)."""
        return {name: getattr(self, name) for name in _ADAPTER_FIELDS}

    def mismatches(self, other: LoraConfig) -> list[str]:
        """``"field: self vs other"`` for every adapter field where the two configs differ."""
        out = []
        for name in _ADAPTER_FIELDS:
            mine, theirs = getattr(self, name), getattr(other, name)
            if name in ("target_modules", "modules_to_save"):
                mine = sorted(mine) if isinstance(mine, list) else mine
                theirs = sorted(theirs) if isinstance(theirs, list) else theirs
            if mine != theirs:
                out.append(f"{name}: {mine!r} vs {theirs!r}")
        return out

    def with_saved_fields(self, saved: Mapping[str, Any]) -> LoraConfig:
        """A copy with the saved adapter/save fields taken from ``saved`` (unknown keys: error)."""
        allowed = {*_ADAPTER_FIELDS, *_SAVE_FIELDS}
        unknown = sorted(set(saved) - allowed)
        if unknown:
            raise ValueError(f"saved LoRA config has unknown fields {unknown}; known: {allowed}")
        values = {f.name: getattr(self, f.name) for f in fields(self)}
        values.update(saved)
        return LoraConfig(**values)

    # PEFT's adapter_config.json ------------------------------------------------------------
    def to_peft_dict(
        self,
        *,
        target_modules: list[str] | str | None = None,
        base_model_name_or_path: str | None = None,
        task_type: str | None = None,
    ) -> dict[str, Any]:
        """This config as PEFT's ``LoraConfig`` JSON (``target_modules`` may be overridden)."""
        targets = target_modules if target_modules is not None else self.target_modules
        return {
            "peft_type": "LORA",
            "task_type": task_type,
            "base_model_name_or_path": base_model_name_or_path,
            "r": self.lora_rank,
            "lora_alpha": self.lora_alpha,
            "lora_dropout": self.lora_dropout,
            "bias": self.bias,
            "target_modules": list(targets) if isinstance(targets, list) else targets,
            "use_rslora": self.use_rslora,
            "init_lora_weights": True if self.init_lora_weights == "default" else "gaussian",
            "modules_to_save": list(self.modules_to_save) if self.modules_to_save else None,
            "fan_in_fan_out": False,
            "inference_mode": True,
            "use_dora": False,
            "rank_pattern": {},
            "alpha_pattern": {},
        }

    @classmethod
    def from_peft_dict(cls, peft: Mapping[str, Any], **overrides: Any) -> LoraConfig:
        """An nxd config from PEFT's JSON; features nxd lacks raise a clear error."""
        if peft.get("peft_type", "LORA") != "LORA":
            raise ValueError(f"not a LoRA adapter: peft_type={peft.get('peft_type')!r}")
        for name, plain in (
            ("use_dora", False),
            ("fan_in_fan_out", False),
            ("rank_pattern", {}),
            ("alpha_pattern", {}),
        ):
            if peft.get(name) not in (None, plain):
                raise ValueError(f"PEFT option {name}={peft[name]!r} is not supported by nxd_lora")
        targets = peft.get("target_modules")
        init = peft.get("init_lora_weights", True)
        if init not in (True, "gaussian"):
            raise ValueError(f"PEFT init_lora_weights={init!r} is not supported (True, 'gaussian')")
        values: dict[str, Any] = {
            "enable_lora": True,
            "lora_rank": peft["r"],
            "lora_alpha": peft["lora_alpha"],
            "lora_dropout": peft.get("lora_dropout", 0.0),
            "bias": peft.get("bias", "none"),
            "target_modules": targets
            if targets is None or isinstance(targets, str)
            else list(targets),
            "use_rslora": peft.get("use_rslora", False),
            "init_lora_weights": "default" if init is True else "gaussian",
            "modules_to_save": peft.get("modules_to_save"),
        }
        values.update(overrides)
        return cls(**values)


def _target_modules(value: Any) -> list[str] | str | None:
    """A list of module names, or one regular expression (checked to compile)."""
    if isinstance(value, str):
        if not value:
            raise ValueError("target_modules must not be an empty string")
        try:
            re.compile(value)
        except re.error as error:
            raise ValueError(
                f"target_modules {value!r} is a string, so a regular expression, and it does not "
                f"compile: {error}"
            ) from error
        return value
    return _keyword_list("target_modules", value)


def _keyword_list(name: str, value: Any) -> list[str] | None:
    if value is None:
        return None
    if isinstance(value, str):
        raise TypeError(f"{name} must be a list of module-name keywords, got the string {value!r}")
    keywords = list(value)
    if not keywords:
        raise ValueError(f"{name} must name at least one module keyword, got an empty list")
    bad = [k for k in keywords if not isinstance(k, str) or not k]
    if bad:
        raise ValueError(f"{name} entries must be non-empty strings, got {bad!r}")
    return keywords
