"""Expert parallelism under Lightning: ``NxDStrategy`` at ``expert_parallel_size=2`` trains a
stock Hugging Face Mixtral (4 experts, top-2, router auxiliary loss on) like one process, and
its checkpoint resumes at EP=1.

One 2-rank spawn (DP=2 = EP, so expert-DP=1; each rank holds experts 2r and 2r + 1 of every
layer):

* ``NeuronLTModule`` + ``NxDStrategy(config)`` at EP=2 fits one epoch (2 steps, 4 sequences per
  rank per step), ``ModelCheckpoint`` saving ``last.ckpt`` (an nxd-ckpt folder);
* the same with ZeRO-1: the module's optimizer is nxd-optim's ``NeuronEPZero1Optimizer``;
* a new module at EP=1 (experts replicated) resumes from the EP=2 folder and trains step 3;
* a plain ``LightningModule`` at EP=2 is refused when the strategy sets it up.

The one-process reference trains the unsharded Mixtral with torch's AdamW and
``clip_grad_norm_`` on each step's global batch: the loss is the mean of the DP ranks' losses,
each on its 4 sequences, as data parallelism computes it (the router's load-balancing loss is a
product of per-batch means, so it is the mean of the ranks', not one loss on all 8 sequences).
The cheap refusals (EP with PP > 1, Lightning's own; CP > 1 and LoRA, the trainer's; EP not
dividing DP) run in this process.
"""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Any

import pytest
import torch

from nxd_state.testing import load_sibling, run_distributed

R = load_sibling(__file__, "_recipe")
WORLD, EP, EXPERTS, BATCH = 2, 2, 4, 4
# fp32: the DP mean of two losses' gradients vs the gradient of their mean, and the norm's sum
# in another grouping, re-associate (~1e-7 relative), which AdamW's division by the root of the
# second moment may amplify on small weights; measured: at most 1.2e-7 off after 3 steps. The
# bugs this must catch are far larger: each expert counted twice in the clipping norm moves
# weights by 4e-4, one load-balancing loss over both ranks' batches by 1e-2 (and an expert
# gradient averaged with another expert's, or a checkpoint's experts misplaced, by O(lr)).
TOL = {"rtol": 1e-5, "atol": 1e-6}


def mixtral() -> torch.nn.Module:
    """A stock ``MixtralForCausalLM``: 2 layers of 4 experts (top-2), router logits returned and
    the load-balancing loss added to the loss. Weights ~ N(0, 1/fan_in) (seed 0, the same full
    model on every rank): router logits of order 1, so no near-tie of experts flips under
    round-off."""
    from transformers import MixtralConfig, MixtralForCausalLM

    config = MixtralConfig(
        vocab_size=R.VOCAB,
        hidden_size=16,
        intermediate_size=16,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_local_experts=EXPERTS,
        num_experts_per_tok=2,
        output_router_logits=True,
        router_aux_loss_coef=0.1,
        use_cache=False,
        attn_implementation="eager",
    )
    torch.manual_seed(0)
    model = MixtralForCausalLM(config)
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() >= 2:
                param.normal_(0, 1 / math.sqrt(param.shape[-1]))
    return model


def _config(ep: int, zero1: bool = False) -> Any:
    from nxd_trainer import NxDConfig

    optimizer = {"zero_one_enabled": zero1, "max_grad_norm": R.MAX_GRAD_NORM}
    return NxDConfig(expert_parallel_size=ep, optimizer_config=optimizer)


def _fit(ep: int, *, zero1: bool = False, folder: Path | None = None, resume: str = "") -> Any:
    """NeuronLTModule(mixtral) under NxDStrategy at ``ep``: one epoch (saving ``last.ckpt`` in
    ``folder``), or from ``resume`` to step 3."""
    from lightning.pytorch import Trainer
    from lightning.pytorch.callbacks import ModelCheckpoint

    import nxd_state
    from nxd_lightning import NeuronLTModule, NxDStrategy

    nxd_state.destroy_model_parallel()
    config = _config(ep, zero1)
    module = NeuronLTModule(mixtral, config, torch.optim.AdamW, None, opt_kwargs=R.ADAMW)
    recorder = R.LossRecorder()
    callbacks = [recorder]
    if folder is not None:
        callbacks.append(ModelCheckpoint(dirpath=folder, save_last=True))
    trainer = Trainer(
        accelerator="cpu",
        devices=WORLD,
        strategy=NxDStrategy(config),
        max_epochs=1 if resume == "" else None,
        max_steps=-1 if resume == "" else 3,
        logger=False,
        enable_checkpointing=folder is not None,
        enable_model_summary=False,
        enable_progress_bar=False,
        callbacks=callbacks,
    )
    trainer.fit(module, R.loader(BATCH), ckpt_path=resume or None)
    inner = module.optimizers().optimizer
    val_loss = None
    if folder is not None:  # run_eval at EP=2 on 8 sequences: 4 per rank, one batch each
        metrics = trainer.validate(module, R.loader(BATCH, samples=8), verbose=False)
        val_loss = metrics[0]["val_loss"]
    return {
        "val_loss": val_loss,
        "ep_rank": trainer.strategy.expert_parallel_rank,
        "losses": recorder.losses,
        "params": {n: p.detach().clone() for n, p in module.model.named_parameters()},
        "experts": sorted(n for n, p in module.model.named_parameters() if _is_expert(p)),
        "optimizer": type(getattr(inner, "optimizer", inner)).__name__,
    }


