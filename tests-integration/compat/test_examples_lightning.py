"""NxD's Lightning Llama example, its calls rendered unchanged but for XLA, on gloo.

The example subclasses ``NeuronLTModule``: ``setup()`` builds the model itself with
``initialize_parallel_model(self.nxd_config, self.model_fn, include_buffers, *self.model_args,
**self.model_kwargs)``; ``training_step`` runs ``self.model(...)``, divides the loss by
``grad_accum_steps``, calls ``loss.backward()`` and every ``grad_accum_steps`` micro-batches
averages the loss over DP (``xm.all_reduce`` on ``get_data_parallel_group(as_list=True)``
there, ``torch.distributed.all_reduce`` here), steps ``self.optimizers()`` and
``self.lr_schedulers()``; ``configure_optimizers`` calls ``initialize_parallel_optimizer`` on
``get_param_groups_by_weight_decay()`` and returns a step-interval scheduler;
``on_train_batch_end`` logs ``loss``, ``lr`` and ``global_step`` and sets the loggers'
``print_step``. The script builds ``NeuronXLAStrategy(nxd_config=..., save_load_xser=...)``,
``NeuronXLAPrecisionPlugin()``, ``NeuronTQDMProgressBar()``, a ``ModelCheckpoint`` monitoring
``global_step``, ``NeuronTensorBoardLogger(save_dir=..., log_rank0=...)``, and calls
``Trainer.fit(model=..., datamodule=...)``.

Run at TP=2 (two ranks) and in one process (TP=1), three steps each, with the example's
meta-device init: the losses agree. Tolerance (rtol 1e-4, atol 1e-5): float32 throughout; TP
splits the matmul sums and the vocabulary-parallel log-sum-exp, and AdamW's steps move every
weight by ~lr whatever the gradient's size, so later losses inherit the reordering (observed
~1e-6); a gradient not summed over TP moves the second loss by >1e-2.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from nxd_state.testing import load_sibling, run_distributed

M = load_sibling(__file__, "_nxd_hf_llama")
TOL = {"rtol": 1e-4, "atol": 1e-5}  # see the module docstring
STEPS, BATCH = 3, 2


def _data_module() -> Any:
    """The example's ``NeuronLightningDataModule``, on synthetic token ids."""
    from lightning.pytorch import LightningDataModule

    class DataModule(LightningDataModule):
        def train_dataloader(self) -> torch.utils.data.DataLoader:
            gen = torch.Generator().manual_seed(7)
            # One batch, seen every step: its loss must fall (fresh random tokens each step
            # may well score worse than the first batch after a few tiny steps).
            ids = torch.randint(1, M.VOCAB, (BATCH, M.SEQ), generator=gen).repeat(STEPS, 1)
            rows = [
                {"input_ids": row, "attention_mask": torch.ones_like(row), "labels": row}
                for row in ids
            ]
            return torch.utils.data.DataLoader(rows, batch_size=BATCH, shuffle=False)

    return DataModule()


