"""Bad input fails early with the value and what was expected.

In-process checks raise while the Trainer or module is being built, before Lightning starts any
process (so on every rank of a torchrun job too, before any collective). The run-time checks
(a pytorch_lightning datamodule, bf16 without master weights) run in one rank and raise before
the strategy creates a process group or the first step.
"""

from __future__ import annotations

from typing import Any

import pytest
import pytorch_lightning
import torch
from lightning.pytorch import Trainer

from nxd_lightning import NeuronLTModule, NeuronXLAPrecisionPlugin, NxDStrategy
from nxd_state.testing import load_sibling, run_distributed

R = load_sibling(__file__, "_recipe")


def _module(**kwargs: Any) -> NeuronLTModule:
    return NeuronLTModule(R.tiny_lm, R.config("tiny_lm", 1, 1), torch.optim.AdamW, None, **kwargs)


def test_manual_opt_false_is_refused_as_in_nxd() -> None:
    with pytest.raises(ValueError, match=r"manual_opt=False.*automatic optimization"):
        _module(manual_opt=False)


@pytest.mark.parametrize("value", [0, -1, 1.5, True])
def test_grad_accum_steps_must_be_a_positive_integer(value: Any) -> None:
    with pytest.raises(
        ValueError, match=rf"grad_accum_steps must be a positive integer, got {value!r}"
    ):
        _module(grad_accum_steps=value)


def test_accumulation_needs_an_optimizer_that_scales_its_gradients() -> None:
    """A custom configure_optimizers returning a plain torch optimizer cannot average the
    accumulated gradient (nxd's NxDOptimizer.scale_gradients does): refused, named."""
    module = _module(grad_accum_steps=2)
    plain = torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=0.1)
    module.optimizers = lambda: type("LightningOptimizer", (), {"optimizer": plain})()
    assert module.finish_step(0) is False  # mid-accumulation: nothing asked of the optimizer
    with pytest.raises(TypeError, match=r"needs an optimizer with scale_gradients.*got SGD"):
        module.finish_step(1)


def test_sizes_that_do_not_fit_the_world_fail_when_the_trainer_is_built() -> None:
    with pytest.raises(
        ValueError, match=r"tensor_parallel_size\(2\).*does not divide world_size\(3\)"
    ):
        Trainer(accelerator="cpu", devices=3, strategy=NxDStrategy(tensor_parallel_size=2))
    config = R.config("tiny_lm", 2, 2)
    with pytest.raises(ValueError, match=r"= 4 does not divide world_size\(2\)"):
        Trainer(accelerator="cpu", devices=2, strategy=NxDStrategy(config))


def test_strategy_arguments_are_checked() -> None:
    with pytest.raises(ValueError, match=r"tensor_parallel_size must be a positive integer, got 0"):
        NxDStrategy(tensor_parallel_size=0)
    with pytest.raises(ValueError, match=r"tensor_parallel_size=4 contradicts nxd_config"):
        NxDStrategy(R.config("tiny_lm", 2, 1), tensor_parallel_size=4)
    # Context parallelism is the trainer API's only: refused by name, not left to fail deep in
    # the model (or train as plain DP).
    with pytest.raises(ValueError, match=r"context_parallel_size=2: NxDStrategy has no context"):
        NxDStrategy(R.config("tiny_lm", 1, 1, context_parallel_size=2))
    with pytest.raises(ValueError, match=r"start_method must be one of"):
        NxDStrategy(start_method="thread")


@pytest.mark.parametrize(
    ("argument", "value", "name"),
    [
        ("callbacks", lambda: [pytorch_lightning.callbacks.ModelCheckpoint()], "ModelCheckpoint"),
        (
            "callbacks",
            lambda: [pytorch_lightning.callbacks.LearningRateMonitor()],
            "LearningRateMonitor",
        ),
        ("logger", lambda: pytorch_lightning.loggers.CSVLogger("unused"), "CSVLogger"),
    ],
)
def test_pytorch_lightning_objects_in_a_lightning_trainer_are_named(argument, value, name) -> None:
    with pytest.raises(TypeError, match=rf"pytorch_lightning objects .*{name}.*lightning\.pytorch"):
        Trainer(accelerator="cpu", devices=1, strategy=NxDStrategy(), **{argument: value()})


