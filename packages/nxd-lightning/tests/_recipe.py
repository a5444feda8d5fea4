"""What the Lightning tests share: models, data, the two training loops that must agree.

Not a test module: test files load it by path (``load_sibling``), since rank processes find
functions by file and pytest's importlib mode does not put this folder on ``sys.path``.

Models: a tiny, unmodified Hugging Face ``LlamaForCausalLM`` built from a config (nxd-trainer's
HF parallelizer swaps its layers at TP > 1; the pipeline captures it with torch.export at
PP > 1), and ``nxd_trainer.testing.TinyLM`` (a causal LM written with nxd's TP layers,
deterministic weights at any TP degree: the NxD way of writing a TP model). Data: SAMPLES
sequences of SEQ tokens. Lightning wraps a training loader in ``DistributedSampler(shuffle=True,
seed=0)`` over the strategy's DP rank and size (``set_epoch`` every epoch); the trainer-API loop
reads through the same sampler, and the one-process run reads each step's union of the DP
ranks' batches (:func:`global_steps`).
"""

from __future__ import annotations

import contextlib
import io
import math
from typing import Any

import torch

SAMPLES, SEQ, VOCAB, BATCH = 16, 8, 64, 2
# AdamW with a larger eps: an exactly-zero gradient in exact arithmetic is round-off that
# differs between layouts, which eps=1e-8 would turn into full-size steps (nxd-trainer's recipe).
ADAMW = {"lr": 1e-2, "eps": 1e-4}
MAX_GRAD_NORM = 0.5
# Lightning vs the trainer API on the same ranks: the same operations in the same order, so
# equal bitwise (tolerance 0).
EXACT = {"rtol": 0.0, "atol": 0.0}
# vs one process (fp32): TP splits matmul sums, PP and DP average micro-batch means instead of
# one mean: re-association round-off (~1e-7 relative) amplified by a few AdamW steps (an ulp in
# a tiny gradient moves a weight by up to ~lr * 1e-4). A missing or doubled DP average, or a
# gradient not summed over TP, changes the losses in the 2nd decimal.
TOL = {"rtol": 1e-4, "atol": 1e-5}


def dataset() -> torch.utils.data.Dataset:
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(0, VOCAB, (SAMPLES, SEQ), generator=generator)
    return _Tokens(ids)


class _Tokens(torch.utils.data.Dataset):
    def __init__(self, ids: torch.Tensor) -> None:
        self.ids = ids

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def loader(batch: int = BATCH, samples: int = SAMPLES) -> torch.utils.data.DataLoader:
    data = torch.utils.data.Subset(dataset(), range(samples))
    return torch.utils.data.DataLoader(data, batch_size=batch, shuffle=False)


def tiny_lm(**kwargs: Any) -> torch.nn.Module:
    """NxD's ``get_model`` for the TP layouts (TinyLM: TP layers when TP > 1)."""
    import nxd_state
    from nxd_trainer.testing import TinyLM, deterministic_init

    tp = nxd_state.model_parallel_is_initialized() and (
        nxd_state.get_tensor_model_parallel_size() > 1
    )
    model = TinyLM(vocab=VOCAB, hidden=16, layers=2, heads=4, tensor_parallel=tp, **kwargs)
    for module in model.modules():
        deterministic_init(module)
    return model


