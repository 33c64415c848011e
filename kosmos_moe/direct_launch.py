"""Launch compiled Triton kernels without Triton's per-call argument binding.

``kernel[grid](*args, **constants)`` binds and specialises every argument on every call and
builds the compiled kernel's cache key from them. The persistent kernels take some forty
arguments and sixty compile-time constants, and that work precedes the launch: the GPU waits
for it whenever the stream has run dry, as in a synchronised call. A ``DirectLauncher``
takes Triton's path the first time it sees a combination of argument traits, keeps the
compiled kernel it returns, and afterwards hands the arguments straight to that kernel's
launcher, which is what Triton itself does last.

The traits are everything Triton specialises a kernel on, kept finer where in doubt: tensor
dtypes and 16-byte alignment, integer ranges, equality to one and divisibility by 16,
tensor descriptors' dtype, block, shape and strides, and every compile-time constant. Two
calls with the same traits compile to the same kernel, so a finer key only costs an extra
trip through Triton's path, which then finds its own cached kernel.
"""

from __future__ import annotations

import dataclasses
import inspect
import logging

import torch

log = logging.getLogger(__name__)

_INT32 = range(-(2**31), 2**31)


def _trait(value) -> tuple | None:
    """What Triton specialises a kernel on for ``value``; None for a value this module does not know."""
    if isinstance(value, torch.Tensor):
        return (value.dtype, value.data_ptr() % 16 == 0, value.device.index)
    if isinstance(value, bool):
        return (bool, value)
    if isinstance(value, int):
        return (int, value == 1, value % 16 == 0, value in _INT32, value >= 2**63)
    if isinstance(value, float):
        return (float,)
    if dataclasses.is_dataclass(value) and isinstance(getattr(value, "base", None), torch.Tensor):
        # A host tensor descriptor: its base's traits and every other field (block, shape,
        # strides, padding, and whatever else this Triton's descriptor carries).
        fields = []
        for f in dataclasses.fields(value):
            v = getattr(value, f.name)
            fields.append(_trait(v) if f.name == "base" else tuple(v) if isinstance(v, list) else v)
        return (type(value), *fields)
    return None


class DirectLauncher:
    """Launches one ``@triton.jit`` kernel, through Triton the first time per argument traits."""

    def __init__(self, kernel) -> None:
        self.kernel = kernel
        self._compiled: dict[tuple, object] = {}
        self._names = list(kernel.arg_names)
        # Compile-time constants a call may leave to their defaults (the backward kernel's MODE):
        # Triton fills them in; the direct path must too.
        signature = getattr(kernel, "signature", None)
        self._defaults = {} if signature is None else {
            name: p.default for name, p in signature.parameters.items() if p.default is not inspect.Parameter.empty}
        self.enabled = True

    def __call__(self, grid: tuple[int, ...], args: tuple, constants: dict, check=None) -> None:
        """Launch; ``check(compiled)`` runs before the first launch of each compiled kernel
        (``kosmos_moe.residency.require_resident``) and may refuse it by raising."""
        key = self._key(grid, args, constants) if self.enabled else None
        compiled = self._compiled.get(key) if key is not None else None
        if compiled is None:
            if check is not None:
                compiled = self.kernel.run(*args, grid=grid, warmup=True, **constants)
                compiled._init_handles()
                check(compiled)
            compiled = self.kernel[grid](*args, **constants)
            if key is not None:
                self._compiled[key] = compiled
            return
        try:
            self._launch(compiled, grid, args, constants)
        except (AttributeError, KeyError, TypeError) as exc:  # a Triton whose internals differ
            log.warning("direct launch of %s failed (%s); launching through Triton from now on",
                        getattr(self.kernel, "__name__", self.kernel), exc)
            self.enabled = False
            self.kernel[grid](*args, **constants)

    def _key(self, grid, args, constants) -> tuple | None:
        traits = tuple(_trait(a) for a in args)
        if None in traits:
            return None
        try:
            # A compiled kernel's module is loaded on one device.
            return (grid, self.current_device(), traits, tuple(constants.items()))
        except TypeError:  # an unhashable constant
            return None

    @staticmethod
    def current_device() -> int:
        return torch.cuda.current_device()

    @staticmethod
    def current_stream() -> int:
        return torch.cuda.current_stream().cuda_stream

    def _launch(self, compiled, grid, args, constants) -> None:
        from triton import knobs

        # Every parameter in order, compile-time constants included (the launcher skips those).
        values = list(args) + [constants[name] if name in constants else self._defaults[name]
                               for name in self._names[len(args):]]
        stream = self.current_stream()
        grid = tuple(grid) + (1,) * (3 - len(grid))
        metadata = compiled.launch_metadata(grid, stream, *values)
        compiled.run(grid[0], grid[1], grid[2], stream, compiled.function, compiled.packed_metadata, metadata,
                     knobs.runtime.launch_enter_hook, knobs.runtime.launch_exit_hook, *values)
