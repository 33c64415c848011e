"""Which matrix products a piece of code runs, as cuBLAS would see them.

In an emulated world (kosmos_moe.fabric.EmulatedWorld) the host may run, between the ranks'
launches, only GEMMs the world's rehearsal ran: a cuBLAS kernel the process has not loaded yet
holds the host until the device's running kernels end. Tests compare the products of the fused
path with those of the rehearsal through this record. Shapes, strides and dtype are what it
sees; cuBLAS also chooses by pointer alignment, which it does not.
"""

import re

import torch
from torch.utils._python_dispatch import TorchDispatchMode


class ProductOps(TorchDispatchMode):
    """Within: ``seen`` collects every product op (in-place and fused forms included: addmm_,
    baddbmm, addmv, addr, dot, _grouped_mm, ...) with its operands' shapes, strides and dtypes."""

    PRODUCT = re.compile(r"mm|mv|dot|addr")

    def __init__(self) -> None:
        super().__init__()
        self.seen: set = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func.overloadpacket.__name__
        if self.PRODUCT.search(name):
            operands = tuple((tuple(a.shape), a.stride(), a.dtype) if isinstance(a, torch.Tensor) else a
                             for a in args)
            self.seen.add((name, operands, tuple(sorted(kwargs.items()))))
        return func(*args, **kwargs)
