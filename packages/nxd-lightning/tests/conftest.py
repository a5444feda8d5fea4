"""Forkserver preloads for the rank processes and the ``slow`` marker (heavier variants)."""

import pytest

from nxd_state.testing import add_preload

# Ranks start from a forkserver that imported these once (Lightning and transformers take
# seconds to import; torch._dynamo is imported by the first optimizer).
add_preload(
    "torch._dynamo",
    "lightning.pytorch",
    "nxd_trainer",
    "nxd_lightning",
    "transformers.models.llama.modeling_llama",
)


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "slow: heavier variants (more processes or steps); run with -m slow"
    )
