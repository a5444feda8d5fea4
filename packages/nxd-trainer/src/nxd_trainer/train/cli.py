"""The ``nxd-train`` command line: ``nxd-train [flags]``, ``nxd-train prepare [flags]`` and
``nxd-train export RUN_DIR``.

Every field of :class:`~nxd_trainer.train.config.TrainConfig` is a flag (``--seq-len``; bools
as ``--zero1`` / ``--no-zero1``), its help text the field's docstring. Flags are spelled out
(an abbreviation such as ``--step`` is an error, not ``--steps``). Bad input ends with one
line, ``nxd-train: error: ...`` (with the closest valid flag when one is misspelled), and exit
status 2, before anything is written; 1 when a worker failed or the disk refused a write (one
line naming the path; a checkpoint written in the background that failed: one line naming
its tag); 130 when interrupted (Ctrl-C anywhere, imports included: one line,
nothing half written). Never a traceback, except for a bug.

This module imports no torch at import time (nor does the ``nxd_trainer`` package), so
``--help`` answers at once and Ctrl-C while the heavy modules load is handled here.
"""

from __future__ import annotations

import argparse
import contextlib
import difflib
import os
import sys
import types
import typing
from dataclasses import fields
from typing import Any, NoReturn

from nxd_trainer.train import _signals
from nxd_trainer.train.config import (
    CHECKPOINTING,
    CP_ALGORITHMS,
    DEVICES,
    SCHEDULES,
    ConfigError,
    TrainConfig,
    default_of,
    field_docs,
    load_toml,
)

__all__ = ["build_parser", "main", "parse_config"]

EXIT_BAD_INPUT = 2
EXIT_INTERRUPTED = 130
EXAMPLES = """\
examples:
  nxd-train                                  tiny Llama, TP=2 on 2 CPU processes, stdlib corpus
  nxd-train --tp 2 --pp 2 --nproc-per-node 4 --microbatches 2
  nxd-train --tp 1 --cp 2 --seq-len 1024     (each sequence split over 2 ranks: ring attention)
  nxd-train --model tiny-moe --tp 1 --ep 2   (a Mixtral, its experts split over 2 ranks)
  nxd-train --tp 1 --zero1 --data notes/ --name notes
  nxd-train --model ./llama-folder --lora-rank 8 --data corpus.txt --tokenizer ./llama-folder
  nxd-train --config run.toml --steps 1000   (flags override the TOML file)
  nxd-train --dry-run --tp 2 --pp 2 --nproc-per-node 8
  nxd-train --nnodes 2 --node-rank 0 --rdzv-endpoint host0:29500   (same on host1, rank 1)
  nxd-train export runs/tiny                 (HF folder of the newest checkpoint)
  nxd-train prepare --data corpus/ --name big   (tokenize only: the same flags then train at once)

run folder <runs-dir>/<name>/: config.toml, tokenizer/, data/, checkpoints/step_NNNNNNNN/,
tb/, metrics.jsonl, summary.json, hf/. Rerunning the same command resumes; Ctrl-C finishes
the step, saves it and exits 130.
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
CHOICES = {
    "schedule": SCHEDULES,
    "activation_checkpointing": CHECKPOINTING,
    "device": DEVICES,
    "cp_algorithm": CP_ALGORITHMS,
}


class _Parser(argparse.ArgumentParser):
    """argparse with one-line errors: no usage block, the closest flag for a misspelled one."""

    def error(self, message: str) -> NoReturn:
        raise ConfigError(f"{message} (nxd-train --help lists the flags)")

    def parse_args(self, args: Any = None, namespace: Any = None) -> Any:
        parsed, unknown = self.parse_known_args(args, namespace)
        if unknown:
            flag = unknown[0]
            known = [o for action in self._actions for o in action.option_strings]
            hint = difflib.get_close_matches(flag.split("=")[0], known, n=1, cutoff=0.6)
            raise ConfigError(
                f"unrecognized argument {flag!r}"
                + (f" (did you mean {hint[0]!r}?)" if hint else "")
                + "; nxd-train --help lists the flags"
            )
        return parsed


def _base_type(annotation: Any) -> Any:
    if isinstance(annotation, types.UnionType) or typing.get_origin(annotation) is typing.Union:
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        return args[0]
    return annotation


def _plain(text: str) -> str:
    """Help text without the docstrings' reST markup."""
    return text.replace("``", "").replace("%", "%%")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="nxd-train",
        description="Train a causal LM with any TP/PP/DP mix (nxd's main job). "
        "Defaults < --config TOML < flags.",
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        argument_default=argparse.SUPPRESS,
        allow_abbrev=False,
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
        text = _plain(f"{docs.get(f.name, '')} (default: {default!r})")
        if kind is bool:
            group.add_argument(flag, action=argparse.BooleanOptionalAction, help=text)
        elif typing.get_origin(kind) is list:
            group.add_argument(flag, nargs="+", metavar="NAME", help=text)
        elif f.name in CHOICES:
            group.add_argument(flag, choices=CHOICES[f.name], help=text)
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
    parser = _Parser(
        prog="nxd-train export",
        description="Write a run's newest checkpoint as a Hugging Face folder (model + "
        "tokenizer) and print a sample generated from it.",
        allow_abbrev=False,
    )
    parser.add_argument("run_dir", metavar="RUN_DIR", help="the run folder (runs/<name>)")
    parser.add_argument("--out", help="output folder (default: RUN_DIR/hf)")
    parser.add_argument("--tag", help="checkpoint tag (default: the newest complete one)")
    parser.add_argument("--prompt", help="sample prompt (default: the run's --prompt)")
    parser.add_argument(
        "--sample-tokens", type=int, help="0: no sample (default: the run's --sample-tokens)"
    )
    parser.add_argument("--seed", type=int, help="sampling seed (default: the run's --seed)")
    args = parser.parse_args(argv)
    from nxd_trainer.train.export import export_run, generate_sample, run_settings

    settings = run_settings(args.run_dir)
    out = export_run(args.run_dir, args.out, args.tag)
    print(f"nxd-train: exported {out}")
    tokens = settings["sample_tokens"] if args.sample_tokens is None else args.sample_tokens
    if tokens > 0:
        prompt = settings["prompt"] if args.prompt is None else args.prompt
        seed = settings["seed"] if args.seed is None else args.seed
        print(generate_sample(out, prompt, tokens, seed=seed))
    return 0


