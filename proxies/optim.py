"""AdamW on fp32 master weights, and the learning-rate schedule.

Mixed precision: the model's parameters are in the compute dtype (bf16 on the GPU), because
``ExpertLayer`` requires its input dtype to equal its weights' and both kernels read bf16
weights directly. Autocast would not help: it keeps fp32 parameters and casts per op, which
the expert layer does not do. So each low-precision parameter has an fp32 master copy, which
the optimizer owns. One step:

1. backward leaves bf16 gradients on the model;
2. they are cast to fp32 into the masters' ``.grad`` (then reduced over ranks and clipped in
   fp32, so that neither the reduction nor Adam's moments lose bits to bf16);
3. AdamW updates the fp32 masters (moments in fp32);
4. the masters are rounded back into the bf16 model parameters.

Updates far below a bf16 ulp of a weight thus accumulate in the master instead of vanishing.
Where the model is already fp32 (the CPU), the master *is* the parameter: no copy, no cast.
"""

from __future__ import annotations

import math

import torch
from torch import nn


class MasterWeights:
    def __init__(self, model: nn.Module) -> None:
        self.names: list[str] = []
        self.params: list[nn.Parameter] = []
        self.masters: list[torch.Tensor] = []
        for name, p in model.named_parameters():
            self.names.append(name)
            self.params.append(p)
            if p.dtype == torch.float32:
                self.masters.append(p)
            else:
                self.masters.append(p.detach().float().clone().requires_grad_(True))

    @property
    def distinct(self) -> bool:
        """Whether the masters are copies (a low-precision model)."""
        return any(m is not p for m, p in zip(self.masters, self.params))

    def named_masters(self) -> list[tuple[str, torch.Tensor]]:
        return list(zip(self.names, self.masters))

    @torch.no_grad()
    def grads_to_master(self) -> list[tuple[str, torch.Tensor]]:
        """Move the model's gradients to the masters as fp32 (zeros where none); return them."""
        out = []
        for name, p, m in zip(self.names, self.params, self.masters):
            if p.grad is None:
                m.grad = torch.zeros_like(m)
            elif m is not p:
                m.grad = p.grad.float()
                p.grad = None
            out.append((name, m.grad))
        return out

    @torch.no_grad()
    def copy_to_model(self) -> None:
        for p, m in zip(self.params, self.masters):
            if m is not p:
                p.copy_(m)

    def zero_grad(self) -> None:
        for p, m in zip(self.params, self.masters):
            p.grad = None
            m.grad = None


def decay_split(tensors: list[torch.Tensor]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """(decayed, not decayed), AdamW's two parameter groups in step order: matrices decay,
    vectors (norm weights, the router's correction bias) do not."""
    return [t for t in tensors if t.dim() >= 2], [t for t in tensors if t.dim() < 2]


def build_adamw(masters: MasterWeights, lr: float, weight_decay: float, betas=(0.9, 0.95), eps: float = 1e-8,
                foreach: bool | None = None):
    """AdamW over the masters, grouped by :func:`decay_split`.

    ``foreach=None`` is torch's default implementation: multi-tensor on the GPU, the per-tensor
    loop on the CPU; both are deterministic, so a resumed run repeats the same updates."""
    decay, no_decay = decay_split(masters.masters)
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=lr, betas=betas, eps=eps, foreach=foreach)


def lr_at(step: int, *, lr: float, warmup: int, total: int, schedule: str, min_lr_ratio: float) -> float:
    """Learning rate of optimizer step ``step`` (1-based): linear warmup, then constant or cosine."""
    if warmup > 0 and step <= warmup:
        return lr * step / warmup
    if schedule == "constant":
        return lr
    if schedule != "cosine":
        raise ValueError(f"unknown schedule {schedule!r}")
    span = max(1, total - warmup)
    progress = min(1.0, (step - warmup) / span)
    return lr * (min_lr_ratio + (1 - min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))