def hf_llama() -> torch.nn.Module:
    """A stock ``LlamaForCausalLM`` (GQA: 4 query heads, 2 KV heads; random weights from seed 0,
    so every rank builds the same full model and the parallelizer keeps its slices)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        use_cache=False,
    )
    return LlamaForCausalLM(config)


MODELS = {"tiny_lm": tiny_lm, "hf_llama": hf_llama}


def config(model: str, tp: int, pp: int, **extra: Any) -> Any:
    """An ``NxDConfig`` (no process group is made by building it)."""
    from nxd_trainer import NxDConfig
    from nxd_trainer.testing import Block

    pipeline = None
    if pp > 1:
        pipeline = {
            "num_microbatches": 2,
            "input_names": ["input_ids", "labels"],
            "pipeline_cuts": ["blocks.0"] if model == "tiny_lm" else ["model.layers.0"],
        }
        if model == "tiny_lm":
            pipeline.update(
                transformer_layer_cls=Block,
                output_loss_value_spec=True,
                leaf_module_cls=["Embed", "Head"],
            )
    return NxDConfig(
        tensor_parallel_size=tp,
        pipeline_parallel_size=pp,
        pipeline_config=pipeline,
        optimizer_config={"grad_clipping": True, "max_grad_norm": MAX_GRAD_NORM},
        **extra,
    )


def param_groups(model: torch.nn.Module) -> list[dict[str, Any]]:
    """NeuronLTModule's default groups (weight decay 0.01, none for biases / LayerNorm)."""
    named = list(model.named_parameters())
    no_decay = ("bias", "LayerNorm")
    decay = [p for n, p in named if not any(k in n for k in no_decay)]
    rest = [p for n, p in named if any(k in n for k in no_decay)]
    return [{"params": decay, "weight_decay": 0.01}, {"params": rest, "weight_decay": 0.0}]


# The two loops, inside a rank --------------------------------------------------------------
def _fresh_state() -> None:
    import nxd_state

    nxd_state.destroy_model_parallel()
    torch.manual_seed(1234)


class LossRecorder:
    """A Lightning callback keeping each optimizer step's loss (None where not held)."""

    def __new__(cls) -> Any:
        from lightning.pytorch.callbacks import Callback

        class _Recorder(Callback):
            def __init__(self) -> None:
                self.losses: list[float | None] = []
                self.grad_norms: list[float | None] = []

            def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx) -> None:
                if module.should_print:  # a step happened in this batch
                    loss = module.loss
                    self.losses.append(None if loss is None else loss.item())
                    norm = module.global_norm
                    self.grad_norms.append(None if norm is None else float(norm))

        return _Recorder()


def lightning_run(
    model: str,
    tp: int,
    pp: int,
    steps: int,
    *,
    batch: int = BATCH,
    grad_accum: int = 1,
    log_rank0: bool = False,
    world: int,
    trainer_kwargs: dict[str, Any] | None = None,
    fit_kwargs: dict[str, Any] | None = None,
    capture: bool = False,
    validate: Any = None,
    **config_extra: Any,
) -> dict[str, Any]:
    """NeuronLTModule + NxDStrategy + Lightning's Trainer on this rank."""
    from lightning.pytorch import Trainer

    from nxd_lightning import NeuronLTModule, NeuronTQDMProgressBar, NxDStrategy

    _fresh_state()
    cfg = config(model, tp, pp, **config_extra)
    module = NeuronLTModule(
        MODELS[model],
        cfg,
        torch.optim.AdamW,
        None,
        opt_kwargs=ADAMW,
        grad_accum_steps=grad_accum,
        log_rank0=log_rank0,
    )
    recorder = LossRecorder()
    kwargs: dict[str, Any] = {
        "accelerator": "cpu",
        "devices": world,
        "strategy": NxDStrategy(cfg),
        "max_steps": steps,
        "logger": False,
        "enable_checkpointing": False,
        "enable_model_summary": False,
        "callbacks": [recorder, NeuronTQDMProgressBar()],
        "num_sanity_val_steps": 0,
    }
    kwargs.update(trainer_kwargs or {})
    if trainer_kwargs and "callbacks" in trainer_kwargs:
        kwargs["callbacks"] = [recorder, NeuronTQDMProgressBar(), *trainer_kwargs["callbacks"]]
    trainer = Trainer(**kwargs)
    output = io.StringIO()  # Lightning's TQDM bars write to stdout
    redirect = contextlib.ExitStack()
    if capture:
        redirect.enter_context(contextlib.redirect_stdout(output))
        redirect.enter_context(contextlib.redirect_stderr(output))
    with redirect:
        trainer.fit(module, **({"train_dataloaders": loader(batch)} | (fit_kwargs or {})))
    val_loss = None
    if validate is not None:
        val_loss = trainer.validate(module, dataloaders=validate, verbose=False)[0]["val_loss"]
    return {
        "val_loss": val_loss,
        "losses": recorder.losses,
        "grad_norms": recorder.grad_norms,
        "params": {n: p.detach().clone() for n, p in module.model.named_parameters()},
        "tp_layers": tp_layers(module.model),
        "metrics": {k: float(v) for k, v in trainer.callback_metrics.items()},
        "output": output.getvalue(),
        "global_step": trainer.global_step,
    }


