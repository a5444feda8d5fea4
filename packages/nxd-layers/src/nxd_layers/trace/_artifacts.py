"""The on-disk form of a traced model: one folder, no pickle.

    manifest.json              format, TP degree, device, buckets (input signatures), files
    tp_<r>.pt2                 rank r's program for bucket 0 (``torch.export.save``)
    tp_<r>_bucket<b>.pt2       rank r's program for bucket b > 0
    tp_<r>.safetensors         rank r's weights, when not inlined (``inline_weights_to_neff``
                               False); the programs then hold NaN placeholders
    tp_<r>[_bucket<b>].aoti.pt2  AOTInductor packages, when compiled

A ``.pt2`` archive stores plain tensors as raw bytes and the graph as JSON, but it can also
carry pickled objects (sample inputs, tensor subclasses, script objects) that
``torch.export.load`` would unpickle: nxd writes none (sample inputs are dropped before saving)
and :func:`check_archive` refuses an archive that holds any before it is loaded.
"""

from __future__ import annotations

import json
import warnings
import zipfile
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file
from torch import nn
from torch.export import ExportedProgram

__all__ = [
    "FORMAT",
    "MANIFEST",
    "check_archive",
    "program_file",
    "read_manifest",
    "restore_weights",
    "save_programs",
    "write_manifest",
]

FORMAT = "nxd-trace"
FORMAT_VERSION = 1
MANIFEST = "manifest.json"


def program_file(rank: int, bucket: int, suffix: str = ".pt2") -> str:
    return f"tp_{rank}{f'_bucket{bucket}' if bucket else ''}{suffix}"


def _placeholder(value: torch.Tensor) -> torch.Tensor:
    """A tensor of ``value``'s shape and dtype backed by one element (NaN where possible)."""
    fill = float("nan") if value.dtype.is_floating_point or value.dtype.is_complex else 0
    small = torch.full((), fill, dtype=value.dtype).expand(value.shape)
    return nn.Parameter(small, requires_grad=False) if isinstance(value, nn.Parameter) else small


def _unique_weights(state: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict]:
    """(one entry per distinct tensor, {alias name: stored name}) for safetensors, which
    refuses tensors that share memory (tied weights)."""
    stored: dict[str, torch.Tensor] = {}
    aliases: dict[str, str] = {}
    seen: dict[tuple[int, int | torch.SymInt, tuple[int, ...]], str] = {}
    for name, value in state.items():
        key = (value.untyped_storage().data_ptr(), value.storage_offset(), tuple(value.shape))
        if key in seen and value.numel():
            aliases[name] = seen[key]
            continue
        seen[key] = name
        stored[name] = value.detach().to("cpu").contiguous().clone()
    return stored, aliases


def save_programs(
    programs: list[ExportedProgram], directory: Path, rank: int, inline: bool
) -> dict[str, Any]:
    """Write rank ``rank``'s programs (and weights unless ``inline``); return its manifest
    entry."""
    entry: dict[str, Any] = {"programs": [], "weights": None, "aliases": {}}
    originals = dict(programs[0].state_dict)
    if not inline:
        stored, entry["aliases"] = _unique_weights(originals)
        name = f"tp_{rank}.safetensors"
        save_file(stored, str(directory / name), metadata={"format": "pt", "rank": str(rank)})
        entry["weights"] = name
    for bucket, program in enumerate(programs):
        path = directory / program_file(rank, bucket)
        kept, examples = dict(program.state_dict), program.example_inputs
        if not inline:
            for key, value in kept.items():
                program.state_dict[key] = _placeholder(value)
        program.example_inputs = None  # they would be pickled into the archive
        try:
            with warnings.catch_warnings():  # placeholders are views of one element
                warnings.filterwarnings("ignore", message="No complete tensor found")
                torch.export.save(program, str(path))
        finally:
            program.state_dict.update(kept)
            program.example_inputs = examples
        entry["programs"].append(path.name)
    return entry


