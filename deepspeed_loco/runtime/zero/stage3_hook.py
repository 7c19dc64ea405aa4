"""Routes DeepSpeed ZeRO-3's gradient reduce through the LoCo reduce, and counts optimizer steps.

The hook replaces, on one ``DeepSpeedZeroOptimizer_Stage3`` instance, the method that averages and scatters a
bucket of gradients (``__avg_scatter_grads``), and wraps its ``step`` to keep the error-feedback state in step
with the optimizer: reset every ``reset_T`` steps, rescale on an fp16 loss-scale change, clear on overflow.
"""
import logging
import os
from typing import List, Optional

import torch
from packaging import version

import deepspeed
from deepspeed.accelerator import get_accelerator
from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3

from deepspeed_loco.config import LocoConfig
from deepspeed_loco.ops import kernels_for
from deepspeed_loco.layout import padded_partition_size
from deepspeed_loco.ops.quantizer import SCALE_BYTES
from deepspeed_loco.runtime.comm.loco_reduce import LocoReducer
from deepspeed_loco.runtime.comm.topology import LocoTopology
from deepspeed_loco.layout.wire import describe_hop_cost
from deepspeed_loco.runtime.zero import checkpoint
from deepspeed_loco.runtime.zero.error_feedback import ErrorFeedbackState
from deepspeed_loco.utils.logging import log_rank0, logger

MIN_DEEPSPEED = "0.19.8"
TESTED_DEEPSPEED = ("0.19.8", )
REDUCE_METHOD = "_DeepSpeedZeroOptimizer_Stage3__avg_scatter_grads"
ENGINE_ATTRIBUTE = "loco_hook"


def check_deepspeed_version() -> None:
    """Fails unless the installed DeepSpeed has the stage-3 reduce this hook replaces."""
    installed = deepspeed.__version__
    if version.parse(installed) < version.parse(MIN_DEEPSPEED):
        raise RuntimeError(f"deepspeed-loco needs DeepSpeed >= {MIN_DEEPSPEED}, found {installed}; DeepSpeed "
                           f"0.16.2-0.19.7 ship their own zeropp_loco_param (use that, or upgrade DeepSpeed)")
    if not callable(getattr(DeepSpeedZeroOptimizer_Stage3, REDUCE_METHOD, None)):
        raise RuntimeError(f"deepspeed-loco cannot hook DeepSpeed {installed}: its ZeRO-3 optimizer has no "
                           f"__avg_scatter_grads (tested with {', '.join(TESTED_DEEPSPEED)}); pin one of those")
    if installed not in TESTED_DEEPSPEED:
        log_rank0(f"deepspeed-loco: DeepSpeed {installed} is untested (tested: {', '.join(TESTED_DEEPSPEED)})",
                  logging.WARNING)


def resolve_local_size(config: LocoConfig, world_size: int) -> int:
    """Ranks per node: the config's ``local_world_size``, else the launcher's, else the accelerator count."""
    if config.local_world_size is not None:
        return config.local_world_size
    for var in ("LOCAL_WORLD_SIZE", "LOCAL_SIZE"):
        if os.environ.get(var):
            return int(os.environ[var])
    return min(get_accelerator().device_count(), world_size) or 1


def describe_wire(config: LocoConfig, topology: LocoTopology) -> str:
    """The start-up line's wire figures: bytes per gradient element each hop puts on the wire, scales included, or
    ``n/a`` for a hop this layout does not have (``L == 1``: no intra-node hop; ``M == 1``: no inter-node hop)."""
    hops = (("intra-node", topology.local_size > 1, config.intra_node_bits),
            ("inter-node", topology.num_nodes > 1, config.inter_node_bits))
    figures = (f"{name} {describe_hop_cost(bits, config.group_size) if present else 'n/a'}"
               for name, present, bits in hops)
    return "wire per element: " + ", ".join(figures)


