"""``python -m nxd_trainer.train``: the ``nxd-train`` command (what each worker runs)."""

import sys

try:
    from nxd_trainer.train.cli import main
except KeyboardInterrupt:  # Ctrl-C while the (light) command-line module loads
    print("nxd-train: interrupted", file=sys.stderr)
    sys.exit(130)

sys.exit(main())
