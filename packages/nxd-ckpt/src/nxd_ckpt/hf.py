"""★ Hugging Face folders: export a checkpoint to one, and load one into a sharded model.

Export writes what ``transformers.AutoModelForCausalLM.from_pretrained`` reads:
``model.safetensors`` (or ``model-0000k-of-0000n.safetensors`` shards of at most
``max_shard_size`` and ``model.safetensors.index.json``), ``config.json`` (``use_cache: true``,
``architectures`` as saved), ``generation_config.json`` (the special token ids, checked
against the tokenizer's: :mod:`nxd_ckpt.sources._hf_config`) and the tokenizer files when given. It
streams: each global tensor is assembled from its chunks, written, and dropped, so host memory
stays near the largest tensor. Names are the stored names (a Hugging Face model parallelised
in place keeps its own, or declares them: :mod:`nxd_ckpt.parts`); ``name_map`` renames or
drops.

Import builds an in-memory index of a Hugging Face folder (one whole-tensor chunk per
tensor) and loads it like a checkpoint: each rank reads only the slices its shards need. The
index's ``weight_map`` may name only files inside the folder (relative, no ``..``, not
absolute: :func:`hf_weight_files`); the files themselves may be links (the Hugging Face
cache is made of them). Headers are parsed and checked by :mod:`nxd_ckpt.format._stread`, so a
damaged file is an error naming it.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from nxd_ckpt.format import (
    INDEX_NAME,
    CheckpointIndex,
    ChunkRecord,
    FormatError,
    TensorRecord,
    _tags,
)
from nxd_ckpt.format._contain import check_relative
from nxd_ckpt.format._stfile import dtype_from_name, dtype_name, plan_file, write_planned
from nxd_ckpt.format._stread import SafetensorsFile
from nxd_ckpt.layout._context import current_context
from nxd_ckpt.load._load_model import load_model
from nxd_ckpt.load._reader import CheckpointReader
from nxd_ckpt.sources._hf_config import export_configs

__all__ = [
    "HF_INDEX_NAME",
    "HF_WEIGHTS_NAME",
    "checkpoint_tag_dir",
    "export_hf",
    "hf_index",
    "hf_weight_files",
    "load_hf_checkpoint",
]

logger = logging.getLogger(__name__)

HF_WEIGHTS_NAME = "model.safetensors"
HF_INDEX_NAME = "model.safetensors.index.json"
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "tokenizer.model",
    "vocab.json",
    "vocab.txt",
    "merges.txt",
    "chat_template.jinja",
)
NameMap = Callable[[str], "str | None"]


def parse_size(size: int | str) -> int:
    """Bytes from an int or ``"5GB"``, ``"500MB"``, ``"2GiB"`` (Hugging Face's notation)."""
    if isinstance(size, int):
        if size <= 0:
            raise ValueError(f"max_shard_size must be positive, got {size}")
        return size
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]i?B)\s*", str(size), re.IGNORECASE)
    if match is None:
        raise ValueError(f"max_shard_size {size!r}: expected an int or e.g. '5GB', '500MB'")
    value, unit = float(match.group(1)), match.group(2).upper()
    base = 1024 if "I" in unit else 1000
    return int(value * base ** ("KMGT".index(unit[0]) + 1))


def checkpoint_tag_dir(checkpoint: str | os.PathLike[str], tag: str | None) -> Path:
    """A tag folder (holding ``index.json``) given itself, or its checkpoint path and tag
    (a plain name; the tag folder is not a link: :func:`nxd_ckpt.format._tags.resolve_tag_dir`)."""
    path = Path(checkpoint)
    if tag is None and os.path.lexists(path / INDEX_NAME):  # a link: refused when read
        return path
    return _tags.resolve_tag_dir(path, tag)[0]


def _config_dict(config: Any) -> dict[str, Any] | None:
    if config is None or isinstance(config, dict):
        return config
    to_json = getattr(config, "to_json_string", None)
    if callable(to_json):
        return json.loads(to_json(use_diff=False))
    to_dict = getattr(config, "to_dict", None)
    if callable(to_dict):
        return to_dict()
    raise TypeError(f"config must be a dict or a PretrainedConfig-like object, got {config!r}")


