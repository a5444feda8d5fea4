"""NxDPPModel's view of this rank's stages under the original model's names (NxD's ``local_*``
methods and the local ``load_state_dict``)."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import torch
from torch import nn
from torch.nn.modules.module import _IncompatibleKeys

__all__ = ["LocalStagesMixin"]


class LocalStagesMixin:
    """Needs ``self.stages`` (stage index -> module whose names are the original ones) and
    ``self.original_torch_module``."""

    stages: nn.ModuleDict
    original_torch_module: Any

    def local_named_parameters(
        self, *args: Any, **kwargs: Any
    ) -> Iterator[tuple[str, nn.Parameter]]:
        """This rank's parameters under the original model's names, each once."""
        seen: set[int] = set()
        for stage in self.stages.values():
            for name, param in stage.named_parameters(remove_duplicate=False):
                if id(param) not in seen:
                    seen.add(id(param))
                    yield name, param

    def local_parameters(self, *args: Any, **kwargs: Any) -> Iterator[nn.Parameter]:
        for _, param in self.local_named_parameters():
            yield param

    def local_named_buffers(
        self, prefix: str = "", recurse: bool = True
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """This rank's buffers under the original model's names (NxD's signature; ``prefix``
        is prepended to every name), each once."""
        seen: set[int] = set()
        for stage in self.stages.values():
            for name, buffer in stage.named_buffers(remove_duplicate=False):
                if id(buffer) not in seen:
                    seen.add(id(buffer))
                    yield prefix + name, buffer

    def local_buffers(self, recurse: bool = True) -> Iterator[torch.Tensor]:
        for _, buffer in self.local_named_buffers(recurse=recurse):
            yield buffer

    def local_named_modules(self, *args: Any, **kwargs: Any) -> Iterator[tuple[str, nn.Module]]:
        """This rank's stage modules' submodules under the original model's names."""
        seen: set[int] = set()
        for stage in self.stages.values():
            for name, module in stage.named_modules():
                if name and id(module) not in seen:
                    seen.add(id(module))
                    yield name, module

    def local_modules(self) -> Iterator[nn.Module]:
        for _, module in self.local_named_modules():
            yield module

    def local_state_dict(
        self, *args: Any, prefix: str = "", keep_vars: bool = False, **kwargs: Any
    ) -> dict[str, torch.Tensor]:
        """Parameters and persistent buffers of the local stages under the original names:
        this rank's part of the original model's ``state_dict()``."""
        skip = self._non_persistent()
        out: dict[str, torch.Tensor] = {}
        for stage in self.stages.values():
            for name, tensor in stage.state_dict(keep_vars=keep_vars).items():
                if name not in skip:
                    out.setdefault(prefix + name, tensor)
        return out

    def _original(self) -> nn.Module:
        module = self.original_torch_module
        if isinstance(module, nn.Module):
            return module
        return nn.ModuleList(module)  # manual mode: the layer list, names "3.weight"

    def _non_persistent(self) -> set[str]:
        """Buffers the original model leaves out of its state dict (rotary tables); a stage
        module, which holds them as plain attributes, would not."""
        out: set[str] = set()
        for name, module in self._original().named_modules():
            out.update(f"{name}.{b}" if name else b for b in module._non_persistent_buffers_set)
        return out

    def _aliases(self) -> dict[str, list[str]]:
        """Other names of each tied parameter in the original model (``lm_head.weight`` ->
        ``["model.embed_tokens.weight"]``): a checkpoint may hold a tied weight once."""
        module = self._original()
        names: dict[int, list[str]] = {}
        for name, param in module.named_parameters(remove_duplicate=False):
            names.setdefault(id(param), []).append(name)
        return {n: [a for a in group if a != n] for group in names.values() for n in group}

    def load_state_dict(
        self, state_dict: Mapping[str, Any], strict: bool = True, assign: bool = False
    ) -> _IncompatibleKeys:
        """Load this rank's entries of a state dict under the original names (NxD's
        semantics): entries of other ranks' stages are ignored; with ``strict``, a local
        parameter or buffer absent from ``state_dict`` (under any of its tied names) is an
        error. ``assign`` is passed to each stage's ``nn.Module.load_state_dict`` (the
        signature is ``nn.Module``'s). Returns ``(missing_keys, unexpected_keys)``; nothing
        is unexpected."""
        aliases, skip = self._aliases(), self._non_persistent()
        missing: list[str] = []
        for stage in self.stages.values():
            mine: dict[str, Any] = {}
            for name in stage.state_dict(keep_vars=True):
                if name in skip:
                    continue
                source = next((n for n in [name, *aliases.get(name, [])] if n in state_dict), None)
                if source is not None:
                    mine[name] = state_dict[source]
            result = stage.load_state_dict(mine, strict=False, assign=assign)
            missing += [k for k in result.missing_keys if k not in missing and k not in skip]
        if strict and missing:
            raise RuntimeError(
                f"Error(s) in loading state_dict for NxDPPModel: this pipeline rank's "
                f"{missing[:8]}{' ...' if len(missing) > 8 else ''} ({len(missing)} keys) are "
                f"missing from the state dict (keys are the original model's names)"
            )
        return _IncompatibleKeys(missing, [])
