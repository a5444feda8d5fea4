"""LoRA on ``nn.Linear``, ``nn.Embedding`` and ``nn.Conv2d``, with PEFT's math and names.

Every LoRA layer wraps a frozen ``base_layer`` and adds a low-rank update::

    Y = base(X) + s · B(A(dropout(X)))       s = alpha / r  (alpha / sqrt(r) with rsLoRA)

so that merging folds ``ΔW = s · B A`` into the base weight. Parameter names match PEFT's with
the adapter name dropped (``lora_A.weight``, ``lora_B.weight``, ``lora_embedding_A``), which is
what makes adapters interchangeable with ``peft``.
"""

from __future__ import annotations

import logging
import math
from typing import Any, Generic, TypeVar

import torch
import torch.nn.functional as F
from torch import nn

from nxd_layers import full_tensor, shard_for_rank
from nxd_lora.config import LoraConfig
from nxd_state import collectives

__all__ = [
    "LoraConv2d",
    "LoraEmbedding",
    "LoraLayer",
    "LoraLinear",
    "copy_full_into",
    "init_lora_a_",
    "lora_a_master",
]

logger = logging.getLogger(__name__)


def init_lora_a_(weight: torch.Tensor, mode: str, rank: int) -> torch.Tensor:
    """A in place: kaiming-uniform(a=sqrt(5)) (``default``) or N(0, 1/r) (``gaussian``)."""
    with torch.no_grad():
        if mode == "default":
            nn.init.kaiming_uniform_(weight, a=math.sqrt(5))
        elif mode == "gaussian":
            nn.init.normal_(weight, std=1.0 / rank)
        else:
            raise ValueError(f"init_lora_weights must be 'default' or 'gaussian', got {mode!r}")
    return weight


