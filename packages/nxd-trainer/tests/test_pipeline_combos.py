"""Context and expert parallelism with pipeline parallelism, through the trainer API.

* **CP2 x PP2** (4 ranks): a tiny Hugging Face Llama (GQA, 2 layers, cut after layer 0) at
  ``context_parallel_size=2, pipeline_parallel_size=2``, 2 micro-batches of one row each, some
  labels ``-100`` unevenly over the CP ranks (a mean of per-rank means would be off by ~5e-2).
  ``run_train`` gets whole sequences; the stages exchange this CP rank's slice of the
  activations; each micro-batch's loss, averaged over CP, is its token mean (the pipeline
  averages the micro-batches, so the reference is the mean of the per-row token means). Ring
  with SGD; all-to-all with ZeRO-1 (state sharded over DP x CP) and full activation
  checkpointing; TP2 x CP2 x PP2 (8 ranks, vocabulary-parallel loss) with ZeRO-1. After
  one SGD(lr=1) step every parameter moved by minus the reference gradient, and the loss
  averaged over CP equals the reference loss.
* **EP2 x PP2** (4 ranks, DP2 = EP2): Mixtral, Qwen2-MoE and Qwen3-MoE (stock transformers
  classes, tiny configs, no router auxiliary loss: it stays refused at PP > 1), each stage
  holding its layer's experts sharded over EP; plain optimizer and ZeRO-1
  (``NeuronEPZero1Optimizer``). Each DP rank runs its own batch; after one SGD step every
  parameter moved by minus the gradient of the DP-mean loss (the experts: the slice this rank
  holds). The Mixtral run saves a checkpoint (SGD with momentum: its buffers too), which one
  process loads at EP1 x PP1: every parameter and momentum buffer equals the saved ones (the
  experts the EP ranks' slices joined).

Tolerance rtol 1e-5 / atol 1e-5 for losses and gradients, fp32: CP splits the softmax sums
(ring: merged with log-sum-exp) and the loss sum, EP sums each token's experts in another
order, DP averages in another order: round-off of a few 1e-7 on O(1) values; a wrong split,
position, count or reduction is off by 1e-2 or more. Loading copies bytes: exact.

Each case captures the model with ``torch.export`` (10-30 s for 4 ranks on 2 cores): the two
4-rank CP x PP cases (ring; all-to-all with ZeRO-1 and checkpointing) run by default, the 8-rank
TP2 x CP2 x PP2 cases under ``-m slow``; the pipeline loss's algebra is also checked in one
process.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from nxd_state.testing import load_sibling, run_distributed

H = load_sibling(__file__, "_hf")
M = load_sibling(__file__, "_moe")
TOL = {"rtol": 1e-5, "atol": 1e-5}
EXACT = {"rtol": 0.0, "atol": 0.0}
SEQ, BATCH = 16, 2  # SEQ divisible by 2 x CP (the ring's zigzag split)


def _zigzag(x: torch.Tensor, n: int, r: int) -> torch.Tensor:
    """Rank ``r`` of ``n``'s zigzag slice of ``x`` (B, S): chunks r and 2n-1-r of 2n."""
    chunks = x.chunk(2 * n, dim=1)
    return torch.cat([chunks[r], chunks[2 * n - 1 - r]], dim=1)


def test_pipeline_loss_averaged_over_cp_is_the_token_mean() -> None:
    """``pipeline_loss`` on each CP rank's zigzag slice (chunks r and 2n-1-r of 2n), averaged
    over the ranks, equals transformers' loss of the whole sequence (one process, n = 2, 4)."""
    from transformers.loss.loss_utils import ForCausalLMLoss

    from nxd_trainer._context_parallel import pipeline_loss

    g = torch.Generator().manual_seed(0)
    logits = torch.randn(1, SEQ, 11, generator=g)
    labels = torch.randint(0, 11, (1, SEQ), generator=g)
    labels[0, 1:7] = -100  # all in the first chunks: uneven over the ranks
    want = ForCausalLMLoss(logits, labels, 11)
    shifted = F.pad(labels, (0, 1), value=-100)[..., 1:]
    for n in (2, 4):
        losses = [
            pipeline_loss(_zigzag(logits, n, r), shifted, 11, shift_labels=_zigzag(shifted, n, r))
            for r in range(n)
        ]
        torch.testing.assert_close(sum(losses) / n, want, rtol=1e-6, atol=1e-6)


def _needs_capture() -> None:
    if not H.pipeline_capture_works():
        pytest.skip(
            f"transformers below {H.PIPELINE_FIRST_GOOD_TRANSFORMERS} cannot be captured into "
            f"pipeline stages (test_hf_pipeline checks the error there)"
        )


