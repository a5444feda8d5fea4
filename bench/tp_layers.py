"""Tensor-parallel layers: step time and collective traffic, side by side with peers.

    .venv/bin/python bench/tp_layers.py [--steps 30] [--hidden 128] [--seq 64]

A small Llama-style causal LM (RMSNorm, GQA attention with RoPE, SwiGLU MLP) trains with
AdamW. Measured in one run, each rank on one thread:

* TP=1: the model built from nxd_layers vs the same model in plain torch.nn (overhead);
* TP=2: the nxd_layers model vs the plain model parallelised by PyTorch DTensor
  (``parallelize_module`` with ColwiseParallel / RowwiseParallel on a gloo DeviceMesh);
* bytes on the wire per decoder layer and step at TP=2 (nxd_state's counter, ring algorithm)
  vs Megatron's minimum 8·b·s·h·(t−1)/t elements: 2 all-reduces of b·s·h forward and 2 backward;
* the gradient norm (``--part grad_norm``, one process): ``nxd_layers.get_grad_norm`` vs
  ``torch.nn.utils.get_total_norm`` (what ``clip_grad_norm_`` computes) vs the elementwise
  ``sum(g.abs().pow(p).sum())`` nxd_layers used before, on the gradients of a model shape
  (float32 and bfloat16), calls alternating, ns per element.

Steps of the compared models alternate, so machine noise hits both alike; medians are
reported with their ratios in bench/results/tp_layers.json.
"""

from __future__ import annotations

import argparse
import functools
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
import torch.nn.functional as F
from torch import nn

import nxd_state
from nxd_layers import (
    ColumnParallelLinear,
    GQAQKVColumnParallelLinear,
    ParallelEmbedding,
    RowParallelLinear,
    parallel_cross_entropy,
)
from nxd_state.testing import run_distributed

logger = logging.getLogger("bench.tp_layers")
RESULTS = Path(__file__).parent / "results" / "tp_layers.json"


@dataclass(kw_only=True)
class Config:
    """The benchmarked model and run."""

    vocab: int = 256
    """Vocabulary size."""
    hidden: int = 128
    """Model width h."""
    ffn: int = 352
    """SwiGLU inner width."""
    heads: int = 8
    """Query heads."""
    kv_heads: int = 4
    """Key/value heads (GQA)."""
    layers: int = 2
    """Decoder layers."""
    batch: int = 4
    """Batch size b."""
    seq: int = 64
    """Sequence length s."""
    steps: int = 40
    """Timed steps per model (after warm-up)."""
    warmup: int = 5
    """Untimed steps per model."""

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads


