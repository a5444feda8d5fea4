"""MoE expert MLPs on one GPU: torch's grouped products vs the padded ``bmm`` vs a loop.

    python3 bench/gpu/moe_experts.py --out DIR [--tokens 16384] [--hidden 2048]
        [--intermediate 5632] [--experts 8] [--top-k 2] [--reps 10] [--device cuda]

One process, bfloat16 on CUDA (``--device cpu`` runs the same script in float32, to check it
here): forward + backward of ``nxd_layers.moe.ExpertMLPs`` with ``grouped_mm=True``
(``torch._grouped_mm`` over the rows sorted by expert, the CUDA default where torch has the
kernel) and ``grouped_mm=False`` (one zero-padded ``bmm``), and a Python loop over experts
(Hugging Face Mixtral's), on the same tokens and routing. Reports the median seconds of each,
the ratios, and the largest output difference against the loop; where torch lacks the grouped
kernel for the card (compute capability < 9.0) it says so and times the other two. Writes
``DIR/moe_experts.json``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from nxd_layers.moe import ExpertMLPs, RouterTopK, grouped_mm_supported


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _median_seconds(fn: Any, reps: int, device: torch.device) -> float:
    fn()  # warm-up: kernels chosen, memory pooled
    times = []
    for _ in range(reps):
        _sync(device)
        start = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _loop(experts: ExpertMLPs, x: torch.Tensor, weights: torch.Tensor, index: torch.Tensor):
    """Mixtral's loop: for each expert, its tokens through its MLP, weighted, added back."""
    out = torch.zeros_like(x)
    for e in range(experts.num_experts):
        token, slot = torch.where(index == e)
        if token.numel() == 0:
            continue
        h = x[token] @ experts.gate_up_proj.weight[e]
        gate, up = h.chunk(2, dim=-1)
        y = (F.silu(gate) * up) @ experts.down_proj.weight[e]
        out.index_add_(0, token, y * weights[token, slot].unsqueeze(1).to(y.dtype))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--tokens", type=int, default=16384)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--intermediate", type=int, default=5632)
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--top-k", type=int, default=2)
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--device", default="cuda")
    args = parser.parse_args()
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    torch.manual_seed(0)
    router = RouterTopK(args.experts, args.top_k, args.hidden, dtype=dtype, device=device)
    experts = ExpertMLPs(
        args.experts, args.top_k, args.hidden, args.intermediate, dtype=dtype, device=device,
        init_method=lambda w: torch.nn.init.normal_(w, std=0.02),
        output_layer_init_method=lambda w: torch.nn.init.normal_(w, std=0.02),
    )  # fmt: skip
    x = torch.randn(args.tokens, args.hidden, dtype=dtype, device=device)
    with torch.no_grad():
        _, affinities, index = router(x)
    weights = affinities.gather(1, index)

    def step(grouped: bool | None) -> None:
        experts.grouped_mm = grouped
        xx = x.clone().requires_grad_(True)
        experts(xx, affinities, index).float().square().mean().backward()

    def loop() -> None:
        xx = x.clone().requires_grad_(True)
        _loop(experts, xx, weights, index).float().square().mean().backward()

    supported = grouped_mm_supported(x, experts.gate_up_proj.weight, experts.down_proj.weight)
    result: dict[str, Any] = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "config": {**vars(args), "out": str(args.out), "dtype": str(dtype)},
        "grouped_supported": supported,
    }
    with torch.no_grad():
        want = _loop(experts, x, weights, index).float()
        for name, grouped in (("grouped", True), ("bmm", False)):
            if grouped and not supported:
                continue
            experts.grouped_mm = grouped
            got = experts(x, affinities, index).float()
            result[f"{name}_max_abs_difference_vs_loop"] = float((got - want).abs().max())
    result["bmm_seconds"] = _median_seconds(lambda: step(False), args.reps, device)
    result["loop_seconds"] = _median_seconds(loop, args.reps, device)
    if supported:
        result["grouped_seconds"] = _median_seconds(lambda: step(True), args.reps, device)
        result["grouped_over_bmm"] = result["grouped_seconds"] / result["bmm_seconds"]
        result["grouped_over_loop"] = result["grouped_seconds"] / result["loop_seconds"]
    result["bmm_over_loop"] = result["bmm_seconds"] / result["loop_seconds"]
    result["default_path"] = "grouped" if supported and device.type == "cuda" else "bmm"
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "moe_experts.json").write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
