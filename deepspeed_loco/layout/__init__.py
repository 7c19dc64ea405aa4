"""The bottom layer: the formats of the numbers (error storages, grids), partition sizes, the wire layout of a
bucket and the hop plan.

Imports nothing of the kernels or the runtime, so both build on it: ``ops`` (kernels) and ``runtime`` (the
reduce, the error state, checkpoints) import ``layout``, never the other way round.
"""
from deepspeed_loco.layout.formats import GRID_NAMES, GRIDS, STORED, ErrorStorage, Grid, Rounding, grid_named
from deepspeed_loco.layout.hop_plan import (INTER_NODE, INTRA_NODE, Exchange, Hop, HopArgs, HopPlan, MeanArgs,
                                            plan_hops, resolve_grid)
from deepspeed_loco.layout.partition import (SCALE_BYTES, packed_bytes, padded_partition_size, padded_widths,
                                             partition_size, slot_to_row)
from deepspeed_loco.layout.wire import WireLayout, describe_hop_cost, wire_bytes_per_element

__all__ = [
    "GRID_NAMES", "GRIDS", "STORED", "ErrorStorage", "Grid", "Rounding", "grid_named",
    "INTER_NODE", "INTRA_NODE", "Exchange", "Hop", "HopArgs", "HopPlan", "MeanArgs", "plan_hops", "resolve_grid",
    "SCALE_BYTES", "packed_bytes", "padded_partition_size", "padded_widths", "partition_size", "slot_to_row",
    "WireLayout", "describe_hop_cost", "wire_bytes_per_element"
]
