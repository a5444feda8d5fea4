"""The ``nxd-train`` command line: ``nxd-train [flags]`` and ``nxd-train export RUN_DIR``.

Every field of :class:`~nxd_trainer.train.config.TrainConfig` is a flag (``--seq-len``; bools
as ``--zero1`` / ``--no-zero1``), its help text the field's docstring. Bad input ends with one
line, ``nxd-train: error: ...``, and exit status 2 (1 when a worker failed, 130 when
interrupted after saving); never a traceback, except for a bug.
"""

from __future__ import annotations

import argparse
import sys
import types
import typing
from dataclasses import fields
from typing import Any

from nxd_trainer.train.config import ConfigError, TrainConfig, default_of, field_docs, load_toml

__all__ = ["build_parser", "main", "parse_config"]

EXAMPLES = """\
examples:
  nxd-train                                  tiny Llama, TP=2 on 2 CPU processes, stdlib corpus
  nxd-train --tp 2 --pp 2 --nproc-per-node 4 --microbatches 2
  nxd-train --tp 1 --zero1 --data notes/ --name notes
  nxd-train --model ./llama-folder --lora-rank 8 --data corpus.txt --tokenizer ./llama-folder
  nxd-train --config run.toml --steps 1000   (flags override the TOML file)
  nxd-train --dry-run --tp 2 --pp 2 --nproc-per-node 8
  nxd-train --nnodes 2 --node-rank 0 --rdzv-endpoint host0:29500   (same on host1, rank 1)
  nxd-train export runs/tiny                 (HF folder of the newest checkpoint)

run folder <runs-dir>/<name>/: config.toml, tokenizer/, data/, checkpoints/step_NNNNNNNN/,
tb/, metrics.jsonl, summary.json, hf/. Rerunning the same command resumes.
"""
# Groups of --help, in the order of the dataclass.
GROUPS = {
    "run": "name",
    "model": "model",
    "data": "data",
    "optimization": "steps",
    "launch": "nproc_per_node",
    "parallelism and numerics": "tp",
    "progress, evaluation, checkpoints, export": "eval_every",
}


def _base_type(annotation: Any) -> Any:
    if isinstance(annotation, types.UnionType) or typing.get_origin(annotation) is typing.Union:
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        return args[0]
    return annotation


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="nxd-train",
        description="Train a Llama-family causal LM with any TP/PP/DP mix (nxd's main job). "
        "Defaults < --config TOML < flags.",
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        argument_default=argparse.SUPPRESS,
    )
    parser.add_argument(
        "--config", metavar="TOML", help="TOML file of settings (keys as below, underscored)"
    )
    hints = typing.get_type_hints(TrainConfig)
    docs = field_docs(TrainConfig)
    starts = {first: title for title, first in GROUPS.items()}
    group: Any = parser
    for f in fields(TrainConfig):
        if f.name in starts:
            group = parser.add_argument_group(starts[f.name])
        flag = "--" + f.name.replace("_", "-")
        kind = _base_type(hints[f.name])
        default = default_of(f.name)
        text = f"{docs.get(f.name, '')} (default: {default!r})".replace("%", "%%")
        if kind is bool:
            group.add_argument(flag, action=argparse.BooleanOptionalAction, help=text)
        elif typing.get_origin(kind) is list:
            group.add_argument(flag, nargs="+", metavar="NAME", help=text)
        else:
            metavar = f.name.upper() if kind is str else None
            group.add_argument(flag, type=kind, metavar=metavar, help=text)
    return parser


def parse_config(argv: list[str]) -> TrainConfig:
    """The run's config from the command line (and its ``--config`` file)."""
    namespace = vars(build_parser().parse_args(argv))
    toml_path = namespace.pop("config", None)
    toml = load_toml(toml_path) if toml_path else None
    return TrainConfig.resolve(toml, namespace)


def _export_main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="nxd-train export",
        description="Write a run's newest checkpoint as a Hugging Face folder (model + "
        "tokenizer) and print a sample generated from it.",
    )
    parser.add_argument("run_dir", metavar="RUN_DIR", help="the run folder (runs/<name>)")
    parser.add_argument("--out", help="output folder (default: RUN_DIR/hf)")
    parser.add_argument("--tag", help="checkpoint tag (default: the newest complete one)")
    parser.add_argument("--prompt", default="def ", help="sample prompt (default: 'def ')")
    parser.add_argument("--sample-tokens", type=int, default=40, help="0: no sample")
    args = parser.parse_args(argv)
    from nxd_trainer.train.export import export_run, generate_sample

    out = export_run(args.run_dir, args.out, args.tag)
    print(f"nxd-train: exported {out}")
    if args.sample_tokens > 0:
        print(generate_sample(out, args.prompt, args.sample_tokens, seed=0))
    return 0


def _dry_run(cfg: TrainConfig) -> int:
    from nxd_trainer.train.layout import format_layout
    from nxd_trainer.train.model import hf_config

    note = ""
    vocab = cfg.vocab_size
    tok = cfg.run_dir / "tokenizer"
    if cfg.tokenizer is not None or tok.is_dir():
        from nxd_trainer.train.data import load_tokenizer

        vocab = len(load_tokenizer(cfg.tokenizer or tok))
    else:
        note = " (the BPE's target size: the tokenizer is not trained yet)"
    print(format_layout(cfg, hf_config(cfg, vocab), note))
    return 0


def _launcher(cfg: TrainConfig, argv: list[str]) -> int:
    """Check everything checkable here (one clear line, no worker started), prepare the
    data once, then start the workers."""
    from nxd_trainer.train.data import prepare_data, prepare_lock
    from nxd_trainer.train.launch import launch
    from nxd_trainer.train.model import hf_config, model_source

    cfg.check_world(cfg.world_size)
    model_source(cfg)
    print(f"nxd-train: preparing data and tokenizer in {cfg.run_dir} ...", file=sys.stderr)
    with prepare_lock(cfg):
        tokenizer, _, _ = prepare_data(cfg, build=True)
    hf_config(cfg, len(tokenizer))
    cfg.run_dir.mkdir(parents=True, exist_ok=True)
    (cfg.run_dir / "config.toml").write_text(cfg.to_toml(), encoding="utf-8")
    print(
        f"nxd-train: starting {cfg.nproc_per_node} worker(s) on this node (world "
        f"{cfg.world_size}, tp={cfg.tp} pp={cfg.pp} dp={cfg.check_world(cfg.world_size)})",
        file=sys.stderr,
    )
    return launch(cfg, argv)


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``nxd-train`` (the launcher, or a worker under torchrun)."""
    import os

    argv = list(sys.argv[1:] if argv is None else argv)
    worker = False
    try:
        if argv[:1] == ["export"]:
            return _export_main(argv[1:])
        cfg = parse_config(argv)
        if cfg.dry_run:
            return _dry_run(cfg)
        from nxd_trainer.train.launch import under_torchrun

        if under_torchrun():
            worker = True
            from nxd_trainer.train.loop import run_worker

            return run_worker(cfg)
        return _launcher(cfg, argv)
    except ConfigError as error:
        if not worker or os.environ.get("RANK", "0") == "0" or os.environ.get("LOCAL_RANK") == "0":
            print(f"nxd-train: error: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    except Exception as error:
        from nxd_trainer.train.loop import PeerFailed

        if isinstance(error, PeerFailed):
            return 1
        raise
