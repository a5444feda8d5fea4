"""Mixtral and Qwen2-MoE built from a Hugging Face folder at expert parallelism: the folder
stores the experts per expert (as ``save_pretrained`` and the Hub write them: Mixtral's
``block_sparse_moe.experts.N.w1/w3/w2``, Qwen's ``mlp.experts.N.gate_proj/up_proj/down_proj``),
the model holds them packed.

``initialize_parallel_model`` at EP2 = DP2 with the model built under
``lazy_load_for_parallelism(expert_parallel_size=2)`` (and at TP2 without EP, the experts
whole on each rank; TP2 x EP2 under ``-m slow``), and the
parallelizer's ``parallelize(model, checkpoint_dir=folder)`` at EP2: every parameter equals the
unsharded model's (experts: this rank's rows, this TP rank's features, cut by hand), the
logits equal its logits, and each rank read the data of no other rank's expert tensors in the
folder (``FolderStore.view``; the first expert's header gives the shapes).

Values are bytes copied from the folder: parameters compared exactly; logits within
``LOGITS_TOL``.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import torch

from nxd_state.testing import load_sibling, run_distributed

M = load_sibling(__file__, "_moe")
EXACT = {"rtol": 0.0, "atol": 0.0}
LOGITS_TOL = M.R.OUT_TOL
"""fp32, rtol = atol = 1e-5 (``_registry``'s): TP adds each row-parallel matmul's partial sums
and EP each token's expert outputs in another order (measured up to 1.7e-6 absolute at TP2 x
EP2); a wrong expert or feature slice is off by O(1)."""
EXPERT = re.compile(r"\.experts\.(\d+)\.")


def _folder(family: str, root: Path) -> Path:
    """The family's tiny model saved by transformers, its experts per expert."""
    from nxd_trainer.hf._expert_export import write_experts_per_expert

    folder = root / family
    M.moe_model(family).save_pretrained(folder)
    write_experts_per_expert(folder, family)  # a no-op where transformers wrote them so
    return folder


def _logits(model: Any) -> torch.Tensor:
    ids = M.batches(1, seed=99)[0]
    model.eval()
    with torch.no_grad():
        return model(input_ids=ids).logits.detach().clone()


def _built(family: str, folder: str, tp: int, ep: int, how: str) -> dict[str, Any]:
    """The model built from ``folder`` at (TP, EP) by the trainer (lazily) or the
    parallelizer (``checkpoint_dir``): this rank's values and the folder tensors it opened."""
    from nxd_trainer.hf._sources import FolderStore

    opened: list[str] = []
    original = FolderStore.view

    def view(self: Any, name: str) -> Any:  # records the tensors this rank opens
        opened.append(name)
        return original(self, name)

    FolderStore.view = view  # type: ignore[method-assign]
    try:
        return _build(family, folder, tp, ep, how, opened)
    finally:
        FolderStore.view = original  # type: ignore[method-assign]


def _build(family: str, folder: str, tp: int, ep: int, how: str, opened: list[str]) -> Any:
    import nxd_state
    import nxd_trainer as nxd
    from nxd_trainer.hf import ParallelizersManager, lazy_load_for_parallelism

    nxd_state.destroy_model_parallel()
    if how == "trainer":
        nxd_config = nxd.neuronx_distributed_config(
            tensor_parallel_size=tp,
            expert_parallel_size=ep,
            optimizer_config={"zero_one_enabled": False},
        )

        def build() -> torch.nn.Module:
            from transformers import AutoModelForCausalLM

            with lazy_load_for_parallelism(tp, expert_parallel_size=ep):
                return AutoModelForCausalLM.from_pretrained(folder)

        model = nxd.initialize_parallel_model(nxd_config, build)
        params = dict(model.named_parameters())
    else:
        nxd_state.initialize_model_parallel(
            tensor_model_parallel_size=tp, expert_model_parallel_size=ep
        )
        model = M.moe_model(family, seed=1)  # other weights: the folder's must replace them
        parallelizer = ParallelizersManager.parallelizer_for_model(model)
        model = parallelizer.parallelize(model, device=torch.device("cpu"), checkpoint_dir=folder)
        params = dict(model.named_parameters())
    state = nxd_state.get_parallel_state()
    logits = _logits(model)
    if tp > 1:
        logits = M.R.H.full_logits(logits, M.R.VOCAB)
    config = M.moe_model(family).config
    values = {}
    for name, param in params.items():
        if M.is_expert(param):
            values[name] = param.detach().clone()
        else:
            values[name] = M.R.H.full(param, param.detach(), name, config)
    return {
        "values": values,
        "experts": sorted(n for n, p in params.items() if M.is_expert(p)),
        "logits": logits,
        "opened": sorted(set(opened)),
        "tp_rank": state.tensor_parallel_rank,
        "ep_rank": state.expert_model_parallel_rank,
    }


