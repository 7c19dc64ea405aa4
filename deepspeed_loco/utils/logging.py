"""deepspeed-loco's logger ``deepspeed_loco``: INFO by default (DeepSpeed's own logger shows WARNING and up), so
the one start-up line saying what LoCo does is visible; lower it with ``logging.getLogger("deepspeed_loco")``."""
import logging

import torch.distributed as dist
from deepspeed.utils.logging import LoggerFactory

logger = LoggerFactory.create_logger(name="deepspeed_loco", level=logging.INFO)


def log_rank0(message: str, level: int = logging.INFO) -> None:
    """Logs ``message`` on global rank 0 only (or always, outside a distributed run)."""
    if not dist.is_initialized() or dist.get_rank() == 0:
        logger.log(level, message)