def lightning_llama(tp: int, folder: str) -> dict[str, Any]:
    """``run_llama_nxd_ptl.py``'s calls, XLA calls replaced."""
    import torch.distributed as dist
    from lightning.pytorch import Trainer
    from lightning.pytorch.callbacks import ModelCheckpoint

    import neuronx_distributed as nxd
    from neuronx_distributed.lightning import (
        NeuronLTModule,
        NeuronTensorBoardLogger,
        NeuronTQDMProgressBar,
        NeuronXLAPrecisionPlugin,
        NeuronXLAStrategy,
    )
    from neuronx_distributed.parallel_layers import parallel_state
    from neuronx_distributed.trainer import initialize_parallel_model, initialize_parallel_optimizer

    losses: list[float] = []

    class NeuronLlamaLTModule(NeuronLTModule):
        def setup(self, stage: str | None = None) -> None:
            include_buffers = True
            self.model = initialize_parallel_model(
                self.nxd_config, self.model_fn, include_buffers, *self.model_args,
                **self.model_kwargs,
            )  # fmt: skip
            self.averaged_loss = torch.zeros(1, dtype=torch.double)
            self.print_pp_rank = (
                0 if self.log_rank0 else self.trainer.strategy.pipeline_parallel_size - 1
            )

        def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
            for logger in self.trainer.loggers:
                logger.print_step = -1
            self.should_print = False
            outputs = self.model(
                input_ids=batch["input_ids"],
                attention_mask=batch["attention_mask"],
                labels=batch["labels"],
            )
            loss = outputs.loss / self.grad_accum_steps
            loss.backward()
            self.averaged_loss += loss.detach()
            if not self.automatic_optimization and (batch_idx + 1) % self.grad_accum_steps == 0:
                self.should_print = True
                loss_div = self.averaged_loss / self.trainer.strategy.data_parallel_size
                dist.all_reduce(loss_div, group=parallel_state.get_data_parallel_group())
                self.averaged_loss.zero_()
                optimizer = self.optimizers()
                scheduler = self.lr_schedulers()
                optimizer.step()
                optimizer.zero_grad()
                scheduler.step()
                self.loss = loss_div.detach()
            return loss

        def configure_optimizers(self) -> Any:
            param_groups = self.get_param_groups_by_weight_decay()
            optimizer = initialize_parallel_optimizer(
                self.nxd_config, self.opt_cls, param_groups, **self.opt_kwargs
            )
            optimizer.zero_grad()
            scheduler = self.scheduler_cls(optimizer, *self.scheduler_args, **self.scheduler_kwargs)
            return ([optimizer], [{"scheduler": scheduler, "interval": "step", "frequency": 1}])

        def on_train_batch_end(self, *args: Any, **kwargs: Any) -> None:
            if self.should_print and not self.automatic_optimization:
                losses.append(float(self.loss))
                self.log("loss", float(self.loss), prog_bar=True)
                self.log("lr", self.lr_schedulers().get_last_lr()[0], prog_bar=True)
                self.log("global_step", self.global_step, prog_bar=True, on_step=True)
                for logger in self.trainer.loggers:
                    logger.print_step = self.global_step

    def configure_scheduler(optimizer: Any, max_steps: int) -> Any:
        return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 - step / max_steps)

    torch.manual_seed(1234)
    config = M.tiny_config()
    config.use_cache = False
    nxd_config = nxd.neuronx_distributed_config(
        tensor_parallel_size=tp,
        optimizer_config={"zero_one_enabled": tp > 1, "grad_clipping": True, "max_grad_norm": 1.0},
        sequence_parallel=False,
        activation_checkpoint_config=M.CoreAttention,
        model_init_config={"meta_device_init": True, "param_init_fn": M.init_weights},
    )
    model = NeuronLlamaLTModule(
        model_fn=M.LlamaForCausalLM,
        nxd_config=nxd_config,
        model_args=(config,),
        opt_cls=torch.optim.AdamW,
        scheduler_cls=configure_scheduler,
        opt_kwargs={"lr": 1e-3, "betas": (0.9, 0.999), "weight_decay": 0.01},
        scheduler_args=(STEPS,),
        grad_accum_steps=1,
        manual_opt=True,
    )
    strategy = NeuronXLAStrategy(nxd_config=nxd_config, save_load_xser=False)
    callbacks = [
        NeuronTQDMProgressBar(),
        ModelCheckpoint(
            save_top_k=1, monitor="global_step", mode="max", every_n_train_steps=STEPS,
            dirpath=folder,
        ),
    ]  # fmt: skip
    trainer = Trainer(
        accelerator="cpu",  # (XLA's accelerator finds its devices; on CPU they are given)
        devices=tp,
        strategy=strategy,
        max_steps=STEPS,
        plugins=[NeuronXLAPrecisionPlugin()],
        enable_checkpointing=True,
        logger=NeuronTensorBoardLogger(save_dir=folder, log_rank0=False),
        log_every_n_steps=1,
        callbacks=callbacks,
        enable_model_summary=False,
    )
    trainer.fit(model=model, datamodule=_data_module())
    return {"losses": losses, "global_step": trainer.global_step}


def test_lightning_llama_example_matches_one_process(tmp_path: Path) -> None:
    parallel = run_distributed(lightning_llama, 2, 2, str(tmp_path / "tp2"))
    (reference,) = run_distributed(lightning_llama, 1, 1, str(tmp_path / "tp1"))
    assert reference["global_step"] == STEPS
    assert len(reference["losses"]) == STEPS
    assert reference["losses"][-1] < reference["losses"][0]  # it trained
    for result in parallel:
        torch.testing.assert_close(result["losses"], reference["losses"], **TOL)
    # ModelCheckpoint's `epoch=0-step=3.ckpt` is an nxd checkpoint folder with a committed index.
    saved = [p for p in (tmp_path / "tp2").rglob("*step=*") if p.is_dir()]
    assert saved, sorted(str(p) for p in (tmp_path / "tp2").rglob("*"))
    assert any((p / "index.json").is_file() or list(p.rglob("index.json")) for p in saved), saved
