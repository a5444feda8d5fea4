"""Old path of :mod:`nxd_ckpt.format._stfile` (moved there; tests-reliability still imports this
one). The same module object, so attributes set on it (monkeypatching) reach the real one.
Import :mod:`nxd_ckpt.format._stfile` in new code."""

import sys

from nxd_ckpt.format import _stfile

sys.modules[__name__] = _stfile
