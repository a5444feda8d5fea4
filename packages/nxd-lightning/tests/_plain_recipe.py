"""Plain LightningModules (not NeuronLTModule) as users write them, and their one-process
references. Not a test module: loaded by path (``load_sibling``), as ``_recipe``.

``Classifier``: a 2-layer MLP on 4 features, 3 classes, cross-entropy; ``TPClassifier``: the same
MLP written with nxd's column- and row-parallel layers (the full weights are drawn from a seed
and each TP rank keeps its slices, so it equals ``Classifier`` built from the same seed).
Data: SAMPLES rows; Lightning's DistributedSampler (shuffle, seed 0) splits them over DP, and the
one-process run reads each step's union of the DP ranks' batches (``_recipe.global_steps``).
"""

from __future__ import annotations

from typing import Any

import torch
from lightning.pytorch import LightningModule
from lightning.pytorch.callbacks import Callback

SAMPLES, FEATURES, HIDDEN, CLASSES = 16, 4, 8, 3
SGD = {"lr": 0.5, "momentum": 0.9}


def tensors() -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(3)
    x = torch.randn(SAMPLES, FEATURES, generator=generator)
    y = torch.randint(0, CLASSES, (SAMPLES,), generator=generator)
    return x, y


def dataset() -> torch.utils.data.TensorDataset:
    return torch.utils.data.TensorDataset(*tensors())


def loader(batch: int) -> torch.utils.data.DataLoader:
    return torch.utils.data.DataLoader(dataset(), batch_size=batch)


def full_weights(seed: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return {
        "fc1.weight": torch.randn(HIDDEN, FEATURES, generator=generator) * 0.5,
        "fc1.bias": torch.randn(HIDDEN, generator=generator) * 0.1,
        "fc2.weight": torch.randn(CLASSES, HIDDEN, generator=generator) * 0.5,
        "fc2.bias": torch.randn(CLASSES, generator=generator) * 0.1,
    }


class Classifier(LightningModule):
    """A plain LightningModule: automatic optimization, SGD, nothing nxd-specific."""

    def __init__(self, seed: int = 0, manual: bool = False, clip: float = 0.0) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.fc1 = torch.nn.Linear(FEATURES, HIDDEN)
        self.fc2 = torch.nn.Linear(HIDDEN, CLASSES)
        self.load_state_dict(full_weights(seed))
        self.automatic_optimization = not manual
        self.losses: list[float] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.tanh(self.fc1(x)))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = torch.nn.functional.cross_entropy(self(x), y)
        self.losses.append(loss.item())
        if not self.automatic_optimization:  # a user's manual loop
            optimizer = self.optimizers()
            optimizer.zero_grad()
            self.manual_backward(loss)
            if self.hparams.clip:
                self.clip_gradients(optimizer, gradient_clip_val=self.hparams.clip)
            optimizer.step()
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        self.log("val_loss", torch.nn.functional.cross_entropy(self(x), y))

    def predict_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self(batch[0])

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), **SGD)


class TPClassifier(Classifier):
    """``Classifier`` with nxd's TP layers: fc1 column-parallel, fc2 row-parallel."""

    def __init__(self, seed: int = 0, manual: bool = False, clip: float = 0.0) -> None:
        LightningModule.__init__(self)
        self.save_hyperparameters()
        import nxd_state
        from nxd_layers import ColumnParallelLinear, RowParallelLinear

        self.fc1 = ColumnParallelLinear(FEATURES, HIDDEN, gather_output=False)
        self.fc2 = RowParallelLinear(HIDDEN, CLASSES, input_is_parallel=True)
        tp = nxd_state.get_tensor_model_parallel_size()
        rank = nxd_state.get_tensor_model_parallel_rank()
        full = full_weights(seed)
        with torch.no_grad():
            self.fc1.weight.copy_(full["fc1.weight"].chunk(tp, 0)[rank])
            self.fc1.bias.copy_(full["fc1.bias"].chunk(tp, 0)[rank])
            self.fc2.weight.copy_(full["fc2.weight"].chunk(tp, 1)[rank])
            self.fc2.bias.copy_(full["fc2.bias"])
        self.automatic_optimization = not manual
        self.losses = []


class GradRecorder(Callback):
    """After each optimizer step: the gradients it used (after clipping: nothing zeroes them
    before the next step's first backward) and the parameters."""

    def __init__(self) -> None:
        self.grads: list[dict[str, torch.Tensor]] = []
        self.params: list[dict[str, torch.Tensor]] = []

    def on_train_batch_end(self, trainer: Any, module: Any, *args: Any) -> None:
        if trainer.global_step == len(self.params):
            return  # accumulating: no step in this batch
        named = list(module.named_parameters())
        self.grads.append({n: p.grad.clone() for n, p in named})
        self.params.append({n: p.detach().clone() for n, p in named})


def one_process(
    steps: int,
    rows: list[torch.Tensor],
    clip: float = 0.0,
) -> dict[str, Any]:
    """torch only: the MLP on each step's global batch, SGD, ``clip_grad_norm_``."""
    net = Classifier(seed=0)
    optimizer = torch.optim.SGD(net.parameters(), **SGD)
    x, y = tensors()
    losses, grads, params, norms = [], [], [], []
    for step in range(steps):
        optimizer.zero_grad()
        loss = torch.nn.functional.cross_entropy(net(x[rows[step]]), y[rows[step]])
        loss.backward()
        if clip:
            norms.append(float(torch.nn.utils.clip_grad_norm_(net.parameters(), clip)))
        grads.append({n: p.grad.clone() for n, p in net.named_parameters()})
        optimizer.step()
        losses.append(loss.item())
        params.append({n: p.detach().clone() for n, p in net.named_parameters()})
    return {"losses": losses, "grads": grads, "params": params, "norms": norms}