def _copy_tokenizer(tokenizer: Any, out_dir: Path) -> list[str]:
    if tokenizer is None:
        return []
    save = getattr(tokenizer, "save_pretrained", None)
    if callable(save):
        save(str(out_dir))
        return ["(save_pretrained)"]
    source = Path(tokenizer)
    if not source.is_dir():
        raise FileNotFoundError(f"tokenizer folder {source} does not exist")
    copied = [name for name in TOKENIZER_FILES if (source / name).is_file()]
    if not copied:
        raise FileNotFoundError(f"{source} holds none of the tokenizer files {TOKENIZER_FILES}")
    for name in copied:
        shutil.copyfile(source / name, out_dir / name)
    return copied


def export_hf(
    checkpoint: str | os.PathLike[str],
    out_dir: str | os.PathLike[str],
    *,
    tag: str | None = None,
    config: Any = None,
    tokenizer: Any = None,
    max_shard_size: int | str = "5GB",
    dtype: torch.dtype | None = None,
    name_map: NameMap | None = None,
    progress: bool = True,
    token_ids: dict[str, Any] | None = None,
    architectures: list[str] | None = None,
) -> Path:
    """Write the model of a checkpoint tag as a Hugging Face folder; returns ``out_dir``.

    ``checkpoint``: a tag folder, or a checkpoint path with ``tag`` (None: newest complete).
    ``config``: a dict or ``PretrainedConfig`` (default: the one saved with the model, if
    it had one); written with ``use_cache: true``. ``tokenizer``: a folder to copy tokenizer
    files from, or an object with ``save_pretrained``; its bos/eos/pad ids must agree with
    the saved config's (an error names both ids otherwise; an explicit ``config`` is taken as
    it is). ``token_ids``: ``{"eos_token_id": …}`` written as given (nxd's keyword).
    ``generation_config.json`` carries the ids. ``architectures``: written when the config
    has none (checkpoints saved before the model class was recorded). ``dtype``: cast
    floating tensors (e.g. ``torch.bfloat16``). ``name_map(name)``: the output name, or None
    to leave a tensor out.
    A LoRA adapter-only checkpoint is written as a PEFT adapter folder instead
    (``adapter_model.safetensors``).
    """
    tag_dir = checkpoint_tag_dir(checkpoint, tag)
    with CheckpointReader(tag_dir) as reader:
        options = {
            "config": config,
            "tokenizer": tokenizer,
            "max_shard_size": max_shard_size,
            "dtype": dtype,
            "name_map": name_map,
            "progress": progress,
            "token_ids": token_ids,
            "architectures": architectures,
        }
        return _export(reader, Path(out_dir), **options)


def _export(
    reader: CheckpointReader,
    out_dir: Path,
    *,
    config: Any,
    tokenizer: Any,
    max_shard_size: int | str,
    dtype: torch.dtype | None,
    name_map: NameMap | None,
    progress: bool,
    token_ids: dict[str, Any] | None,
    architectures: list[str] | None,
) -> Path:
    """The export of :func:`export_to_hf` from an open tag: the weights in shards, the
    configs, the tokenizer."""
    index = reader.index
    if index.lora is not None and index.lora.get("mode") == "adapter":
        from nxd_ckpt.lora import export_peft_adapter

        return export_peft_adapter(reader, Path(out_dir), progress=progress)
    tensors = _exportable_tensors(reader)
    config_dict, generation = _export_configs(reader, config, tokenizer, token_ids, architectures)
    shards = _weight_shards(tensors, name_map, dtype, parse_size(max_shard_size))
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    total_bytes = _write_weights(reader, tensors, shards, out, dtype, progress)
    (out / "config.json").write_text(json.dumps(config_dict, indent=2, sort_keys=True))
    (out / "generation_config.json").write_text(json.dumps(generation, indent=2, sort_keys=True))
    copied = _copy_tokenizer(tokenizer, out)
    logger.info(
        "exported %s to %s: %d tensors in %d file(s), %d bytes, tokenizer %s",
        reader.tag_dir,
        out,
        sum(len(shard) for shard in shards),
        len(shards),
        total_bytes,
        copied or "not given",
    )
    return out


