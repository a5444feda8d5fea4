"""Everything together: TP=2 x PP=2 x DP=2 with ZeRO-1 and clipping trains like one process.

A GPT-style model built from nxd's TP layers is cut into two pipeline stages (nxd-pipeline,
1F1B and ZB-H1), its optimizer is NxD's wrapper with ZeRO-1 over DP and gradient clipping over
TP and PP (nxd-optim). Every step's loss and, after the last step, every parameter must equal
the same model trained with torch's AdamW and clip_grad_norm_ in one process on the whole
batch; the losses must also match the checked-in golden curve.
"""

import json
from pathlib import Path

import pytest
import torch

from nxd_state.testing import run_distributed

GOLDEN = Path(__file__).parent / "assets" / "losses" / "tiny_gpt_adamw_clip.json"
STEPS, GLOBAL_BATCH, SEQ, VOCAB = 3, 4, 8, 64
OPTIMIZER_CONFIG = {"zero_one_enabled": True, "grad_clipping": True, "max_grad_norm": 0.5}
# eps 1e-4: the key projection's bias has an exactly-zero gradient in exact arithmetic (softmax
# ignores a per-query constant), so its computed gradient is pure round-off (~1e-9), different in
# every parallel layout. With torch's default eps=1e-8 Adam would turn that noise into full-size
# lr steps; 1e-4 keeps it at ~1e-7 while real gradients (>= 1e-3) are barely affected.
ADAMW = {"lr": 1e-2, "weight_decay": 0.01, "eps": 1e-4}
# fp32 throughout; TP splits matmul sums, PP/DP average micro-batch means instead of one mean,
# ZeRO-1 reduces in another order: re-association round-off only, amplified by 3 AdamW steps
# (whose update normalises by sqrt(v): an ulp in a tiny gradient can move a weight by ~lr*1e-4).
TOL = {"rtol": 1e-4, "atol": 1e-5}


def make_reference() -> torch.nn.Module:
    from nxd_pipeline.testing import TinyGPT

    torch.manual_seed(0)
    return TinyGPT(vocab=VOCAB, hidden=32, layers=4, heads=4, max_positions=SEQ)


def make_batches() -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    return [torch.randint(0, VOCAB, (GLOBAL_BATCH, SEQ), generator=generator) for _ in range(STEPS)]


def train_single_process() -> tuple[list[float], dict[str, torch.Tensor]]:
    model = make_reference()
    optimizer = torch.optim.AdamW(model.parameters(), **ADAMW)
    losses = []
    for ids in make_batches():
        loss = model(ids, ids)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), OPTIMIZER_CONFIG["max_grad_norm"])
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses, {name: p.detach().clone() for name, p in model.named_parameters()}


def is_tensor_parallel(param: torch.Tensor) -> bool:
    return getattr(param, "tensor_model_parallel", False)


def train_3d(schedule: str) -> dict:
    import nxd_state
    from nxd_optim import build_optimizer
    from nxd_pipeline import NxDPPModel
    from nxd_pipeline.testing import Block, TinyGPT, copy_into_tensor_parallel

    state = nxd_state.initialize_model_parallel(
        tensor_model_parallel_size=2, pipeline_model_parallel_size=2
    )
    reference = make_reference()
    parallel = TinyGPT(
        vocab=VOCAB, hidden=32, layers=4, heads=4, max_positions=SEQ, tensor_parallel=True
    )
    copy_into_tensor_parallel(parallel, reference, state.tensor_parallel_rank, 2)
    model = NxDPPModel(
        parallel,
        transformer_layer_cls=Block,
        num_microbatches=2,
        pipeline_cuts=["h.1"],
        use_zero1_optimizer=True,
        broadcast_and_average_loss=True,
        schedule=schedule,
    )
    optimizer = build_optimizer(
        OPTIMIZER_CONFIG, torch.optim.AdamW, model.local_parameters(), **ADAMW
    )
    per_replica = GLOBAL_BATCH // state.data_parallel_size
    rows = slice(
        state.data_parallel_rank * per_replica, (state.data_parallel_rank + 1) * per_replica
    )
    losses = []
    for ids in make_batches():
        loss = model.run_train(input_ids=ids[rows], labels=ids[rows])
        optimizer.step()
        optimizer.zero_grad()
        losses.append(float(loss))
    shards = {
        name: (p.detach().clone(), p.partition_dim if is_tensor_parallel(p) else None)
        for name, p in model.local_named_parameters()
    }
    return {"losses": losses, "shards": shards, "tp_rank": state.tensor_parallel_rank}


@pytest.mark.parametrize("schedule", ["1f1b", "zb_h1"])
def test_tp2_pp2_dp2_zero1_matches_single_process_and_golden(schedule: str) -> None:
    expected_losses, expected_params = train_single_process()
    results = run_distributed(train_3d, 8, schedule)
    covered = set()
    for result in results:
        torch.testing.assert_close(
            torch.tensor(result["losses"]), torch.tensor(expected_losses), **TOL
        )
        for name, (value, partition_dim) in result["shards"].items():
            full = expected_params[name]
            if partition_dim is not None:
                full = full.chunk(2, dim=partition_dim)[result["tp_rank"]]
            torch.testing.assert_close(value, full, **TOL, msg=lambda m, n=name: f"{n}: {m}")
            covered.add(name)
    assert covered == set(expected_params)  # every parameter lives on some stage and was checked
    # The golden curve pins the whole recipe (init, data, loss, optimizer) against silent drift.
    golden = json.loads(GOLDEN.read_text())["losses"]
    torch.testing.assert_close(torch.tensor(expected_losses), torch.tensor(golden), **TOL)
