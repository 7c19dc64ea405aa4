"""Op builders of deepspeed-loco (DeepSpeed ``CUDAOpBuilder`` subclasses)."""
from deepspeed_loco.ops.op_builder.loco import LocoBuilder, csrc_dir

__all__ = ["LocoBuilder", "csrc_dir"]
