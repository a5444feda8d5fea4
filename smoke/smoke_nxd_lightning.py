"""nxd-lightning installed alone: Trainer.fit of one step with NxD's strategy, precision plugin,
progress bar, TensorBoard logger and checkpoint IO, on one CPU process."""

import sys
import tempfile
from pathlib import Path

import torch
from lightning.pytorch import Trainer
from lightning.pytorch.callbacks import ModelCheckpoint

from nxd_lightning import (
    NeuronLTModule,
    NeuronTensorBoardLogger,
    NeuronTQDMProgressBar,
    NeuronXLAPrecisionPlugin,
    NxDStrategy,
)
from nxd_trainer import NxDConfig
from nxd_trainer.testing import TinyLM


def get_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return TinyLM(vocab=64, hidden=16, layers=2, heads=4)


class Tokens(torch.utils.data.Dataset):
    ids = torch.randint(0, 64, (8, 8), generator=torch.Generator().manual_seed(0))

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def main() -> None:
    config = NxDConfig(tensor_parallel_size=1, optimizer_config={"max_grad_norm": 1.0})
    module = NeuronLTModule(get_model, config, torch.optim.AdamW, None, opt_kwargs={"lr": 1e-3})
    with tempfile.TemporaryDirectory() as folder:
        trainer = Trainer(
            accelerator="cpu",
            devices=1,
            strategy=NxDStrategy(config),
            plugins=[NeuronXLAPrecisionPlugin()],
            callbacks=[
                NeuronTQDMProgressBar(),
                ModelCheckpoint(dirpath=Path(folder, "ckpts"), save_last=True),
            ],
            logger=NeuronTensorBoardLogger(save_dir=Path(folder, "logs")),
            max_steps=1,
            log_every_n_steps=1,
        )
        before = {n: p.detach().clone() for n, p in get_model().named_parameters()}
        trainer.fit(module, torch.utils.data.DataLoader(Tokens(), batch_size=4))
        assert trainer.global_step == 1, trainer.global_step
        after = dict(module.model.named_parameters())
        assert any(not torch.equal(after[n].detach(), before[n]) for n in before)
        assert Path(folder, "ckpts", "last.ckpt").exists(), sorted(Path(folder).rglob("*"))
        assert list(Path(folder, "logs").rglob("events.out.tfevents.*"))
    print("nxd-lightning smoke: ok", file=sys.stderr)


if __name__ == "__main__":
    main()
