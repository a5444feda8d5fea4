"""An NxD-style pipeline script, imported through neuronx_distributed, trains like one process."""

import copy

import torch

from nxd_state.testing import run_distributed


def nxd_pipeline_script() -> float:
    from neuronx_distributed import parallel_state
    from neuronx_distributed.pipeline import NxDPPModel
    from nxd_pipeline.testing import Block, TinyGPT

    parallel_state.initialize_model_parallel(pipeline_model_parallel_size=2)
    torch.manual_seed(0)
    reference = TinyGPT(layers=2)
    ids = torch.randint(0, 64, (2, 8))
    expected = reference(ids, ids)
    model = NxDPPModel(
        copy.deepcopy(reference),
        transformer_layer_cls=Block,
        num_microbatches=2,
        pipeline_cuts=["h.0"],
        broadcast_and_average_loss=True,
    )
    loss = model.run_train(input_ids=ids, labels=ids)
    # fp32, per-microbatch mean of means vs one mean: round-off only
    torch.testing.assert_close(loss, expected.detach(), rtol=1e-5, atol=1e-6)
    return float(loss)


def test_nxd_pipeline_import_path() -> None:
    losses = run_distributed(nxd_pipeline_script, 2)
    assert losses[0] == losses[1]  # broadcast_and_average_loss: every rank reports the loss
