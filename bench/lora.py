"""LoRA benchmark: nxd_lora vs PEFT on one process, and the adapter's TP=2 traffic vs theory.

    .venv/bin/python bench/lora.py            # writes bench/results/lora.json and prints it

1. One process, a small Llama (random init): median train-step time (forward + backward) of the
   unwrapped model (all weights train), PEFT's LoRA and nxd's LoRA on the same targets; ratios.
2. TP=2 on gloo (two ranks), an MLP block (column -> row): median step time with and without
   LoRA, and the bytes the adapter adds to the collectives against the theoretical minimum
   (rank-sized: one all-reduce of (tokens, r) forward for the row-parallel A, one backward for
   the column-parallel B's input), vs what gathering the full activation would cost.
"""

from __future__ import annotations

import copy
import json
import logging
import statistics
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

STEPS, WARMUP = 12, 3
RESULTS = Path(__file__).parent / "results" / "lora.json"
logger = logging.getLogger("bench.lora")


def _interleaved_medians_ms(steps: dict[str, Any]) -> dict[str, float]:
    """Median seconds per step of each callable, measured round-robin (one step of each per
    round) so that load drifting on a shared machine hits every peer alike."""
    for _ in range(WARMUP):
        for step in steps.values():
            step()
    times: dict[str, list[float]] = {name: [] for name in steps}
    for _ in range(STEPS):
        for name, step in steps.items():
            start = time.perf_counter()
            step()
            times[name].append(time.perf_counter() - start)
    return {name: 1e3 * statistics.median(values) for name, values in times.items()}


def _train_step(model: nn.Module, *args: Any, **kwargs: Any) -> Any:
    def step() -> None:
        output = model(*args, **kwargs)
        loss = output.loss if hasattr(output, "loss") else output.square().sum()
        loss.backward()
        model.zero_grad(set_to_none=True)

    return step


def single_process() -> dict[str, Any]:
    import peft
    from transformers import LlamaConfig, LlamaForCausalLM

    import nxd_lora

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=512,
        hidden_size=256,
        intermediate_size=688,
        num_hidden_layers=2,
        num_attention_heads=8,
        num_key_value_heads=4,
        max_position_embeddings=256,
    )
    base = LlamaForCausalLM(config)
    targets = ["q_proj", "v_proj", "o_proj", "down_proj"]
    ids = torch.randint(0, 512, (4, 64), generator=torch.Generator().manual_seed(1))
    models = {
        "unwrapped": copy.deepcopy(base),
        "peft": peft.get_peft_model(
            copy.deepcopy(base), peft.LoraConfig(r=16, lora_alpha=32, target_modules=targets)
        ),
        "nxd_lora": nxd_lora.LoRAModel(
            copy.deepcopy(base),
            nxd_lora.LoraConfig(lora_rank=16, lora_alpha=32, target_modules=targets),
        ),
    }
    out: dict[str, Any] = {
        "shape": {"batch": 4, "seq": 64, "hidden": config.hidden_size, "rank": 16}
    }
    medians = _interleaved_medians_ms(
        {name: _train_step(model, input_ids=ids, labels=ids) for name, model in models.items()}
    )
    for name, value in medians.items():
        out[f"{name}_step_ms"] = value
        logger.info("%s: %.1f ms", name, value)
    out["nxd_over_peft"] = out["nxd_lora_step_ms"] / out["peft_step_ms"]
    out["nxd_over_unwrapped"] = out["nxd_lora_step_ms"] / out["unwrapped_step_ms"]
    return out


def tensor_parallel_rank(tokens: int, hidden: int, ffn: int, rank: int) -> dict[str, Any]:
    """One rank of the TP=2 measurement (run by nxd_state.testing.run_distributed)."""
    import nxd_lora
    import nxd_state
    from nxd_layers import ColumnParallelLinear, RowParallelLinear

    nxd_state.initialize_model_parallel(tensor_model_parallel_size=2)
    torch.manual_seed(0)

    def block() -> nn.Sequential:
        return nn.Sequential(
            ColumnParallelLinear(hidden, ffn, gather_output=False),
            nn.GELU(),
            RowParallelLinear(ffn, hidden, input_is_parallel=True),
        )

    plain = block()
    lora = nxd_lora.LoRAModel(
        block(), nxd_lora.LoraConfig(lora_rank=rank, lora_alpha=2 * rank, target_modules=["0", "2"])
    )
    x = torch.randn(tokens, hidden)
    steps = {"tp_base": _train_step(plain, x), "tp_lora": _train_step(lora, x)}
    out: dict[str, Any] = {
        f"{name}_step_ms": value for name, value in _interleaved_medians_ms(steps).items()
    }
    for name, step in steps.items():
        with nxd_state.count_collectives() as counter:
            step()
        out[f"{name}_bytes"] = counter.total().bytes
    return out


def tensor_parallel() -> dict[str, Any]:
    from nxd_state.testing import run_distributed

    tokens, hidden, ffn, rank = 512, 256, 1024, 16
    results = run_distributed(tensor_parallel_rank, 2, tokens, hidden, ffn, rank)
    mine = results[0]
    extra = mine["tp_lora_bytes"] - mine["tp_base_bytes"]
    theory = 2 * tokens * rank * 4  # (tokens, r) fp32: row-A all-reduce fwd + column-B grad bwd
    return {
        "shape": {"tokens": tokens, "hidden": hidden, "ffn": ffn, "rank": rank, "tp": 2},
        "tp_base_step_ms": statistics.median(r["tp_base_step_ms"] for r in results),
        "tp_lora_step_ms": statistics.median(r["tp_lora_step_ms"] for r in results),
        "tp_lora_over_base": mine["tp_lora_step_ms"] / mine["tp_base_step_ms"],
        "base_collective_bytes": mine["tp_base_bytes"],
        "lora_extra_collective_bytes": extra,
        "lora_extra_theory_bytes": theory,
        "extra_over_theory": extra / theory,
        "gathering_full_activation_bytes": tokens * hidden * 4,
    }


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    torch.set_num_threads(2)
    result = {
        "torch": torch.__version__,
        "steps": STEPS,
        "single_process": single_process(),
        "tensor_parallel": tensor_parallel(),
    }
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(result, indent=2))
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
