"""``apex.optimizers.FusedAdam`` / ``FusedSGD``: stock ``torch.optim`` optimizers built from Apex's arguments.

Factories, not subclasses: the object is exactly ``torch.optim.AdamW`` (Apex's default ``adam_w_mode=True``,
decoupled weight decay), ``torch.optim.Adam`` (``adam_w_mode=False``, L2 weight decay) or ``torch.optim.SGD``, so
DeepSpeed's ZeRO accepts it as a supported client optimizer (it checks the exact type). See ``apex/__init__.py``.
"""
import torch


def FusedAdam(params, lr=1e-3, bias_correction=True, betas=(0.9, 0.999), eps=1e-8, adam_w_mode=True,
              weight_decay=0.0, amsgrad=False, set_grad_none=True, capturable=False, master_weights=False):
    if not bias_correction:
        raise ValueError("apex stand-in: FusedAdam(bias_correction=False) has no torch.optim equivalent")
    cls = torch.optim.AdamW if adam_w_mode else torch.optim.Adam
    return cls(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, amsgrad=amsgrad)


def FusedSGD(params, lr=1e-3, momentum=0.0, dampening=0.0, weight_decay=0.0, nesterov=False,
             wd_after_momentum=False, materialize_master_grads=True, set_grad_none=False):
    return torch.optim.SGD(params, lr=lr, momentum=momentum, dampening=dampening, weight_decay=weight_decay,
                           nesterov=nesterov)
