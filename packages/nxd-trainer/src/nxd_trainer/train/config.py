"""The configuration of an ``nxd-train`` run: one kw-only dataclass, a docstring per field.

Values are resolved in three layers, each overriding the one before: the field defaults, a
TOML file (``--config run.toml``, flat ``key = value`` pairs named as the fields), then the
command-line flags (``--tp 2`` for ``tp``). :meth:`TrainConfig.__post_init__` checks every
value on its own; :meth:`TrainConfig.check_world` checks what depends on the world size
(``world = tp · pp · cp · dp``), so both fail on every rank before any process group exists.
"""

from __future__ import annotations

import difflib
import math
import os
from collections.abc import Callable
from dataclasses import MISSING, asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

__all__ = ["ConfigError", "TrainConfig", "field_docs", "load_toml"]

PRESETS = ("tiny", "small", "tiny-moe")
# Schedules nxd-train runs (nxd-pipeline also has interleaved 1F1B, which needs virtual stages
# per rank: the main job does not offer them).
SCHEDULES = ("gpipe", "1f1b", "zb_h1")
CHECKPOINTING = ("none", "full", "selective")
CP_ALGORITHMS = ("ring", "all-to-all")
DEVICES = ("cpu", "cuda", "xla")
MAX_VOCAB = 1 << 20
# A million sequences per step, or of tokens per sequence, is beyond any run (Llama 3 stepped
# on 2k sequences of 8k tokens); above it a value is a typo that would exhaust memory.
MAX_SEQUENCES = 1 << 20


class ConfigError(ValueError):
    """A bad setting or input: the message names the value and what was expected."""


def setting(
    default: Any = MISSING, doc: str = "", *, factory: Callable[[], Any] | None = None
) -> Any:
    """A field of :class:`TrainConfig` with its documentation: the text ``--help`` prints,
    kept in the field's metadata (read at run time, so it needs no source files)."""
    metadata = {"doc": " ".join(doc.split())}
    if factory is not None:
        return field(default_factory=factory, metadata=metadata)
    return field(default=default, metadata=metadata)


