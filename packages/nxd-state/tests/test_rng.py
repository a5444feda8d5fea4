"""Model-parallel RNG streams: TP-distinct inside ``fork()``, shared outside, saved and restored."""

import pytest
import torch

import nxd_state as ps
from nxd_state.rng import RNGStatesTracker, xla_seed_from_tensor, xla_seed_to_tensor
from nxd_state.testing import run_distributed


def draw_streams(seed: int) -> dict:
    ps.initialize_model_parallel(tensor_model_parallel_size=2)
    ps.model_parallel_manual_seed(seed)
    shared_before = torch.rand(4)
    with ps.get_rng_tracker().fork():
        tp_distinct = torch.rand(4)
    shared_after = torch.rand(4)
    return {"shared": torch.cat([shared_before, shared_after]), "tp": tp_distinct}


def test_tp_stream_differs_across_tp_ranks_and_shared_stream_agrees() -> None:
    results = run_distributed(draw_streams, 4, 1234)  # TP=2, DP=2
    # Every rank draws the same shared numbers (identical generator state, exact equality).
    for result in results[1:]:
        torch.testing.assert_close(result["shared"], results[0]["shared"], rtol=0, atol=0)
    # TP ranks 0 and 1 differ inside the fork; the same TP rank in another DP replica agrees.
    assert not torch.equal(results[0]["tp"], results[1]["tp"])
    torch.testing.assert_close(results[0]["tp"], results[2]["tp"], rtol=0, atol=0)
    torch.testing.assert_close(results[1]["tp"], results[3]["tp"], rtol=0, atol=0)
    # Forking does not advance the shared stream: the draws after it continue the sequence.
    torch.manual_seed(1234)
    torch.testing.assert_close(results[0]["shared"], torch.rand(8), rtol=0, atol=0)


def test_fork_restores_default_stream_and_continues_its_own() -> None:
    tracker = RNGStatesTracker(device_type="cpu")
    tracker.add("a", 7)
    torch.manual_seed(0)
    with tracker.fork("a"):
        first = torch.rand(3)
    outside = torch.rand(3)
    with tracker.fork("a"):
        second = torch.rand(3)
    torch.manual_seed(7)
    torch.testing.assert_close(torch.cat([first, second]), torch.rand(6), rtol=0, atol=0)
    torch.manual_seed(0)
    torch.testing.assert_close(outside, torch.rand(3), rtol=0, atol=0)


def test_state_dict_round_trip_replays_the_same_numbers() -> None:
    ps.model_parallel_manual_seed(42, tensor_parallel_rank=0, pipeline_parallel_rank=0)
    saved = ps.rng_state_dict()
    with ps.get_rng_tracker().fork():
        expected_tp = torch.rand(5)
    expected_shared = torch.rand(5)
    ps.load_rng_state_dict(saved)
    with ps.get_rng_tracker().fork():
        torch.testing.assert_close(torch.rand(5), expected_tp, rtol=0, atol=0)
    torch.testing.assert_close(torch.rand(5), expected_shared, rtol=0, atol=0)
    assert set(saved) == {"cpu", "tracker.model-parallel-rng"}
    assert all(isinstance(v, torch.Tensor) for v in saved.values())


def test_tracker_errors_name_the_stream_and_seed() -> None:
    tracker = RNGStatesTracker(device_type="cpu")
    tracker.add("x", 1)
    with pytest.raises(ValueError, match=r"RNG stream 'x' already exists"):
        tracker.add("x", 2)
    with pytest.raises(ValueError, match=r"seed 1 is already used"):
        tracker.add("y", 1)
    with pytest.raises(KeyError, match=r"RNG stream 'nope' does not exist"), tracker.fork("nope"):
        pass


@pytest.mark.parametrize(
    ("seed", "stored"),
    [
        (0, 0),
        (5, 5),
        (2**63 - 1, 2**63 - 1),
        (2**63, -(2**63)),  # above int64's range: the same bits, read as negative
        (2**63 + 12345, -(2**63) + 12345),
        (2**64 - 1, -1),
    ],
)
def test_xla_seed_is_stored_as_its_64_bits(seed: int, stored: int) -> None:
    tensor = xla_seed_to_tensor(seed)
    assert tensor.dtype == torch.int64
    assert tensor.tolist() == [stored]
    assert xla_seed_from_tensor(tensor) == seed


def test_xla_seed_out_of_range_is_refused() -> None:
    for bad in (-1, 2**64, 1.5, True):
        with pytest.raises(ValueError, match=r"an XLA RNG state is an integer in \[0, 2\*\*64\)"):
            xla_seed_to_tensor(bad)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"stored as one int64, got torch.int32"):
        xla_seed_from_tensor(torch.tensor([1], dtype=torch.int32))
