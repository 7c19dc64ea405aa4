"""A pure-PyTorch stand-in for the few parts of NVIDIA Apex that Megatron-DeepSpeed imports on CUDA.

Megatron-DeepSpeed imports ``apex.optimizers.FusedAdam``, ``apex.normalization`` (fused layer norm, RMS norm),
``apex.multi_tensor_apply`` and the compiled modules ``amp_C`` and ``fused_layer_norm_cuda`` whenever DeepSpeed's
accelerator is CUDA. Apex has no wheel and its CUDA build takes tens of minutes, so a short run (a GPU machine
without a package index, ``benchmarks/device_megatron.sh``) puts ``examples/megatron/compat/apex_standin`` on
``PYTHONPATH`` instead; ``examples/megatron/ds_pretrain_gpt_tiny_loco.sh`` does so only when the real Apex (its
compiled ``amp_C`` and ``fused_layer_norm_cuda``) cannot be imported. Each piece computes what Apex's does
with stock PyTorch operations: slower, the same up to rounding. ``FusedAdam`` is ``torch.optim.AdamW``, which
ZeRO-3 steps on its fp32 partitions (gradient clipping is DeepSpeed's under ``--deepspeed``). Not part of the
``deepspeed_loco`` package; install the real Apex for anything but a smoke run.
"""