def tp_layers(model: torch.nn.Module) -> int:
    """How many of nxd's TP layers the trained model holds (0: replicated over TP)."""
    from nxd_layers import BaseParallelLinear, ParallelEmbedding

    return sum(isinstance(m, (BaseParallelLinear, ParallelEmbedding)) for m in model.modules())


def trainer_api_run(
    model: str, tp: int, pp: int, steps: int, *, batch: int = BATCH, **config_extra: Any
) -> dict[str, Any]:
    """The reference's trainer-API loop on the same ranks, data and seed."""
    import nxd_state
    import nxd_trainer as nxd

    _fresh_state()
    cfg = config(model, tp, pp, **config_extra)
    nxd_trainer_model = nxd.initialize_parallel_model(cfg, MODELS[model])
    optimizer = nxd.initialize_parallel_optimizer(
        cfg, torch.optim.AdamW, param_groups(nxd_trainer_model), **ADAMW
    )
    optimizer.zero_grad()
    state = nxd_state.get_parallel_state()
    losses: list[float | None] = []
    for inputs in epochs(state.data_parallel_size, state.data_parallel_rank, batch, steps):
        loss = nxd_trainer_model.run_train(**inputs)
        optimizer.step()
        optimizer.zero_grad()
        if loss is not None:
            value = loss.detach().float().clone()
            nxd_state.collectives.all_reduce(value, group=state.data_parallel_group)
            losses.append((value / state.data_parallel_size).item())
        else:
            losses.append(None)
    return {
        "losses": losses,
        "params": {n: p.detach().clone() for n, p in nxd_trainer_model.named_parameters()},
    }


def sampler(dp: int, rank: int, epoch: int) -> torch.utils.data.DistributedSampler:
    """The sampler Lightning injects into a training loader (shuffle, seed 0)."""
    sampler = torch.utils.data.DistributedSampler(
        dataset(), num_replicas=dp, rank=rank, shuffle=True, seed=0
    )
    sampler.set_epoch(epoch)
    return sampler


def epochs(dp: int, rank: int, batch: int, steps: int) -> list[dict[str, torch.Tensor]]:
    """This DP rank's first ``steps`` batches, epoch after epoch, as Lightning feeds them."""
    out: list[dict[str, torch.Tensor]] = []
    epoch = 0
    while len(out) < steps:
        data = torch.utils.data.DataLoader(dataset(), batch, sampler=sampler(dp, rank, epoch))
        out += list(data)[: steps - len(out)]
        epoch += 1
    return out


def global_steps(dp: int, batch: int, steps: int) -> list[torch.Tensor]:
    """Each step's samples over all DP ranks (what one process must train on)."""
    per_step = SAMPLES // (dp * batch)
    out = []
    for step in range(steps):
        epoch, index = divmod(step, per_step)
        rows = []
        for rank in range(dp):
            mine = list(sampler(dp, rank, epoch))
            rows += mine[index * batch : (index + 1) * batch]
        out.append(torch.tensor(rows))
    return out


# One process ------------------------------------------------------------------------------------
def single_process_run(model: str, steps: int, dp: int, batch: int = BATCH) -> dict[str, Any]:
    """Plain model, torch's AdamW and clip_grad_norm_, on the union of ``dp`` ranks' batches."""
    _fresh_state()
    net = MODELS[model]()
    optimizer = torch.optim.AdamW(param_groups(net), **ADAMW)
    ids = dataset().ids
    losses = []
    for rows in global_steps(dp, batch, steps):
        chunk = ids[rows]
        out = net(input_ids=chunk, labels=chunk)
        loss = out if isinstance(out, torch.Tensor) else out.loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(net.parameters(), MAX_GRAD_NORM)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return {"losses": losses, "params": {n: p.detach() for n, p in net.named_parameters()}}


def held(losses: list[float | None]) -> bool:
    return all(v is not None and not math.isnan(v) for v in losses)
