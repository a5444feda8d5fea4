"""``python -m nxd_trainer.train``: the ``nxd-train`` command (what each worker runs)."""

import sys

from nxd_trainer.train.cli import main

sys.exit(main())
