"""NxD's ``neuronx_distributed.modules.moe.loss_function``."""

from nxd_layers.moe.loss import load_balancing_loss_func, router_z_loss_func

__all__ = ["load_balancing_loss_func", "router_z_loss_func"]
