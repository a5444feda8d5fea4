"""``parallelize(fuse_qkv=True)``: the GQA projection holds one ``weight_qkv``.

Mistral's tiny model has 1 KV head, so TP 2 replicates it (the GQA projection). Fused and
unfused, from the same model, give the same logits bitwise (the same rows multiply the same
inputs: the fused weight is only split into views); with optimum's ``optimizer_for_mp`` the
fused parameter, which stands for the three original projections, is stepped once, and one
AdamW step leaves both models equal bitwise again. A parallel parameter standing for
originals in param groups with different hyper-parameters is refused.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch

from nxd_state.testing import load_sibling, run_distributed

H = load_sibling(__file__, "_hf")


def _parallel(reference: torch.nn.Module, fused: bool, lr_qkv: float = 1e-2) -> tuple[Any, Any]:
    from nxd_trainer.hf import (
        ParallelizersManager,
        make_optimizer_constructor_lazy,
        optimizer_for_mp,
        original_parameter_ids,
        parameter_mapping,
    )

    model = copy.deepcopy(reference)
    qkv = [p for n, p in model.named_parameters() if n.endswith(("q_proj.weight", "v_proj.weight"))]
    rest = [p for n, p in model.named_parameters() if not any(p is q for q in qkv)]
    groups = [{"params": qkv, "lr": lr_qkv}, {"params": rest}]
    lazy = make_optimizer_constructor_lazy(torch.optim.AdamW)(groups, lr=1e-2)
    ids = original_parameter_ids(model)
    parallelizer = ParallelizersManager.parallelizer_for_model(model)
    parallel = parallelizer.parallelize(model, fuse_qkv=fused)
    return parallel, optimizer_for_mp(lazy, parameter_mapping(ids, parallel))


def _step(model: Any, optimizer: Any) -> torch.Tensor:
    ids = H.batch(seed=4)
    out = model(input_ids=ids, labels=ids)
    out.loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return out.logits.detach()


def fused_and_unfused() -> dict[str, Any]:
    import nxd_state

    nxd_state.initialize_model_parallel(tensor_model_parallel_size=2)
    reference = H.model("mistral")
    out: dict[str, Any] = {}
    for fused in (False, True):
        model, optimizer = _parallel(reference, fused)
        names = [n for n, _ in model.named_parameters()]
        stepped = [p for g in optimizer.param_groups for p in g["params"]]
        out[fused] = {
            "names": names,
            "stepped": len(stepped),
            "distinct": len({id(p) for p in stepped}),
            "logits": _step(model, optimizer),
            "after": _step(model, optimizer),
        }
    with pytest.raises(ValueError, match="different hyper-parameters"):
        _parallel(reference, True, lr_qkv=1e-3)
    with pytest.raises(TypeError, match="fuse_qkv must be a bool"):
        _parallel(reference, "yes")  # type: ignore[arg-type]
    return out


def test_fused_qkv_matches_unfused_and_steps_each_parameter_once() -> None:
    for result in run_distributed(fused_and_unfused, 2):
        unfused, fused = result[False], result[True]
        assert any(n.endswith("qkv_proj.weight_qkv") for n in fused["names"])
        assert any(n.endswith("qkv_proj.weight_k") for n in unfused["names"])
        assert fused["stepped"] == fused["distinct"] == len(fused["names"])
        assert unfused["stepped"] == len(unfused["names"])
        for key in ("logits", "after"):
            torch.testing.assert_close(fused[key], unfused[key], rtol=0, atol=0, msg=key)