PREPARE_HELP = """\
usage: nxd-train prepare [--workers N] [nxd-train flags]

Tokenize the run's corpus into its token shards (shared by every run of the same corpus and
tokenizer, under <runs-dir>/.cache or $NXD_TRAIN_CACHE) and write the run folder's tokenizer/
and data/, without training: `nxd-train` with the same flags then starts at once. Interrupted,
it resumes where it stopped. Takes the flags of nxd-train (nxd-train --help; --data,
--text-field, --tokenizer, --vocab-size, --corpus-mb, --val-fraction, --seq-len, --name,
--runs-dir, --no-progress matter here) and:

  --workers N   processes that tokenize (default: this machine's cores)
"""


def _prepare_main(argv: list[str]) -> int:
    """``nxd-train prepare``: the data of the run, and nothing else."""
    if "-h" in argv or "--help" in argv:
        print(PREPARE_HELP, end="")
        return 0
    pre = _Parser(prog="nxd-train prepare", add_help=False, allow_abbrev=False)
    pre.add_argument("--workers", type=int)
    known, rest = pre.parse_known_args(argv)
    if known.workers is not None and known.workers < 1:
        raise ConfigError(f"--workers must be an integer >= 1, got {known.workers}")
    cfg = parse_config(rest)
    from nxd_trainer.train.data import check_inputs, prepare_data, prepare_lock
    from nxd_trainer.train.rundir import RunDir

    check_inputs(cfg)
    run = RunDir.of(cfg)
    created = not run.root.exists()
    try:
        with run.lock():
            point = run.resume_point()
            if point is not None:
                run.check_resume(point)  # the data of another setup would not resume
            with prepare_lock(cfg):
                tokenizer, train, valid = prepare_data(cfg, build=True, workers=known.workers)
    except BaseException:
        if created:
            _remove_if_unused(run.root)
        raise
    print(
        f"nxd-train: prepared {run.root}: {len(train):,} training and {len(valid):,} "
        f"validation sequences of {cfg.seq_len} tokens, vocabulary {len(tokenizer):,}",
        file=sys.stderr,
    )
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
    """Check everything checkable here (one clear line, no worker started, nothing written),
    hold the run folder, check the resume point against the command, prepare the data once,
    record the settings, then start the workers."""
    from nxd_trainer.train.data import check_inputs, prepare_data, prepare_lock
    from nxd_trainer.train.launch import launch
    from nxd_trainer.train.model import hf_config
    from nxd_trainer.train.rundir import OWNER_ENV, RESUME_ENV, RunDir

    dp = cfg.check_world(cfg.world_size)
    hf_config(cfg, 1)  # the model against the degrees (heads, layers), before any write
    check_inputs(cfg)
    run = RunDir.of(cfg)
    single_node = cfg.nnodes == 1  # else global rank 0 owns the run (the nodes share it)
    created = not run.root.exists()
    try:
        with run.lock() if single_node else contextlib.nullcontext():
            point = run.resume_point()
            if point is not None:
                run.check_resume(point)  # before anything in the folder changes
                if _finished(cfg, run, point.step):
                    return 0
            print(f"nxd-train: preparing data and tokenizer in {run.root} ...", file=sys.stderr)
            with prepare_lock(cfg):
                tokenizer, _, _ = prepare_data(cfg, build=True)
            hf_config(cfg, len(tokenizer))
            if single_node:
                run.begin(point)
                os.environ[OWNER_ENV] = "1"
            os.environ[_signals.LAUNCHER_PID_ENV] = str(os.getpid())
            os.environ[RESUME_ENV] = point.tag if point is not None else ""  # verified here
            print(
                f"nxd-train: starting {cfg.nproc_per_node} worker(s) on this node (world "
                f"{cfg.world_size}, tp={cfg.tp} pp={cfg.pp}"
                + (f" cp={cfg.cp} ({cfg.cp_algorithm})" if cfg.cp > 1 else "")
                + f" dp={dp}"
                + (f" ep={cfg.ep}" if cfg.ep > 1 else "")
                + ")",
                file=sys.stderr,
            )
            code = launch(cfg, argv)
    except BaseException:
        if created:
            _remove_if_unused(run.root)
        raise
    if code == EXIT_INTERRUPTED:
        _say_interrupted(run)
    return code


