"""Model-parallel random number streams.

Inside a tensor-parallel region each TP rank holds a different slice of the activations, so
dropout there must draw *different* masks per TP rank; everywhere else (replicated
activations) every TP rank must draw the *same* mask. The default generator is the shared
stream; :class:`RNGStatesTracker` keeps named extra streams (the TP-distinct
``"model-parallel-rng"`` among them) and swaps one into the default generator for the length of
a ``with tracker.fork():`` block. Works on CPU, CUDA and XLA.

XLA's generator state is one unsigned 64-bit seed s in [0, 2^64). It is kept as a one-element
int64 tensor (safetensors and torch have no uint64 arithmetic to rely on) holding the same 64
bits: s for s < 2^63, s - 2^64 above (two's complement), and s = v mod 2^64 on the way back, so
every state round-trips exactly.
"""

from __future__ import annotations

import contextlib
import importlib
from collections.abc import Iterator

import torch

from nxd_state.device import resolve_device_type

__all__ = [
    "MODEL_PARALLEL_RNG",
    "RNGStatesTracker",
    "get_rng_tracker",
    "load_rng_state_dict",
    "model_parallel_manual_seed",
    "rng_state_dict",
    "xla_seed_from_tensor",
    "xla_seed_to_tensor",
]

MODEL_PARALLEL_RNG = "model-parallel-rng"
# Offset of the TP-distinct stream from the user's seed, so it never equals the shared one.
_TP_SEED_OFFSET = 2718
# Pipeline stages hold different layers: give each stage its own streams.
_PP_SEED_STRIDE = 100


_UINT64 = 2**64


def xla_seed_to_tensor(seed: int) -> torch.Tensor:
    """XLA's RNG state ``seed`` (an unsigned 64-bit int) as a one-element int64 tensor holding
    its bits: ``seed`` below 2^63, ``seed - 2^64`` from there."""
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < _UINT64:
        raise ValueError(f"an XLA RNG state is an integer in [0, 2**64), got {seed!r}")
    return torch.tensor([seed - _UINT64 if seed >= 2**63 else seed], dtype=torch.int64)


def xla_seed_from_tensor(state: torch.Tensor) -> int:
    """The unsigned seed stored by :func:`xla_seed_to_tensor` (``v mod 2^64``)."""
    if state.dtype != torch.int64 or state.numel() != 1:
        raise ValueError(
            f"an XLA RNG state is stored as one int64, got {state.dtype} of shape "
            f"{tuple(state.shape)}"
        )
    return int(state.item()) % _UINT64


def _get_device_state(device_type: str) -> torch.Tensor:
    if device_type == "cuda":
        return torch.cuda.get_rng_state()
    if device_type == "xla":
        xm = importlib.import_module("torch_xla.core.xla_model")
        return xla_seed_to_tensor(int(xm.get_rng_state()))
    return torch.get_rng_state()


def _set_device_state(device_type: str, state: torch.Tensor) -> None:
    if device_type == "cuda":
        torch.cuda.set_rng_state(state)
    elif device_type == "xla":
        xm = importlib.import_module("torch_xla.core.xla_model")
        xm.set_rng_state(xla_seed_from_tensor(state))
    else:
        torch.set_rng_state(state)


def _seed_device(device_type: str, seed: int) -> None:
    if device_type == "cuda":
        torch.cuda.manual_seed(seed)
    elif device_type == "xla":
        xm = importlib.import_module("torch_xla.core.xla_model")
        xm.set_rng_state(seed)
    else:
        torch.manual_seed(seed)


