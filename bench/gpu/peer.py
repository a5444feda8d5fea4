"""The peer of nxd-train's main job: a plain Hugging Face training loop on the same model,
config, batch and data, in one process (and the probe of the card).

    python3 bench/gpu/peer.py SPEC.json    # SPEC: what main_job.py writes (result: its "result")

Per step: ``loss = model(input_ids=ids, labels=ids).loss``, ``loss.backward()``, the loss read
back (``loss.item()``), the global gradient norm clipped to 1.0, AdamW (fused on CUDA; betas
0.9/0.95, eps 1e-8, weight decay 0.1), the LR schedule, the norm read back: what a plain loop
that logs loss and norm every step does, and what nxd-train's step does. Two numerics:

* ``amp``: fp32 weights, gradients and AdamW; forward and backward under
  ``torch.autocast(bfloat16)`` (automatic mixed precision; the goal's peer);
* ``bf16-master``: bf16 weights and gradients, no autocast; fp32 master weights in AdamW,
  the gradients copied up to them before the step and the weights copied down after it (what
  ``nxd-train --bf16`` does: nxd-optim's master weights).

``compile``: ``torch.compile(model)`` (the whole model, loss included). The step time is the
interval between the ends of consecutive steps (each ends with a host sync), so it is the steady
period of the loop; the first ``skip`` steps (compilation, allocator warm-up) are left out.
"""

from __future__ import annotations

import itertools
import json
import math
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch


def _batches(spec: dict[str, Any]) -> tuple[Any, str]:
    """``(next_batch, source)``: nxd-train's packed blocks of the main run, in a seeded
    permutation, or uniform random ids when that run left none (said in ``source``)."""
    blocks_path = Path(spec["blocks"]) if spec.get("blocks") else None
    batch, seq = spec["batch_size"], spec["seq_len"]
    if blocks_path is not None and blocks_path.is_file():
        from safetensors.torch import load_file

        blocks = load_file(str(blocks_path))["train"]
        if blocks.shape[1] != seq:
            raise ValueError(f"{blocks_path} holds blocks of {blocks.shape[1]} tokens, not {seq}")
        source = f"nxd-train's packed blocks {blocks_path} ({len(blocks)} blocks)"
    else:
        generator = torch.Generator().manual_seed(spec["seed"])
        blocks = torch.randint(0, spec["vocab_size"], (64 * batch, seq), generator=generator)
        source = "uniform random ids (the main run left no packed blocks)"
    order = torch.randperm(len(blocks), generator=torch.Generator().manual_seed(spec["seed"]))
    position = 0

    def next_batch() -> torch.Tensor:
        nonlocal position
        rows = order[torch.arange(position, position + batch) % len(blocks)]
        position += batch
        return blocks[rows].long()

    return next_batch, source


def _schedule(spec: dict[str, Any]) -> Any:
    warmup, steps = spec["warmup_steps"], spec["steps"]

    def factor(step: int) -> float:  # nxd-train's: linear warm-up, cosine to 0.1
        if step < warmup:
            return (step + 1) / warmup
        progress = min(1.0, (step - warmup) / max(1, steps - warmup))
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress))

    return factor


def train(spec: dict[str, Any]) -> dict[str, Any]:
    """Run the loop of ``spec``; the per-step times, losses and norms."""
    import transformers

    device = torch.device(spec["device"])
    cuda = device.type == "cuda"
    config = transformers.LlamaConfig.from_json_file(spec["config"])
    config._attn_implementation = "sdpa"
    config.use_cache = False
    torch.manual_seed(spec["seed"])
    with torch.device(device):
        model = transformers.LlamaForCausalLM(config)
    numerics = spec["numerics"]
    if numerics == "bf16-master":
        model = model.to(torch.bfloat16)
    elif numerics != "amp":
        raise ValueError(f"numerics {numerics!r}: expected 'amp' or 'bf16-master'")
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    if numerics == "bf16-master":
        masters = [p.detach().float() for p in params]
        for master in masters:
            master.grad = torch.empty_like(master)
    else:
        masters = params
    optimizer = torch.optim.AdamW(
        masters, lr=spec["lr"], betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, fused=cuda
    )
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, _schedule(spec))
    forward = torch.compile(model) if spec["compile"] else model
    next_batch, source = _batches(spec)
    if config.vocab_size < spec["vocab_size"]:
        raise ValueError(f"config vocab {config.vocab_size} < the data's {spec['vocab_size']}")

    def step() -> tuple[float, float]:
        ids = next_batch().to(device)
        if numerics == "amp":
            with torch.autocast(device.type, dtype=torch.bfloat16):
                loss = forward(input_ids=ids, labels=ids).loss
        else:
            loss = forward(input_ids=ids, labels=ids).loss
        loss.backward()
        value = loss.item()
        if numerics == "bf16-master":
            torch._foreach_copy_([m.grad for m in masters], [p.grad for p in params])
        norm = torch.nn.utils.clip_grad_norm_(masters, 1.0, foreach=True)
        optimizer.step()
        scheduler.step()
        if numerics == "bf16-master":
            with torch.no_grad():
                torch._foreach_copy_(params, masters)
            model.zero_grad(set_to_none=True)
        else:
            optimizer.zero_grad(set_to_none=True)
        return value, norm.item()

    if cuda:
        torch.cuda.reset_peak_memory_stats()
    started = time.perf_counter()
    ends, losses, norms = [], [], []
    for _ in range(spec["steps"]):
        loss, norm = step()
        ends.append(time.perf_counter())
        losses.append(loss)
        norms.append(norm)
    periods = [b - a for a, b in itertools.pairwise(ends)]  # step 2 onwards
    steady = periods[max(0, spec["skip"] - 1) :]
    tokens = spec["batch_size"] * spec["seq_len"]
    median = statistics.median(steady) if steady else None
    return {
        "numerics": numerics,
        "compile": spec["compile"],
        "data": source,
        "steps": spec["steps"],
        "steps_timed": len(steady),
        "first_step_s": ends[0] - started,
        "step_ms_median": median * 1e3 if median else None,
        "step_ms_min": min(steady) * 1e3 if steady else None,
        "tokens_per_s": tokens / median if median else None,
        "losses": losses,
        "grad_norms": norms,
        "max_memory_allocated_mib": torch.cuda.max_memory_allocated() / 2**20 if cuda else None,
    }


def probe(spec: dict[str, Any]) -> dict[str, Any]:
    """Versions, the card, and a measured bf16 matrix-product rate (8192³, random data, median
    of 10 after 3 warm-ups, timed with CUDA events)."""
    import platform

    import transformers

    info: dict[str, Any] = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "cuda_available": torch.cuda.is_available(),
    }
    if spec["device"] != "cuda" or not torch.cuda.is_available():
        return info | {"device_name": "cpu"}
    props = torch.cuda.get_device_properties(0)
    info |= {
        "device_name": torch.cuda.get_device_name(0),
        "capability": list(torch.cuda.get_device_capability(0)),
        "multiprocessors": props.multi_processor_count,
        "memory_gib": props.total_memory / 2**30,
        "cuda": torch.version.cuda,
    }
    n = 8192
    a, b = (torch.randn(n, n, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    for _ in range(3):
        a @ b
    times = []
    for _ in range(10):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        a @ b
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    info["measured_bf16_matmul_tflops"] = 2 * n**3 / statistics.median(times) / 1e12
    return info


def main() -> None:
    spec = json.loads(Path(sys.argv[1]).read_text())
    result = probe(spec) if spec["role"] == "probe" else train(spec)
    Path(spec["result"]).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
