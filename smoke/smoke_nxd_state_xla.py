"""nxd-state[xla]: the extra resolves torch-xla next to the torch it was built for, and an XLA
device (torch-xla's CPU client, PJRT_DEVICE=CPU) computes."""

import importlib.metadata
import os
import sys

import torch

import nxd_state
from nxd_state.device import xla_version_mismatch


def main() -> None:
    os.environ.setdefault("PJRT_DEVICE", "CPU")
    xla_version = importlib.metadata.version("torch-xla")
    assert xla_version_mismatch(torch.__version__, xla_version) is None, (
        torch.__version__,
        xla_version,
    )
    device = nxd_state.current_device("xla")
    assert device.type == "xla", device
    x = torch.arange(6.0, device=device).reshape(2, 3)
    nxd_state.mark_step("xla")
    torch.testing.assert_close((x @ x.T).cpu(), torch.tensor([[5.0, 14.0], [14.0, 50.0]]))
    print(
        f"nxd-state[xla] smoke: ok (torch {torch.__version__}, torch-xla {xla_version})",
        file=sys.stderr,
    )


if __name__ == "__main__":
    main()
