"""``collectives.all_to_all_uneven`` on 3 gloo ranks against its definition: rank i sends
``count(i, j)`` rows to rank j (zeros included), natively and through the pairwise emulation,
and the counter records the bytes that leave each rank."""

import pytest
import torch

from nxd_state import collectives as C
from nxd_state import count_collectives
from nxd_state.testing import run_distributed

WORLD, WIDTH = 3, 2


def count(i: int, j: int) -> int:
    return (i + 2 * j) % 3  # 0, 1 or 2 rows; rank 0 sends nothing to itself


def block(i: int, j: int) -> torch.Tensor:
    """The rows rank i sends rank j: values that name both."""
    rows = torch.arange(count(i, j), dtype=torch.float32).unsqueeze(1)
    return rows + 100 * i + 10 * j + torch.zeros(1, WIDTH)


def exchange(emulate: bool) -> tuple[bool, float, float]:
    me = torch.distributed.get_rank()
    if emulate:
        C._NO_NATIVE_ALL_TO_ALL.add(C._backend_name(None))
    send = torch.cat([block(me, j) for j in range(WORLD)])
    with count_collectives() as counter:
        got = C.all_to_all_uneven(
            send,
            None,
            send_counts=[count(me, j) for j in range(WORLD)],
            recv_counts=[count(i, me) for i in range(WORLD)],
        )
    expected = torch.cat([block(i, me) for i in range(WORLD)])
    stats = counter.total(op="all_to_all")
    sent_elsewhere = sum(count(me, j) for j in range(WORLD) if j != me) * WIDTH * 4
    return torch.equal(got, expected), stats.wire_bytes, float(sent_elsewhere)


@pytest.mark.parametrize("emulate", [False, True])
def test_uneven_blocks_arrive_in_rank_order(emulate: bool) -> None:
    for equal, wire, expected_wire in run_distributed(exchange, WORLD, emulate):
        assert equal
        assert wire == expected_wire


def bad_counts() -> list[str]:
    errors = []
    for rows, send, recv in (([3, 1], [1, 1], [1, 1]), ([2, 1], [1, 1], [2])):
        try:
            C.all_to_all_uneven(torch.zeros(rows), None, send_counts=send, recv_counts=recv)
        except ValueError as error:
            errors.append(str(error))
    return errors


def test_counts_must_match_the_rows_and_the_group() -> None:
    assert (
        run_distributed(bad_counts, 2)
        == [
            [
                "all_to_all_uneven: send counts sum to 2 but the tensor has 3 rows",
                "all_to_all_uneven: 2 send counts and 1 receive counts for a group of 2 ranks "
                "(one count per rank expected)",
            ]
        ]
        * 2
    )
