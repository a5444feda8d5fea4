"""One rank of ``nxd-train``: the run's model, optimizer, schedule and data, and its step.

Per optimizer step, with B global sequences, D data-parallel ranks and k accumulation steps:
each rank runs k micro-steps of B/(D·k) sequences (``run_train``: forward + backward, or the
pipeline schedule), then ``optimizer.scale_gradients(1/k)`` turns the k summed gradients into
their mean wherever the optimizer keeps them (``p.grad``, fp32 accumulators, ZeRO-1's
buffers), so the step's gradient is the mean over the global batch, as in one process; the
optimizer wrapper averages over DP, measures the global norm, clips and steps.

Tensors stay on the run's device (CPU, CUDA or XLA). The micro-steps' losses are summed there;
once per step, one all-reduce over the world of ``[Σ loss, count, stop, grad norm]`` and one
read of it on the host (the step's only host sync) give the logged loss (the mean over the
global batch), the grad norm, and the Ctrl-C flag, so every rank stops after the same step.

The trainer owns what a checkpoint must restore beyond the model, optimizer, scheduler and
RNG: ``state_dict()`` (step, tokens, the loader's position, the run's settings) is the
checkpoint's user content. Its :class:`~nxd_trainer.train.saving.Saver` writes the
checkpoints, in the background by default (``async_save``): the optimizer step after a save
waits for its copy to host memory, and :meth:`Saver.wait` for its write.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass
from typing import Any

import torch

from nxd_trainer.train.config import ConfigError, TrainConfig
from nxd_trainer.train.rundir import Resume, RunDir, tag_name
from nxd_trainer.train.saving import Saver, save_mode

__all__ = ["StepResult", "Trainer", "lr_lambda"]

logger = logging.getLogger(__name__)


def lr_lambda(cfg: TrainConfig) -> Any:
    """lr(s)/lr: linear warm-up (s+1)/W over W steps, then cosine from 1 to ``min_lr_ratio``."""

    def factor(step: int) -> float:
        if step < cfg.warmup_steps:
            return (step + 1) / cfg.warmup_steps
        span = max(1, cfg.steps - cfg.warmup_steps)
        progress = min(1.0, (step - cfg.warmup_steps) / span)
        return cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    return factor


@dataclass(frozen=True)
class StepResult:
    """What one optimizer step reports (the same on every rank)."""

    step: int
    loss: float
    grad_norm: float
    lr: float
    seconds: float
    stop: bool


class Trainer:
    """The training state of one rank (collective: every rank builds one, in step).

    ``init_distributed`` must have run; the run's data must be prepared (``prepare_data``).
    """

    def __init__(self, cfg: TrainConfig, run: RunDir, data: tuple[Any, Any, Any]) -> None:
        import torch.distributed as dist

        import nxd_state
        import nxd_trainer as nxd
        from nxd_trainer.train.data import PackedLoader
        from nxd_trainer.train.model import build_nxd_config, hf_config, make_model_fn

        self.cfg, self.run = cfg, run
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.dp = cfg.check_world(self.world)  # the same answer on every rank
        self.device = nxd_state.current_device()
        self.tokenizer, train_blocks, self.valid_blocks = data
        torch.manual_seed(cfg.seed)
        self.hf_config = hf_config(cfg, len(self.tokenizer), self.tokenizer)
        self.nxd_config = build_nxd_config(cfg, self.hf_config, self.world)
        state = nxd_state.get_parallel_state()
        self.parallel_state = state
        self.model = nxd.initialize_parallel_model(
            self.nxd_config, make_model_fn(cfg, self.hf_config)
        )
        if cfg.compile:
            _compile(self.model, cfg)
        fused = {"fused": True} if self.device.type == "cuda" else {}
        self.optimizer = nxd.initialize_parallel_optimizer(
            self.nxd_config, torch.optim.AdamW, self.model.parameters(), lr=cfg.lr,
            betas=(0.9, 0.95), eps=1e-8, weight_decay=cfg.weight_decay, **fused,
        )  # fmt: skip
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lr_lambda(cfg))
        # One loader batch per micro-step: the k micro-steps of a step cover its B sequences.
        micro = cfg.batch_size // cfg.grad_accum
        self.loader = PackedLoader(train_blocks, micro, state.data_parallel_rank, self.dp, cfg.seed)
        last_stage = state.pipeline_parallel_rank == state.pipeline_parallel_size - 1
        # The ranks whose loss is counted: one per DP replica (the loss is replicated over TP
        # and exists only on the last pipeline stage).
        self.contributes = last_stage and state.tensor_parallel_rank == 0
        self.step, self.tokens = 0, 0
        self.saver = Saver(save_mode(cfg.async_save, self.device.type))
        self.model.train()

    # Checkpointed state ----------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """The checkpoint's user content: what the trainer adds to model/optimizer/RNG."""
        return {"step": self.step, "tokens": self.tokens, "loader": self.loader.state_dict(),
                "config": self.cfg.to_dict()}  # fmt: skip

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.loader.load_state_dict(state["loader"])
        self.step, self.tokens = int(state["step"]), int(state["tokens"])

    def save(self) -> None:
        """Checkpoint ``step_N`` of the run (collective; the oldest beyond ``keep`` go once it
        is complete). With ``async_save`` it is written in the background: ``self.saver.wait()``
        until it is complete."""
        self.saver.save(
            self.run.checkpoints, tag_name(self.step), model=self.model,
            optimizer=self.optimizer, scheduler=self.scheduler, user_content=self.state_dict(),
            num_kept_ckpts=self.cfg.keep, nxd_config=self.nxd_config,
        )  # fmt: skip

    def resume(self, point: Resume) -> None:
        """Load ``point`` (checked against this run's settings first: collective-free)."""
        import nxd_trainer as nxd

        self.run.check_resume(point)
        user = nxd.load_checkpoint(
            self.run.checkpoints, point.tag, model=self.model, optimizer=self.optimizer,
            scheduler=self.scheduler,
        )  # fmt: skip
        self.load_state_dict(user)
        # The schedule's horizon is this run's --steps (a rerun may extend the run).
        self.scheduler.lr_lambdas = [lr_lambda(self.cfg)]

    # The step ------------------------------------------------------------------------------
    def train_step(self, stop_requested: bool = False) -> StepResult:
        """One optimizer step over the next global batch (collective)."""
        import nxd_state
        from nxd_state import collectives

        started = time.perf_counter()
        cfg = self.cfg
        loss_sum = torch.zeros((), dtype=torch.float32, device=self.device)
        count = 0
        for _ in range(cfg.grad_accum):
            ids = self.loader.next_batch().to(self.device, non_blocking=True)
            loss = self.model.run_train(input_ids=ids, labels=ids)
            if loss is not None and self.contributes:
                loss_sum += loss.detach().float()
                count += 1
        if cfg.grad_accum > 1:
            self.optimizer.scale_gradients(1.0 / cfg.grad_accum)
        with self.saver.step():  # waits for the host copy of a save made since the last step
            self.optimizer.step()
        lr = float(self.scheduler.get_last_lr()[0])  # a float: LambdaLR over a float lr
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        norm = self.optimizer.grad_norm
        report = torch.stack([
            loss_sum,
            torch.tensor(float(count), device=self.device),
            torch.tensor(1.0 if stop_requested else 0.0, device=self.device),
            (norm.detach().float().reshape(()) if norm is not None and self.rank == 0
             else torch.zeros((), device=self.device)),
        ])  # fmt: skip
        collectives.all_reduce(report)
        nxd_state.mark_step()
        total, counted, stop, grad_norm = report.tolist()  # the step's one host sync
        self.step += 1
        self.tokens += cfg.batch_size * cfg.seq_len
        return StepResult(
            step=self.step, loss=total / counted if counted else math.nan,
            grad_norm=grad_norm if norm is not None else math.nan, lr=lr,
            seconds=time.perf_counter() - started, stop=stop > 0,
        )  # fmt: skip

    def evaluate(self) -> float:
        """Validation loss: the mean over ``eval_batches`` global batches of the validation
        blocks (the same sequences at any degree; collective)."""
        import nxd_state
        from nxd_state import collectives

        cfg, valid = self.cfg, self.valid_blocks
        share = cfg.batch_size // (self.dp * cfg.grad_accum)
        dp_rank = self.parallel_state.data_parallel_rank
        total = torch.zeros(2, dtype=torch.float32, device=self.device)
        for b in range(cfg.eval_batches):
            start = b * cfg.batch_size + dp_rank * (cfg.batch_size // self.dp)
            for m in range(cfg.grad_accum):
                rows = [(start + m * share + i) % len(valid) for i in range(share)]
                ids = valid[rows].long().to(self.device, non_blocking=True)
                out = self.model.run_eval(input_ids=ids, labels=ids)
                loss = getattr(out, "loss", out)
                if loss is not None and self.contributes:
                    total[0] += loss.detach().float().reshape(())
                    total[1] += 1
        collectives.all_reduce(total)
        nxd_state.mark_step()
        self.model.train()
        loss_total, counted = total.tolist()
        return loss_total / counted if counted else math.nan

    def save_merged(self) -> None:
        """LoRA: the merged model (base + adapters, no adapter tensors) as a checkpoint of
        its own, which the HF export reads (collective)."""
        import nxd_ckpt

        lora_model: Any = self.model.local_module()  # the LoRA model: its lora_config is read
        lora_config = lora_model.lora_config
        saved = (lora_config.save_lora_base, lora_config.merge_lora)
        lora_config.save_lora_base, lora_config.merge_lora = True, True
        try:
            nxd_ckpt.save_checkpoint(self.run.merged_checkpoint, "", model=lora_model)
        finally:
            lora_config.save_lora_base, lora_config.merge_lora = saved


def _compile(model: Any, cfg: TrainConfig) -> None:
    import nxd_state

    if nxd_state.resolve_device_type(cfg.device) != "cuda":
        raise ConfigError("--compile is for CUDA devices (torch.compile on CPU is not offered)")
    if cfg.pp > 1:
        raise ConfigError("--compile needs pp=1 (the pipeline runs captured stage graphs)")
    for module in model.local_module().modules():
        if type(module).__name__.endswith("DecoderLayer"):
            module.compile()
