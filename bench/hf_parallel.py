"""Parallelised Hugging Face Llama: step time side by side with peers (nxd_trainer.hf).

    .venv/bin/python bench/hf_parallel.py [--steps 30] [--hidden 256] [--seq 64] [--rounds 3]

An unmodified ``transformers`` ``LlamaForCausalLM`` (RMSNorm, GQA attention with RoPE, SwiGLU
MLP; SDPA attention) trains with AdamW (forward with labels, backward, step). Measured in one
run per comparison, each rank on one thread, steps of the two models alternating (neither
always first) so machine noise hits both:

* TP=2: ``Parallelizer.parallelize`` (nxd layers, GQA-aware attention, loss on
  vocabulary-sharded logits) vs the same model under PyTorch DTensor ``parallelize_module``
  with the same plan (Q/K/V/gate/up column-wise, O/down row-wise, embedding row-wise; its LM
  head column-wise with replicated output so Hugging Face's loss runs on full logits, as
  DTensor's plan needs);
* TP=1: the model ``parallelize`` returns (at TP=1 it swaps nothing) vs the unmodified model,
  and the swapped model at TP=1 (nxd layers of one rank, the parallel attention forward and
  loss) vs the unmodified model: the layers' own overhead.

Per round, medians of the alternating steps and their ratio; over rounds, the median ratio.
Results in bench/results/hf_parallel.json. Goals: TP=2 <= 0.8x DTensor, TP=1 <= 1.02x.
"""

from __future__ import annotations

import argparse
import copy
import json
import logging
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.distributed as dist

import nxd_state
from nxd_state.testing import run_distributed

logger = logging.getLogger("bench.hf_parallel")
RESULTS = Path(__file__).parent / "results" / "hf_parallel.json"


@dataclass(kw_only=True)
class Config:
    """The benchmarked model and run."""

    vocab: int = 1024
    """Vocabulary size."""
    hidden: int = 256
    """Model width."""
    ffn: int = 704
    """SwiGLU inner width."""
    heads: int = 8
    """Query heads."""
    kv_heads: int = 4
    """Key/value heads (GQA)."""
    layers: int = 2
    """Decoder layers."""
    batch: int = 4
    """Batch size."""
    seq: int = 64
    """Sequence length."""
    steps: int = 30
    """Timed steps per model and round (after warm-up)."""
    warmup: int = 5
    """Untimed steps per model and round."""


def hf_model(cfg: Config) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=cfg.vocab,
        hidden_size=cfg.hidden,
        intermediate_size=cfg.ffn,
        num_hidden_layers=cfg.layers,
        num_attention_heads=cfg.heads,
        num_key_value_heads=cfg.kv_heads,
        max_position_embeddings=2 * cfg.seq,
        attn_implementation="sdpa",
    )
    return LlamaForCausalLM(config)


def swapped_at_tp1(model: torch.nn.Module) -> torch.nn.Module:
    """The nxd swap forced at TP=1 (benchmark only: ``parallelize`` keeps the model there)."""
    from nxd_trainer._materialize import materialize_meta_module
    from nxd_trainer.hf import LlamaParallelizer
    from nxd_trainer.hf._swap import layout_for, swap_layers

    layout = layout_for(model.config, 1, None)
    plan = swap_layers(
        model,
        LlamaParallelizer.spec,
        layout,
        sequence_parallel=False,
        parallelize_embeddings=True,
        swap_at_tp1=True,
    )
    materialize_meta_module(model, torch.device("cpu"), plan.init_fn())
    return model


def dtensor_model(model: torch.nn.Module, cfg: Config, tp: int) -> torch.nn.Module:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    mesh = init_device_mesh("cpu", (tp,))
    plan = {
        "model.embed_tokens": RowwiseParallel(input_layouts=Replicate()),
        "lm_head": ColwiseParallel(output_layouts=Replicate()),
    }
    for i in range(cfg.layers):
        for name in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"):
            plan[f"model.layers.{i}.{name}"] = ColwiseParallel()
        for name in ("mlp.gate_proj", "mlp.up_proj"):
            plan[f"model.layers.{i}.{name}"] = ColwiseParallel()
        for name in ("self_attn.o_proj", "mlp.down_proj"):
            plan[f"model.layers.{i}.{name}"] = RowwiseParallel()
    return parallelize_module(model, mesh, plan)