def _is_expert(param: torch.Tensor) -> bool:
    return bool(getattr(param, "expert_model_parallel", False))


def _plain_refusal() -> str:
    from lightning.pytorch import Trainer

    import nxd_state
    from nxd_lightning import NxDStrategy

    P = load_sibling(__file__, "_plain_recipe")
    nxd_state.destroy_model_parallel()
    trainer = Trainer(
        accelerator="cpu",
        devices=WORLD,
        strategy=NxDStrategy(expert_parallel_size=EP),
        max_steps=1,
        logger=False,
        enable_checkpointing=False,
        enable_model_summary=False,
        enable_progress_bar=False,
    )
    try:
        trainer.fit(P.Classifier(seed=0), P.loader(BATCH))
    except ValueError as error:
        return str(error)
    return "no error"


def ranks(folder: str) -> dict[str, Any]:
    import nxd_state

    out: dict[str, Any] = {"ep2": _fit(EP, folder=Path(folder))}
    out["ep_rank"] = nxd_state.get_parallel_state().expert_model_parallel_rank
    out["ep2_zero1"] = _fit(EP, zero1=True)
    out["ep1_resumed"] = _fit(1, resume=str(Path(folder) / "last.ckpt"))
    out["plain"] = _plain_refusal()
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return run_distributed(ranks, WORLD, str(tmp_path_factory.mktemp("ep")))


@pytest.fixture(scope="module")
def reference() -> dict[str, Any]:
    """One process, 3 steps: each step's loss is the mean of the DP ranks' batch losses."""
    model = mixtral()
    optimizer = torch.optim.AdamW(R.param_groups(model), **R.ADAMW)
    ids = R.dataset().ids
    losses, params = [], []
    for rows in R.global_steps(WORLD, BATCH, 3):
        chunks = ids[rows].split(BATCH)  # rank 0's sequences, then rank 1's
        loss = sum(model(input_ids=c, labels=c).loss for c in chunks) / len(chunks)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), R.MAX_GRAD_NORM)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
        params.append({n: p.detach().clone() for n, p in model.named_parameters()})
    return {"losses": losses, "params": params}


def _check(
    run: dict[str, Any], reference: dict[str, Any], step: int, ep_rank: int, ep: int
) -> None:
    """``run``'s parameters (experts: this EP rank's slice) equal the reference's after
    ``step`` steps."""
    want = reference["params"][step - 1]
    assert run["params"].keys() == want.keys()
    local = EXPERTS // ep
    for name, value in run["params"].items():
        full = want[name]
        if name in run["experts"]:
            full = full[ep_rank * local : (ep_rank + 1) * local]
        torch.testing.assert_close(value, full, **TOL, msg=name)


