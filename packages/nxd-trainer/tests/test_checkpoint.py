"""The reference's sample with its checkpoint lines: a job stopped after step 2 and restarted
in fresh processes (``load_checkpoint`` with ``tag=None`` picks the newest complete tag)
continues **bitwise** equal to the same job run without interruption, at TP=2, PP=2 and
TP=2 x PP=2 x DP=2 with ZeRO-1, and with LoRA through ``lora_config`` /
``load_lora_from_ckpt``.

Exact equality (rtol = atol = 0) is the right bar: the restarted job runs the same operations
in the same order on the same values at the same degrees, on CPU, so any difference is state
the checkpoint lost. Each part of the state is needed for it: the weights (the restarted
model starts from its initial weights), AdamW's moments and step count, the scheduler's
position (LinearLR warm-up: the LR differs per step), and the RNG streams (dropout 0.1 on
the default generator and, in attention, on the TP tracker stream; the restarted processes
are seeded differently on purpose, so only a restored RNG draws the uninterrupted run's masks).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from nxd_state.testing import load_sibling, run_distributed

R = load_sibling(__file__, "_recipe")
STEPS, STOP_AFTER = 4, 2
DROPOUT = 0.1
EXACT = {"rtol": 0.0, "atol": 0.0}
LORA = {
    "enable_lora": True,
    "lora_rank": 4,
    "lora_alpha": 8.0,
    "target_modules": ["q_proj", "v_proj", "o_proj"],
}


def _batches() -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(5)
    return [torch.randint(0, R.VOCAB, (R.BATCH, R.SEQ), generator=generator) for _ in range(STEPS)]


def sample(
    tp: int,
    pp: int,
    zero1: bool,
    ckpt: str | None,
    stop_after: int | None = None,
    seed: int = 1234,
    lora: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The reference's sample (config -> model -> optimizer -> auto-resume -> run_train loop
    with a checkpoint after every step), ``import neuronx_distributed as nxd`` changed only.

    ``ckpt=None``: no checkpoints (the uninterrupted job). ``stop_after``: the job "dies" after
    that many steps (its last checkpoint is then the newest tag).
    """
    import nxd_state
    import nxd_trainer as nxd
    from nxd_lora import LoraConfig
    from nxd_trainer.testing import Block

    nxd_state.destroy_model_parallel()
    torch.manual_seed(seed)
    nxd_state.model_parallel_manual_seed(seed)
    pipeline_config = None
    if pp > 1:
        pipeline_config = {
            "transformer_layer_cls": Block,
            "num_microbatches": 2,
            "input_names": ["input_ids", "labels"],
            "pipeline_cuts": ["blocks.1"],
            "leaf_module_cls": ["Embed", "Head"],
            "broadcast_and_average_loss": True,
        }
    nxd_config = nxd.neuronx_distributed_config(
        tensor_parallel_size=tp,
        pipeline_parallel_size=pp,
        pipeline_config=pipeline_config,
        optimizer_config={"zero_one_enabled": zero1, "max_grad_norm": R.MAX_GRAD_NORM},
        lora_config=LoraConfig(**lora) if lora else None,
    )
    model = nxd.initialize_parallel_model(
        nxd_config, R.get_model, tensor_parallel=True, dropout=DROPOUT
    )
    built = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    optimizer = nxd.initialize_parallel_optimizer(
        nxd_config, torch.optim.AdamW, model.parameters(), **R.ADAMW
    )
    scheduler = torch.optim.lr_scheduler.LinearLR(optimizer, start_factor=0.25, total_iters=STEPS)

    total_steps = 0
    # NxD's keyword names; use_zero1_dcp=True with ZeRO-1 (accepted: nxd's own format is used)
    if ckpt is not None and nxd.has_checkpoint(checkpoint_dir_str=ckpt):  # auto-resume
        user_content = nxd.load_checkpoint(
            ckpt, model=model, optimizer=optimizer, scheduler=scheduler, use_zero1_dcp=zero1
        )
        total_steps = user_content["total_steps"]

    state = nxd_state.get_parallel_state()
    per_replica = R.BATCH // state.data_parallel_size
    rows = slice(
        state.data_parallel_rank * per_replica, (state.data_parallel_rank + 1) * per_replica
    )
    losses, norms = {}, {}
    for ids in _batches()[total_steps:stop_after]:
        loss = model.run_train(ids[rows], ids[rows])
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
        total_steps += 1
        losses[total_steps], norms[total_steps] = float(loss), float(optimizer.grad_norm)
        if ckpt is not None:
            nxd.save_checkpoint(
                checkpoint_dir_str=ckpt,
                tag=f"step_{total_steps}",
                nxd_config=nxd_config,
                use_zero1_dcp=zero1,
                model=model,
                optimizer=optimizer,
                scheduler=scheduler,
                user_content={"total_steps": total_steps},
                num_kept_ckpts=2,
            )
    return {
        "losses": losses,
        "norms": norms,
        "lr": scheduler.get_last_lr(),
        "params": {n: p.detach().clone() for n, p in model.named_parameters()},
        "built": built,
        "rng": torch.get_rng_state(),
    }