def _finished(cfg: TrainConfig, run: Any, step: int) -> bool:
    """A run at its last step, summarised (and exported, if asked) by an earlier command:
    say so with its final figures, start nothing, change nothing."""
    from nxd_trainer.train.loop import summary_line

    summary = run.read_summary()
    if step < cfg.steps or summary is None or summary.get("step") != step:
        return False
    if cfg.export and not (run.export_dir / "config.json").is_file():
        return False
    print(
        f"nxd-train: the run {run.root} is finished (step {step}, --steps {cfg.steps}); pass "
        f"a larger --steps to train further. {summary_line(run, summary)}",
        file=sys.stderr,
    )
    return True


def _remove_if_unused(root: Any) -> None:
    """A run folder this command created and left holding only its lock files goes again."""
    leftovers = {".lock", ".prepare.lock"}
    with contextlib.suppress(OSError):
        if root.is_dir() and {p.name for p in root.iterdir()} <= leftovers:
            for name in leftovers:
                (root / name).unlink(missing_ok=True)
            root.rmdir()


def _say_interrupted(run: Any) -> None:
    tag = run.newest_tag()
    where = (
        f"the newest checkpoint is {run.checkpoints / tag}: rerun the same command to resume"
        if tag is not None
        else "no checkpoint was saved: rerunning the same command starts the run again"
    )
    print(f"nxd-train: interrupted; {where}", file=sys.stderr, flush=True)


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``nxd-train`` (the launcher, or a worker under torchrun)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    worker = "LOCAL_RANK" in os.environ and "WORLD_SIZE" in os.environ
    interrupted = False
    try:
        _signals.install()
        if argv[:1] == ["export"]:
            return _export_main(argv[1:])
        if argv[:1] == ["prepare"]:
            return _prepare_main(argv[1:])
        cfg = parse_config(argv)
        if cfg.dry_run:
            return _dry_run(cfg)
        from nxd_trainer.train.launch import under_torchrun

        if under_torchrun():
            worker = True
            _signals.die_with_launcher()
            from nxd_trainer.train.loop import run_worker

            return run_worker(cfg)
        return _launcher(cfg, argv)
    except ConfigError as error:
        if not worker or os.environ.get("RANK", "0") == "0":
            print(f"nxd-train: error: {error}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except KeyboardInterrupt:
        interrupted = True
    except OSError as error:  # a read-only or full disk, a missing permission: it names the path
        if worker and _signals.was_received():
            return EXIT_INTERRUPTED
        where = f" (rank {os.environ.get('RANK', '?')})" if worker else ""
        print(f"nxd-train: error{where}: {error}", file=sys.stderr)
        return 1
    except Exception as error:
        from nxd_trainer.train.loop import PeerFailed
        from nxd_trainer.train.saving import SaveFailed

        if worker and _signals.was_received():  # a peer stopped by the same interrupt
            return EXIT_INTERRUPTED
        if isinstance(error, PeerFailed):
            return 1
        if isinstance(error, SaveFailed):  # a background checkpoint write: it names the tag
            print(f"nxd-train: error (rank {os.environ.get('RANK', '?')}): {error}",
                  file=sys.stderr)  # fmt: skip
            return 1
        raise
    if interrupted and not worker:  # a worker stays quiet: its launcher says it
        print("nxd-train: interrupted", file=sys.stderr, flush=True)
    return EXIT_INTERRUPTED
