"""What autograd keeps between a layer's forward and backward, in bytes."""

from __future__ import annotations

import torch
from torch import nn


def saved_bytes(step, module: nn.Module) -> int:
    """Bytes of the tensors autograd saves during ``step()``; weights (and views of them) and duplicates excluded."""
    weights = {p.untyped_storage().data_ptr() for p in module.parameters()}
    seen, total = set(), 0

    def pack(t):
        nonlocal total
        if t.untyped_storage().data_ptr() not in weights:
            key = (t.untyped_storage().data_ptr(), t.storage_offset(), t.numel())
            if key not in seen:
                seen.add(key)
                total += t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        step()
    return total
