"""The Lightning loop's features at PP = 2 on a tiny Hugging Face Llama (2 ranks, one spawn).

* ``ModelCheckpoint(save_last=True)`` + ``fit(ckpt_path="last")`` in a new Trainer and module
  continues with the losses and parameters of the uninterrupted run, bitwise (the checkpoint is
  nxd-ckpt's: safetensors + JSON, the loop state included);
* gradient accumulation (``grad_accum_steps=2`` on batches of 2) equals batches of 4;
* the progress bar and the TensorBoard logger write from one rank only, the last stage's
  (the one holding the loss), or rank 0 with ``log_rank0``; the events hold the step losses;
* a validation loop runs (``trainer.validate``): its loss equals one process's eval loss on the
  trained weights.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

import pytest
import torch

from nxd_state.testing import load_sibling, run_distributed

R = load_sibling(__file__, "_recipe")
WORLD, PP = 2, 2
# 2 batches per epoch, so checkpoints fall at epoch ends (a plain DataLoader is not resumable
# mid-epoch in Lightning), and runs end by epochs: Lightning resumes a checkpoint written when
# max_steps stopped the run one batch "into" the finished epoch (plain Lightning does the same).
EPOCH = {"limit_train_batches": 2, "max_steps": -1}


def features(folder: str) -> dict[str, Any]:
    from lightning.pytorch.callbacks import ModelCheckpoint

    from nxd_lightning import NeuronTensorBoardLogger

    out: dict[str, Any] = {"rank": torch.distributed.get_rank()}
    root = Path(folder)
    # 1. Uninterrupted: 4 steps, TensorBoard logger, captured progress bar.
    out["full"] = R.lightning_run(
        "hf_llama",
        1,
        PP,
        4,
        world=WORLD,
        capture=True,
        trainer_kwargs={
            **EPOCH,
            "max_epochs": 2,
            "log_every_n_steps": 1,
            "logger": NeuronTensorBoardLogger(save_dir=str(root / "tb")),
        },
    )
    # 2. Stopped after 2 steps (end of epoch 0), checkpointed; log_rank0 puts the loss on rank 0.
    ckpt = {"dirpath": str(root / "ckpt"), "save_last": True}
    out["first"] = R.lightning_run(
        "hf_llama",
        1,
        PP,
        2,
        world=WORLD,
        log_rank0=True,
        capture=True,
        trainer_kwargs={
            **EPOCH,
            "max_epochs": 1,
            "enable_checkpointing": True,
            "callbacks": [ModelCheckpoint(**ckpt)],
        },
    )
    # 3. A new module and Trainer resume from "last" (another seed: the RNG comes from the
    #    checkpoint) and run to step 4.
    torch.manual_seed(99)
    out["resumed"] = R.lightning_run(
        "hf_llama",
        1,
        PP,
        4,
        world=WORLD,
        log_rank0=True,
        trainer_kwargs={
            **EPOCH,
            "max_epochs": 2,
            "enable_checkpointing": True,
            "callbacks": [ModelCheckpoint(**ckpt)],
        },
        fit_kwargs={"ckpt_path": "last"},
        validate=R.loader(4, 8),
    )
    # 4. Gradient accumulation: 2 micro-batches of 2 == one batch of 4.
    out["accum"] = R.lightning_run("hf_llama", 1, PP, 2, world=WORLD, batch=2, grad_accum=2)
    out["large"] = R.lightning_run("hf_llama", 1, PP, 2, world=WORLD, batch=4)
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> tuple[list[dict[str, Any]], Path]:
    folder = tmp_path_factory.mktemp("features")
    return run_distributed(features, WORLD, str(folder)), folder


def test_resume_from_last_continues_the_uninterrupted_run(results) -> None:
    ranks, folder = results
    last = folder / "ckpt" / "last.ckpt"
    assert (last / "done").exists()
    assert (last / "index.json").exists()
    assert not list(last.rglob("*.pt"))
    assert not list(last.rglob("*.pkl"))
    for rank in ranks:
        full, first, resumed = rank["full"], rank["first"], rank["resumed"]
        assert resumed["global_step"] == 4
        assert len(resumed["losses"]) == 2  # steps 3 and 4 only: the loop state was restored
        if R.held(full["losses"]):  # the last stage holds the loss in every run
            assert first["losses"] == full["losses"][:2]
            assert resumed["losses"] == full["losses"][2:]  # bitwise
        for name, value in resumed["params"].items():
            torch.testing.assert_close(value, full["params"][name], **R.EXACT, msg=name)


def test_gradient_accumulation_equals_the_larger_batch(results) -> None:
    ranks, _ = results
    for rank in ranks:
        accum, large = rank["accum"], rank["large"]
        assert len(accum["losses"]) == len(large["losses"]) == 2
        if R.held(large["losses"]):
            # Mean of two micro-batch means vs one mean over the same samples: round-off.
            torch.testing.assert_close(
                torch.tensor(accum["losses"]), torch.tensor(large["losses"]), **R.TOL
            )
            torch.testing.assert_close(
                torch.tensor(accum["grad_norms"]), torch.tensor(large["grad_norms"]), **R.TOL
            )
        for name, value in accum["params"].items():
            torch.testing.assert_close(value, large["params"][name], **R.TOL, msg=name)


def test_progress_bar_shows_on_the_loss_holding_rank_only(results) -> None:
    ranks, _ = results
    by_rank = {r["rank"]: r for r in ranks}
    # Default: the last pipeline stage (rank 1 at PP=2, DP=1, TP=1); log_rank0: rank 0.
    assert "loss=" in by_rank[1]["full"]["output"], by_rank[1]["full"]["output"][-2000:]
    assert "Epoch" not in by_rank[0]["full"]["output"]
    assert "loss=" in by_rank[0]["first"]["output"], by_rank[0]["first"]["output"][-2000:]
    assert "Epoch" not in by_rank[1]["first"]["output"]
    # With log_rank0 the loss is broadcast: both stages hold the same values.
    assert by_rank[0]["first"]["losses"] == by_rank[1]["first"]["losses"]
    assert R.held(by_rank[0]["first"]["losses"])
    assert not R.held(by_rank[0]["full"]["losses"])  # stage 0 holds no loss by default


def _scalars(event_file: Path) -> dict[str, list[tuple[int, float]]]:
    """The scalars of a TensorBoard event file (TFRecord framing, tensorboardX's protos)."""
    from tensorboardX.proto import event_pb2

    data = event_file.read_bytes()
    out: dict[str, list[tuple[int, float]]] = {}
    offset = 0
    while offset < len(data):
        (length,) = struct.unpack_from("<Q", data, offset)
        record = data[offset + 12 : offset + 12 + length]
        offset += 12 + length + 4
        event = event_pb2.Event.FromString(record)
        for value in event.summary.value:
            out.setdefault(value.tag, []).append((event.step, value.simple_value))
    return out


def test_tensorboard_logger_writes_one_event_stream(results) -> None:
    ranks, folder = results
    files = list((folder / "tb").rglob("events.out.tfevents.*"))
    assert len(files) == 1, files
    losses = [value for _, value in _scalars(files[0])["loss"]]
    holder = next(r for r in ranks if R.held(r["full"]["losses"]))
    torch.testing.assert_close(
        torch.tensor(losses), torch.tensor(holder["full"]["losses"]), rtol=0, atol=0
    )


def test_validation_loop_equals_one_process_eval(results) -> None:
    ranks, _ = results
    params: dict[str, torch.Tensor] = {}
    for rank in ranks:
        params.update(rank["resumed"]["params"])
    model = R.hf_llama()
    missing = model.load_state_dict(params, strict=False).missing_keys
    assert missing == [] or set(missing) <= {"lm_head.weight"}, missing
    model.eval()
    ids = R.dataset().ids[:8]
    with torch.no_grad():
        expected = torch.stack([model(input_ids=b, labels=b).loss for b in ids.split(4)]).mean()
    holder = next(r for r in ranks if r["rank"] == 1)
    # fp32 eval of the same weights, split over two pipeline stages: round-off only.
    torch.testing.assert_close(torch.tensor(holder["resumed"]["val_loss"]), expected, **R.TOL)
    assert json.dumps(holder["resumed"]["metrics"])  # plain numbers