def _fit_with(kind: str) -> str:
    """One rank: a run that must fail before training (returns the error text)."""
    from lightning.pytorch import Trainer as LightningTrainer

    plugins, datamodule = [], None
    config = R.config("tiny_lm", 1, 1)
    if kind == "datamodule":

        class Data(pytorch_lightning.LightningDataModule):
            def train_dataloader(self) -> Any:
                return R.loader()

        datamodule = Data()
    else:  # bf16 without fp32 master weights (the config's default without ZeRO-1)
        plugins = [NeuronXLAPrecisionPlugin(mixed_precision_enabled=True)]
    module = NeuronLTModule(R.tiny_lm, config, torch.optim.AdamW, None, opt_kwargs=R.ADAMW)
    trainer = LightningTrainer(
        accelerator="cpu",
        devices=1,
        strategy=NxDStrategy(config),
        max_steps=1,
        logger=False,
        enable_checkpointing=False,
        plugins=plugins,
    )
    try:
        if datamodule is not None:
            trainer.fit(module, datamodule=datamodule)
        else:
            trainer.fit(module, train_dataloaders=R.loader())
    except (TypeError, ValueError) as error:
        return f"{type(error).__name__}: {error}"
    return "no error"


def test_run_time_checks() -> None:
    texts = [run_distributed(_fit_with, 1, kind)[0] for kind in ("datamodule", "bf16")]
    assert texts[0].startswith("TypeError: pytorch_lightning objects"), texts[0]
    assert "datamodule" in texts[0]
    assert texts[1].startswith("ValueError: NeuronXLAPrecisionPlugin(mixed_precision_enabled=True)")
    assert "use_master_weights" in texts[1]


def test_retention_removes_only_checkpoints_this_plugin_saved(
    tmp_path: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """ModelCheckpoint's retention calls ``remove_checkpoint`` with paths it computed: an
    nxd-ckpt tag goes; a file, a link or a folder that nxd-ckpt did not write at such a path
    stays, with a warning naming it (training goes on)."""
    import nxd_ckpt
    from nxd_lightning import NeuronCheckpointIO

    io = NeuronCheckpointIO()
    nxd_ckpt.save_checkpoint(tmp_path, "epoch=0-step=2.ckpt", model=torch.nn.Linear(2, 2))
    (tmp_path / "last.ckpt").write_text("a plain Lightning checkpoint file")
    (tmp_path / "other.ckpt").mkdir()
    (tmp_path / "other.ckpt" / "done").write_text("1")
    (tmp_path / "link.ckpt").symlink_to(tmp_path / "other.ckpt", target_is_directory=True)

    io.remove_checkpoint(tmp_path / "epoch=0-step=2.ckpt")
    assert not (tmp_path / "epoch=0-step=2.ckpt").exists()
    io.remove_checkpoint(tmp_path / "missing.ckpt")  # nothing there: nothing to do
    for name in ("last.ckpt", "other.ckpt", "link.ckpt"):
        caplog.clear()
        io.remove_checkpoint(tmp_path / name)
        assert f"{name} not removed" in caplog.text
    assert (tmp_path / "last.ckpt").read_text() == "a plain Lightning checkpoint file"
    assert (tmp_path / "other.ckpt" / "done").exists()
    assert (tmp_path / "link.ckpt").is_symlink()


def test_hooks_callback_needs_the_module_model_to_be_a_module() -> None:
    """The callback hooks layers of ``pl_module.model``: anything else is named, not hooked."""
    from types import SimpleNamespace

    from lightning.pytorch import LightningModule

    from nxd_lightning import NeuronHooksCallback

    cfg = SimpleNamespace(
        hooks=True,
        master_print_model_layers=False,
        target_layers="layer",
        dump_only_master_rank=False,
        dump_only_norms=True,
        hooks_interval=1,
        enable_activation_dumps=True,
        enable_grad_dumps=False,
        enable_tb_logging_master_rank_activation_norms=False,
        enable_tb_logging_master_rank_grad_norms=False,
    )
    module = LightningModule()
    module.model = "not a module"
    with pytest.raises(TypeError, match=r"LightningModule\.model is a str"):
        NeuronHooksCallback(cfg).on_train_start(Trainer(logger=False), module)