def _check_resumed(full: list[dict[str, Any]], resumed: list[dict[str, Any]]) -> None:
    for rank, (a, b) in enumerate(zip(full, resumed)):
        assert sorted(b["losses"]) == list(range(STOP_AFTER + 1, STEPS + 1)), b["losses"]
        for step, loss in b["losses"].items():
            assert loss == a["losses"][step], (rank, step, loss, a["losses"][step])
            assert b["norms"][step] == a["norms"][step], (rank, step)
        assert b["lr"] == a["lr"]
        assert a["params"].keys() == b["params"].keys()
        for name, value in a["params"].items():
            torch.testing.assert_close(
                b["params"][name], value, **EXACT, msg=lambda m, n=name, r=rank: f"{r} {n}: {m}"
            )
        torch.testing.assert_close(b["rng"], a["rng"], **EXACT)


def _run_case(
    tmp_path: Path, world: int, *args: Any, lora: dict[str, Any] | None = None
) -> list[dict[str, Any]]:
    """Uninterrupted, stopped and restarted jobs; returns the uninterrupted job's results."""
    ckpt = str(tmp_path / "ckpts")
    full = run_distributed(sample, world, *args, None, lora=lora)
    stopped = run_distributed(sample, world, *args, ckpt, STOP_AFTER, lora=lora)
    tags = sorted(p.name for p in Path(ckpt).iterdir() if (p / "done").exists())
    assert tags == [f"step_{s}" for s in range(1, STOP_AFTER + 1)], tags
    # The restarted job: fresh processes, another seed; everything it needs is in the tags.
    resumed = run_distributed(sample, world, *args, ckpt, seed=99, lora=lora)
    for rank, result in enumerate(stopped):
        assert result["losses"] == {s: full[rank]["losses"][s] for s in (1, 2)}
    _check_resumed(full, resumed)
    return full


@pytest.mark.parametrize(("tp", "pp"), [(2, 1), (1, 2)], ids=["tp2", "pp2"])
def test_resume_is_bitwise_at_tp2_and_pp2(tmp_path: Path, tp: int, pp: int) -> None:
    _run_case(tmp_path, 2, tp, pp, False)


def test_resume_is_bitwise_at_tp2_pp2_dp2_zero1(tmp_path: Path) -> None:
    _run_case(tmp_path, 8, 2, 2, True)


def lora_sample(ckpt: str, seed: int) -> dict[str, Any]:
    """A LoRA model built with ``load_lora_from_ckpt`` on the last tag of a job; returns its
    trainable parameters right after ``initialize_parallel_model``."""
    import nxd_state
    import nxd_trainer as nxd
    from nxd_lora import LoraConfig

    nxd_state.destroy_model_parallel()
    torch.manual_seed(seed)
    config = LoraConfig(
        **LORA, load_lora_from_ckpt=True, lora_save_dir=ckpt, lora_load_tag=f"step_{STEPS}"
    )
    nxd_config = nxd.neuronx_distributed_config(tensor_parallel_size=2, lora_config=config)
    model = nxd.initialize_parallel_model(
        nxd_config, R.get_model, tensor_parallel=True, dropout=DROPOUT
    )
    return {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}