@dataclass(kw_only=True)
class TrainConfig:
    """Everything one ``nxd-train`` run needs; the defaults train the tiny model at TP=2 on
    2 CPU processes in about three minutes."""

    # --- run ---------------------------------------------------------------------------
    name: str = setting(
        "tiny",
        "Run name: everything the run writes goes to ``<runs_dir>/<name>/``.",
    )

    runs_dir: str = setting(
        "runs",
        "Folder holding the runs (relative to the working directory).",
    )

    seed: int = setting(
        1234,
        "Seed of the model's initial weights, the data order and every RNG stream.",
    )

    # --- model -------------------------------------------------------------------------
    model: str = setting(
        "tiny",
        """``tiny`` (4 layers, hidden 128), ``small`` (8 layers, hidden 512), ``tiny-moe`` (a
        Mixtral: 4 layers, hidden 128, 4 experts, top-2), a Hugging Face ``config.json``
        (trained from scratch) or an HF model folder with weights (fine-tuned).""",
    )

    lora_rank: int = setting(
        0,
        """LoRA rank r for fine-tuning (0: train every weight; > 0: freeze the base, train
        adapters B·A of rank r on ``lora_targets``).""",
    )

    lora_alpha: float = setting(
        16.0,
        "LoRA scaling numerator: adapters add (alpha / r) · B·A·x.",
    )

    lora_targets: list[str] = setting(  # noqa: RUF009 (a dataclasses.field)
        factory=lambda: ["q_proj", "v_proj"],
        doc="Module names (last component) that get LoRA adapters.",
    )

    # --- data --------------------------------------------------------------------------
    data: str | None = setting(
        None,
        """Training text: a file or a folder of text, JSON Lines or Parquet files (each
        recognised by its content), a ``datasets`` folder (``save_to_disk``), or
        ``BUILDER:FILES`` for ``datasets.load_dataset`` (e.g. ``csv:tables/*.csv``). None: the
        Python standard library's own sources (no download).""",
    )

    text_field: str = setting(
        "text",
        "Field holding the text in JSON Lines, Parquet and ``datasets`` inputs.",
    )

    tokenizer: str | None = setting(
        None,
        """An HF tokenizer folder. None: train a byte-level BPE on the training split (cached in
        the run folder).""",
    )

    vocab_size: int = setting(
        2048,
        "Vocabulary of the trained BPE tokenizer (ignored with ``tokenizer``).",
    )

    seq_len: int = setting(
        128,
        "Tokens per packed training sequence.",
    )

    corpus_mb: float = setting(
        0.0,
        "Read only the first this many MB of the corpus (train and validation together; 0: all).",
    )

    val_fraction: float = setting(
        0.05,
        """Fraction of documents held out for validation (chosen by a hash of their content;
        inside documents when they are few).""",
    )

    # --- optimization ------------------------------------------------------------------
    steps: int = setting(
        150,
        "Optimizer steps to train (a rerun with more steps continues the run).",
    )

    batch_size: int = setting(
        8,
        "Sequences per optimizer step, over all data-parallel ranks and accumulation steps.",
    )

    grad_accum: int = setting(
        1,
        "Micro-steps accumulated per optimizer step (gradients averaged over them).",
    )

    lr: float = setting(
        3e-3,
        "Peak learning rate of AdamW.",
    )

    warmup_steps: int = setting(
        20,
        "Steps of linear warm-up from 0 to ``lr``; then cosine decay to ``min_lr_ratio · lr``.",
    )

    min_lr_ratio: float = setting(
        0.1,
        "Final learning rate as a fraction of ``lr``.",
    )

    weight_decay: float = setting(
        0.1,
        "AdamW's decoupled weight decay.",
    )

    clip: float = setting(
        1.0,
        """Clip the global gradient norm to this (0: no clipping; the norm is logged either
        way).""",
    )

    # --- launch ------------------------------------------------------------------------
    nproc_per_node: int = setting(
        2,
        "Worker processes on this machine (one per GPU on CUDA).",
    )

    nnodes: int = setting(
        1,
        """Machines taking part; each runs ``nxd-train`` with the same flags and its
        ``node_rank``.""",
    )

    node_rank: int | None = setting(
        None,
        """This machine's rank among ``nnodes`` (static rendezvous); None with ``nnodes`` > 1:
        torch's c10d rendezvous assigns it.""",
    )

    rdzv_endpoint: str | None = setting(
        None,
        "``host:port`` of the rendezvous for multi-node runs (the node-rank-0 machine).",
    )

    device: str | None = setting(
        None,
        """``cpu`` (gloo), ``cuda`` (NCCL) or ``xla``; None: nxd_state's choice (``NXD_DEVICE``,
        else CUDA when present, else CPU).""",
    )

    # --- parallelism and numerics ------------------------------------------------------
    tp: int = setting(
        2,
        "Tensor-parallel degree (heads, MLP and vocabulary split over ``tp`` ranks).",
    )

    pp: int = setting(
        1,
        "Pipeline-parallel degree (layers cut into ``pp`` even stages).",
    )

    cp: int = setting(
        1,
        """Context-parallel degree: every sequence split over ``cp`` ranks (attention over the
        whole sequence by ``cp_algorithm``); with ``pp`` > 1 the stages pass each rank's
        slice.""",
    )

    ep: int = setting(
        1,
        """Expert-parallel degree: the experts of every MoE layer split over ``ep`` consecutive
        data-parallel ranks (``ep`` divides dp; the experts' gradients are averaged over the
        dp/ep ranks holding the same experts). A Mixtral, Qwen2-MoE or Qwen3-MoE model
        (``--model tiny-moe``, or its config.json; with ``pp`` > 1 each stage holds its
        layers' experts), ``cp`` = 1, without LoRA or ``--compile``; ``--zero1`` shards
        expert state over the dp/ep ranks holding the same experts.""",
    )

    cp_algorithm: str = setting(
        "ring",
        """Context-parallel attention: ``ring`` (K/V passed around the ring, zigzag split:
        ``seq_len`` divisible by 2·``cp``) or ``all-to-all`` (sequence <-> heads: ``seq_len``
        and the heads per TP rank divisible by ``cp``).""",
    )

    microbatches: int = setting(
        1,
        "Pipeline micro-batches per micro-step (``pp`` > 1); the per-rank batch must divide.",
    )

    schedule: str = setting(
        "1f1b",
        "Pipeline schedule: gpipe, 1f1b or zb_h1.",
    )

    zero1: bool = setting(
        False,
        "ZeRO-1: shard AdamW's state over data parallelism.",
    )

    sequence_parallel: bool = setting(
        False,
        "Sequence parallelism on the norms and dropouts between TP regions (``tp`` > 1).",
    )

    activation_checkpointing: str = setting(
        "none",
        """Recompute activations in backward: ``full`` (every decoder layer), ``selective``
        (attention only) or ``none``.""",
    )

    bf16: bool = setting(
        False,
        """bf16 parameters and activations; the optimizer keeps fp32 master weights and sums
        gradients in fp32 wherever they are summed (micro-steps, micro-batches, ranks).""",
    )

    compile: bool = setting(
        False,
        "torch.compile the decoder layers (CUDA only).",
    )

    # --- progress, evaluation, checkpoints, export ------------------------------------
    eval_every: int = setting(
        50,
        "Validation loss and perplexity every this many steps (and at the end; 0: end only).",
    )

    eval_batches: int = setting(
        4,
        "Batches of ``batch_size`` sequences in each validation pass.",
    )

    save_every: int = setting(
        50,
        "Checkpoint every this many steps (and at the end).",
    )

    keep: int = setting(
        2,
        "Newest checkpoint tags kept (older ones are deleted).",
    )

    async_save: bool = setting(
        True,
        """Write checkpoints in the background: the save returns once the buffers, RNG states
        and user content are copied, the next optimizer step waits until the parameters and
        optimizer state are copied to host memory
        (nxd-ckpt's ``async_copy="before_step"``; on XLA the copy is made before the save
        returns), and the next save, the end of the run and Ctrl-C wait for the write.
        ``--no-async-save``: every save is written before training continues.""",
    )

    export: bool = setting(
        True,
        "Write the Hugging Face folder (model + tokenizer) at the end and print a sample.",
    )

    prompt: str = setting(
        "def ",
        "Prompt of the sample generated from the exported folder.",
    )

    sample_tokens: int = setting(
        40,
        "Tokens generated for the sample (0: no sample).",
    )

    progress: bool = setting(
        True,
        "Show the progress bar (on one rank).",
    )

    dry_run: bool = setting(
        False,
        """Print the resolved layout (rank coordinates, parameters per rank, pipeline schedule)
        and exit without training.""",
    )

    def __post_init__(self) -> None:
        self._check_numbers()
        self._check_text_and_flags()
        self._check_combinations()

    def _check_numbers(self) -> None:
        """Each int and float in its range."""
        # Upper bounds where a huge value would hang or exhaust memory before any check:
        # torch seeds are 64-bit and the loader adds the epoch to the seed; no tokenizer has
        # a million-token vocabulary (the BPE trainer allocates per entry).
        _int("seed", self.seed, minimum=0, maximum=2**32 - 1)
        _int("vocab_size", self.vocab_size, minimum=1, maximum=MAX_VOCAB)
        for name in ("seq_len", "batch_size"):
            _int(name, getattr(self, name), minimum=1, maximum=MAX_SEQUENCES)
        for name in (
            "steps",
            "grad_accum",
            "nproc_per_node",
            "nnodes",
            "tp",
            "pp",
            "cp",
            "ep",
            "microbatches",
            "eval_batches",
            "save_every",
            "keep",
        ):
            _int(name, getattr(self, name), minimum=1)
        for name in ("lora_rank", "warmup_steps", "eval_every", "sample_tokens"):
            _int(name, getattr(self, name), minimum=0)
        if self.node_rank is not None:
            _int("node_rank", self.node_rank, minimum=0)
            if self.node_rank >= self.nnodes:
                raise ConfigError(f"node_rank {self.node_rank} must be below nnodes {self.nnodes}")
        for name, low, high in (
            ("lr", 0.0, math.inf),
            ("min_lr_ratio", 0.0, 1.0),
            ("weight_decay", 0.0, math.inf),
            ("clip", 0.0, math.inf),
            ("corpus_mb", 0.0, math.inf),
            ("val_fraction", 0.0, 0.5),
            ("lora_alpha", 0.0, math.inf),
        ):
            _float(name, getattr(self, name), low, high)
        if self.val_fraction == 0.0:
            raise ConfigError("val_fraction must be above 0 (a validation split is needed)")

    def _check_text_and_flags(self) -> None:
        """Each string, choice, bool and name list of the right kind."""
        for name in ("name", "runs_dir", "model", "text_field", "prompt"):
            if not isinstance(getattr(self, name), str) or not getattr(self, name):
                raise ConfigError(f"{name} must be a non-empty string, got {getattr(self, name)!r}")
        if "/" in self.name or self.name in (".", ".."):
            raise ConfigError(f"name must be a plain folder name, got {self.name!r}")
        for name in ("data", "tokenizer", "rdzv_endpoint", "device"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise ConfigError(f"{name} must be a non-empty string or unset, got {value!r}")
        _choice("schedule", self.schedule, SCHEDULES)
        _choice("activation_checkpointing", self.activation_checkpointing, CHECKPOINTING)
        _choice("cp_algorithm", self.cp_algorithm, CP_ALGORITHMS)
        if self.device is not None:
            _choice("device", self.device, DEVICES)
        for name in ("zero1", "sequence_parallel", "bf16", "compile", "async_save", "export",
                     "progress"):  # fmt: skip
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"{name} must be true or false, got {getattr(self, name)!r}")
        if not isinstance(self.lora_targets, list) or not all(
            isinstance(t, str) and t for t in self.lora_targets
        ):
            raise ConfigError(
                f"lora_targets must be a list of module names, got {self.lora_targets!r}"
            )

    def _check_combinations(self) -> None:
        """What the settings need of each other (the world size: :meth:`check_world`)."""
        if self.sequence_parallel and self.tp == 1:
            raise ConfigError("sequence_parallel needs tp > 1 (it splits the sequence over TP)")
        if self.pp > 1 and self.lora_rank > 0:
            raise ConfigError(f"LoRA (lora_rank={self.lora_rank}) needs pp=1, got pp={self.pp}")
        if self.pp == 1 and self.microbatches > 1:
            raise ConfigError(f"microbatches={self.microbatches} needs pp > 1 (got pp=1)")
        if self.cp > 1:
            self._check_context_parallel()
        if self.ep > 1:
            self._check_expert_parallel()
        if self.nnodes > 1 and self.rdzv_endpoint is None:
            raise ConfigError(f"nnodes={self.nnodes} needs rdzv_endpoint (host:port)")

    def _check_context_parallel(self) -> None:
        """What ``cp`` > 1 needs from the other settings (the heads: ``model.hf_config``)."""
        chunks = 2 * self.cp if self.cp_algorithm == "ring" else self.cp
        if self.seq_len % chunks:
            what = (
                f"2 x cp({self.cp}) = {chunks} (the ring's zigzag split)"
                if self.cp_algorithm == "ring"
                else f"cp({self.cp})"
            )
            raise ConfigError(
                f"seq_len {self.seq_len} is not divisible by {what}; use a seq_len that is a "
                f"multiple of {chunks}"
            )
        if self.sequence_parallel and (self.seq_len // self.cp) % self.tp:
            raise ConfigError(
                f"sequence_parallel splits each context-parallel rank's {self.seq_len // self.cp}"
                f" tokens (seq_len {self.seq_len} / cp {self.cp}) over tp({self.tp}), which "
                f"does not divide them"
            )
        if self.compile:
            raise ConfigError(
                f"cp={self.cp} with compile=True is not supported yet: context parallelism "
                f"runs without --compile"
            )

    def _check_expert_parallel(self) -> None:
        """What ``ep`` > 1 needs from the other settings (the experts: ``model.hf_config``;
        that ``ep`` divides dp: :meth:`check_world`)."""
        limits = {"cp": self.cp > 1, "lora_rank": self.lora_rank > 0, "compile": self.compile}
        for name, bad in limits.items():
            if bad:
                raise ConfigError(
                    f"ep={self.ep} with {name}={getattr(self, name)!r} is not supported yet: "
                    f"expert parallelism runs at cp=1, without LoRA or --compile"
                )

    @property
    def cp_algorithm_name(self) -> str:
        """``cp_algorithm`` as ``NxDConfig.context_parallel_algorithm`` spells it."""
        return self.cp_algorithm.replace("-", "_")

    # ------------------------------------------------------------------------------------
    @property
    def run_dir(self) -> Path:
        """``<runs_dir>/<name>``, where the run writes everything."""
        return Path(self.runs_dir) / self.name

    @property
    def world_size(self) -> int:
        """Processes over all nodes: ``nnodes · nproc_per_node``."""
        return self.nnodes * self.nproc_per_node

    def check_world(self, world: int) -> int:
        """The data-parallel degree at ``world`` processes; an error when the degrees, the
        batch or the micro-batches do not fit."""
        model_parallel = self.tp * self.pp * self.cp
        if world % model_parallel:
            cp = f" x cp({self.cp})" if self.cp > 1 else ""
            raise ConfigError(
                f"tp({self.tp}) x pp({self.pp}){cp} = {model_parallel} does not divide the "
                f"world size {world} (nnodes x nproc_per_node)"
            )
        dp = world // model_parallel
        if dp % self.ep:
            raise ConfigError(
                f"ep({self.ep}) does not divide dp({dp}) (world {world} / (tp x pp x cp)): "
                f"expert parallelism splits the experts over ep consecutive data-parallel ranks"
            )
        per_rank = self.batch_size / (dp * self.grad_accum)
        if per_rank != int(per_rank):
            raise ConfigError(
                f"batch_size {self.batch_size} is not divisible by dp({dp}) x "
                f"grad_accum({self.grad_accum}) = {dp * self.grad_accum}"
            )
        if int(per_rank) % self.microbatches:
            raise ConfigError(
                f"the per-rank micro-step batch {int(per_rank)} (batch_size / (dp x "
                f"grad_accum)) is not divisible by microbatches {self.microbatches}"
            )
        return dp

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def to_toml(self) -> str:
        """The resolved config as TOML, loadable with ``--config`` (unset values, which TOML
        cannot hold, are listed in a comment)."""
        import tomli_w

        values = self.to_dict()
        unset = [key for key, value in values.items() if value is None]
        head = f"# unset: {', '.join(unset)}\n" if unset else ""
        return head + tomli_w.dumps({k: v for k, v in values.items() if v is not None})

    @classmethod
    def resolve(cls, toml: dict[str, Any] | None, flags: dict[str, Any]) -> TrainConfig:
        """Defaults < TOML < flags; unknown TOML keys name the closest valid one."""
        merged: dict[str, Any] = {}
        valid = [f.name for f in fields(cls)]
        for key, value in (toml or {}).items():
            if key not in valid:
                hint = difflib.get_close_matches(key, valid, n=1, cutoff=0.5)
                raise ConfigError(
                    f"unknown config key {key!r}"
                    + (f" (did you mean {hint[0]!r}?)" if hint else "")
                    + "; run `nxd-train --help` for the valid keys"
                )
            merged[key] = value
        merged.update(flags)
        try:
            return cls(**merged)
        except TypeError as error:  # a wrong type reached a comparison
            raise ConfigError(str(error)) from None


def load_toml(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The flat table of a TOML file (``[section]`` tables are flattened: ``[data]
    seq_len = 64`` is ``seq_len``)."""
    import tomllib

    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file {str(path)!r} does not exist")
    try:
        table = tomllib.loads(path.read_text(encoding="utf-8"))
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as error:
        raise ConfigError(f"config file {str(path)!r} is not valid TOML: {error}") from None
    flat: dict[str, Any] = {}
    for key, value in table.items():
        if isinstance(value, dict):
            flat.update(value)
        else:
            flat[key] = value
    return flat


def field_docs(cls: type = TrainConfig) -> dict[str, str]:
    """Each field's documentation (from :func:`setting`), in the order of the fields."""
    return {f.name: f.metadata["doc"] for f in fields(cls) if "doc" in f.metadata}


def default_of(name: str) -> Any:
    for f in fields(TrainConfig):
        if f.name == name:
            if f.default is not MISSING:
                return f.default
            assert callable(f.default_factory), name  # a field has a default or a factory
            return f.default_factory()
    raise KeyError(name)


def _int(name: str, value: Any, minimum: int, maximum: int | None = None) -> None:
    ok = isinstance(value, int) and not isinstance(value, bool) and value >= minimum
    if not ok or (maximum is not None and value > maximum):
        bounds = f">= {minimum}" if maximum is None else f"in [{minimum}, {maximum}]"
        raise ConfigError(f"{name} must be an integer {bounds}, got {value!r}")


def _float(name: str, value: Any, low: float, high: float) -> None:
    """A finite number in [low, high] (an infinite learning rate trains to NaN silently)."""
    ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    if not ok or not math.isfinite(value) or not (low <= value <= high):
        bounds = f"[{low}, {high}]" if math.isfinite(high) else f">= {low}"
        raise ConfigError(f"{name} must be a finite number {bounds}, got {value!r}")


def _choice(name: str, value: Any, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ConfigError(f"{name} must be one of {', '.join(choices)}; got {value!r}")
