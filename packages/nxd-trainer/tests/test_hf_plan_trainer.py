"""The trainer API parallelises any family transformers declares a tensor-parallel plan for, not
only the registered (Llama-family) path: ``initialize_parallel_model(cfg, lambda: gemma2)`` at
TP=2 gives the loss and, after one SGD(lr=1) step through ``initialize_parallel_optimizer``,
every parameter's update (minus the gradient; TP shards gathered) of the unmodified model in
one process. A family without a pipeline plan is refused at PP=2 before any change.

Tolerance: ``_registry.OUT_TOL`` / ``GRAD_TOL`` (fp32 re-association of the TP-split matmul
sums on unit-scale weights; a missing TP reduction is off by O(1)).
"""

from __future__ import annotations

import pytest
import torch

from nxd_state.testing import load_sibling, run_distributed

R = load_sibling(__file__, "_registry")
H = load_sibling(__file__, "_hf")


def one_step(family: str) -> list[str]:
    import nxd_trainer as nxd

    reference = R.build(family).train()
    ids = torch.randint(0, R.VOCAB, (R.BATCH, R.SEQ), generator=torch.Generator().manual_seed(5))
    cfg = nxd.neuronx_distributed_config(
        tensor_parallel_size=2, optimizer_config={"grad_clipping": False}
    )
    model = nxd.initialize_parallel_model(cfg, lambda: R.build(family).train())
    optimizer = nxd.initialize_parallel_optimizer(cfg, torch.optim.SGD, model.parameters(), lr=1.0)
    expected = reference(input_ids=ids, labels=ids, use_cache=False).loss
    expected.backward()
    grads = {n: p.grad for n, p in reference.named_parameters()}
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    loss = model.run_train(input_ids=ids, labels=ids)
    optimizer.step()
    bad = []
    checks: list[tuple[str, torch.Tensor, torch.Tensor, dict[str, float]]] = [
        ("loss", loss.detach(), expected.detach(), R.OUT_TOL)
    ]
    names = {n for n, _ in model.named_parameters()}
    if names != set(grads):
        bad.append(f"parameters differ from the model's: {sorted(names ^ set(grads))}")
    for name, param in model.named_parameters():
        update = H.full(param, before[name] - param.detach(), name, reference.config)
        checks.append((f"update {name}", update, grads.get(name, torch.zeros(())), R.GRAD_TOL))
    for what, got, want, tol in checks:
        try:
            torch.testing.assert_close(got, want, **tol)
        except AssertionError as error:
            bad.append(f"{what}: {error}")
    return bad


def test_trainer_parallelizes_a_plan_family_at_tp2() -> None:
    """Gemma 2: embedding scale, soft-capping, sliding-window layers, tied embeddings."""
    if "gemma2" not in R.families():
        pytest.skip("this transformers has no gemma2")
    for rank, bad in enumerate(run_distributed(one_step, 2, "gemma2")):
        assert not bad, f"rank {rank}:\n" + "\n".join(bad)


def pipeline_refusal(family: str) -> str | None:
    import nxd_trainer as nxd

    cfg = nxd.neuronx_distributed_config(
        tensor_parallel_size=2,
        pipeline_parallel_size=2,
        pipeline_config={"input_names": ["input_ids", "labels"], "pipeline_cuts": ["x"]},
    )
    try:
        nxd.initialize_parallel_model(cfg, lambda: R.build(family))
    except ValueError as error:
        return str(error)
    return None


def test_a_plan_family_without_a_pipeline_plan_is_refused_at_pp2() -> None:
    """Nemotron: transformers declares its tensor-parallel plan but no pipeline plan."""
    from nxd_trainer.hf import UnsupportedModelError
    from nxd_trainer.hf.plan import pipeline_layers, text_tp_plan

    try:
        has_tp_plan = "nemotron" in R.families() and bool(text_tp_plan("nemotron"))
    except UnsupportedModelError:
        has_tp_plan = False
    if not has_tp_plan or pipeline_layers("nemotron") is not None:
        pytest.skip("this transformers has no nemotron with a tensor- but no pipeline plan")
    for error in run_distributed(pipeline_refusal, 4, "nemotron"):
        assert error is not None
        assert "no pipeline plan (base_model_pp_plan)" in error, error
        assert "'nemotron'" in error
