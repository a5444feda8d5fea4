"""An unmodified Hugging Face ``LlamaForCausalLM``, parallelized by ``nxd_trainer.hf`` at TP=2,
goes through ``nxd_layers.trace``: traced in two workers, saved, loaded in a fresh interpreter
that never imports this file, and its logits equal the unsharded model's.

The parallelized model returns vocabulary-sharded logits (each rank its columns), so the
traced function wraps it in a module that gathers them over TP, which puts that all-gather in
the captured graph too. Tolerance: fp32, rtol 1e-5 / atol 1e-6: TP splits each matmul's sum
over two ranks and adds the partial sums in another order (round-off ~1e-7 relative on O(1)
logits); a wrong head split or a missing reduction is off by O(1).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import torch
import transformers
from safetensors.torch import load_file, save_file

SEED = 0
VOCAB = 96


def _config() -> transformers.LlamaConfig:
    return transformers.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        attn_implementation="eager",
    )


def _unsharded() -> transformers.LlamaForCausalLM:
    torch.manual_seed(SEED)
    return transformers.LlamaForCausalLM(_config()).eval()


class GatheredLogits(torch.nn.Module):
    """``input_ids -> logits`` of the whole vocabulary: the TP model's shards gathered."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        from nxd_layers.mappings import gather_from_tensor_model_parallel_region

        logits = self.model(input_ids=input_ids).logits
        return gather_from_tensor_model_parallel_region(logits)[..., :VOCAB]


def parallel_llama() -> tuple[torch.nn.Module, None]:
    """``func`` of the trace: every worker builds the same unsharded model from the seed (the
    trace seeded it too) and keeps its TP shard."""
    from nxd_trainer.hf import ParallelizersManager

    model = _unsharded()
    parallelizer = ParallelizersManager.parallelizer_for_model(model)
    return GatheredLogits(parallelizer.parallelize(model)), None


LOAD_AND_RUN = """
import sys
from safetensors.torch import load_file, save_file
from nxd_layers.trace import parallel_model_load

inputs = load_file(sys.argv[2])
with parallel_model_load(sys.argv[1], call_timeout=600) as model:
    outputs = {name: model(ids) for name, ids in inputs.items()}
assert not [m for m in sys.modules if "test_trace_hf" in m or m.startswith("transformers")]
save_file(outputs, sys.argv[3])
"""


def test_parallelized_hf_llama_traces_saves_and_loads_like_the_unsharded_model(
    tmp_path: Path,
) -> None:
    from nxd_layers.trace import parallel_model_save, parallel_model_trace

    generator = torch.Generator().manual_seed(1)
    batches = {
        "s8": torch.randint(0, VOCAB, (2, 8), generator=generator),
        "s4": torch.randint(0, VOCAB, (2, 4), generator=generator),
    }
    with torch.no_grad():
        reference = {name: _unsharded()(input_ids=ids).logits for name, ids in batches.items()}

    traced = parallel_model_trace(
        parallel_llama, batches["s8"], bucket_config=[batches["s4"]], tp_degree=2, seed=SEED
    )
    try:
        eager_traced = {name: traced(ids) for name, ids in batches.items()}
        parallel_model_save(traced, tmp_path / "traced")
    finally:
        traced.close()
    for name, logits in eager_traced.items():
        torch.testing.assert_close(logits, reference[name], rtol=1e-5, atol=1e-6, msg=name)

    save_file(batches, str(tmp_path / "inputs.safetensors"))
    result = subprocess.run(
        [
            sys.executable,
            "-c",
            LOAD_AND_RUN,
            str(tmp_path / "traced"),
            str(tmp_path / "inputs.safetensors"),
            str(tmp_path / "outputs.safetensors"),
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    loaded = load_file(str(tmp_path / "outputs.safetensors"))
    for name, logits in loaded.items():
        # The loaded programs are the saved graphs on the same shards: exactly the traced output.
        torch.testing.assert_close(logits, eager_traced[name], rtol=0, atol=0, msg=name)