def lora_a_master(
    shape: tuple[int, ...], mode: str, rank: int, *, dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    """A full-size, initialised A (TP layers slice it, so any TP degree starts from the same A)."""
    return init_lora_a_(torch.empty(shape, dtype=dtype, device=device), mode, rank)


BaseT = TypeVar("BaseT", bound=nn.Module)
"""The type of the wrapped ``base_layer`` (``LoraLinear`` is a ``LoraLayer[nn.Linear]``)."""


class LoraLayer(nn.Module, Generic[BaseT]):
    """Base of every LoRA layer: ``Y = base(X) + s · adapter(dropout(X))``, mergeable.

    Subclasses build the adapter parameters and implement :meth:`adapter_forward` and
    :meth:`delta_weights` (``{base parameter name: s · B A}`` in that parameter's local shape).
    """

    # Names of the adapter's own parameters/submodules (prefix "lora_", as in PEFT).
    adapter_names: tuple[str, ...] = ("lora_A", "lora_B")

    def __init__(self, base_layer: BaseT, config: LoraConfig) -> None:
        super().__init__()
        if config.lora_rank <= 0:
            raise ValueError(f"lora_rank must be a positive integer, got {config.lora_rank}")
        self.base_layer: BaseT = base_layer
        self.lora_rank = config.lora_rank
        self.lora_alpha = config.lora_alpha
        self.scaling = config.scaling
        self.merged = False
        self.lora_dropout: nn.Module = (
            nn.Dropout(p=config.lora_dropout) if config.lora_dropout > 0 else nn.Identity()
        )

    # To implement ----------------------------------------------------------------------
    def adapter_forward(self, x: torch.Tensor) -> Any:
        """``s · B(A(dropout(x)))`` in the base output's layout (a tuple for QKV layers)."""
        raise NotImplementedError

    def delta_weights(self) -> dict[str, torch.Tensor]:
        """``{base parameter name: ΔW}`` with ``ΔW = s · B A`` shaped like that parameter."""
        raise NotImplementedError

    # Shared behaviour -------------------------------------------------------------------
    def forward(self, x: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        result = self.base_layer(x, *args, **kwargs)
        if self.merged:
            return result
        update = self.adapter_forward(x)
        if isinstance(result, tuple) and isinstance(update, tuple):  # q, k, v
            return tuple(r + u.to(r.dtype) for r, u in zip(result, update, strict=True))
        if isinstance(result, tuple):  # skip_bias_add: (output, bias)
            return (result[0] + update.to(result[0].dtype), *result[1:])
        return result + update.to(result.dtype)

    def merged_base_weights(self) -> dict[str, torch.Tensor]:
        """``{base parameter name: W + ΔW}``, computed without touching the model."""
        with torch.no_grad():
            return {
                name: getattr(self.base_layer, name).detach() + delta.to(self._dtype(name))
                for name, delta in self.delta_weights().items()
            }

    def merge(self) -> None:
        """``W <- W + s · B A``; the adapter path is then skipped in forward."""
        if self.merged:
            logger.warning("%s is already merged; merge() does nothing", type(self).__name__)
            return
        with torch.no_grad():
            for name, delta in self.delta_weights().items():
                getattr(self.base_layer, name).add_(delta.to(self._dtype(name)))
        self.merged = True

    def unmerge(self) -> None:
        """``W <- W - s · B A``: undo :meth:`merge`."""
        if not self.merged:
            logger.warning("%s is not merged; unmerge() does nothing", type(self).__name__)
            return
        with torch.no_grad():
            for name, delta in self.delta_weights().items():
                getattr(self.base_layer, name).sub_(delta.to(self._dtype(name)))
        self.merged = False

    # Full (unsharded) adapter tensors, as PEFT stores them -------------------------------
    def adapter_parameters(self) -> dict[str, nn.Parameter]:
        """The adapter's own parameters by name (``lora_A.weight`` ...), base excluded."""
        return {
            name: param
            for name, param in self.named_parameters()
            if not name.startswith("base_layer.")
        }

    def peft_tensor_names(self, name: str) -> list[str]:
        """The keys :meth:`peft_tensors` returns, computed without communicating."""
        return [f"{name}.{param_name}" for param_name in self.adapter_parameters()]

    def peft_tensors(self, name: str) -> dict[str, torch.Tensor]:
        """``{f"{name}.lora_A.weight": A, ...}``: full tensors (TP shards all-gathered)."""
        group = getattr(self, "tensor_parallel_group", None)
        return {
            f"{name}.{param_name}": full_tensor(param, group=group).clone()
            for param_name, param in self.adapter_parameters().items()
        }

    def load_peft_tensors(self, name: str, tensors: dict[str, torch.Tensor]) -> list[str]:
        """Copy full tensors named as :meth:`peft_tensors` names them (sliced for this rank).

        Returns the keys used; a missing key or a shape mismatch raises, naming both shapes.
        """
        used = []
        for param_name, param in self.adapter_parameters().items():
            key = f"{name}.{param_name}"
            if key not in tensors:
                raise ValueError(f"the adapter has no tensor {key!r} for LoRA layer {name!r}")
            copy_full_into(param, tensors[key], key, getattr(self, "tensor_parallel_group", None))
            used.append(key)
        return used

    def _dtype(self, name: str) -> torch.dtype:
        return getattr(self.base_layer, name).dtype

    def _factory(self) -> dict[str, Any]:
        weight = next(self.base_layer.parameters())
        return {"dtype": weight.dtype, "device": weight.device}


class LoraLinear(LoraLayer[nn.Linear]):
    """``Y = X W^T + b + s · dropout(X) A^T B^T``, A ``(r, in)``, B ``(out, r)``."""

    def __init__(self, base_layer: nn.Linear, config: LoraConfig) -> None:
        super().__init__(base_layer, config)
        self.in_features, self.out_features = base_layer.in_features, base_layer.out_features
        factory = self._factory()
        self.lora_A = nn.Linear(self.in_features, self.lora_rank, bias=False, **factory)
        self.lora_B = nn.Linear(self.lora_rank, self.out_features, bias=False, **factory)
        init_lora_a_(self.lora_A.weight, config.init_lora_weights, self.lora_rank)
        nn.init.zeros_(self.lora_B.weight)

    def adapter_forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.to(self.lora_A.weight.dtype)
        return self.lora_B(self.lora_A(self.lora_dropout(x))) * self.scaling

    def delta_weights(self) -> dict[str, torch.Tensor]:
        return {"weight": (self.lora_B.weight @ self.lora_A.weight) * self.scaling}


class LoraEmbedding(LoraLayer[nn.Embedding]):
    """``Y = W[ids] + s · (A^T[ids]) B^T``, A ``(r, num_embeddings)``, B ``(dim, r)``.

    As in PEFT, A starts at zero and B normal, and dropout does not apply (the input is ids).
    """

    adapter_names = ("lora_embedding_A", "lora_embedding_B")

    def __init__(self, base_layer: nn.Embedding, config: LoraConfig) -> None:
        super().__init__(base_layer, config)
        self.in_features, self.out_features = base_layer.num_embeddings, base_layer.embedding_dim
        factory = self._factory()
        # Drawn then re-initialised, as PEFT does, so one seed gives PEFT's adapter exactly.
        self.lora_embedding_A = nn.Parameter(
            torch.randn(self.lora_rank, self.in_features).to(**factory)
        )
        self.lora_embedding_B = nn.Parameter(
            torch.randn(self.out_features, self.lora_rank).to(**factory)
        )
        with torch.no_grad():
            nn.init.zeros_(self.lora_embedding_A)
            nn.init.normal_(self.lora_embedding_B)

    def adapter_forward(self, x: torch.Tensor) -> torch.Tensor:
        base = self.base_layer
        after_a = F.embedding(
            x,
            self.lora_embedding_A.T,
            padding_idx=base.padding_idx,
            max_norm=base.max_norm,
            norm_type=base.norm_type,
            scale_grad_by_freq=base.scale_grad_by_freq,
            sparse=base.sparse,
        )
        return (after_a @ self.lora_embedding_B.T) * self.scaling

    def delta_weights(self) -> dict[str, torch.Tensor]:
        return {"weight": (self.lora_embedding_B @ self.lora_embedding_A).T * self.scaling}


class LoraConv2d(LoraLayer[nn.Conv2d]):
    """``Y = conv(X, W) + s · conv1x1(conv(dropout(X), A), B)``; A has the base's kernel.

    Supports ``groups=1``, ``dilation=1`` and zero padding (the layouts PEFT's adapter shares).
    """

    def __init__(self, base_layer: nn.Conv2d, config: LoraConfig) -> None:
        super().__init__(base_layer, config)
        if base_layer.groups != 1 or base_layer.dilation != (1, 1):
            raise ValueError(
                f"LoRA on Conv2d needs groups=1 and dilation=(1, 1), got groups="
                f"{base_layer.groups}, dilation={base_layer.dilation}"
            )
        padding = base_layer.padding
        if base_layer.padding_mode != "zeros" or isinstance(padding, str):
            raise ValueError(
                f"LoRA on Conv2d needs numeric zero padding, got padding={padding!r}, "
                f"padding_mode={base_layer.padding_mode!r}"
            )
        # nn.Conv2d holds these as 2-tuples (torch types them tuple[int, ...]).
        (kh, kw), (sh, sw), (ph, pw) = base_layer.kernel_size, base_layer.stride, padding
        self.in_features, self.out_features = base_layer.in_channels, base_layer.out_channels
        factory = self._factory()
        self.lora_A = nn.Conv2d(
            self.in_features,
            self.lora_rank,
            (kh, kw),
            (sh, sw),
            (ph, pw),
            bias=False,
            **factory,
        )
        self.lora_B = nn.Conv2d(
            self.lora_rank, self.out_features, (1, 1), (1, 1), bias=False, **factory
        )
        init_lora_a_(self.lora_A.weight, config.init_lora_weights, self.lora_rank)
        nn.init.zeros_(self.lora_B.weight)

    def adapter_forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.to(self.lora_A.weight.dtype)
        return self.lora_B(self.lora_A(self.lora_dropout(x))) * self.scaling

    def delta_weights(self) -> dict[str, torch.Tensor]:
        a, b = self.lora_A.weight, self.lora_B.weight  # (r, in, kh, kw), (out, r, 1, 1)
        # ΔW[o, i, h, w] = s · Σ_r B[o, r] A[r, i, h, w]
        delta = torch.einsum("or,rihw->oihw", b[:, :, 0, 0], a)
        return {"weight": delta * self.scaling}


def copy_full_into(param: torch.Tensor, full: torch.Tensor, key: str, group: Any = None) -> None:
    """``param <- this rank's shard of full`` (all of it for a replicated parameter)."""
    value = full
    if getattr(param, "tensor_model_parallel", False):
        dim, stride = param.partition_dim, getattr(param, "partition_stride", 1)  # type: ignore[attr-defined]
        if group is None:
            from nxd_state import get_parallel_state

            group = get_parallel_state().tensor_parallel_group
        size = collectives.group_size(group)
        expected = list(param.shape)
        expected[dim] *= size
        if list(full.shape) != expected:
            raise ValueError(
                f"{key}: adapter tensor has shape {tuple(full.shape)}, the model expects the full "
                f"shape {tuple(expected)} (local {tuple(param.shape)} x {size} ranks on dim {dim})"
            )
        value = shard_for_rank(full, dim, collectives.group_rank(group), size, stride)
    elif tuple(full.shape) != tuple(param.shape):
        raise ValueError(
            f"{key}: adapter tensor has shape {tuple(full.shape)}, the model expects "
            f"{tuple(param.shape)} (check lora_rank and the module sizes)"
        )
    with torch.no_grad():
        param.copy_(value.to(dtype=param.dtype, device=param.device))