def check_archive(path: Path) -> None:
    """Refuse a ``.pt2`` that holds pickled payloads (sample inputs, pickled tensors, custom
    objects), before ``torch.export.load`` would unpickle them."""
    try:
        archive = zipfile.ZipFile(path)
    except zipfile.BadZipFile as error:
        raise ValueError(f"{path} is not a torch.export archive ({error})") from error
    with archive:
        for info in archive.infolist():
            name = info.filename
            if "/data/sample_inputs/" in name and info.file_size:
                raise ValueError(
                    f"refusing to load {path}: it holds pickled sample inputs ({name})"
                )
            if name.endswith("_config.json") and "/data/" in name:
                config = json.loads(archive.read(name)).get("config", {})
                pickled = sorted(k for k, v in config.items() if v.get("use_pickle"))
                if pickled:
                    raise ValueError(
                        f"refusing to load {path}: entries {pickled} are pickled (nxd saves "
                        "plain tensors only)"
                    )


def restore_weights(
    programs: list[ExportedProgram], weights_path: Path | None, aliases: dict[str, str]
) -> None:
    """Put real weights into loaded programs: from ``weights_path`` (safetensors) when they
    were saved apart, else bucket 0's inlined ones (so every bucket shares one copy)."""
    if weights_path is None:
        source = dict(programs[0].state_dict)
    else:
        source = load_file(str(weights_path))
        for alias, target in aliases.items():
            source[alias] = source[target]
    for program in programs:
        for key, placeholder in list(program.state_dict.items()):
            if key not in source:
                raise ValueError(f"{weights_path or 'bucket 0'} has no tensor {key!r}")
            value = source[key]
            if value.shape != placeholder.shape or value.dtype != placeholder.dtype:
                raise ValueError(
                    f"weight {key!r}: {weights_path} holds {value.dtype}{list(value.shape)}, the "
                    f"program expects {placeholder.dtype}{list(placeholder.shape)}"
                )
            if isinstance(placeholder, nn.Parameter) and not isinstance(value, nn.Parameter):
                value = nn.Parameter(value, requires_grad=False)
            program.state_dict[key] = value


def write_manifest(directory: Path, manifest: dict[str, Any]) -> None:
    text = json.dumps({"format": FORMAT, "version": FORMAT_VERSION, **manifest}, indent=1)
    tmp = directory / (MANIFEST + ".tmp")
    tmp.write_text(text)
    tmp.replace(directory / MANIFEST)


def read_manifest(directory: Path) -> dict[str, Any]:
    """The manifest of a saved traced model, after checking that every rank's files exist."""
    path = directory / MANIFEST
    if not directory.is_dir():
        raise FileNotFoundError(f"parallel_model_load: {directory} is not a directory")
    if not path.is_file():
        raise FileNotFoundError(
            f"parallel_model_load: {directory} has no {MANIFEST}; save it with parallel_model_save"
        )
    manifest = json.loads(path.read_text())
    if manifest.get("format") != FORMAT or manifest.get("version") != FORMAT_VERSION:
        raise ValueError(
            f"{path} is not an nxd traced model (format {manifest.get('format')!r} version "
            f"{manifest.get('version')!r}, expected {FORMAT!r} {FORMAT_VERSION})"
        )
    tp = manifest["tp_degree"]
    if len(manifest["ranks"]) != tp:
        raise ValueError(f"{path} lists {len(manifest['ranks'])} ranks for tp_degree={tp}")
    for rank, entry in enumerate(manifest["ranks"]):
        names = [*entry["programs"], *entry.get("aoti", [])]
        if entry.get("weights"):
            names.append(entry["weights"])
        missing = [name for name in names if not (directory / name).is_file()]
        if missing:
            raise FileNotFoundError(
                f"parallel_model_load: rank {rank} of tp_degree={tp} is missing {missing} in "
                f"{directory} (was the folder copied completely?)"
            )
    return manifest