def _exportable_tensors(reader: CheckpointReader) -> dict[str, TensorRecord]:
    """The tag's model tensors; refused when there are none, or when some were saved without
    sharding (a plain state dict's, which cannot be assembled into full tensors)."""
    tensors = reader.index.category("model")
    if not tensors:
        raise ValueError(f"{reader.tag_dir} holds no model tensors to export")
    unknown = [n for n, r in tensors.items() if r.sharding.get("rank_local")]
    if unknown:
        raise ValueError(
            f"{reader.tag_dir}: tensors {unknown[:8]} were saved from a plain state dict "
            f"without sharding attributes; they cannot be assembled into full tensors"
        )
    return tensors


def _export_configs(
    reader: CheckpointReader,
    config: Any,
    tokenizer: Any,
    token_ids: dict[str, Any] | None,
    architectures: list[str] | None,
) -> tuple[dict[str, Any], dict[str, Any]]:
    """``config.json`` and ``generation_config.json``: from ``config``, else the saved one."""
    config_dict = _config_dict(config) if config is not None else reader.index.hf_config
    if config_dict is None:
        raise ValueError(
            f"{reader.tag_dir} has no model config saved (the model had no .config): pass "
            f"config= (a dict or transformers PretrainedConfig) to write config.json"
        )
    config_dict, generation = export_configs(
        config_dict, tokenizer=tokenizer, token_ids=token_ids, explicit_config=config is not None
    )
    if not config_dict.get("architectures") and architectures:
        config_dict["architectures"] = list(architectures)
    if not config_dict.get("architectures"):
        logger.warning(
            "%s: the config has no architectures (the checkpoint was saved without the model "
            "class); transformers' Auto classes still load it by model_type",
            reader.tag_dir,
        )
    return config_dict, generation


def _weight_shards(
    tensors: dict[str, TensorRecord],
    name_map: NameMap | None,
    dtype: torch.dtype | None,
    limit: int,
) -> list[list[tuple[str, str]]]:
    """The output files' ``(output name, stored name)`` lists, in stored order: a new file
    starts when the next tensor would take the current one past ``limit`` bytes (a larger
    tensor gets a file of its own). ``name_map`` renames or (None) leaves a tensor out."""
    shards: list[list[tuple[str, str]]] = [[]]
    size = 0
    for name, record in tensors.items():
        out_name = name_map(name) if name_map is not None else name
        if out_name is None:
            continue
        nbytes = _nbytes(record, dtype)
        if shards[-1] and size + nbytes > limit:
            shards.append([])
            size = 0
        shards[-1].append((out_name, name))
        size += nbytes
    return shards


def _write_weights(
    reader: CheckpointReader,
    tensors: dict[str, TensorRecord],
    shards: list[list[tuple[str, str]]],
    out: Path,
    dtype: torch.dtype | None,
    progress: bool,
) -> int:
    """Write one safetensors file per shard (and, for several, the index naming each
    tensor's file), each tensor read whole and cast; returns the bytes written."""
    from tqdm.auto import tqdm

    total_bytes = sum(_nbytes(tensors[n], dtype) for shard in shards for _, n in shard)
    bar = tqdm(total=total_bytes, unit="B", unit_scale=True, desc="export", disable=not progress)

    def source(name: str) -> Callable[[], torch.Tensor]:
        def read() -> torch.Tensor:
            value = reader.read_full("model", name)
            value = value.to(_out_dtype(tensors[name], dtype)).contiguous()
            bar.update(value.numel() * value.element_size())
            return value

        return read

    weight_map: dict[str, str] = {}
    for number, shard in enumerate(shards, start=1):
        filename = (
            HF_WEIGHTS_NAME
            if len(shards) == 1
            else f"model-{number:05d}-of-{len(shards):05d}.safetensors"
        )
        items = [(o, _out_dtype(tensors[n], dtype), tuple(tensors[n].shape)) for o, n in shard]
        plan = plan_file(items, {"format": "pt"})
        stored = dict(shard)
        write_planned(out / filename, plan, [source(stored[e.key]) for e in plan.entries])
        weight_map.update({out_name: filename for out_name, _ in shard})
    bar.close()
    if len(shards) > 1:
        document = {"metadata": {"total_size": total_bytes}, "weight_map": weight_map}
        (out / HF_INDEX_NAME).write_text(json.dumps(document, indent=2))
    return total_bytes