# CP x PP ------------------------------------------------------------------------------------
def _cp_data() -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randint(0, H.VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(3))
    labels = ids.clone()
    labels[0, 1:7] = -100  # CP rank 0's first chunk of row 0: uneven over the CP ranks
    return ids, labels


def _llama() -> torch.nn.Module:
    model = H.model("llama")
    model.config.use_cache = False
    return model


def _cp_reference() -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The mean of the per-row token means (one row per micro-batch) and its gradients."""
    model = _llama()
    ids, labels = _cp_data()
    rows = [model(input_ids=ids[i : i + 1], labels=labels[i : i + 1]).loss for i in range(BATCH)]
    loss = sum(rows) / BATCH
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters()}


def _pipeline_config(names: list[str]) -> dict[str, Any]:
    return {"num_microbatches": 2, "input_names": names, "pipeline_cuts": ["model.layers.0"]}


def cp_pp_step(
    algorithm: str, zero1: bool, checkpointing: bool, tp: int = 1, sp: bool = False
) -> list[str]:
    import nxd_state
    import nxd_trainer as nxd

    cfg = nxd.neuronx_distributed_config(
        tensor_parallel_size=tp,
        pipeline_parallel_size=2,
        context_parallel_size=2,
        context_parallel_algorithm=algorithm,
        pipeline_config=_pipeline_config(["input_ids", "labels"]),
        optimizer_config={"zero_one_enabled": zero1, "grad_clipping": False},
        activation_checkpoint_config="full" if checkpointing else None,
        sequence_parallel=sp,
    )
    model = nxd.initialize_parallel_model(cfg, _llama)
    optimizer = nxd.initialize_parallel_optimizer(cfg, torch.optim.SGD, model.parameters(), lr=1.0)
    state = nxd_state.get_parallel_state()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    ids, labels = _cp_data()
    loss = model.run_train(input_ids=ids, labels=labels)
    optimizer.step()
    ref_loss, ref_grads = _cp_reference()
    bad = []
    checks = []
    if loss is not None:  # the last stage's ranks
        mean = loss.clone()
        dist.all_reduce(mean, group=state.context_parallel_group)
        checks.append(("loss", mean / state.context_parallel_size, ref_loss))
    elif state.pipeline_parallel_rank == 1:
        bad.append("the last stage returned no loss")
    for name, param in model.named_parameters():
        update = H.full(param, before[name] - param.detach(), name, model.config)
        checks.append((f"grad {name}", update, ref_grads[name]))
    if not any(name.startswith("grad") for name, _, _ in checks):
        bad.append("no parameter on this rank")
    return bad + H.mismatches(checks, **TOL)


CP_CASES = {
    "ring": (4, "ring", False, False),
    "all-to-all-zero1-checkpointing": (4, "all_to_all", True, True),
    "tp2-ring-zero1": (8, "ring", True, False, 2),
    "tp2-sp-ring-checkpointing": (8, "ring", False, True, 2, True),
}
_EIGHT_RANKS = pytest.mark.slow  # 8 processes each capturing the model: minutes on 2 cores


@pytest.mark.parametrize(
    "case",
    [pytest.param(c, marks=_EIGHT_RANKS) if CP_CASES[c][0] == 8 else c for c in CP_CASES],
)
def test_cp2_pp2_llama_matches_one_process(case: str) -> None:
    _needs_capture()
    world, *args = CP_CASES[case]
    results = run_distributed(cp_pp_step, world, *args)
    for rank, bad in enumerate(results):
        assert not bad, f"rank {rank}:\n" + "\n".join(bad)


# EP x PP ------------------------------------------------------------------------------------
def _moe(family: str, seed: int = 0) -> torch.nn.Module:
    return M.R.build(family, seed)  # output_router_logits off: refused at PP > 1


def _ep_reference(family: str, dp: int) -> dict[str, torch.Tensor]:
    """Gradients of the mean over DP ranks of each rank's batch loss, one process."""
    model = _moe(family).train()
    losses = [model(input_ids=b, labels=b).loss for b in M.batches(dp, seed=30)]
    (sum(losses) / dp).backward()
    return {n: p.grad for n, p in model.named_parameters()}


def _snapshot(model: Any, optimizer: Any) -> dict[str, dict[str, torch.Tensor]]:
    out = {}
    for name, param in model.named_parameters():
        out[name] = {"param": param.detach().clone()}
        buffer = optimizer.state[param].get("momentum_buffer")
        if buffer is not None:
            out[name]["momentum_buffer"] = buffer.detach().clone()
    return out


