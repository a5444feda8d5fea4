"""Bad input across the public APIs: a clear error, naming the value and what was expected,
raised on every rank before any collective.

Every case runs on both of 2 gloo ranks (in one spawn) under ``count_collectives``; each
asserts the exception type, that the message holds the offending value and the words of what
was expected, that no collective was issued before the error, and that both ranks raised the
same error. Degrees, heads, vocabulary, shapes, dtypes, config keys, schedule names, paths,
tags, LoRA settings, checkpoint options, environment settings and CLI flags.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from nxd_state.testing import run_distributed

TIMEOUT = 300.0


def _cfg(**kwargs: Any) -> Any:
    import nxd_trainer

    return nxd_trainer.neuronx_distributed_config(**kwargs)


def _layers() -> Any:
    import nxd_layers

    return nxd_layers


def _ckpt() -> Any:
    import nxd_ckpt

    return nxd_ckpt


def _lora(**kwargs: Any) -> Any:
    from nxd_lora import LoraConfig

    return LoraConfig(**kwargs)


def _layout(world: int, tp: int, pp: int) -> Any:
    from nxd_state import ParallelLayout

    return ParallelLayout(world_size=world, tensor_parallel_size=tp, pipeline_parallel_size=pp)


def _init_mp(**kwargs: Any) -> Any:
    import nxd_state

    nxd_state.destroy_model_parallel()
    return nxd_state.initialize_model_parallel(**kwargs)


def _env_timeout(value: str) -> Any:
    from nxd_state import health

    os.environ["NXD_COLLECTIVE_TIMEOUT_S"] = value
    try:
        return health.collective_timeout()
    finally:
        del os.environ["NXD_COLLECTIVE_TIMEOUT_S"]


def _linear_model() -> torch.nn.Module:
    return torch.nn.Linear(4, 4)


# (id, call, exception type, substrings the message must hold: the value, what was expected)
CASES: list[tuple[str, Callable[[str], Any], type[BaseException], tuple[str, ...]]] = [
    # degrees and layouts
    ("tp-not-dividing-world", lambda d: _layout(8, 3, 1), ValueError, ("3", "world_size(8)")),
    ("pp-not-dividing", lambda d: _layout(8, 2, 3), ValueError, ("3", "divide")),
    ("tp-zero", lambda d: _layout(8, 0, 1), ValueError, ("0",)),
    (
        "cp-not-dividing-world",
        lambda d: _init_mp(context_parallel_size=3),
        ValueError,
        ("context_parallel_size(3)", "does not divide"),
    ),
    (
        "ep-not-dividing-dp",
        lambda d: _init_mp(expert_model_parallel_size=3),
        ValueError,
        ("expert_model_parallel_size(3)", "data_parallel_size(2)"),
    ),
    ("lnc-size", lambda d: _init_mp(lnc_size=0), ValueError, ("lnc_size", "0")),
    ("cfg-tp-world", lambda d: _cfg(tensor_parallel_size=3), ValueError, ("3", "world")),
    (
        "cfg-tp-type",
        lambda d: _cfg(tensor_parallel_size="2"),
        ValueError,
        ("'2'", "positive integer"),
    ),
    (
        "cfg-ep-cp",
        lambda d: _cfg(expert_parallel_size=2, context_parallel_size=2),
        ValueError,
        ("expert_parallel_size=2", "context_parallel_size=2"),
    ),
    # config keys and values
    (
        "cfg-unknown-key",
        lambda d: _cfg(optimizer_config={"zero_one_enable": True}),
        ValueError,
        ("zero_one_enable", "did you mean 'zero_one_enabled'"),
    ),
    (
        "cfg-unknown-pipeline-key",
        lambda d: _cfg(pipeline_config={"num_microbatch": 2}),
        ValueError,
        ("num_microbatch", "num_microbatches"),
    ),
    (
        "cfg-max-grad-norm",
        lambda d: _cfg(optimizer_config={"max_grad_norm": -1.0}),
        ValueError,
        ("max_grad_norm", "-1.0"),
    ),
    ("cfg-sp-without-tp", lambda d: _cfg(sequence_parallel=True), ValueError, ("sequence",)),
    (
        "cfg-pp-without-cuts",
        lambda d: _cfg(pipeline_parallel_size=2, pipeline_config={}),
        ValueError,
        ("pipeline_cuts",),
    ),
    (
        "cfg-meta-without-init-fn",
        lambda d: _cfg(model_init_config={"meta_device_init": True}),
        ValueError,
        ("param_init_fn",),
    ),
    (
        "cfg-activation-checkpoint",
        lambda d: _cfg(activation_checkpoint_config="sometimes"),
        ValueError,
        ("'sometimes'", "full"),
    ),
    (
        "cfg-microbatches",
        lambda d: _cfg(
            pipeline_parallel_size=2,
            pipeline_config={"pipeline_cuts": ["a"], "num_microbatches": 0},
        ),
        ValueError,
        ("num_microbatches", "0"),
    ),
    # schedule names
    (
        "pp-schedule-name",
        lambda d: _cfg(
            pipeline_parallel_size=2,
            pipeline_config={"pipeline_cuts": ["a"], "schedule": "2f2b"},
        ),
        ValueError,
        ("'2f2b'", "1f1b"),
    ),
    # heads, vocabulary, shapes, dtypes (layers)
    (
        "column-out-features",
        lambda d: _layers().ColumnParallelLinear(8, 7),
        ValueError,
        ("7", "2"),
    ),
    ("row-in-features", lambda d: _layers().RowParallelLinear(7, 8), ValueError, ("7", "2")),
    (
        "embedding-dims",
        lambda d: _layers().ParallelEmbedding(0, 8),
        ValueError,
        ("0", "num_embeddings"),
    ),
    (
        "cross-entropy-shapes",
        lambda d: _layers().parallel_cross_entropy(torch.zeros(2, 3, 4), torch.zeros(5).long()),
        ValueError,
        ("(5,)", "(2, 3)"),
    ),
    (
        "cross-entropy-dtype",
        lambda d: _layers().parallel_cross_entropy(torch.zeros(2, 4), torch.zeros(2)),
        ValueError,
        ("torch.float32", "integer"),
    ),
    (
        "clip-norm-type",
        lambda d: _layers().clip_grad_norm([torch.zeros(2, requires_grad=True)], 1.0, -3),
        ValueError,
        ("-3", "norm_type"),
    ),
    # collectives
    (
        "p2p-kind",
        lambda d: __import__("nxd_state").collectives.batch_send_recv(
            [__import__("nxd_state").collectives.P2POp("push", torch.zeros(1), 1)]
        ),
        ValueError,
        ("'push'", "'send' or 'recv'"),
    ),
    (
        "bucket-cap",
        lambda d: __import__("nxd_state").collectives.all_reduce_bucketed(
            [torch.zeros(1)], None, average=True, bucket_cap_bytes=0
        ),
        ValueError,
        ("bucket_cap_bytes", "0", "positive"),
    ),
    ("timeout-env", lambda d: _env_timeout("soon"), ValueError, ("'soon'", "positive number")),
    ("timeout-env-zero", lambda d: _env_timeout("0"), ValueError, ("'0'", "positive number")),
    # LoRA settings
    ("lora-rank", lambda d: _lora(enable_lora=True, lora_rank=0), ValueError, ("lora_rank", "0")),
    ("lora-rank-type", lambda d: _lora(lora_rank=2.5), TypeError, ("2.5", "int")),
    ("lora-alpha", lambda d: _lora(lora_alpha=-1.0), ValueError, ("lora_alpha", "-1.0")),
    ("lora-dropout", lambda d: _lora(lora_dropout=1.0), ValueError, ("lora_dropout", "1.0")),
    ("lora-bias", lambda d: _lora(bias="some"), ValueError, ("'some'", "none")),
    # paths, tags and checkpoint options
    (
        "load-missing-path",
        lambda d: _ckpt().load_checkpoint(f"{d}/nowhere", model=_linear_model()),
        FileNotFoundError,
        ("nowhere",),
    ),
    (
        "load-missing-tag",
        lambda d: _ckpt().load_checkpoint(f"{d}/ckpt", "step_404", model=_linear_model()),
        FileNotFoundError,
        ("step_404",),
    ),
    (
        "save-under-a-file",
        lambda d: _ckpt().save_checkpoint(f"{d}/a-file/ckpt", "t", model=_linear_model()),
        PermissionError,
        ("a-file/ckpt", "writable"),
    ),
    (
        "save-tag-with-slash",
        lambda d: _ckpt().save_checkpoint(f"{d}/ckpt", "../escape", model=_linear_model()),
        ValueError,
        ("'../escape'",),
    ),
    (
        "num-kept",
        lambda d: _ckpt().save_checkpoint(
            f"{d}/ckpt", "t", model=_linear_model(), num_kept_ckpts=0
        ),
        ValueError,
        ("num_kept_ckpts", "0"),
    ),
    (
        "async-copy",
        lambda d: _ckpt().save_checkpoint(
            f"{d}/ckpt", "t", model=_linear_model(), async_save=True, async_copy="later"
        ),
        ValueError,
        ("'later'", "async_copy must be one of"),
    ),
    (
        "user-content-object",
        lambda d: _ckpt().save_checkpoint(
            f"{d}/ckpt", "t", model=_linear_model(), user_content={"f": object()}
        ),
        TypeError,
        ("user_content.f", "object"),
    ),
    (
        "export-missing-tag",
        lambda d: _ckpt().export_hf(f"{d}/ckpt", f"{d}/hf", tag="nope"),
        FileNotFoundError,
        ("nope",),
    ),
]


def run_cases(workdir: str) -> dict[str, tuple[str, str, int]]:
    """Every case on this rank: (exception type, message, collectives issued before it)."""
    import nxd_state

    nxd_state.initialize_model_parallel(tensor_model_parallel_size=2)
    Path(workdir, "a-file").write_text("not a folder")
    import nxd_ckpt

    nxd_ckpt.save_checkpoint(f"{workdir}/ckpt", "t", model=_linear_model())
    results = {}
    for name, call, _, _ in CASES:
        with nxd_state.count_collectives() as counter:
            try:
                call(workdir)
                results[name] = ("no error", "", 0)
                continue
            except Exception as error:
                calls = sum(s["calls"] for s in counter.as_dict().values())
                results[name] = (type(error).__name__, str(error), calls)
        nxd_state.destroy_model_parallel()
        nxd_state.initialize_model_parallel(tensor_model_parallel_size=2)
    return results


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, tuple[str, str, int]]]:
    workdir = tmp_path_factory.mktemp("bad-inputs")
    return run_distributed(run_cases, 2, str(workdir), timeout=TIMEOUT)


def test_the_matrix_has_at_least_40_cases() -> None:
    assert len(CASES) >= 40, len(CASES)


@pytest.mark.parametrize(("name", "call", "kind", "needles"), CASES, ids=[c[0] for c in CASES])
def test_bad_input(
    outcomes: list[dict[str, tuple[str, str, int]]],
    name: str,
    call: Any,
    kind: type[BaseException],
    needles: tuple[str, ...],
) -> None:
    per_rank = [result[name] for result in outcomes]
    # A rank whose peer found the error raises one naming that peer (nxd-ckpt's agreement).
    notified = [t == "RuntimeError" and "failed on rank(s) [" in m for t, m, _ in per_rank]
    assert not all(notified), per_rank
    for rank, (type_name, message, _) in enumerate(per_rank):
        if notified[rank]:
            continue
        assert type_name == kind.__name__, (rank, type_name, message)
        for needle in needles:
            assert needle in message, (rank, needle, message)
    full = [r for r, n in enumerate(notified) if not n]
    assert len({per_rank[r][:2] for r in full}) == 1, per_rank  # the same error on every rank


@pytest.mark.parametrize("name", [c[0] for c in CASES])
def test_no_collective_before_the_error(
    outcomes: list[dict[str, tuple[str, str, int]]], name: str
) -> None:
    for rank, result in enumerate(outcomes):
        assert result[name][2] == 0, (rank, result[name])


CLI_CASES = [
    (["info"], "checkpoint"),
    (["info", "{tmp}", "--verfy"], "--verfy"),
    (["frobnicate"], "frobnicate"),
    (["export-hf", "{tmp}", "{tmp}/o", "--dtype", "float8"], "float8"),
]


@pytest.mark.parametrize(("argv", "needle"), CLI_CASES)
def test_cli_flags_are_checked(tmp_path: Path, argv: list[str], needle: str) -> None:
    """``nxd-ckpt``'s argument errors: exit code 2 naming the flag or value."""
    argv = [a.replace("{tmp}", str(tmp_path)) for a in argv]
    proc = subprocess.run(
        [sys.executable, "-m", "nxd_ckpt.cli", *argv],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 2, (argv, proc.returncode, proc.stderr)
    assert needle in proc.stderr, (argv, proc.stderr)