# The model, written once: projections are whatever modules the builder passes in -----------
def rope(x: torch.Tensor) -> torch.Tensor:
    """Rotary embedding on (B, nh, T, hd)."""
    hd, t = x.shape[-1], x.shape[-2]
    freq = 1.0 / (10000 ** (torch.arange(0, hd, 2, dtype=torch.float32) / hd))
    angle = torch.arange(t, dtype=torch.float32)[:, None] * freq[None, :]
    cos, sin = angle.cos().repeat(1, 2), angle.sin().repeat(1, 2)
    return x * cos + torch.cat([-x[..., hd // 2 :], x[..., : hd // 2]], dim=-1) * sin


class RMSNorm(nn.Module):
    def __init__(self, h: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(h))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.weight


class Layer(nn.Module):
    """Pre-norm decoder layer; q/k/v/o and the MLP projections are injected."""

    def __init__(self, cfg: Config, proj: dict[str, nn.Module]) -> None:
        super().__init__()
        self.hd = cfg.head_dim
        self.attn_norm, self.mlp_norm = RMSNorm(cfg.hidden), RMSNorm(cfg.hidden)
        self.proj = nn.ModuleDict(proj)

    def qkv(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        if "qkv" in self.proj:
            return self.proj["qkv"](x)
        return self.proj["q"](x), self.proj["k"](x), self.proj["v"](x)

    def gate_up(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if "gate_up" in self.proj:  # fused; with stride 2 each rank holds [gate_r, up_r]
            return self.proj["gate_up"](x).chunk(2, dim=-1)
        return self.proj["gate"](x), self.proj["up"](x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = (
            y.reshape(b, t, -1, self.hd).transpose(1, 2) for y in self.qkv(self.attn_norm(x))
        )  # (B, nh, T, hd), local heads
        q, k = rope(q), rope(k)
        rep = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
        attn = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj["o"](attn.transpose(1, 2).reshape(b, t, -1))
        gate, up = self.gate_up(self.mlp_norm(x))
        return x + self.proj["down"](F.silu(gate) * up)


class LM(nn.Module):
    def __init__(self, cfg: Config, embed: nn.Module, layers: list[Layer], head: nn.Module):
        super().__init__()
        self.embed, self.layers, self.head = embed, nn.ModuleList(layers), head
        self.norm = RMSNorm(cfg.hidden)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        for layer in self.layers:
            x = layer(x)
        return self.head(self.norm(x))


def plain_model(cfg: Config, fused_gate_up: bool) -> LM:
    def layer() -> Layer:
        h, kv = cfg.hidden, cfg.kv_heads * cfg.head_dim
        proj: dict[str, nn.Module] = {
            "q": nn.Linear(h, h, bias=False),
            "k": nn.Linear(h, kv, bias=False),
            "v": nn.Linear(h, kv, bias=False),
            "o": nn.Linear(h, h, bias=False),
            "down": nn.Linear(cfg.ffn, h, bias=False),
        }
        if fused_gate_up:
            proj["gate_up"] = nn.Linear(h, 2 * cfg.ffn, bias=False)
        else:
            proj["gate"] = nn.Linear(h, cfg.ffn, bias=False)
            proj["up"] = nn.Linear(h, cfg.ffn, bias=False)
        return Layer(cfg, proj)

    head = nn.Linear(cfg.hidden, cfg.vocab, bias=False)
    return LM(cfg, nn.Embedding(cfg.vocab, cfg.hidden), [layer() for _ in range(cfg.layers)], head)


def nxd_layer(cfg: Config) -> Layer:
    h = cfg.hidden
    proj: dict[str, nn.Module] = {
        "qkv": GQAQKVColumnParallelLinear(
            h, [h, cfg.kv_heads * cfg.head_dim], bias=False, gather_output=False
        ),
        "o": RowParallelLinear(h, h, bias=False, input_is_parallel=True),
        "gate_up": ColumnParallelLinear(h, 2 * cfg.ffn, bias=False, gather_output=False, stride=2),
        "down": RowParallelLinear(cfg.ffn, h, bias=False, input_is_parallel=True),
    }
    return Layer(cfg, proj)


def nxd_model(cfg: Config) -> LM:
    head = ColumnParallelLinear(cfg.hidden, cfg.vocab, bias=False, gather_output=False)
    layers = [nxd_layer(cfg) for _ in range(cfg.layers)]
    return LM(cfg, ParallelEmbedding(cfg.vocab, cfg.hidden), layers, head)


def dtensor_model(cfg: Config, tp: int) -> LM:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    model = plain_model(cfg, fused_gate_up=False)
    mesh = init_device_mesh("cpu", (tp,))
    plan = {
        "embed": RowwiseParallel(input_layouts=Replicate()),
        "head": ColwiseParallel(output_layouts=Replicate()),
    }
    for i in range(cfg.layers):
        for name in ("q", "k", "v", "gate", "up"):
            plan[f"layers.{i}.proj.{name}"] = ColwiseParallel()
        for name in ("o", "down"):
            plan[f"layers.{i}.proj.{name}"] = RowwiseParallel()
    return parallelize_module(model, mesh, plan)


# Steps and timing ---------------------------------------------------------------------------
def make_step(model: LM, vocab_parallel: bool, cfg: Config) -> Callable[[], float]:
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    torch.manual_seed(0)
    ids = torch.randint(0, cfg.vocab, (cfg.batch, cfg.seq))
    labels = torch.roll(ids, -1, dims=1)

    def step() -> float:
        optimizer.zero_grad(set_to_none=True)
        logits = model(ids)
        if vocab_parallel:
            loss = parallel_cross_entropy(logits, labels).mean()
        else:
            loss = F.cross_entropy(logits.reshape(-1, cfg.vocab), labels.reshape(-1))
        loss.backward()
        optimizer.step()
        return float(loss.detach())

    return step


def time_alternating(steps: dict[str, Callable[[], float]], cfg: Config) -> dict[str, list[float]]:
    for _ in range(cfg.warmup):
        for step in steps.values():
            step()
    times: dict[str, list[float]] = {name: [] for name in steps}
    order = list(steps.items())
    for i in range(cfg.steps):
        for name, step in order if i % 2 == 0 else order[::-1]:  # neither always goes first
            dist.barrier()
            start = time.perf_counter()
            step()
            times[name].append(time.perf_counter() - start)
    return times


def _summary(times: dict[str, list[float]], ours: str, peer: str) -> dict[str, float]:
    med = {name: statistics.median(values) * 1e3 for name, values in times.items()}
    return {
        f"{ours}_median_ms": round(med[ours], 3),
        f"{peer}_median_ms": round(med[peer], 3),
        "ratio": round(med[ours] / med[peer], 3),
    }


def run_tp1(config: dict[str, int]) -> dict[str, float]:
    cfg = Config(**config)
    nxd_state.initialize_model_parallel(tensor_model_parallel_size=1)
    torch.manual_seed(1)
    ours = make_step(nxd_model(cfg), vocab_parallel=True, cfg=cfg)
    torch.manual_seed(1)
    plain = make_step(plain_model(cfg, fused_gate_up=True), vocab_parallel=False, cfg=cfg)
    return _summary(time_alternating({"nxd": ours, "plain": plain}, cfg), "nxd", "plain")


def run_tp2(config: dict[str, int]) -> dict[str, object]:
    cfg = Config(**config)
    tp = dist.get_world_size()
    nxd_state.initialize_model_parallel(tensor_model_parallel_size=tp)
    torch.manual_seed(1)
    ours = make_step(nxd_model(cfg), vocab_parallel=True, cfg=cfg)
    torch.manual_seed(1)
    peer = make_step(dtensor_model(cfg, tp), vocab_parallel=False, cfg=cfg)
    result: dict[str, object] = _summary(
        time_alternating({"nxd": ours, "dtensor": peer}, cfg), "nxd", "dtensor"
    )
    result["traffic"] = measure_layer_traffic(cfg, tp)
    return result


def measure_layer_traffic(cfg: Config, tp: int) -> dict[str, float]:
    """Wire bytes of one fwd+bwd through the decoder layers alone, per layer, vs theory."""
    layers = nn.ModuleList([nxd_layer(cfg) for _ in range(cfg.layers)])
    x = torch.randn(cfg.batch, cfg.seq, cfg.hidden, requires_grad=True)
    with nxd_state.count_collectives() as counter:
        out = x
        for layer in layers:
            out = layer(out)
        out.sum().backward()
    measured = counter.total(group="tp").wire_bytes / cfg.layers
    elements = 8 * cfg.batch * cfg.seq * cfg.hidden * (tp - 1) / tp
    theory = elements * torch.finfo(torch.float32).bits // 8
    return {
        "measured_wire_bytes_per_layer": measured,
        "theory_wire_bytes_per_layer": theory,
        "ratio": round(measured / theory, 4),
        "calls_per_layer": counter.total(group="tp").calls / cfg.layers,
    }


# Gradient norm ------------------------------------------------------------------------------
def _elementwise_norm(grads: list[torch.Tensor], p: float) -> torch.Tensor:
    """The formula nxd_layers used before: sum of |g|^p per tensor, in float32."""
    total = torch.zeros(())
    for grad in grads:
        total = total + grad.float().abs().pow(p).sum()
    return total.pow(1.0 / p)


def run_grad_norm(rounds: int = 30, threads: int = 1) -> dict[str, object]:
    """ns per gradient element of three norms over the same gradients, calls alternating
    (order rotated every round), medians and quartiles; float32 and bfloat16 gradients."""
    from nxd_layers import get_grad_norm

    torch.set_num_threads(threads)
    torch.manual_seed(0)
    h, ffn, layers, vocab = 512, 1408, 4, 4096
    shapes = [(vocab, h)]
    for _ in range(layers):
        shapes += [(h,), (3 * h, h), (h, h), (h,), (2 * ffn, h), (h, ffn)]
    shapes += [(h,), (vocab, h)]
    out: dict[str, object] = {"threads": threads, "tensors": len(shapes), "norm_type": 2.0}
    for dtype in (torch.float32, torch.bfloat16):
        params = []
        for shape in shapes:
            param = nn.Parameter(torch.empty(shape, dtype=dtype))
            param.grad = torch.randn(shape).to(dtype)
            params.append(param)
        grads = [p.grad for p in params]
        numel = sum(g.numel() for g in grads)
        calls = {
            "nxd_get_grad_norm": functools.partial(
                get_grad_norm, params, 2.0, tensor_parallel_group=None
            ),
            "torch_get_total_norm": functools.partial(torch.nn.utils.get_total_norm, grads, 2.0),
            "elementwise_abs_pow_sum": functools.partial(_elementwise_norm, grads, 2.0),
        }
        values = {name: float(call()) for name, call in calls.items()}
        times: dict[str, list[float]] = {name: [] for name in calls}
        order = list(calls.items())
        for i in range(rounds):
            rotated = order[i % len(order) :] + order[: i % len(order)]
            for name, call in rotated:
                start = time.perf_counter()
                call()
                times[name].append((time.perf_counter() - start) / numel * 1e9)
        summary = {}
        for name, samples in times.items():
            q1, median, q3 = statistics.quantiles(samples, n=4)
            summary[name] = {
                "ns_per_element_median": round(median, 4),
                "q1": round(q1, 4),
                "q3": round(q3, 4),
                "value": values[name],
            }
        nxd = summary["nxd_get_grad_norm"]["ns_per_element_median"]
        out[str(dtype).removeprefix("torch.")] = {
            "elements": numel,
            "measurements": summary,
            "elementwise_over_nxd": round(
                summary["elementwise_abs_pow_sum"]["ns_per_element_median"] / nxd, 3
            ),
            "nxd_over_torch": round(
                nxd / summary["torch_get_total_norm"]["ns_per_element_median"], 3
            ),
        }
    return out


def main(argv: list[str] | None = None) -> dict[str, object]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=Config.steps)
    parser.add_argument("--hidden", type=int, default=Config.hidden)
    parser.add_argument("--seq", type=int, default=Config.seq)
    parser.add_argument(
        "--part",
        choices=("all", "steps", "grad_norm"),
        default="all",
        help="what to measure; a part updates its own entries of the results file",
    )
    args = parser.parse_args(argv)
    cfg = Config(steps=args.steps, hidden=args.hidden, seq=args.seq)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    result: dict[str, object] = {}
    if RESULTS.exists() and args.part != "all":
        result = json.loads(RESULTS.read_text())
    if args.part in ("all", "grad_norm"):
        logger.info("gradient norm: get_grad_norm vs get_total_norm vs the elementwise formula")
        result["grad_norm"] = run_grad_norm()
    if args.part in ("all", "steps"):
        result.update(run_steps(cfg))
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))
    return result


def run_steps(cfg: Config) -> dict[str, object]:
    """Step times at TP=1 and TP=2 against the peers, and the TP=2 traffic."""
    logger.info("TP=1: nxd_layers vs plain torch.nn (%d steps each)", cfg.steps)
    tp1 = run_distributed(run_tp1, 1, asdict(cfg), timeout=600)[0]
    logger.info("TP=2: nxd_layers vs DTensor parallelize_module (%d steps each)", cfg.steps)
    tp2 = run_distributed(run_tp2, 2, asdict(cfg), timeout=600)[0]
    result = {
        "benchmark": "tp_layers",
        "config": asdict(cfg),
        "torch": torch.__version__,
        "threads_per_rank": 1,
        "tp1_overhead_vs_plain": tp1,
        "tp2_vs_dtensor": {k: v for k, v in tp2.items() if k != "traffic"},
        "tp2_traffic": tp2["traffic"],
        "goals": {"tp1_ratio_max": 1.02, "tp2_ratio_max": 0.8, "bytes_ratio": 1.0},
    }
    return result


if __name__ == "__main__":
    main(sys.argv[1:])