def make_step(model: torch.nn.Module, cfg: Config) -> Callable[[], float]:
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    ids = torch.randint(
        0, cfg.vocab, (cfg.batch, cfg.seq), generator=torch.Generator().manual_seed(1)
    )
    model.train()

    def step() -> float:
        optimizer.zero_grad(set_to_none=True)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        return float(loss.detach())

    return step


def time_alternating(steps: dict[str, Callable[[], float]], cfg: Config) -> dict[str, float]:
    """Median step time (ms) of each model, steps alternating."""
    for _ in range(cfg.warmup):
        for step in steps.values():
            step()
    times: dict[str, list[float]] = {name: [] for name in steps}
    order = list(steps.items())
    for i in range(cfg.steps):
        for name, step in order if i % 2 == 0 else order[::-1]:
            if dist.is_initialized():
                dist.barrier()
            start = time.perf_counter()
            step()
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(values) * 1e3 for name, values in times.items()}


def run_tp1(config: dict[str, int]) -> dict[str, float]:
    from nxd_trainer.hf import LlamaParallelizer

    torch.set_num_threads(1)
    cfg = Config(**config)
    nxd_state.initialize_model_parallel(tensor_model_parallel_size=1)
    plain = hf_model(cfg)
    returned = LlamaParallelizer.parallelize(copy.deepcopy(plain))
    swapped = swapped_at_tp1(copy.deepcopy(plain))
    steps = {
        "plain": make_step(plain, cfg),
        "parallelize": make_step(returned, cfg),
        "swapped": make_step(swapped, cfg),
    }
    return time_alternating(steps, cfg)


def run_tp2(config: dict[str, int]) -> dict[str, float]:
    from nxd_trainer.hf import LlamaParallelizer

    torch.set_num_threads(1)
    cfg = Config(**config)
    tp = dist.get_world_size()
    nxd_state.initialize_model_parallel(tensor_model_parallel_size=tp)
    plain = hf_model(cfg)
    ours = LlamaParallelizer.parallelize(copy.deepcopy(plain))
    peer = dtensor_model(plain, cfg, tp)
    return time_alternating({"nxd": make_step(ours, cfg), "dtensor": make_step(peer, cfg)}, cfg)


def _rounds(fn: Callable[..., dict[str, float]], world: int, cfg: Config, rounds: int) -> list:
    out = []
    for index in range(rounds):
        medians = run_distributed(fn, world, asdict(cfg), timeout=900)[0]
        logger.info("round %d: %s", index + 1, {k: round(v, 2) for k, v in medians.items()})
        out.append(medians)
    return out


def _ratio(rounds: list[dict[str, float]], ours: str, peer: str) -> dict[str, object]:
    ratios = [r[ours] / r[peer] for r in rounds]
    return {
        f"{ours}_median_ms": [round(r[ours], 3) for r in rounds],
        f"{peer}_median_ms": [round(r[peer], 3) for r in rounds],
        "ratios": [round(x, 3) for x in ratios],
        "ratio": round(statistics.median(ratios), 3),
    }


def main(argv: list[str] | None = None) -> dict[str, object]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=Config.steps)
    parser.add_argument("--hidden", type=int, default=Config.hidden)
    parser.add_argument("--seq", type=int, default=Config.seq)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args(argv)
    cfg = Config(steps=args.steps, hidden=args.hidden, seq=args.seq)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    logger.info("TP=2: parallelize vs DTensor parallelize_module (%d rounds)", args.rounds)
    tp2 = _rounds(run_tp2, 2, cfg, args.rounds)
    logger.info("TP=1: parallelize / swapped vs the unmodified model (%d rounds)", args.rounds)
    tp1 = _rounds(run_tp1, 1, cfg, args.rounds)
    result = {
        "benchmark": "hf_parallel",
        "config": asdict(cfg),
        "torch": torch.__version__,
        "threads_per_rank": 1,
        "tp2_vs_dtensor": _ratio(tp2, "nxd", "dtensor"),
        "tp1_parallelize_vs_plain": _ratio(tp1, "parallelize", "plain"),
        "tp1_swapped_vs_plain": _ratio(tp1, "swapped", "plain"),
        "goals": {"tp2_ratio_max": 0.8, "tp1_ratio_max": 1.02},
    }
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main(sys.argv[1:])