class RNGStatesTracker:
    """Named generator states that can be swapped into the device's default generator."""

    def __init__(self, device_type: str | None = None) -> None:
        self._device_type = device_type
        self._states: dict[str, torch.Tensor] = {}
        self._seeds: set[int] = set()

    @property
    def device_type(self) -> str:
        return resolve_device_type(self._device_type)

    def reset(self) -> None:
        self._states.clear()
        self._seeds.clear()

    def add(self, name: str, seed: int) -> None:
        """Create stream ``name`` seeded with ``seed`` (both must be new)."""
        if name in self._states:
            raise ValueError(f"RNG stream {name!r} already exists")
        if seed in self._seeds:
            raise ValueError(f"seed {seed} is already used by another RNG stream")
        device = self.device_type
        saved = _get_device_state(device)
        _seed_device(device, seed)
        self._states[name] = _get_device_state(device)
        _set_device_state(device, saved)
        self._seeds.add(seed)

    def get_states(self) -> dict[str, torch.Tensor]:
        return {name: state.clone() for name, state in self._states.items()}

    def set_states(self, states: dict[str, torch.Tensor]) -> None:
        self._states = {name: state.clone() for name, state in states.items()}

    @contextlib.contextmanager
    def fork(self, name: str = MODEL_PARALLEL_RNG) -> Iterator[None]:
        """Draw from stream ``name`` inside the block; the default stream resumes after it."""
        if name not in self._states:
            raise KeyError(
                f"RNG stream {name!r} does not exist; call model_parallel_manual_seed(seed) "
                f"(or tracker.add) first. Known: {sorted(self._states)}"
            )
        device = self.device_type
        outside = _get_device_state(device)
        _set_device_state(device, self._states[name])
        try:
            yield
        finally:
            self._states[name] = _get_device_state(device)
            _set_device_state(device, outside)


_TRACKER = RNGStatesTracker()


def get_rng_tracker() -> RNGStatesTracker:
    """Process-wide tracker (NxD: ``get_xla_rng_tracker``; Megatron: ``get_cuda_rng_tracker``).

    One per process, as in NxD and Megatron: RNG state is process state.
    """
    return _TRACKER


def model_parallel_manual_seed(
    seed: int, *, tensor_parallel_rank: int | None = None, pipeline_parallel_rank: int | None = None
) -> None:
    """Seed the shared stream and the TP-distinct ``model-parallel-rng`` stream.

    shared = ``seed + 100 * pp_rank`` (equal across TP and DP ranks of a stage);
    model-parallel = ``shared + 2718 + tp_rank``. Ranks default to the current parallel state
    (0 when none is initialized).
    """
    from nxd_state import parallel_state

    if tensor_parallel_rank is None or pipeline_parallel_rank is None:
        initialized = parallel_state.model_parallel_is_initialized()
        state = parallel_state.get_parallel_state() if initialized else None
        if tensor_parallel_rank is None:
            tensor_parallel_rank = state.tensor_parallel_rank if state else 0
        if pipeline_parallel_rank is None:
            pipeline_parallel_rank = state.pipeline_parallel_rank if state else 0
    shared_seed = seed + _PP_SEED_STRIDE * pipeline_parallel_rank
    _seed_device(_TRACKER.device_type, shared_seed)
    if _TRACKER.device_type != "cpu":
        torch.manual_seed(shared_seed)  # CPU-side randomness (data, init on host) too
    _TRACKER.reset()
    _TRACKER.add(MODEL_PARALLEL_RNG, shared_seed + _TP_SEED_OFFSET + tensor_parallel_rank)


def rng_state_dict() -> dict[str, torch.Tensor]:
    """Every RNG state this process uses, as tensors (checkpoints store them in safetensors)."""
    states = {"cpu": torch.get_rng_state()}
    device = _TRACKER.device_type
    if device != "cpu":
        states[device] = _get_device_state(device)
    for name, state in _TRACKER.get_states().items():
        states[f"tracker.{name}"] = state
    return states


def load_rng_state_dict(states: dict[str, torch.Tensor]) -> None:
    """Restore what :func:`rng_state_dict` returned."""
    torch.set_rng_state(states["cpu"])
    device = _TRACKER.device_type
    if device != "cpu" and device in states:
        _set_device_state(device, states[device])
    prefix = "tracker."
    _TRACKER.set_states({k[len(prefix) :]: v for k, v in states.items() if k.startswith(prefix)})
