"""Boxes: rectangular regions of an n-d tensor, and the arithmetic resharding needs.

The geometry lives upstream, in :mod:`nxd_state.shards` (the shard type every package that
describes checkpoint state uses); these are the same objects under their old names.
"""

from nxd_state.shards import Box, flat_range_boxes, linear_index

__all__ = ["Box", "flat_range_boxes", "linear_index"]
