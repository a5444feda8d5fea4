"""The rank processes and the trace workers fork from one forkserver: have it import the
export machinery (torch._dynamo, seconds) and the trace worker once, for all of them."""

from nxd_state.testing import add_preload

add_preload("torch.export", "torch._dynamo", "nxd_layers.trace._worker")
