"""Bad input to ``nxd_trainer.hf`` fails with the value named and what was expected, on every
rank (2 gloo ranks, TP=2), before any collective: an unsupported model type (the supported
ones listed), attention heads TP does not divide, a ``kv_size_multiplier`` that leaves the KV
heads indivisible, a checkpoint folder missing a shard, pipeline parallelism without input
names, and the (tp, sp, pp) support table.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from nxd_state.testing import load_sibling, run_distributed

H = load_sibling(__file__, "_hf")


def test_manager_lists_and_refuses_model_types() -> None:
    import transformers

    from nxd_trainer.hf import LlamaParallelizer, ParallelizersManager

    assert ParallelizersManager.get_supported_model_types() == [
        "llama",
        "mistral",
        "qwen2",
        "qwen3",
    ]
    assert ParallelizersManager.is_model_supported("qwen3") == (True, True, True)
    assert ParallelizersManager.is_model_supported("gpt2") == (False, False, False)
    assert ParallelizersManager.parallelizer_for_model(H.model("llama")) is LlamaParallelizer
    gpt2 = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=1, n_embd=32, n_head=2))
    with pytest.raises(NotImplementedError, match=r"'gpt2'.*\['llama', 'mistral', 'qwen2'"):
        ParallelizersManager.parallelizer_for_model(gpt2)


def _error(fn: Any) -> str:
    try:
        fn()
    except Exception as error:  # the test inspects it
        return f"{type(error).__name__}: {error}"
    return "no error"


def bad_inputs(missing_shard: str) -> dict[str, str]:
    import nxd_state
    from nxd_trainer.hf import LlamaParallelizer, MistralParallelizer

    nxd_state.initialize_model_parallel(tensor_model_parallel_size=2)
    with nxd_state.count_collectives() as counter:
        out = {
            "heads": _error(
                lambda: LlamaParallelizer.parallelize(
                    H.model("llama", heads=3, kv_heads=3, hidden=48)
                )
            ),
            "multiplier": _error(
                lambda: MistralParallelizer.parallelize(H.model("mistral"), kv_size_multiplier=3)
            ),
            "family": _error(lambda: MistralParallelizer.parallelize(H.model("llama"))),
            "shard": _error(
                lambda: LlamaParallelizer.parallelize(
                    H.model("llama"), checkpoint_dir=missing_shard
                )
            ),
        }
    out["collectives"] = str(counter.as_dict())
    return out


def bad_pipeline() -> str:
    import nxd_state
    from nxd_trainer.hf import LlamaParallelizer

    nxd_state.initialize_model_parallel(pipeline_model_parallel_size=2)
    return _error(lambda: LlamaParallelizer.parallelize(H.model("llama")))


def test_bad_inputs_raise_on_every_rank(tmp_path: Path) -> None:
    folder = tmp_path / "sharded-hf"
    H.model("llama").save_pretrained(folder, max_shard_size="20KB")
    shards = sorted(folder.glob("model-*.safetensors"))
    assert len(shards) > 1
    shards[-1].unlink()
    for errors in run_distributed(bad_inputs, 2, str(folder)):
        assert "num_attention_heads=3 is not divisible by tensor_parallel_size=2" in errors["heads"]
        assert "kv_size_multiplier=3 gives 1 x 3 = 3 KV heads" in errors["multiplier"]
        assert "smallest valid multiplier is 2" in errors["multiplier"]
        assert "MistralParallelizer parallelises model_type 'mistral'" in errors["family"]
        assert "missing shard files" in errors["shard"]
        assert shards[-1].name in errors["shard"]
        assert errors["collectives"] == "{}"  # raised before any collective
    for error in run_distributed(bad_pipeline, 2):
        assert "pipeline_parallel_input_names" in error
