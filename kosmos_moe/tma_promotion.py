"""L2 promotion of TMA weight descriptors: how much the L2 cache fetches per TMA miss.

Triton (3.6) encodes every host tensor descriptor with ``CU_TENSOR_MAP_L2_PROMOTION_L2_128B``
and offers no way to choose. A forward tile's k-step reads 128 bytes of each weight row (64
bf16 columns), so every miss brings exactly that step's bytes; with 256-byte promotion a miss
also brings the row's next step into L2, ahead of its TMA copy. Kernels that stream expert
weights from HBM (DeepGEMM's among them) encode their descriptors that way.

:func:`promote` marks a descriptor. At each launch Triton turns a descriptor argument into a
``CUtensorMap`` in Python (``triton.backends.nvidia.driver.make_tensordesc_arg``); the hook
:func:`install` puts around it encodes the same map again through the driver
(``cuTensorMapEncodeTiled``) with the marked promotion and writes it over Triton's. It first
encodes Triton's own map the same way and checks the bytes are equal, so a Triton whose
encoding differs from this module's reading of it keeps its own maps (with one warning) and is
never given a map that disagrees with it in anything but the promotion.
"""

from __future__ import annotations

import ctypes
import logging
import threading

from .residency import _libcuda

log = logging.getLogger(__name__)

#: Bytes per L2 fetch -> ``CUtensorMapL2promotion``.
PROMOTIONS = {0: 0, 64: 1, 128: 2, 256: 3}
TRITON_PROMOTION = 128  # what Triton encodes
_MAP_BYTES = 128
_ATTRIBUTE = "_kosmos_l2_promotion"

_lock = threading.Lock()
_installed = False
_disabled: str | None = None  # why the hook leaves Triton's maps alone
_encoded: dict[tuple, bytes] = {}
_offset: int | None = None  # of the 128-byte map inside Triton's PyCUtensorMap object
rewrites = 0  # maps re-encoded so far (the GPU tests check the hook ran)


def promote(descriptor, nbytes: int):
    """Mark a host ``TensorDescriptor`` to be launched with ``nbytes`` L2 promotion; return it.

    A plain attribute, so Triton's specialisation and ``direct_launch``'s traits see an
    ordinary descriptor. 128 (Triton's own) leaves it as it is.
    """
    if nbytes not in PROMOTIONS:
        raise ValueError(f"L2 promotion must be one of {sorted(PROMOTIONS)} bytes, not {nbytes}")
    if nbytes != TRITON_PROMOTION:
        install()
        setattr(descriptor, _ATTRIBUTE, nbytes)
    return descriptor


def install() -> bool:
    """Put the re-encoding hook around Triton's descriptor arguments (once); False where this
    Triton has no such step (the descriptors then keep Triton's promotion)."""
    global _installed, _disabled
    with _lock:
        if _installed:
            return _disabled is None
        _installed = True
        try:
            from triton.backends.nvidia import driver
        except ImportError as exc:
            _disabled = f"no Triton NVIDIA driver ({exc})"
            log.warning("L2 promotion of TMA descriptors unavailable: %s", _disabled)
            return False
        original = getattr(driver, "make_tensordesc_arg", None)
        if original is None:
            _disabled = "this Triton has no driver.make_tensordesc_arg"
            log.warning("L2 promotion of TMA descriptors unavailable: %s", _disabled)
            return False

        # Triton 3.8 added a third argument to this step; pass through whatever it is given.
        def make_tensordesc_arg(arg, metadata, *rest):
            out = original(arg, metadata, *rest)
            nbytes = getattr(arg, _ATTRIBUTE, None)
            if nbytes is not None and metadata is not None and _disabled is None:
                _rewrite(out[0], arg, metadata, nbytes)
            return out

        driver.make_tensordesc_arg = make_tensordesc_arg
        return True


def _encode(arg, metadata, promotion: int) -> bytes:
    """``cuTensorMapEncodeTiled`` with the arguments Triton's ``fill_tma_descriptor`` passes
    for ``arg`` under ``metadata``, but ``promotion`` bytes of L2 promotion."""
    from triton.backends.nvidia.driver import TMA_DTYPE_DEVICE_TO_HOST

    if metadata.get("fp4_padded"):
        raise ValueError("fp4-padded descriptors are not re-encoded")
    elem = metadata["elem_size"]
    block = list(metadata["block_size"])
    shape, strides = [int(s) for s in arg.shape], [int(s) for s in arg.strides]
    rank = len(shape)
    # The driver lists dimensions innermost first, and strides in bytes without the innermost.
    dims = (ctypes.c_uint64 * 5)(*reversed(shape))
    byte_strides = (ctypes.c_uint64 * 5)(*[elem * s for s in reversed(strides[:-1])])
    box = (ctypes.c_uint32 * 5)(*reversed(block))
    element_strides = (ctypes.c_uint32 * 5)(1, 1, 1, 1, 1)
    oob_fill = 1 if arg.padding == "nan" else 0  # NAN_REQUEST_ZERO_FMA, else NONE
    out = (ctypes.c_uint8 * (2 * _MAP_BYTES))()
    aligned = (ctypes.addressof(out) + _MAP_BYTES - 1) // _MAP_BYTES * _MAP_BYTES
    fn = _libcuda().cuTensorMapEncodeTiled
    fn.restype = ctypes.c_int
    status = fn(
        ctypes.c_void_p(aligned), ctypes.c_int(TMA_DTYPE_DEVICE_TO_HOST[metadata["elem_type"]]),
        ctypes.c_uint32(rank), ctypes.c_void_p(arg.base.data_ptr()), dims, byte_strides, box, element_strides,
        ctypes.c_int(0), ctypes.c_int(metadata["swizzle"]), ctypes.c_int(PROMOTIONS[promotion]), ctypes.c_int(oob_fill),
    )
    if status != 0:
        raise RuntimeError(f"cuTensorMapEncodeTiled failed with CUresult {status}")
    return ctypes.string_at(aligned, _MAP_BYTES)


def _object_memory(tensor_map) -> tuple[int, int]:
    """Address and size of Triton's ``PyCUtensorMap`` object (CPython: ``id`` is the address;
    the map sits in the object's struct, 128-byte aligned)."""
    return id(tensor_map), type(tensor_map).__basicsize__


def _rewrite(tensor_map, arg, metadata, nbytes: int) -> None:
    global _disabled, _offset, rewrites
    key = (arg.base.data_ptr(), tuple(arg.shape), tuple(arg.strides), tuple(metadata["block_size"]),
           metadata["swizzle"], metadata["elem_type"], arg.padding, nbytes)
    ours = _encoded.get(key)
    if ours is None:
        try:
            theirs = _encode(arg, metadata, TRITON_PROMOTION)
            ours = _encode(arg, metadata, nbytes)
        except (KeyError, ValueError, RuntimeError, OSError) as exc:
            _disabled = f"re-encoding failed ({exc})"
            log.warning("L2 promotion of TMA descriptors disabled: %s", _disabled)
            return
        address, size = _object_memory(tensor_map)
        where = ctypes.string_at(address, size).find(theirs)
        if where < 0 or (_offset is not None and where != _offset):
            _disabled = "Triton's tensor map differs from this module's encoding of the same descriptor"
            log.warning("L2 promotion of TMA descriptors disabled: %s", _disabled)
            return
        _offset = where
        _encoded[key] = ours
    ctypes.memmove(_object_memory(tensor_map)[0] + _offset, ours, _MAP_BYTES)
    rewrites += 1


def status() -> str | None:
    """Why marked descriptors keep Triton's promotion (None while the hook works)."""
    return _disabled
