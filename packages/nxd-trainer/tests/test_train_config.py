"""nxd-train's pieces that need no process: the config (a docstring per field, defaults <
TOML < flags, bad values named, world arithmetic), the torchrun command line it hands to
torch's launcher, and the packed loader's data-parallel sharding and resume position (the
corpus and its shards: test_train_data.py)."""

from __future__ import annotations

import os
from dataclasses import fields
from pathlib import Path

import pytest
import torch

from nxd_trainer.train import ConfigError, PackedLoader, TrainConfig, parse_config, torchrun_args
from nxd_trainer.train.config import field_docs


def test_every_field_has_a_docstring() -> None:
    docs = field_docs(TrainConfig)
    assert [f.name for f in fields(TrainConfig)] == list(docs)
    assert all(len(text) > 10 for text in docs.values())


def test_flags_override_toml_override_defaults(tmp_path: Path) -> None:
    toml = tmp_path / "run.toml"
    toml.write_text('tp = 1\nsteps = 7\n[data]\nseq_len = 64\nlora_targets = ["q_proj"]\n')
    cfg = parse_config(["--config", str(toml), "--steps", "9", "--zero1"])
    assert (cfg.tp, cfg.steps, cfg.seq_len, cfg.zero1) == (1, 9, 64, True)
    assert cfg.lora_targets == ["q_proj"]
    assert cfg.batch_size == TrainConfig().batch_size
    assert TrainConfig.resolve(None, {}) == TrainConfig()
    round_trip = tmp_path / "back.toml"
    round_trip.write_text(cfg.to_toml())
    assert parse_config(["--config", str(round_trip)]) == cfg
    # Any string survives the file (a newline or quotes used to make it unreadable).
    odd = parse_config(["--prompt", 'def f():\n    return "\\x"'])
    round_trip.write_text(odd.to_toml())
    assert parse_config(["--config", str(round_trip)]) == odd


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"tp": 0}, "tp must be an integer >= 1, got 0"),
        ({"schedule": "2f2b"}, "schedule must be one of gpipe, 1f1b, zb_h1"),
        ({"schedule": "interleaved_1f1b"}, "schedule must be one of gpipe, 1f1b, zb_h1"),
        ({"tp": 1, "sequence_parallel": True}, "sequence_parallel needs tp > 1"),
        ({"ep": 0}, "ep must be an integer >= 1, got 0"),
        ({"ep": 2, "cp": 2}, "ep=2 with cp=2 is not supported yet"),
        ({"microbatches": 2}, "microbatches=2 needs pp > 1"),
        ({"nnodes": 2}, "nnodes=2 needs rdzv_endpoint"),
        ({"val_fraction": 0.9}, "val_fraction must be a finite number [0.0, 0.5], got 0.9"),
        ({"lr": float("inf")}, "lr must be a finite number >= 0.0, got inf"),
        ({"seed": 2**70}, "seed must be an integer in [0, 4294967295], got 1180591620717411303424"),
        ({"vocab_size": 10**9}, "vocab_size must be an integer in [1, 1048576], got 1000000000"),
        ({"weight_decay": float("nan")}, "weight_decay must be a finite number >= 0.0, got nan"),
        ({"name": "a/b"}, "name must be a plain folder name"),
    ],
)
def test_bad_values_are_named(kwargs: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=None) as info:
        TrainConfig(**kwargs)
    assert message in str(info.value)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"tp": 2, "pp": 2, "sequence_parallel": True},
        {"tp": 2, "cp": 2, "pp": 2, "sequence_parallel": True, "seq_len": 64},
    ],
    ids=["tp-pp-sp", "tp-cp-pp-sp"],
)
def test_sequence_parallel_with_pipeline_is_accepted(kwargs: dict) -> None:
    """Refused before the fix (the sequence split applied twice in the first stage); the
    trainer API's parity tests run these layouts (test_hf_trainer, test_pipeline_combos)."""
    assert TrainConfig(**kwargs).sequence_parallel


def test_unknown_toml_key_names_the_closest() -> None:
    with pytest.raises(
        ConfigError, match=r"unknown config key 'grad_acum' \(did you mean 'grad_accum'"
    ):
        TrainConfig.resolve({"grad_acum": 2}, {})


def test_world_arithmetic() -> None:
    assert TrainConfig(tp=2, pp=2, batch_size=8).check_world(8) == 2
    with pytest.raises(
        ConfigError, match=r"tp\(2\) x pp\(2\) = 4 does not divide the world size 6"
    ):
        TrainConfig(tp=2, pp=2).check_world(6)
    with pytest.raises(ConfigError, match=r"batch_size 6 is not divisible by dp\(4\) x grad_accum"):
        TrainConfig(tp=1, batch_size=6).check_world(4)
    with pytest.raises(ConfigError, match="not divisible by microbatches 4"):
        TrainConfig(tp=1, pp=2, microbatches=4, batch_size=4).check_world(4)


def test_torchrun_command_lines() -> None:
    single = torchrun_args(TrainConfig(), ["--steps", "3"])
    assert single[:4] == ["--nnodes", "1", "--nproc-per-node", "2"]
    assert single[single.index("--rdzv-endpoint") + 1] == "localhost:0"  # --standalone's
    assert single[-4:] == ["--module", "nxd_trainer.train", "--steps", "3"]
    static = torchrun_args(TrainConfig(nnodes=2, node_rank=1, rdzv_endpoint="h:29500"), [])
    assert static[static.index("--rdzv-backend") + 1] == "static"
    assert static[static.index("--node-rank") + 1] == "1"
    elastic = torchrun_args(TrainConfig(nnodes=2, rdzv_endpoint="h:29500"), [])
    assert elastic[elastic.index("--rdzv-backend") + 1] == "c10d"
    from torch.distributed.run import get_args_parser

    parsed = get_args_parser().parse_args(static)  # torchrun itself accepts them
    assert (parsed.nnodes, parsed.node_rank, parsed.module) == ("2", 1, True)