def _check(family: str, ranks: list[dict[str, Any]], tp: int, ep: int) -> None:
    reference = M.moe_model(family)
    want_logits = _logits(reference)
    want = {n: p.detach() for n, p in reference.named_parameters()}
    for rank in ranks:
        case = f"{family} tp={tp} ep={ep} tp_rank={rank['tp_rank']} ep_rank={rank['ep_rank']}"
        assert bool(rank["experts"]) == (ep > 1), f"{case}: experts {rank['experts']}"
        assert sorted(rank["values"]) == sorted(want), case
        local = M.EXPERTS // ep
        mine = range(rank["ep_rank"] * local, (rank["ep_rank"] + 1) * local)
        for name, value in rank["values"].items():
            expected = want[name]
            if name in rank["experts"]:
                expected = expected[mine.start : mine.stop]
                if name.endswith("gate_up_proj"):
                    gate, up = expected.chunk(2, dim=1)
                    cut = [g.chunk(tp, dim=1)[rank["tp_rank"]] for g in (gate, up)]
                    expected = torch.cat(cut, dim=1)
                else:
                    expected = expected.chunk(tp, dim=2)[rank["tp_rank"]]
            torch.testing.assert_close(value, expected, **EXACT, msg=f"{case} {name}")
        torch.testing.assert_close(
            rank["logits"], want_logits, **LOGITS_TOL, msg=lambda m, c=case: f"{c}: {m}"
        )
        read = {int(m.group(1)) for n in rank["opened"] if (m := EXPERT.search(n))}
        assert read == set(mine), f"{case}: opened experts {sorted(read)}, holds {list(mine)}"


@pytest.mark.parametrize("family", ["mixtral", "qwen2_moe"])
def test_lazy_folder_at_ep2_through_the_trainer(family: str, tmp_path: Path) -> None:
    folder = _folder(family, tmp_path)
    _check(family, run_distributed(_built, 2, family, str(folder), 1, 2, "trainer"), 1, 2)


def test_checkpoint_dir_folder_at_ep2_through_the_parallelizer(tmp_path: Path) -> None:
    folder = _folder("mixtral", tmp_path)
    _check("mixtral", run_distributed(_built, 2, "mixtral", str(folder), 1, 2, "hf"), 1, 2)


@pytest.mark.slow
def test_lazy_folder_at_tp2_ep2_through_the_trainer(tmp_path: Path) -> None:
    folder = _folder("qwen2_moe", tmp_path)
    ranks = run_distributed(_built, 4, "qwen2_moe", str(folder), 2, 2, "trainer")
    _check("qwen2_moe", ranks, 2, 2)


def test_lazy_folder_at_tp2_without_ep(tmp_path: Path) -> None:
    """TP2 at EP1: the experts kept whole on each TP rank are assembled from the folder too."""
    folder = _folder("mixtral", tmp_path)
    _check("mixtral", run_distributed(_built, 2, "mixtral", str(folder), 2, 1, "trainer"), 2, 1)
