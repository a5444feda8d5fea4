"""The training job every reliability test runs: the reference's sample on the trainer API.

Not a test module: ``conftest.py`` registers it as ``nxd_reliability_job`` (rank processes
load its functions by file). ``train`` is NxD's sample loop (config -> model -> optimizer ->
auto-resume -> ``run_train`` loop with a checkpoint after every step) on a tiny
``nxd_trainer.testing.TinyLM`` with dropout (so a resumed job must restore the RNG too),
AdamW and a LinearLR warm-up (so it must restore the scheduler).
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

import torch

STEPS, BATCH, SEQ, VOCAB = 6, 4, 8, 64
DROPOUT = 0.1
ADAMW = {"lr": 1e-2, "weight_decay": 0.01, "eps": 1e-4}


def batches(steps: int = STEPS) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(5)
    return [torch.randint(0, VOCAB, (BATCH, SEQ), generator=generator) for _ in range(steps)]


def get_model(**kwargs: Any) -> torch.nn.Module:
    from nxd_trainer.testing import TinyLM, deterministic_init

    model = TinyLM(vocab=VOCAB, hidden=32, layers=2, heads=4, **kwargs)
    for module in model.modules():
        deterministic_init(module)
    return model


def _events(path: str | None):
    """Append "<event> <step> <monotonic ns>" lines to ``path`` (unbuffered: a SIGKILL loses
    nothing written before it)."""
    if path is None:
        return lambda event, step: None
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)

    def emit(event: str, step: int) -> None:
        os.write(fd, f"{event} {step} {time.monotonic_ns()}\n".encode())

    return emit


P2P_OPS = ("send", "recv", "isend", "irecv", "batch_send_recv")


def inject(fault: dict[str, Any] | None) -> None:
    """Make this rank fail inside its ``fault["call"]``-th call of ``nxd_state.collectives``'s
    ``fault["op"]`` ("p2p": any stage-to-stage transfer), so its peers are then in the same
    collective or transfer, by ``fault["how"]``: "raise", "exit" (sys.exit(3)), "os_exit"
    (os._exit(3): no Python clean-up), "sigkill", or "hang" (sleeps: alive, never joins)."""
    import torch.distributed as dist

    from nxd_state import collectives

    if fault is None or dist.get_rank() != fault["rank"]:
        return
    calls = [0]

    def failing(real: Any) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            calls[0] += 1
            if calls[0] == fault["call"]:
                how = fault["how"]
                if how == "raise":
                    raise ValueError(f"injected failure on rank {dist.get_rank()}")
                if how == "exit":
                    sys.exit(3)
                if how == "os_exit":
                    os._exit(3)
                if how == "sigkill":
                    os.kill(os.getpid(), signal.SIGKILL)
                if how == "hang":
                    time.sleep(3600)
            return real(*args, **kwargs)

        return call

    for op in P2P_OPS if fault["op"] == "p2p" else (fault["op"],):
        setattr(collectives, op, failing(getattr(collectives, op)))


def train(
    ckpt: str | None,
    *,
    steps: int = STEPS,
    tp: int = 1,
    pp: int = 1,
    zero1: bool = False,
    async_save: bool = False,
    seed: int = 1234,
    events: str | None = None,
    fault: dict[str, Any] | None = None,
    out: str | None = None,
) -> dict[str, Any]:
    """NxD's sample with a checkpoint after every step (``num_kept_ckpts=2``).

    Resumes from the newest complete tag of ``ckpt`` if there is one. Returns (and with
    ``out``, writes as ``out.<rank>.json``) the losses by step and a SHA-256 of every final
    parameter's bytes.
    """
    import nxd_state
    import nxd_trainer as nxd
    from nxd_trainer.testing import Block

    torch.set_num_threads(1)
    nxd_state.destroy_model_parallel()
    torch.manual_seed(seed)
    emit = _events(events)
    pipeline_config = None
    if pp > 1:
        pipeline_config = {
            "transformer_layer_cls": Block,
            "num_microbatches": 2,
            "input_names": ["input_ids", "labels"],
            "pipeline_cuts": ["blocks.0"],
            "leaf_module_cls": ["Embed", "Head"],
            "broadcast_and_average_loss": True,
        }
    config = nxd.neuronx_distributed_config(
        tensor_parallel_size=tp,
        pipeline_parallel_size=pp,
        pipeline_config=pipeline_config,
        optimizer_config={"zero_one_enabled": zero1, "max_grad_norm": 0.5},
    )
    nxd_state.model_parallel_manual_seed(seed)
    model = nxd.initialize_parallel_model(config, get_model, tensor_parallel=True, dropout=DROPOUT)
    optimizer = nxd.initialize_parallel_optimizer(
        config, torch.optim.AdamW, model.parameters(), **ADAMW
    )
    scheduler = torch.optim.lr_scheduler.LinearLR(optimizer, start_factor=0.25, total_iters=steps)
    inject(fault)
    done = 0
    if ckpt is not None and nxd.has_checkpoint(ckpt):
        content = nxd.load_checkpoint(ckpt, model=model, optimizer=optimizer, scheduler=scheduler)
        done = content["total_steps"]
        emit("resumed", done)
    state = nxd_state.get_parallel_state()
    per_replica = BATCH // state.data_parallel_size
    rows = slice(
        state.data_parallel_rank * per_replica, (state.data_parallel_rank + 1) * per_replica
    )
    losses: dict[int, float] = {}

    def save(tag: str) -> None:
        emit("save_start", done)
        nxd.save_checkpoint(
            ckpt,
            tag,
            nxd_config=config,
            model=model,
            optimizer=optimizer,
            scheduler=scheduler,
            user_content={"total_steps": done},
            num_kept_ckpts=2,
            async_save=async_save,
        )
        emit("save_return", done)
        if async_save:
            nxd.finalize_checkpoint()
            emit("save_written", done)

    for ids in batches(steps)[done:]:
        loss = model.run_train(ids[rows], ids[rows])
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
        done += 1
        losses[done] = float(loss)
        emit("step", done)
        if ckpt is not None:
            save(f"step_{done:03d}")
    result = {
        "losses": losses,
        "params": {n: digest(p) for n, p in model.named_parameters()},
    }
    if out is not None:
        Path(f"{out}.{torch.distributed.get_rank()}.json").write_text(json.dumps(result))
    return result


def digest(tensor: torch.Tensor) -> str:
    """SHA-256 of a tensor's bytes (bitwise comparison across processes)."""
    data = tensor.detach().contiguous().cpu().view(torch.uint8).numpy().tobytes()
    return hashlib.sha256(data).hexdigest()


def read_result(out: str, rank: int = 0) -> dict[str, Any]:
    result = json.loads(Path(f"{out}.{rank}.json").read_text())
    result["losses"] = {int(k): v for k, v in result["losses"].items()}
    return result
