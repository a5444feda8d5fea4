"""The ``nxd-ckpt`` command: inspect, export and convert checkpoints.

::

    nxd-ckpt info CKPT [--tag T] [--tensors] [--verify] [--json]
    nxd-ckpt export-hf CKPT OUT [--tag T] [--config FILE_OR_DIR] [--tokenizer DIR]
                       [--token-ids JSON]
                       [--max-shard-size 5GB] [--dtype bfloat16]
    nxd-ckpt convert-nxd SRC DST [--tag T] [--out-tag T] [--rules llama|FILE.json]
                         [--allow-pickle]

``info`` lists the tags of a checkpoint folder (complete or not, newest first), and for one
tag the degrees it was saved at, its tensors and sizes; ``--verify`` reads every byte and
checks the checksums. A tag whose index or files fail a check (an index whose chunks overlap,
a link, a checksum) is reported ``DAMAGED`` with the reason, and the command exits 1.
``export-hf`` writes a Hugging Face folder. ``convert-nxd`` turns a folder in NxD's own
layout (pickled ``.pt`` files, read with ``torch.load(weights_only=True)``) into this format.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import sys
from pathlib import Path
from typing import Any

__all__ = ["main"]


def _tag_summary(tag_dir: Path, *, tensors: bool, verify: bool) -> dict[str, Any]:
    from nxd_ckpt.format import FormatError
    from nxd_ckpt.load._reader import CheckpointReader

    try:
        with CheckpointReader(tag_dir) as reader:
            return _summary(reader, tensors=tensors, verify=verify)
    except FormatError as error:  # DamagedFileError and ContainmentError included
        return {"tag": tag_dir.name, "path": str(tag_dir), "damaged": str(error)}


def _summary(reader: Any, *, tensors: bool, verify: bool) -> dict[str, Any]:
    tag_dir = reader.tag_dir
    index = reader.index
    summary: dict[str, Any] = {
        "tag": index.tag,
        "path": str(tag_dir),
        "complete": (tag_dir / "done").is_file(),
        "format_version": index.format_version,
        "saved_at": index.parallel,
        "files": len(index.files),
        "bytes": sum(f.size for f in index.files.values()),
        "categories": {},
        "has_scheduler": index.has_scheduler,
        "has_user_content": index.has_user_content,
        "lora": index.lora,
    }
    for category, records in index.tensors.items():
        summary["categories"][category] = {
            "tensors": len(records),
            "elements": sum(math.prod(r.shape) for r in records.values()),
        }
        if tensors:
            summary["categories"][category]["list"] = {
                name: {"shape": r.shape, "dtype": r.dtype, "chunks": len(r.chunks), **r.sharding}
                for name, r in records.items()
            }
    if verify:
        summary["verified_bytes"] = reader.verify_files()
    return summary


def _info(args: argparse.Namespace) -> int:
    from nxd_ckpt.format import INDEX_NAME, _tags

    path = Path(args.checkpoint)
    if not path.exists():
        raise FileNotFoundError(f"{path} does not exist")
    if (path / INDEX_NAME).is_file() and not (path / INDEX_NAME).is_symlink() and args.tag is None:
        tag_dirs = [path]
        listing: list[dict[str, Any]] | None = None
    else:
        tags = _tags.list_tags(path)
        listing = [{"tag": t.name, "complete": t.complete} for t in reversed(tags)]
        chosen = [
            t
            for t in tags
            if t.complete and t.kind == "nxd" and (args.tag is None or t.name == args.tag)
        ]
        if args.tag is not None and not chosen:
            _tags.resolve_tag_dir(path, args.tag)  # raises the precise error
        tag_dirs = [chosen[-1].path] if chosen else []
    summaries = [_tag_summary(d, tensors=args.tensors, verify=args.verify) for d in tag_dirs]
    result = {"tags": listing, "newest_complete": summaries}
    damaged = any("damaged" in summary for summary in summaries)
    if args.json:
        print(json.dumps(result, indent=2))
        return 1 if damaged else 0
    if listing is not None:
        print(f"{path}: {len(listing)} tag(s), newest first")
        for entry in listing:
            state = "complete" if entry["complete"] else "INCOMPLETE (no done marker)"
            print(f"  {entry['tag'] or '(root)':<24} {state}")
    for summary in summaries:
        if "damaged" in summary:
            print(f"tag {summary['tag']!r} at {summary['path']}: DAMAGED: {summary['damaged']}")
            continue
        saved = summary["saved_at"]
        print(
            f"tag {summary['tag']!r}: format v{summary['format_version']}, saved at TP="
            f"{saved.get('tensor_parallel_size')} PP={saved.get('pipeline_parallel_size')} "
            f"DP={saved.get('data_parallel_size')} ZeRO-1={saved.get('zero1')}, "
            f"{summary['files']} file(s), {summary['bytes'] / 2**20:.2f} MiB"
        )
        for category, entry in summary["categories"].items():
            print(f"  {category}: {entry['tensors']} tensors, {entry['elements']:,} elements")
            for name, record in entry.get("list", {}).items():
                print(f"    {name} {record['dtype']}{record['shape']} chunks={record['chunks']}")
        if "verified_bytes" in summary:
            print(f"  verified: {summary['verified_bytes']:,} bytes, all checksums match")
    return 1 if damaged else 0


def _load_config(value: str | None) -> Any:
    if value is None:
        return None
    path = Path(value)
    if path.is_dir():
        path = path / "config.json"
    return json.loads(path.read_text())


def _token_ids(value: str | None) -> dict[str, int] | None:
    if value is None:
        return None
    ids = json.loads(value)
    if not isinstance(ids, dict):
        raise ValueError(
            f'--token-ids must be a JSON object such as {{"eos_token_id": 0}}: {value}'
        )
    return ids


def _export(args: argparse.Namespace) -> int:
    import torch

    from nxd_ckpt.hf import export_hf

    dtype = getattr(torch, args.dtype) if args.dtype else None  # a checked choice
    out = export_hf(
        args.checkpoint,
        args.out,
        tag=args.tag,
        config=_load_config(args.config),
        tokenizer=args.tokenizer,
        max_shard_size=args.max_shard_size,
        dtype=dtype,
        token_ids=_token_ids(args.token_ids),
    )
    print(f"wrote {out}")
    return 0


def _convert(args: argparse.Namespace) -> int:
    from nxd_ckpt.nxd_convert import convert_nxd_checkpoint, load_rules

    out = convert_nxd_checkpoint(
        args.source,
        args.destination,
        tag=args.tag,
        out_tag=args.out_tag,
        rules=load_rules(args.rules),
        allow_pickle=args.allow_pickle,
    )
    print(f"wrote {out}")
    return 0


_EXPORT_DTYPES = ("float64", "float32", "float16", "bfloat16", "float8_e4m3fn", "float8_e5m2")
"""The floating dtypes safetensors stores (``--dtype`` casts floating tensors only)."""


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="nxd-ckpt", description=__doc__.split("\n\n")[0])
    parser.add_argument("-v", "--verbose", action="store_true", help="log progress")
    commands = parser.add_subparsers(dest="command", required=True)
    info = commands.add_parser("info", help="tags, degrees, tensors, sizes, completeness")
    info.add_argument("checkpoint", help="a checkpoint folder or one tag folder")
    info.add_argument("--tag", help="describe this tag (default: the newest complete one)")
    info.add_argument("--tensors", action="store_true", help="list every tensor")
    info.add_argument("--verify", action="store_true", help="read all data, check checksums")
    info.add_argument("--json", action="store_true", help="print JSON")
    info.set_defaults(run=_info)
    export = commands.add_parser("export-hf", help="write a Hugging Face folder")
    export.add_argument("checkpoint")
    export.add_argument("out")
    export.add_argument("--tag")
    export.add_argument("--config", help="config.json (or its folder); default: the saved one")
    export.add_argument("--tokenizer", help="a folder to copy tokenizer files from")
    export.add_argument(
        "--token-ids",
        help='special token ids to write, JSON: {"eos_token_id": 0, ...} (default: the '
        "config's, which must agree with the tokenizer's)",
    )
    export.add_argument("--max-shard-size", default="5GB")
    export.add_argument(
        "--dtype", choices=_EXPORT_DTYPES, help="cast floating tensors, e.g. bfloat16"
    )
    export.set_defaults(run=_export)
    convert = commands.add_parser("convert-nxd", help="NxD's .pt layout -> this format")
    convert.add_argument("source", help="an NxD checkpoint folder (or one of its tags)")
    convert.add_argument("destination", help="the checkpoint folder to write")
    convert.add_argument("--tag", help="the NxD tag (default: newest complete)")
    convert.add_argument("--out-tag", help="tag to write (default: the same name)")
    convert.add_argument(
        "--rules",
        default="llama",
        help="partition dims by parameter name: 'llama' or a JSON file of [regex, dim] pairs",
    )
    convert.add_argument(
        "--allow-pickle",
        action="store_true",
        help="also convert user_content.pt / scheduler.pt (UNSAFE: runs code from the files)",
    )
    convert.set_defaults(run=_convert)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING)
    try:
        return int(args.run(args))
    except (OSError, ValueError, RuntimeError, KeyError) as error:
        print(f"nxd-ckpt {args.command}: error: {error}", file=sys.stderr)
        return 1


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