def _out_dtype(record: TensorRecord, dtype: torch.dtype | None) -> torch.dtype:
    saved = dtype_from_name(record.dtype)
    return dtype if dtype is not None and saved.is_floating_point else saved


def _nbytes(record: TensorRecord, dtype: torch.dtype | None) -> int:
    count = 1
    for size in record.shape:
        count *= size
    return count * _out_dtype(record, dtype).itemsize


def hf_weight_files(source: Path) -> tuple[Path, list[str]]:
    """(folder, safetensors files relative to it) of a Hugging Face folder or one file. The
    index's ``weight_map`` must map names to file names inside the folder (a FormatError
    names an absolute path, ``..`` or a malformed index)."""
    if source.is_file():
        return source.parent, [source.name]
    index_path = source / HF_INDEX_NAME
    if index_path.is_file():
        try:
            document = json.loads(index_path.read_bytes())
        except (ValueError, RecursionError) as error:
            raise FormatError(f"{index_path} is not valid JSON: {error}") from None
        weight_map = document.get("weight_map") if isinstance(document, dict) else None
        if not isinstance(weight_map, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in weight_map.items()
        ):
            raise FormatError(f"{index_path}: 'weight_map' must map tensor names to file names")
        files = sorted(set(weight_map.values()))
        for name in files:
            check_relative(name, str(index_path))
        return source, files
    if (source / HF_WEIGHTS_NAME).is_file():
        return source, [HF_WEIGHTS_NAME]
    pickled = sorted(p.name for p in source.glob("*.bin")) if source.is_dir() else []
    found = (
        f"; it holds {', '.join(pickled)}: a pickle (torch.save), which nxd-ckpt never reads "
        f"(loading it could run code); convert it to safetensors first"
        if pickled
        else ""
    )
    raise FileNotFoundError(
        f"{source} is neither a safetensors file nor a folder with {HF_WEIGHTS_NAME} or "
        f"{HF_INDEX_NAME}{found}"
    )


def hf_index(
    source: str | os.PathLike[str], name_map: NameMap | None = None
) -> tuple[Path, CheckpointIndex]:
    """(folder, in-memory index) of the safetensors weights of ``source``; every header is
    parsed and checked (an error names the file)."""
    folder, files = hf_weight_files(Path(source))
    index = CheckpointIndex(tag="", save_id="", parallel={})
    model: dict[str, TensorRecord] = {}
    for relative in files:
        header = SafetensorsFile(folder / relative, follow=True)
        try:
            for key, entry in header.entries.items():
                name = name_map(key) if name_map is not None else key
                if name is None:
                    continue
                shape = list(entry.shape)
                chunk = ChunkRecord(relative, key, [0] * len(shape), shape, [], 1)
                model[name] = TensorRecord(shape, dtype_name(entry.dtype), [chunk])
        finally:
            header.close()
    index.tensors["model"] = model
    return folder, index


def load_hf_checkpoint(
    model: Any,
    source: str | os.PathLike[str],
    *,
    strict: bool = True,
    name_map: NameMap | None = None,
) -> None:
    """Load a Hugging Face folder (or one safetensors file) into ``model`` at any TP/PP/DP
    layout; ``name_map(hf_name)`` gives the model's name (None: skip). Collective."""
    folder, index = hf_index(source, name_map)
    with CheckpointReader(folder, index=index, follow_links=True) as reader:
        load_model(model, reader, current_context(), strict)
        logger.info("loaded %s (%d bytes read)", source, reader.bytes_read)
