"""nxd checkpoint folders where Lightning users load checkpoints, and ``predict`` returning the
whole vocabulary.

One 2-rank spawn:

* a plain LightningModule at DP=2 saves ``last.ckpt`` (a folder) after 2 steps; a new module
  from another seed resumes with ``fit(ckpt_path=folder)`` to step 3 and equals the
  uninterrupted 3-step run bitwise; ``validate(ckpt_path=folder)`` gives the loss of the
  saved weights;
* the same MLP written with nxd's TP layers, at TP=2, saves its shards;
* a NeuronLTModule with a stock HF Llama at TP=2 predicts: full-vocabulary logits by default,
  this rank's vocabulary slice with ``predict_gathers_vocabulary = False``.

Then, in the test process (no process group): ``Classifier.load_from_checkpoint(folder)`` on
both folders gives the trained weights, the TP one assembled from its two shards.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from nxd_state.testing import load_sibling, run_distributed

R = load_sibling(__file__, "_recipe")
P = load_sibling(__file__, "_plain_recipe")
WORLD = 2


def _trainer(tp: int, steps: int, folder: Path | None = None, epochs: int | None = None) -> Any:
    from lightning.pytorch import Trainer
    from lightning.pytorch.callbacks import ModelCheckpoint

    from nxd_lightning import NxDStrategy

    callbacks = [] if folder is None else [ModelCheckpoint(dirpath=folder, save_last=True)]
    return Trainer(
        accelerator="cpu",
        devices=WORLD,
        strategy=NxDStrategy(tensor_parallel_size=tp),
        max_steps=steps,
        max_epochs=epochs,
        logger=False,
        enable_checkpointing=folder is not None,
        enable_model_summary=False,
        enable_progress_bar=False,
        callbacks=callbacks,
    )


def _params(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in module.named_parameters()}


def ranks(folder: str) -> dict[str, Any]:
    import torch.distributed as dist

    import nxd_state
    from nxd_lightning import NeuronLTModule

    out: dict[str, Any] = {}
    base = Path(folder)
    # DP=2, plain module: save after one epoch (2 steps of 4 samples per rank; Lightning
    # resumes mid-epoch only with a resumable loader), resume to step 3, compare with 3
    # uninterrupted steps.
    nxd_state.destroy_model_parallel()
    saved = P.Classifier(seed=0)
    _trainer(1, -1, base / "dp", epochs=1).fit(saved, P.loader(4))
    out["dp_saved"] = _params(saved)
    resumed = P.Classifier(seed=5)
    _trainer(1, 3).fit(resumed, P.loader(4), ckpt_path=str(base / "dp" / "last.ckpt"))
    straight = P.Classifier(seed=0)
    _trainer(1, 3).fit(straight, P.loader(4))
    out["resumed"], out["straight"] = _params(resumed), _params(straight)
    fresh = P.Classifier(seed=7)
    metrics = _trainer(1, 1).validate(
        fresh, P.loader(4), ckpt_path=str(base / "dp" / "last.ckpt"), verbose=False
    )
    out["val_loss"] = metrics[0]["val_loss"]
    # TP=2, the MLP with nxd's TP layers: each rank saves its shards.
    nxd_state.destroy_model_parallel()
    nxd_state.initialize_model_parallel(tensor_model_parallel_size=2)
    tp_module = P.TPClassifier(seed=0)
    _trainer(2, 2, base / "tp").fit(tp_module, P.loader(4))
    out["tp_saved"] = _params(tp_module)
    out["tp_rank"] = nxd_state.get_tensor_model_parallel_rank()
    # predict: NeuronLTModule, stock HF Llama at TP=2.
    nxd_state.destroy_model_parallel()
    config = R.config("hf_llama", 2, 1)
    ids = R.dataset().ids[:4]
    loader = torch.utils.data.DataLoader([{"input_ids": row} for row in ids], batch_size=2)
    module = NeuronLTModule(R.hf_llama, config, torch.optim.AdamW, None)
    full = _trainer(2, 1).predict(module, loader)
    module.predict_gathers_vocabulary = False
    sliced = _trainer(2, 1).predict(module, loader)
    out["predict_full"] = torch.cat([o.logits for o in full])
    out["predict_slice"] = torch.cat([o.logits for o in sliced])
    out["rank"] = dist.get_rank()
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict[str, Any]]]:
    folder = tmp_path_factory.mktemp("ckpts")
    return folder, run_distributed(ranks, WORLD, str(folder))


def test_fit_resumes_from_a_folder_bitwise(results: tuple[Path, list[dict[str, Any]]]) -> None:
    _, per_rank = results
    for rank in per_rank:
        for key, value in rank["straight"].items():
            # bitwise: the same operations on the same values (weights, momentum, sampler)
            torch.testing.assert_close(rank["resumed"][key], value, rtol=0, atol=0, msg=key)


def test_validate_loads_a_folder(results: tuple[Path, list[dict[str, Any]]]) -> None:
    _, per_rank = results
    net = P.Classifier(seed=0)
    net.load_state_dict(per_rank[0]["dp_saved"])
    x, y = P.tensors()
    for rank in per_rank:
        # This rank's val_loss: the mean of its 2 batches of 4 (validation's DistributedSampler
        # deals rows rank, rank + 2, ...), the mean over its 8 rows up to fp32 round-off of
        # the regrouped sums (rtol 1e-6).
        r = rank["rank"]
        expected = torch.nn.functional.cross_entropy(net(x[r::2]), y[r::2]).detach()
        torch.testing.assert_close(torch.tensor(rank["val_loss"]), expected, rtol=1e-6, atol=0)


def test_load_from_checkpoint_reads_a_folder(results: tuple[Path, list[dict[str, Any]]]) -> None:
    import nxd_lightning  # noqa: F401  (as a user's script imports it: folders load)

    folder, per_rank = results
    loaded = P.Classifier.load_from_checkpoint(folder / "dp" / "last.ckpt")
    assert loaded.hparams.seed == 0  # the saved hyper-parameters built it
    for key, value in per_rank[0]["dp_saved"].items():
        torch.testing.assert_close(loaded.state_dict()[key], value, rtol=0, atol=0, msg=key)
    # The TP=2 checkpoint loads into the one-process MLP: each tensor assembled whole.
    whole = P.Classifier.load_from_checkpoint(folder / "tp" / "last.ckpt").state_dict()
    for rank in per_rank:
        for key, shard in rank["tp_saved"].items():
            if key == "fc2.bias":
                expected = whole[key]
            else:
                expected = whole[key].chunk(2, 1 if key == "fc2.weight" else 0)[rank["tp_rank"]]
            torch.testing.assert_close(shard, expected, rtol=0, atol=0, msg=key)


def test_predict_returns_the_whole_vocabulary(results: tuple[Path, list[dict[str, Any]]]) -> None:
    _, per_rank = results
    net = R.hf_llama()
    with torch.no_grad():
        expected = net(input_ids=R.dataset().ids[:4]).logits
    assert expected.shape[-1] == R.VOCAB
    for rank in per_rank:
        # fp32: the TP-split matmul sums re-associate (a few ulps of logits of size ~1).
        torch.testing.assert_close(rank["predict_full"], expected, rtol=1e-5, atol=1e-6)
        own = expected.chunk(2, -1)[rank["rank"]]  # TP rank = global rank at TP=2 on 2 ranks
        assert rank["predict_slice"].shape[-1] == R.VOCAB // 2
        torch.testing.assert_close(rank["predict_slice"], own, rtol=1e-5, atol=1e-6)