@pytest.mark.parametrize("case", ["ep2", "ep2_zero1"])
def test_ep2_trains_like_one_process(
    results: list[dict[str, Any]], reference: dict[str, Any], case: str
) -> None:
    for rank in results:
        run = rank[case]
        # The experts are sharded (2 of 4 per rank), by the HF parallelizer, in both layers.
        assert len(run["experts"]) == 4, run["experts"]
        assert all(run["params"][n].shape[0] == EXPERTS // EP for n in run["experts"])
        torch.testing.assert_close(
            torch.tensor(run["losses"]), torch.tensor(reference["losses"][:2]), **TOL
        )
        _check(run, reference, 2, rank["ep_rank"], EP)
    assert [rank["ep_rank"] for rank in results] == [0, 1]
    assert [rank[case]["ep_rank"] for rank in results] == [0, 1]  # the strategy's, the same
    names = {rank[case]["optimizer"] for rank in results}
    assert names == {"NeuronEPZero1Optimizer" if case == "ep2_zero1" else "AdamW"}


def test_ep2_validates_like_one_process(
    results: list[dict[str, Any]], reference: dict[str, Any]
) -> None:
    """``val_loss`` after the 2 steps: the DP mean of each rank's batch loss (Lightning's
    validation sampler deals rank r the rows r, r + 2, ...), with the router loss, in eval."""
    model = mixtral()
    model.load_state_dict(reference["params"][1])
    ids = R.dataset().ids[:8]
    with torch.no_grad():
        expected = sum(model(input_ids=ids[r::2], labels=ids[r::2]).loss for r in (0, 1)) / 2
    for rank in results:
        torch.testing.assert_close(torch.tensor(rank["ep2"]["val_loss"]), expected, **TOL)


def test_ep2_checkpoint_resumes_at_ep1(
    results: list[dict[str, Any]], reference: dict[str, Any]
) -> None:
    """The EP=2 folder (each rank's two experts, their AdamW moments) loads at EP=1, every
    rank all four experts, and step 3 is the one-process run's."""
    for rank in results:
        run = rank["ep1_resumed"]
        assert run["experts"] == []  # EP=1: nothing sharded
        torch.testing.assert_close(
            torch.tensor(run["losses"]), torch.tensor(reference["losses"][2:]), **TOL
        )
        _check(run, reference, 3, 0, 1)


def test_plain_module_at_ep2_is_refused(results: list[dict[str, Any]]) -> None:
    for rank in results:
        assert rank["plain"].startswith("expert_parallel_size=2 with Classifier"), rank["plain"]
        assert "Expected expert_parallel_size=1, or a NeuronLTModule" in rank["plain"]


# Refusals in this process, before Lightning starts any process --------------------------------
LIGHTNING_EP_PP = (
    "expert_parallel_size=2 with pipeline_parallel_size=2 is not supported by NxDStrategy yet: "
    "Lightning runs expert parallelism at pipeline_parallel_size=1 (the trainer API and "
    "nxd-train --ep --pp run both)"
)


def _trainer_message(**config: Any) -> str:
    """The trainer API's refusal of ``config``."""
    from nxd_trainer import NxDConfig

    with pytest.raises(ValueError, match=r"expert_parallel_size=2.*not supported") as error:
        NxDConfig(**config)
    return str(error.value)


def _with(combination: str) -> dict[str, Any]:
    """The config keys that pair ``combination`` with EP."""
    if combination == "pp2":
        return {
            "pipeline_parallel_size": 2,
            "pipeline_config": {"pipeline_cuts": ["model.layers.0"]},
        }
    if combination == "cp2":
        return {"context_parallel_size": 2}
    from nxd_lora import LoraConfig

    return {"lora_config": LoraConfig(enable_lora=True, target_modules=["q_proj"])}


@pytest.mark.parametrize("combination", ["pp2", "cp2", "lora"])
def test_what_the_trainer_refuses_at_ep2_is_refused_alike(combination: str) -> None:
    """EP=2 with PP=2, CP=2 or LoRA, in the dict given to the strategy: the trainer's message,
    when the strategy is built (before the Trainer, so before any process or collective)."""
    from nxd_lightning import NxDStrategy

    extra = _with(combination)
    if combination == "pp2":  # the trainer runs EP x PP; Lightning refuses it by its own line
        expected = LIGHTNING_EP_PP
    else:
        expected = _trainer_message(expert_parallel_size=2, **extra)
    with pytest.raises(ValueError, match=f"^{re.escape(expected)}$"):
        NxDStrategy({"expert_parallel_size": 2, **extra})


def test_ep_sizes_are_checked_when_the_trainer_is_built() -> None:
    from lightning.pytorch import Trainer

    from nxd_lightning import NxDStrategy

    # Without a config, EP with PP > 1 is refused too.
    with pytest.raises(ValueError, match=f"^{re.escape(LIGHTNING_EP_PP)}$"):
        NxDStrategy(expert_parallel_size=2, pipeline_parallel_size=2)
    with pytest.raises(ValueError, match=r"expert_parallel_size must be a positive integer"):
        NxDStrategy(expert_parallel_size=0)
    with pytest.raises(ValueError, match=r"expert_parallel_size=4 contradicts nxd_config"):
        NxDStrategy(_config(2), expert_parallel_size=4)
    # EP groups are carved out of DP: EP=4 on DP=2 fails before any process starts.
    with pytest.raises(ValueError, match=r"expert_model_parallel_size\(4\) does not divide"):
        Trainer(accelerator="cpu", devices=2, strategy=NxDStrategy(expert_parallel_size=4))