def test_lora_resume_and_load_lora_from_ckpt(tmp_path: Path) -> None:
    import nxd_ckpt

    full = _run_case(tmp_path, 2, 2, 1, False, lora=LORA)
    ckpt = tmp_path / "ckpts"
    # The default save mode keeps the adapter only.
    names = set(nxd_ckpt.read_index(ckpt / f"step_{STEPS}").tensors["model"])
    assert names
    assert all(".lora_" in n for n in names), sorted(names)[:4]
    loaded = run_distributed(lora_sample, 2, str(ckpt), 7)
    for rank in range(2):
        trained = full[rank]["params"]
        assert loaded[rank].keys() == {n for n in trained if ".lora_" in n}
        # Training moved the adapter away from its initial values, so equality below means
        # the trained adapter was loaded (not a freshly initialised one).
        assert any(not torch.equal(full[rank]["built"][n], trained[n]) for n in loaded[rank])
        for name, value in loaded[rank].items():
            torch.testing.assert_close(value, trained[name], **EXACT)


def _lora_model(nxd: Any, lora: dict[str, Any], shift: float) -> Any:
    """A TP=2 TinyLM with LoRA through the trainer; ``shift`` moves every base weight, so a
    base restored from a checkpoint is told apart from the built one."""
    from nxd_lora import LoraConfig

    def model_fn() -> torch.nn.Module:
        model = R.get_model(tensor_parallel=True)
        with torch.no_grad():
            for param in model.parameters():
                param.add_(shift)
        return model

    nxd_config = nxd.neuronx_distributed_config(
        tensor_parallel_size=2, lora_config=LoraConfig(**{**LORA, **lora})
    )
    return nxd_config, nxd.initialize_parallel_model(nxd_config, model_fn)


def _eval_loss(model: Any) -> float:
    ids = _batches()[0]
    model.eval()
    with torch.no_grad():
        return float(model(ids, ids))


def lora_modes(ckpt: str) -> dict[str, tuple[float, float]]:
    """NxD's three LoRA save modes set in the ``lora_config`` of the config: each trains one
    step, saves, and a model built elsewhere (another base, another adapter seed) with
    ``load_lora_from_ckpt`` on that tag returns (trained eval loss, loaded eval loss)."""
    import nxd_state
    import nxd_trainer as nxd

    modes = {
        "adapter": {},
        "base_and_adapter": {"save_lora_base": True},
        "merged": {"save_lora_base": True, "merge_lora": True},
    }
    out = {}
    for tag, fields in modes.items():
        nxd_state.destroy_model_parallel()
        torch.manual_seed(0)
        nxd_config, model = _lora_model(nxd, fields, shift=0.0)
        optimizer = nxd.initialize_parallel_optimizer(
            nxd_config, torch.optim.SGD, model.parameters(), lr=0.5
        )
        for ids in _batches()[:2]:  # B leaves zero at the first step, then both move
            model.run_train(ids, ids)
            optimizer.step()
            optimizer.zero_grad()
        trained = _eval_loss(model)
        nxd.save_checkpoint(ckpt, tag, nxd_config=nxd_config, model=model)
        nxd_state.destroy_model_parallel()
        torch.manual_seed(1)
        load = {"load_lora_from_ckpt": True, "lora_save_dir": ckpt, "lora_load_tag": tag}
        # The adapter mode keeps the base out of the checkpoint: it must be the same base.
        _, loaded = _lora_model(nxd, {**fields, **load}, shift=0.0 if tag == "adapter" else 0.01)
        out[tag] = (trained, _eval_loss(loaded))
    return out


def test_lora_save_modes_through_the_config(tmp_path: Path) -> None:
    import nxd_ckpt

    ckpt = tmp_path / "ckpts"
    results = run_distributed(lora_modes, 2, str(ckpt))
    for result in results:
        for mode in ("adapter", "base_and_adapter"):  # the same tensors, the same operations
            trained, loaded = result[mode]
            assert loaded == trained, (mode, trained, loaded)
        # merged: W + s·BA in one matmul instead of two summed, and a fresh adapter whose
        # B is zero: fp32 re-association only (~1e-7 relative on an O(1) loss).
        trained, loaded = result["merged"]
        torch.testing.assert_close(loaded, trained, rtol=1e-5, atol=1e-6)
    names = {
        tag: set(nxd_ckpt.read_index(ckpt / tag).tensors["model"])
        for tag in ("adapter", "base_and_adapter", "merged")
    }
    assert all(".lora_" in n for n in names["adapter"])
    assert names["base_and_adapter"] > names["adapter"]
    assert not any(".lora_" in n for n in names["merged"])