class LocoHook:
    """LoCo attached to one ZeRO-3 optimizer: its topology, error-feedback state and reducer."""

    def __init__(self, optimizer: DeepSpeedZeroOptimizer_Stage3, config: LocoConfig, named_params=None):
        self.optimizer = optimizer
        self.config = config
        group = optimizer.dp_process_group
        world_size = torch.distributed.get_world_size(group)
        self.topology = LocoTopology.build(group, resolve_local_size(config, world_size))
        self.state = ErrorFeedbackState(config, self.topology)
        self.reducer = LocoReducer(config, self.topology, self.state)
        self._group_ranks = torch.distributed.get_process_group_ranks(group)
        self._checked_groups = set()
        self._original_step = optimizer.step
        setattr(optimizer, REDUCE_METHOD, self._avg_scatter_grads)
        optimizer.step = self._step
        self.checkpoint = checkpoint.install(self, named_params)  # state_dict/load_state_dict carry self.state

    def _avg_scatter_grads(self, params: List[torch.nn.Parameter],
                           communication_data_type: torch.dtype) -> List[torch.Tensor]:
        """Mean partitions of a bucket, in the optimizer's gradient-accumulation dtype (DeepSpeed's contract)."""
        opt = self.optimizer
        opt._assert_same_partition_group(params)
        self._check_partition_group(opt._get_param_partition_group(params[0]))
        grads = [p.grad if communication_data_type == opt.dtype else p.grad.to(communication_data_type) for p in params]
        partitions = self.reducer.reduce_scatter(params, grads)
        averaging = opt._gradient_averaging_world_size(params, self.topology.world_size)
        if averaging != self.topology.world_size:
            partitions = [p.mul(self.topology.world_size / float(averaging)) for p in partitions]
        if communication_data_type != opt.gradient_accumulation_dtype:
            partitions = [p.to(opt.gradient_accumulation_dtype) for p in partitions]
        return partitions

    def _check_partition_group(self, group) -> None:
        """LoCo's subgroups were built for the data-parallel ranks; a bucket over other ranks is an error."""
        if id(group) in self._checked_groups:
            return
        if torch.distributed.get_process_group_ranks(group) != self._group_ranks:
            raise RuntimeError("deepspeed-loco: a ZeRO-3 bucket is partitioned over a process group other than the "
                               "data-parallel group LoCo was set up for (MiCS/expert groups are not supported)")
        self._checked_groups.add(id(group))

    def _step(self, *args, **kwargs):
        opt = self.optimizer
        scale_before = opt.loss_scale
        result = self._original_step(*args, **kwargs)
        if opt.overflow:
            self.state.reset()
        elif opt.loss_scale != scale_before:
            self.state.rescale(opt.loss_scale / scale_before)
        if self.state.on_optimizer_step():
            logger.debug(f"LoCo: error buffers reset at optimizer step {self.state.step} "
                         f"(reset_T={self.config.reset_T})")
        return result

    def planned_buffer_bytes(self, params) -> int:
        """Error-buffer bytes this rank will hold for ``params`` (ZeRO-3 parameters with ``ds_numel``)."""
        topo, cfg = self.topology, self.config
        if not cfg.error_feedback or topo.world_size == 1:
            return 0
        rows = (topo.world_size if topo.local_size > 1 else 0) + (topo.num_nodes if topo.num_nodes > 1 else 0)
        bytes_per_element = 1 if cfg.error_bits == 8 else 4
        scale_bytes = SCALE_BYTES / cfg.group_size if cfg.error_bits == 8 else 0
        total = 0
        for param in params:
            cols = padded_partition_size(getattr(param, "ds_numel", param.numel()), topo.world_size, cfg.group_size)
            total += int(rows * cols * (bytes_per_element + scale_bytes))
        return total

    def describe(self, params) -> str:
        """The start-up line: mode, layout, bits, group size, hadamard, the wire cost of each hop
        (:func:`describe_wire`), ``err_beta``/``reset_T``, this rank's error-buffer memory and the kernels."""
        topo, cfg = self.topology, self.config
        numel = sum(getattr(p, "ds_numel", p.numel()) for p in params)
        buffer_bytes = self.planned_buffer_bytes(params)
        kernels = kernels_for(torch.device(get_accelerator().current_device_name()))
        kernels = getattr(kernels, "__name__", type(kernels).__name__).rsplit(".", 1)[-1]
        mode = "LoCo error feedback" if cfg.error_feedback else "plain qgZ (error feedback off)"
        return (f"deepspeed-loco active: {mode}; {topo.describe()}; bits intra/inter {cfg.intra_node_bits}/"
                f"{cfg.inter_node_bits}, group {cfg.group_size}, hadamard {'on' if cfg.hadamard else 'off'}; "
                f"{describe_wire(cfg, topo)}; err_beta {cfg.err_beta}, reset_T {cfg.reset_T}; "
                f"error buffers {buffer_bytes / 2**20:.2f} MiB ({buffer_bytes / max(numel, 1):.3f} B per parameter "
                f"element, int{cfg.error_bits}) on this rank; kernels: {kernels}")


def attach(engine, config: LocoConfig) -> Optional[LocoHook]:
    """Attaches LoCo to ``engine``'s ZeRO-3 optimizer and logs what it does; the hook is ``engine.loco_hook``."""
    check_deepspeed_version()
    optimizer = engine.optimizer
    if not isinstance(optimizer, DeepSpeedZeroOptimizer_Stage3):
        raise RuntimeError(f"zero_optimization.zeropp_loco_param needs the ZeRO stage-3 optimizer, but the engine "
                           f"built {type(optimizer).__name__}")
    hook = LocoHook(optimizer, config, dict(engine.module.named_parameters()))
    params = [p for p in engine.module.parameters() if p.requires_grad]
    if hook.topology.world_size == 1:
        log_rank0("deepspeed-loco: zeropp_loco_param is set but the data-parallel world has one rank: nothing is "
                  "communicated, so LoCo does nothing in this run", logging.WARNING)
    else:
        log_rank0(hook.describe(params))
    setattr(engine, ENGINE_ATTRIBUTE, hook)
    return hook
