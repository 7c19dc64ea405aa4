"""The fused CUDA kernels of the ``deepspeed_loco`` ops: the ``loco_ops`` extension
(``deepspeed_loco/csrc/quantization``, built by :class:`deepspeed_loco.ops.op_builder.LocoBuilder`). Loading it
registers the ops' CUDA implementations, one kernel launch per op call, for the CUDA dispatch key
(``deepspeed_loco/csrc/quantization/README.md``); the module itself exports ``limits()``.
"""
_extension = None


def load():
    """Builds (the first time, with ninja) and loads the ``loco_ops`` extension, once per process; raises if that
    fails. Returns the extension module."""
    global _extension
    if _extension is None:
        from deepspeed_loco.ops.op_builder import LocoBuilder
        _extension = LocoBuilder().load(verbose=False)
    return _extension
