"""nxd-state on one XLA device (torch-xla's CPU client): device, process group, RNG, moves."""

import pytest
import torch
from torch import nn

import nxd_state as ps
from nxd_state import collectives as C

pytestmark = pytest.mark.xla


@pytest.fixture
def xla_world(monkeypatch: pytest.MonkeyPatch):
    import torch.distributed as dist

    for key in ("WORLD_SIZE", "RANK", "LOCAL_RANK"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("NXD_DEVICE", "xla")
    ps.init_distributed()
    yield
    ps.destroy_model_parallel()
    dist.destroy_process_group()


def test_xla_is_selected_and_groups_build(xla_world: None) -> None:
    import torch.distributed as dist

    assert ps.resolve_device_type() == "xla"
    assert ps.current_device().type == "xla"
    assert dist.get_backend() == "xla"
    state = ps.initialize_model_parallel(1, 1)
    assert (state.tensor_parallel_size, state.data_parallel_size) == (1, 1)
    assert ps.get_data_parallel_group(as_list=True) == [[0]]


def test_collectives_on_one_device_are_identities(xla_world: None) -> None:
    ps.initialize_model_parallel(1, 1)
    x = torch.arange(6.0, device=ps.current_device()).reshape(2, 3)
    tp = ps.get_tensor_model_parallel_group()
    for out in (
        C.all_reduce(x, group=tp),
        C.all_gather(x, group=tp, dim=1),
        C.reduce_scatter(x, group=tp),
    ):
        torch.testing.assert_close(out.cpu(), torch.arange(6.0).reshape(2, 3), rtol=0, atol=0)


def test_a_cpu_tensor_on_the_xla_group_is_staged_to_this_device(xla_world: None) -> None:
    from nxd_state._staging import stage, staging_device, unstage

    cpu = torch.arange(3.0)
    assert staging_device(cpu, None) == ps.current_device()
    assert staging_device(cpu.to(ps.current_device()), None) is None
    staged = stage(cpu, None)
    assert staged.device.type == "xla"
    staged.mul_(2)
    assert unstage(cpu, staged) is cpu
    torch.testing.assert_close(cpu, torch.tensor([0.0, 2.0, 4.0]), rtol=0, atol=0)


def test_rng_tracker_forks_xla_seed_state(xla_world: None) -> None:
    device = ps.current_device()
    ps.model_parallel_manual_seed(5)
    with ps.get_rng_tracker().fork():
        inside = torch.rand(4, device=device).cpu()
    outside = torch.rand(4, device=device).cpu()
    assert not torch.equal(inside, outside)
    saved = ps.rng_state_dict()
    again = torch.rand(4, device=device).cpu()
    ps.load_rng_state_dict(saved)
    torch.testing.assert_close(torch.rand(4, device=device).cpu(), again, rtol=0, atol=0)


def test_rng_state_above_2_63_round_trips_on_xla(xla_world: None) -> None:
    """XLA's state is a uint64: one above int64's range is saved and restored bit for bit
    (it overflowed the int64 tensor before)."""
    xm = pytest.importorskip("torch_xla.core.xla_model")
    device = ps.current_device()
    high = 2**64 - 12345
    xm.set_rng_state(high)
    assert xm.get_rng_state() == high
    saved = ps.rng_state_dict()
    assert saved["xla"].tolist() == [high - 2**64]
    expected = torch.rand(4, device=device).cpu()
    ps.load_rng_state_dict(saved)
    assert xm.get_rng_state() == high
    torch.testing.assert_close(torch.rand(4, device=device).cpu(), expected, rtol=0, atol=0)


def test_move_model_to_xla_keeps_attributes(xla_world: None) -> None:
    model = nn.Linear(3, 2)
    model.weight.partition_dim = 1
    move = ps.move_model_to_device(model, ps.current_device())
    assert move.weight.device.type == "xla"
    assert move.weight.partition_dim == 1


def test_mark_step_runs_the_pending_graph(xla_world: None) -> None:
    assert not ps.is_cpu_mode()
    x = torch.arange(4.0, device=ps.current_device())
    y = x * 2 + 1  # pending lazy computation until the graph is cut
    ps.mark_step()
    torch.testing.assert_close(y.cpu(), torch.tensor([1.0, 3.0, 5.0, 7.0]), rtol=0, atol=0)


def test_nxd_surface_at_degree_one_on_xla(xla_world: None) -> None:
    ps.initialize_model_parallel(1, 1, 1, skip_collective_init=False, lnc_size=1)
    assert ps.get_context_model_parallel_size() == ps.get_expert_model_parallel_size() == 1
    assert ps.get_tensor_model_parallel_replica_groups() == [[0]]
    ps.initialize_kv_group(1)
    assert ps.get_kv_shared_replica_groups() == [[0]]
