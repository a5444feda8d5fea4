"""Decoder layers compiled without graph breaks equal eager ones (``nxd-train --compile``'s path).

``nxd-train --compile`` compiles each decoder layer of the parallelized model. Here the same
layers are compiled with ``fullgraph=True`` (a graph break is an error, not a silent fallback
to eager) through AOT autograd (``aot_eager``: the forward and backward graphs Inductor would
receive; no C++ toolchain needed on CPU), and one training step's loss and every gradient
equal the eager model's:

* a Hugging Face Llama (nxd's Llama-family layers) at TP = 1 and at TP = 2 with sequence
  parallelism, where the sequence is gathered and reduce-scattered along dim 1 inside each
  layer (that layout failed at run time before the operators returned contiguous outputs);
* Gemma 2 at TP = 2 with sequence parallelism: a family parallelized by transformers' plan,
  whose blocks gather the sequence at their input.

Tolerance: rtol 1e-5 / atol 1e-6, fp32: AOT autograd decomposes RMSNorm and attention into
the same float32 operations in another order, round-off of a few 1e-7 on O(1) values; a
wrong layout or a lost reduction is off by 1e-2 or more.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from nxd_state.testing import load_sibling, run_distributed

H = load_sibling(__file__, "_hf")
R = load_sibling(__file__, "_registry")
TOL = {"rtol": 1e-5, "atol": 1e-6}


def _build(family: str) -> torch.nn.Module:
    if family == "llama":
        return H.model("llama")
    return R.build(family, 0)


def _step(family: str, tp: int, compiled: bool) -> dict[str, Any]:
    import nxd_trainer as nxd

    torch._dynamo.reset()
    cfg = nxd.neuronx_distributed_config(
        tensor_parallel_size=tp,
        sequence_parallel=tp > 1,
        optimizer_config={"zero_one_enabled": False, "grad_clipping": False},
    )
    model = nxd.initialize_parallel_model(cfg, lambda: _build(family))
    layers = 0
    for module in model.local_module().modules():
        if type(module).__name__.endswith("DecoderLayer") and compiled:
            module.compile(fullgraph=True, backend="aot_eager")
            layers += 1
    ids = H.batch(seed=7)
    loss = model.run_train(input_ids=ids, labels=ids)
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    return {"loss": loss.detach(), "grads": grads, "compiled_layers": layers}


def _eager_and_compiled(family: str, tp: int) -> list[str]:
    eager, compiled = _step(family, tp, False), _step(family, tp, True)
    bad = [] if compiled["compiled_layers"] > 0 else ["no decoder layer was compiled"]
    checks = [("loss", compiled["loss"], eager["loss"])]
    if set(compiled["grads"]) != set(eager["grads"]) or not eager["grads"]:
        bad.append(f"gradients of {sorted(compiled['grads'])} vs {sorted(eager['grads'])}")
    checks += [(f"grad {n}", compiled["grads"][n], g) for n, g in eager["grads"].items()]
    for what, got, want in checks:
        try:
            torch.testing.assert_close(got, want, **TOL)
        except (AssertionError, KeyError) as error:
            bad.append(f"{what}: {error}")
    return bad


@pytest.mark.parametrize(
    ("family", "tp"),
    [("llama", 1), ("llama", 2), ("gemma2", 2)],
    ids=["llama-tp1", "llama-tp2-sp", "gemma2-tp2-sp"],
)
def test_compiled_decoder_layers_equal_eager(family: str, tp: int) -> None:
    for rank, bad in enumerate(run_distributed(_eager_and_compiled, tp, family, tp)):
        assert not bad, f"rank {rank}:\n" + "\n".join(bad)
