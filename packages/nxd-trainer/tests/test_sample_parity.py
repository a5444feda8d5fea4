"""The reference's sample script (config -> model -> optimizer -> run_train loop), with only its
import changed, trains like one process at TP=2, PP=2 and TP=2 x PP=2 x DP=2 with ZeRO-1.

Every rank's loss at every step and every parameter shard after the last step must equal the
one-process run of the same recipe (``_recipe.py``: TinyLM, AdamW, clipping at 0.5); the
one-process losses must also equal the checked-in golden curve (``assets/losses/``), which
pins the recipe itself against silent drift. Tolerance: ``_recipe.TOL``, justified there.
"""

from __future__ import annotations

from typing import Any

import torch

from nxd_state.testing import load_sibling, run_distributed

R = load_sibling(__file__, "_recipe")


def run_sample(
    tp: int,
    pp: int,
    zero1: bool,
    model_kwargs: dict[str, Any],
    config_kwargs: dict[str, Any],
    count_step: int | None = None,
) -> dict[str, Any]:
    """The reference's sample on this rank; returns losses, shards and optionally the traffic of
    one whole step (run_train + optimizer.step)."""
    import nxd_state
    import nxd_trainer as nxd  # the sample's `import neuronx_distributed as nxd`
    from nxd_trainer.testing import Block

    pipeline_config = None
    if pp > 1:
        pipeline_config = {
            "transformer_layer_cls": Block,
            "num_microbatches": 2,
            "output_loss_value_spec": True,
            "input_names": ["input_ids", "labels"],
            "pipeline_cuts": ["blocks.1"],
            "leaf_module_cls": ["Embed", "Head"],  # NxD passes class names
            "broadcast_and_average_loss": True,
            "use_zero1_optimizer": zero1,
        }
    nxd_config = nxd.neuronx_distributed_config(
        tensor_parallel_size=tp,
        pipeline_parallel_size=pp,
        pipeline_config=pipeline_config,
        optimizer_config={
            "zero_one_enabled": zero1,
            "grad_clipping": True,
            "max_grad_norm": R.MAX_GRAD_NORM,
        },
        **config_kwargs,
    )
    model = nxd.initialize_parallel_model(
        nxd_config, R.get_model, tensor_parallel=True, **model_kwargs
    )
    optimizer = nxd.initialize_parallel_optimizer(
        nxd_config, torch.optim.AdamW, model.parameters(), **R.ADAMW
    )
    state = nxd_state.get_parallel_state()
    per_replica = R.BATCH // state.data_parallel_size
    first = state.data_parallel_rank * per_replica
    rows = slice(first, first + per_replica)
    losses, traffic = [], None
    for step, ids in enumerate(R.batches()):
        with nxd_state.count_collectives() as counter:
            loss = model.run_train(ids[rows], ids[rows])
            optimizer.step()
        optimizer.zero_grad()
        if step == count_step:
            traffic = counter
        losses.append(float(loss))
    out = {
        "losses": losses,
        "shards": R.local_shards(model),
        "tp": tp,
        "tp_rank": state.tensor_parallel_rank,
        "grad_norm": float(optimizer.grad_norm),
        "local_numel": sum(p.numel() for p in model.parameters()),
        "dp": state.data_parallel_size,
    }
    if traffic is not None:
        out["traffic"] = {
            "dp_all_reduce_bytes": traffic.total(op="all_reduce", group="dp").bytes,
            "dp_reduce_scatter_bytes": traffic.total(op="reduce_scatter", group="dp").bytes,
            "dp_reduce_scatter_calls": traffic.total(op="reduce_scatter", group="dp").calls,
            "dp_all_reduce_calls": traffic.total(op="all_reduce", group="dp").calls,
        }
    nxd_state.destroy_model_parallel()
    return out


def _check(results: list[dict[str, Any]], golden: str, **model_kwargs: Any) -> None:
    expected = R.reference_run(**model_kwargs)
    for result in results:
        torch.testing.assert_close(
            torch.tensor(result["losses"]), torch.tensor(expected["losses"]), **R.TOL
        )
    R.check_params(results, expected["params"])
    torch.testing.assert_close(
        torch.tensor(expected["losses"]), torch.tensor(R.golden_losses(golden)), **R.TOL
    )


def two_rank_samples() -> dict[str, Any]:
    """TP=2, TP=2 with sequence parallelism, PP=2: one spawn, the state rebuilt per case."""
    return {
        "tp2": run_sample(2, 1, False, {}, {}),
        "tp2_sp": run_sample(2, 1, False, {"sequence_parallel": True}, {"sequence_parallel": True}),
        "pp2": run_sample(1, 2, False, {}, {}),
        "tp2_zero1": run_sample(2, 1, True, {}, {}),
    }


def test_sample_at_tp2_sp_pp2_equals_one_process() -> None:
    per_rank = run_distributed(two_rank_samples, 2)
    for case in ("tp2", "tp2_sp", "pp2", "tp2_zero1"):
        _check([r[case] for r in per_rank], "tiny_lm_adamw_clip")


def test_sample_at_tp2_pp2_dp2_zero1_equals_one_process_with_minimal_dp_traffic() -> None:
    results = run_distributed(run_sample, 8, 2, 2, True, {}, {}, 1)
    _check(results, "tiny_lm_adamw_clip")
    for result in results:
        traffic = result["traffic"]
        # ZeRO-1 reduces the flat, padded gradient buffer once over DP: a reduce-scatter, or on
        # gloo (whose reduce-scatter is an emulated all-reduce) nxd-optim's all-reduce and
        # slice: Ψ_local fp32 values plus < DP padding per call, and the clipping norm (a
        # scalar) besides. A second reduction would double it.
        psi = 4 * result["local_numel"]
        moved = traffic["dp_reduce_scatter_bytes"] + traffic["dp_all_reduce_bytes"]
        calls = traffic["dp_reduce_scatter_calls"] + traffic["dp_all_reduce_calls"]
        assert psi <= moved < psi + 4 * result["dp"] * calls + 16, traffic
