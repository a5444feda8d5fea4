"""The in-place all-gather, ``all_gather(x, group, out=F)``, on 2 and 4 gloo ranks.

F must come back as cat(x_0, …, x_{n-1}) on every rank, whether x is a separate tensor or
this rank's own chunk of F, on the world group and on data-parallel groups whose global ranks
are not consecutive (TP=2: [0, 2] and [1, 3], so a broadcast's source must be mapped from
group rank to global rank). On gloo it runs as n asynchronous broadcasts (recorded by wrapping
``torch.distributed``'s functions) and is counted as one all-gather of (n-1)·B_shard. Inputs
are small integers in float32: every comparison is exact.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist

from nxd_state import collectives as C
from nxd_state import count_collectives
from nxd_state.testing import run_distributed

EXACT = {"rtol": 0.0, "atol": 0.0}
SHAPE = (2, 3)


def shard_of(global_rank: int) -> torch.Tensor:
    return torch.arange(6, dtype=torch.float32).reshape(SHAPE) + 100 * global_rank


class _Spy:
    """Records which torch.distributed functions ran (and with what), then delegates."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, dict[str, Any]]] = []
        self._saved: dict[str, Any] = {}

    def __enter__(self) -> _Spy:
        for name in ("broadcast", "all_gather_into_tensor"):
            original = getattr(dist, name)
            self._saved[name] = original

            def spy(*args: Any, _name: str = name, _original: Any = original, **kw: Any) -> Any:
                self.calls.append((_name, {k: v for k, v in kw.items() if k != "group"}))
                return _original(*args, **kw)

            setattr(dist, name, spy)
        return self

    def __exit__(self, *exc: object) -> None:
        for name, original in self._saved.items():
            setattr(dist, name, original)


def gather_into(tp: int) -> dict[str, Any]:
    import nxd_state as ps

    state = ps.initialize_model_parallel(tensor_model_parallel_size=tp)
    group = None if tp == 1 else state.data_parallel_group
    n, me = C.group_size(group), C.group_rank(group)
    x = shard_of(dist.get_rank())
    with count_collectives() as counter, _Spy() as spy:
        out = torch.full((n * SHAPE[0], SHAPE[1]), float("nan"))
        separate = C.all_gather(x, group, out=out)
        in_place = torch.full_like(out, float("nan"))
        mine = in_place.view(n, *SHAPE)[me]
        mine.copy_(x)
        returned = C.all_gather(mine, group, out=in_place)
    return {
        "group_ranks": dist.get_process_group_ranks(group or dist.GroupMember.WORLD),
        "separate": separate,
        "separate_is_out": separate is out,
        "in_place": in_place,
        "in_place_is_out": returned is in_place,
        "calls": spy.calls,
        "counter": counter.as_dict(),
        "dp_name": C.group_name(group),
    }


@pytest.mark.parametrize(("world", "tp"), [(2, 1), (4, 1), (4, 2)])
def test_all_gather_into_out_is_the_concatenation_by_n_broadcasts(world: int, tp: int) -> None:
    for out in run_distributed(gather_into, world, tp):
        ranks = out["group_ranks"]
        n = len(ranks)
        expected = torch.cat([shard_of(r) for r in ranks])
        torch.testing.assert_close(out["separate"], expected, **EXACT)
        torch.testing.assert_close(out["in_place"], expected, **EXACT)
        assert out["separate_is_out"]
        assert out["in_place_is_out"]
        # gloo: n asynchronous broadcasts per gather, from every global rank of the group,
        # and never gloo's all-gather (which stages through a flat buffer of its own)
        sources = [kw["src"] for name, kw in out["calls"] if name == "broadcast"]
        assert sources == ranks + ranks
        assert all(kw["async_op"] for name, kw in out["calls"] if name == "broadcast")
        assert not [name for name, _ in out["calls"] if name != "broadcast"]
        # counted as the all-gathers they are: 2 calls, (n-1)·B_shard each
        nbytes = 4 * 6
        assert out["counter"] == {
            f"all_gather@{out['dp_name']}": {
                "calls": 2,
                "bytes": 2 * nbytes,
                "wire_bytes": 2 * (n - 1) * nbytes,
            }
        }


def bad_out(case: str) -> dict[str, Any]:
    x = shard_of(dist.get_rank())
    n = dist.get_world_size()
    outs = {
        "shape": (torch.empty(n * 2 + 1, 3), 0),
        "dtype": (torch.empty(n * 2, 3, dtype=torch.float64), 0),
        "contiguous": (torch.empty(3, n * 2).t(), 0),
        "dim": (torch.empty(n * 2, 3), 1),
    }
    out, dim = outs[case]
    with count_collectives() as counter, _Spy() as spy:
        try:
            C.all_gather(x, dim=dim, out=out)
        except ValueError as error:
            message = str(error)
        else:
            message = "no error"
    return {"message": message, "counter": counter.as_dict(), "calls": spy.calls}


@pytest.mark.parametrize(
    ("case", "words"),
    [
        ("shape", "out has shape (5, 3), expected (4, 3) (2 shards of shape (2, 3))"),
        ("dtype", "out is torch.float64 on cpu, the shard is torch.float32 on cpu"),
        ("contiguous", "out must be contiguous"),
        ("dim", "gathers along dim 0 only, got dim=1"),
    ],
)
def test_all_gather_into_bad_out_fails_on_every_rank_before_any_traffic(
    case: str, words: str
) -> None:
    for out in run_distributed(bad_out, 2, case):
        assert words in out["message"]
        assert out["counter"] == {}
        assert out["calls"] == []


def group_of_one() -> dict[str, Any]:
    group = dist.new_group([dist.get_rank()]) if dist.get_world_size() > 1 else None
    x = shard_of(dist.get_rank())
    out = torch.full(SHAPE, float("nan"))
    with count_collectives() as counter:
        returned = C.all_gather(x, group=group, out=out)
    return {"out": out, "same": returned is out, "expected": x, "stats": counter.as_dict()}


def test_all_gather_into_on_a_group_of_one_copies_the_shard() -> None:
    for result in run_distributed(group_of_one, 2):
        torch.testing.assert_close(result["out"], result["expected"], **EXACT)
        assert result["same"]
        assert result["stats"] == {}