def ep_pp_step(family: str, zero1: bool, root: str | None) -> dict[str, Any]:
    import nxd_state
    import nxd_trainer as nxd

    cfg = nxd.neuronx_distributed_config(
        pipeline_parallel_size=2,
        expert_parallel_size=2,
        pipeline_config=_pipeline_config(["input_ids", "labels"]),
        optimizer_config={"zero_one_enabled": zero1, "grad_clipping": False},
    )
    model = nxd.initialize_parallel_model(cfg, lambda: _moe(family))
    momentum = 0.0 if zero1 else 0.9  # momentum: a state tensor for the checkpoint
    optimizer = nxd.initialize_parallel_optimizer(
        cfg, torch.optim.SGD, model.parameters(), lr=1.0, momentum=momentum
    )
    state = nxd_state.get_parallel_state()
    dp = state.data_parallel_size
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    ids = M.batches(dp, seed=30)[state.data_parallel_rank]
    model.run_train(input_ids=ids, labels=ids)
    optimizer.step()
    grads = _ep_reference(family, dp)
    local = M.EXPERTS // state.expert_model_parallel_size
    first = state.expert_model_parallel_rank * local
    bad, experts = [], []
    for name, param in model.named_parameters():
        want = grads[name]
        if M.is_expert(param):
            want, _ = want[first : first + local], experts.append(name)
        try:  # SGD's first step, momentum or not: p -= lr * grad
            torch.testing.assert_close(before[name] - param.detach(), want, **TOL)
        except AssertionError as error:
            bad.append(f"{family} rank {state.rank} {name}: {error}")
    if not experts:
        bad.append(f"rank {state.rank}: no expert parameter in its stage")
    out: dict[str, Any] = {"bad": bad, "experts": experts, "ep_rank": first // local}
    if root is not None:
        nxd.save_checkpoint(root, "step1", model=model, optimizer=optimizer, nxd_config=cfg)
        out["saved"] = _snapshot(model, optimizer)
    return out


def load_at_ep1_pp1(family: str, root: str) -> dict[str, dict[str, torch.Tensor]]:
    import nxd_trainer as nxd

    cfg = nxd.neuronx_distributed_config(optimizer_config={"grad_clipping": False})
    model = nxd.initialize_parallel_model(cfg, lambda: _moe(family, seed=1))
    optimizer = nxd.initialize_parallel_optimizer(
        cfg, torch.optim.SGD, model.parameters(), lr=1.0, momentum=0.9
    )
    nxd.load_checkpoint(root, "step1", model=model, optimizer=optimizer)
    return _snapshot(model, optimizer)


def _saved_whole(results: list[dict[str, Any]]) -> dict[str, dict[str, torch.Tensor]]:
    """The saved tensors under every name: an expert the EP ranks' slices joined in EP order
    (from the ranks of its stage), any other as its stage's ranks hold it (all equal)."""
    out: dict[str, dict[str, torch.Tensor]] = {}
    for result in results:
        for name, tensors in result["saved"].items():
            if name not in result["experts"]:
                for key, value in tensors.items():
                    kept = out.setdefault(name, {}).setdefault(key, value)
                    torch.testing.assert_close(value, kept, **EXACT)
                continue
            holders = sorted((r for r in results if name in r["saved"]), key=lambda r: r["ep_rank"])
            out[name] = {
                key: torch.cat([r["saved"][name][key] for r in holders]) for key in tensors
            }
    return out


EP_CASES = {
    "mixtral-checkpoint": ("mixtral", False, True),
    "qwen2_moe-zero1": ("qwen2_moe", True, False),
    "qwen3_moe": ("qwen3_moe", False, False),
}


@pytest.mark.slow
@pytest.mark.parametrize("case", list(EP_CASES))
def test_ep2_pp2_moe_matches_one_process(case: str, tmp_path: Path) -> None:
    _needs_capture()
    family, zero1, save = EP_CASES[case]
    root = str(tmp_path) if save else None
    results = run_distributed(ep_pp_step, 4, family, zero1, root)
    for result in results:
        assert not result["bad"], "\n".join(result["bad"])
    if not save:
        return
    saved = _saved_whole(results)
    (loaded,) = run_distributed(load_at_ep1_pp1, 1, family, root)
    assert sorted(loaded) == sorted(saved)
    for name, tensors in saved.items():
        assert sorted(loaded[name]) == sorted(tensors), name
        for key, value in tensors.items():
            torch.testing.assert_close(
                loaded[name][key], value, **EXACT, msg=lambda m, n=name, k=key: f"{n} {k}: {m}"
            )
