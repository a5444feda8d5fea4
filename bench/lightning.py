"""Step time of the Lightning loop vs the trainer-API loop, same model, data and ranks.

Each rank of a TP=2 (or PP=2) job on gloo trains nxd's TinyLM twice per round:

* **Lightning**: ``Trainer.fit`` with ``NeuronLTModule`` and ``NxDStrategy`` for STEPS steps; a
  step's time is the interval between consecutive ``on_train_batch_start`` hooks, so it
  includes everything Lightning does per batch (data fetch, hooks, logging, the progress bar
  off) besides ``run_train`` and the optimizer step;
* **trainer API**: the reference's loop (``run_train``, ``optimizer.step``, ``zero_grad``) over
  a DataLoader with the same DistributedSampler, timed from one iteration to the next.

The first WARMUP steps of each run are dropped; each round's medians give one ratio
Lightning / API (paired per round, so a busy moment of the shared machine hits both alike);
the median and quartiles of the ratios are reported against the goal (<= 1.05x).

    uv run python bench/lightning.py [--rounds 8] [--layouts tp2 pp2]

Writes bench/results/lightning.json and prints it.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from nxd_state.testing import add_preload, run_distributed

RESULTS = Path(__file__).parent / "results" / "lightning.json"
MODEL = {"vocab": 2048, "hidden": 256, "layers": 4, "heads": 4}
BATCH, SEQ, SAMPLES = 8, 64, 512
STEPS, WARMUP = 10, 3
LAYOUTS = {"tp2": (2, 1), "pp2": (1, 2)}


class _Tokens(torch.utils.data.Dataset):
    def __init__(self) -> None:
        generator = torch.Generator().manual_seed(0)
        self.ids = torch.randint(0, MODEL["vocab"], (SAMPLES, SEQ), generator=generator)

    def __len__(self) -> int:
        return SAMPLES

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def _model() -> torch.nn.Module:
    import nxd_state
    from nxd_trainer.testing import TinyLM, deterministic_init

    tp = nxd_state.get_tensor_model_parallel_size() > 1
    model = TinyLM(**MODEL, tensor_parallel=tp)
    for module in model.modules():
        deterministic_init(module)
    return model


def _config(tp: int, pp: int) -> Any:
    from nxd_trainer import NxDConfig
    from nxd_trainer.testing import Block

    pipeline = None
    if pp > 1:
        pipeline = {
            "num_microbatches": 4,
            "input_names": ["input_ids", "labels"],
            "pipeline_cuts": ["blocks.1"],
            "transformer_layer_cls": Block,
            "output_loss_value_spec": True,
            "leaf_module_cls": ["Embed", "Head"],
        }
    return NxDConfig(tensor_parallel_size=tp, pipeline_parallel_size=pp, pipeline_config=pipeline)


def _median_step(stamps: list[float]) -> float:
    intervals = [b - a for a, b in itertools.pairwise(stamps)][WARMUP:]
    return statistics.median(intervals)


def _lightning_round(module: Any, config: Any, world: int) -> float:
    from lightning.pytorch import Trainer
    from lightning.pytorch.callbacks import Callback

    from nxd_lightning import NxDStrategy

    stamps: list[float] = []

    class Clock(Callback):
        def on_train_batch_start(self, *args: Any) -> None:
            stamps.append(time.perf_counter())

    trainer = Trainer(
        accelerator="cpu",
        devices=world,
        strategy=NxDStrategy(config),
        max_steps=STEPS + 1,  # the last start closes the STEPS-th interval
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[Clock()],
    )
    data = torch.utils.data.DataLoader(_Tokens(), batch_size=BATCH)
    trainer.fit(module, train_dataloaders=data)
    return _median_step(stamps)


def _api_round(model: Any, optimizer: Any) -> float:
    import nxd_state

    state = nxd_state.get_parallel_state()
    sampler = torch.utils.data.DistributedSampler(
        _Tokens(), num_replicas=state.data_parallel_size, rank=state.data_parallel_rank, seed=0
    )
    data = torch.utils.data.DataLoader(_Tokens(), batch_size=BATCH, sampler=sampler)
    stamps = []
    for step, batch in enumerate(data):
        stamps.append(time.perf_counter())
        if step == STEPS:
            break
        model.run_train(**batch)
        optimizer.step()
        optimizer.zero_grad()
    return _median_step(stamps)


def bench_rank(tp: int, pp: int, rounds: int, world: int) -> dict[str, Any]:
    import nxd_state
    import nxd_trainer as nxd
    from nxd_lightning import NeuronLTModule

    config = _config(tp, pp)
    nxd_state.initialize_model_parallel(
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp
    )
    module = NeuronLTModule(_model, config, torch.optim.AdamW, None, opt_kwargs={"lr": 1e-4})
    api_model = nxd.initialize_parallel_model(config, _model)
    api_optimizer = nxd.initialize_parallel_optimizer(
        config, torch.optim.AdamW, api_model.parameters(), lr=1e-4
    )
    lightning, api = [], []
    for _ in range(rounds):
        torch.distributed.barrier()
        lightning.append(_lightning_round(module, config, world))
        torch.distributed.barrier()
        api.append(_api_round(api_model, api_optimizer))
    return {"lightning_s": lightning, "api_s": api}


def _quartiles(values: list[float]) -> list[float]:
    q = statistics.quantiles(values, n=4) if len(values) > 1 else [values[0]] * 3
    return [round(v, 4) for v in q]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--layouts", nargs="+", default=list(LAYOUTS), choices=list(LAYOUTS))
    args = parser.parse_args()
    add_preload("torch._dynamo", "lightning.pytorch", "nxd_trainer", "nxd_lightning")
    out: dict[str, Any] = {
        "model": MODEL,
        "batch": BATCH,
        "seq": SEQ,
        "steps_per_round": STEPS,
        "warmup_steps": WARMUP,
        "rounds": args.rounds,
        "goal": "lightning / trainer API step time <= 1.05",
        "load_average": os.getloadavg(),
        "layouts": {},
    }
    for name in args.layouts:
        tp, pp = LAYOUTS[name]
        world = tp * pp
        ranks = run_distributed(bench_rank, world, tp, pp, args.rounds, world, timeout=3000)
        lightning, api = ranks[0]["lightning_s"], ranks[0]["api_s"]
        ratios = [a / b for a, b in zip(lightning, api)]
        out["layouts"][name] = {
            "world": world,
            "median_step_s": {
                "lightning": round(statistics.median(lightning), 5),
                "trainer_api": round(statistics.median(api), 5),
            },
            "ratio_median": round(statistics.median(ratios), 4),
            "ratio_quartiles": _quartiles(ratios),
            "ratios": [round(r, 4) for r in ratios],
        }
    out["load_average_after"] = os.getloadavg()
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(out, indent=2) + "\n")
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