def test_loader_shards_the_global_batch_and_resumes() -> None:
    blocks = torch.arange(7 * 3, dtype=torch.int32).view(7, 3)  # 7 blocks: batches wrap epochs
    one = PackedLoader(blocks, 4, 0, 1, seed=5)
    ranks = [PackedLoader(blocks, 4, d, 2, seed=5) for d in range(2)]
    for _ in range(5):  # 20 sequences: across two epoch boundaries
        whole = one.next_batch()
        assert torch.equal(torch.cat([r.next_batch() for r in ranks]), whole)
    epoch0 = {int(b[0]) // 3 for b in PackedLoader(blocks, 7, 0, 1, seed=5).next_batch()}
    assert epoch0 == set(range(7))  # an epoch is a permutation of every block
    resumed = PackedLoader(blocks, 4, 1, 2, seed=5)
    resumed.load_state_dict(ranks[1].state_dict())
    assert torch.equal(resumed.next_batch(), ranks[1].next_batch())
    narrower = PackedLoader(blocks, 4, 0, 1, seed=5)  # DP2 -> DP1: the straight run's batch
    narrower.load_state_dict(ranks[0].state_dict())  # after 5 steps, as `one`
    assert torch.equal(narrower.next_batch(), one.next_batch())
    with pytest.raises(ConfigError, match="the data or seed changed"):
        PackedLoader(blocks[:6], 4, 0, 1, seed=5).load_state_dict(one.state_dict())


def test_bpe_is_deterministic_and_lossless() -> None:
    from nxd_trainer.train import load_corpus, train_tokenizer

    corpus = load_corpus(TrainConfig(corpus_mb=0.5, val_fraction=0.2))
    first, second = (train_tokenizer(corpus.train, 300) for _ in range(2))
    assert first.backend_tokenizer.to_str() == second.backend_tokenizer.to_str()
    text = corpus.valid[0][:500]
    assert first.decode(first(text)["input_ids"]) == text  # byte-level: lossless


def test_help_needs_no_source_files(tmp_path: Path) -> None:
    """The help text comes from the fields' metadata, not from reading ``.py`` files: an
    install with only compiled modules (``compileall -b``, sources removed) prints it."""
    import compileall
    import shutil
    import subprocess
    import sys

    import nxd_trainer

    package = tmp_path / "nxd_trainer"
    shutil.copytree(Path(nxd_trainer.__file__).parent, package)
    assert compileall.compile_dir(package, legacy=True, quiet=1)
    for source in package.rglob("*.py"):
        source.unlink()
    shown = subprocess.run(
        [sys.executable, "-c", "from nxd_trainer.train.cli import build_parser; "
         "import nxd_trainer; print(nxd_trainer.__file__); print(build_parser().format_help())"],
        env={**os.environ, "PYTHONPATH": str(tmp_path)}, capture_output=True, text=True,
        check=True,
    )  # fmt: skip
    assert shown.stdout.startswith(str(package))  # the compiled copy was imported
    assert "Tensor-parallel degree" in shown.stdout


def test_bf16_sums_gradients_in_fp32_only_where_they_are_summed() -> None:
    from nxd_trainer.train.model import fp32_gradient_sums

    one = TrainConfig(tp=1, bf16=True)
    assert not fp32_gradient_sums(one, world=1)  # one backward per step: nothing summed
    assert fp32_gradient_sums(one, world=2)  # a reduction over ranks
    assert fp32_gradient_sums(TrainConfig(tp=1, bf16=True, grad_accum=2), world=1)  # micro-steps
    assert fp32_gradient_sums(TrainConfig(tp=1, bf16=True, zero1=True), world=1)  # ZeRO-1's own


def _bf16_steps(fp32_accumulation: bool) -> dict[str, torch.Tensor]:
    """Three AdamW steps with clipping on a tiny bf16 Llama in one process, fp32 masters."""
    import nxd_trainer as nxd
    from nxd_state.testing import load_sibling

    hf = load_sibling(__file__, "_hf")
    cfg = nxd.neuronx_distributed_config(
        tensor_parallel_size=1,
        optimizer_config={"zero_one_enabled": False, "max_grad_norm": 0.5},
        mixed_precision_config={
            "use_master_weights": True, "use_fp32_grad_acc": fp32_accumulation},
    )  # fmt: skip
    torch.manual_seed(0)
    model = nxd.initialize_parallel_model(cfg, lambda: hf.model("llama").to(torch.bfloat16))
    optimizer = nxd.initialize_parallel_optimizer(cfg, torch.optim.AdamW, model.parameters())
    ids = torch.randint(0, hf.VOCAB, (2, 8), generator=torch.Generator().manual_seed(1))
    for _ in range(3):
        model.run_train(input_ids=ids, labels=ids)
        optimizer.step()
        optimizer.zero_grad()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _both_bf16_runs() -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    return _bf16_steps(True), _bf16_steps(False)


def test_one_process_bf16_without_fp32_buffers_is_bitwise_the_same() -> None:
    """What ``fp32_gradient_sums`` relies on: with one backward per step, casting the bf16
    gradient at the step gives exactly the fp32 buffer's values (bitwise: rtol=atol=0)."""
    from nxd_state.testing import run_distributed

    ((buffered, cast),) = run_distributed(_both_bf16_runs, 1)
    assert buffered.keys() == cast.keys()
    for name, value in buffered.items():
        torch.testing.assert_close(cast[name], value, rtol=0, atol=0, msg=name)
