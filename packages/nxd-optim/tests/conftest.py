"""Warm the rank forkserver: creating a torch optimizer imports torch._dynamo (seconds)."""

from nxd_state.testing import add_preload

add_preload("torch._dynamo", "nxd_optim")
