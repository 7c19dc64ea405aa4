"""The ``amp_C`` ops Megatron-DeepSpeed calls through ``multi_tensor_applier``, in PyTorch (see
``apex/__init__.py``)."""
import torch


def _flag_if_not_finite(noop_flag, tensors):
    if any(not torch.isfinite(t).all() for t in tensors):
        noop_flag.fill_(1)


def multi_tensor_scale(noop_flag, tensor_lists, scale):
    """``out = in * scale`` for each pair of ``tensor_lists = [ins, outs]``; flags non-finite inputs."""
    ins, outs = tensor_lists
    _flag_if_not_finite(noop_flag, ins)
    for src, dst in zip(ins, outs):
        dst.copy_(src.float() * scale)


def multi_tensor_l2norm(noop_flag, tensor_lists, per_tensor):
    """``(total L2 norm, per-tensor norms or an empty tensor)`` of ``tensor_lists[0]``, in float32."""
    tensors = tensor_lists[0]
    device = tensors[0].device if tensors else noop_flag.device
    norms = torch.stack([t.float().norm() for t in tensors]) if tensors else torch.zeros(0, device=device)
    total = norms.norm().reshape(1)
    return total, (norms if per_tensor else torch.zeros(0, device=device))


def multi_tensor_adam(*_args, **_kwargs):
    raise NotImplementedError("apex shim: amp_C.multi_tensor_adam; FusedAdam here is torch.optim.AdamW")
