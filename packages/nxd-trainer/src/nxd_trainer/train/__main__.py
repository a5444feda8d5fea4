"""``python -m nxd_trainer.train``: the ``nxd-train`` command (what each worker runs)."""

import os
import sys

try:
    from nxd_trainer.train.cli import main
except KeyboardInterrupt:  # Ctrl-C while the (light) command-line module loads
    if "NXD_TRAIN_LAUNCHER_PID" not in os.environ:  # a worker stays quiet: its launcher says it
        print("nxd-train: interrupted", file=sys.stderr)
    sys.exit(130)

sys.exit(main())
