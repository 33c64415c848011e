"""kosmos_moe.tma_promotion's hook around Triton's descriptor arguments, on the CPU.

The driver's encoding needs a GPU (tests/test_fused_gpu.py::test_weight_l2_promotion runs the
real one); here ``_encode`` and the tensor map's memory are stand-ins, so what is checked is
the hook's own logic: marked descriptors only, Triton's map verified before it is replaced,
the replacement where Triton's map was and nowhere else, and no replacement at all once
Triton's map is not what this module would have encoded; each with the descriptor step taking
Triton 3.6's two arguments and 3.8's three (the hook once took two and broke every launch there).
"""

import ctypes
import inspect
import logging
from types import SimpleNamespace

import pytest
import torch
from triton.tools.tensor_descriptor import TensorDescriptor

from kosmos_moe import tma_promotion as tp
from kosmos_moe.workspace import GPU_TILES, Tiles

META = {"swizzle": 3, "elem_size": 2, "elem_type": 6, "block_size": [16, 16], "fp4_padded": False}
THEIRS, OURS = b"T" * 128, b"O" * 128


def installed_arity() -> int:
    """Positional arguments the installed Triton's descriptor step takes (2 in Triton 3.6, 3
    from 3.8)."""
    try:
        from triton.backends.nvidia import driver
    except ImportError:  # no NVIDIA backend: the fixture's own import reports it
        return 2
    return len(inspect.signature(driver.make_tensordesc_arg).parameters)


# Triton's launcher calls the step with this many arguments (every Triton the hook may meet).
@pytest.fixture(params=sorted({2, 3, installed_arity()}))
def driver(monkeypatch, request):
    """The NVIDIA driver module's descriptor step with a stand-in for Triton's encoding taking
    the fixture's number of arguments, fresh hook state (all restored afterwards), and the
    stand-in map's memory."""
    from triton.backends.nvidia import driver

    memory = (ctypes.c_uint8 * 256)()
    arity = request.param

    def triton_encoding(arg, metadata, *rest):  # the map object, then shape and strides
        assert len(rest) == arity - 2, f"Triton's step takes {arity} arguments, got {2 + len(rest)}"
        ctypes.memmove(ctypes.addressof(memory) + 128, THEIRS, 128)
        return ["map", *arg.shape, *arg.strides]

    monkeypatch.setattr(driver, "make_tensordesc_arg", triton_encoding)
    for name, value in (("_installed", False), ("_disabled", None), ("_encoded", {}), ("_offset", None),
                        ("rewrites", 0)):
        monkeypatch.setattr(tp, name, value)
    monkeypatch.setattr(tp, "_object_memory", lambda tensor_map: (ctypes.addressof(memory), 256))
    monkeypatch.setattr(tp, "_encode", lambda arg, metadata, promotion: THEIRS if promotion == 128 else OURS)
    extra = (None,) * (arity - 2)
    call = lambda arg, meta: driver.make_tensordesc_arg(arg, meta, *extra)  # as the launcher does
    return SimpleNamespace(module=driver, memory=memory, call=call)


def descriptor():
    return TensorDescriptor.from_tensor(torch.zeros(64, 64, dtype=torch.bfloat16), [16, 16])


def test_promote_checks_the_size_and_leaves_triton_s_own_alone(driver):
    with pytest.raises(ValueError, match="L2 promotion must be one of"):
        tp.promote(descriptor(), 100)
    d = tp.promote(descriptor(), 128)
    assert not hasattr(d, tp._ATTRIBUTE) and not tp._installed


def test_marked_descriptor_gets_the_promoted_map_in_place(driver):
    d = tp.promote(descriptor(), 256)
    out = driver.call(d, META)
    assert out == ["map", 64, 64, 64, 1]
    raw = bytes(driver.memory)
    assert raw[128:] == OURS and raw[:128] == bytes(128), "the map must be replaced where Triton's was, only there"
    assert tp.rewrites == 1 and tp.status() is None
    # A second launch of the same descriptor: Triton makes a fresh map, which is replaced again.
    driver.call(d, META)
    assert bytes(driver.memory)[128:] == OURS and tp.rewrites == 2


def test_unmarked_descriptors_and_unlowered_ones_keep_triton_s_map(driver):
    tp.install()
    driver.call(descriptor(), META)
    driver.call(tp.promote(descriptor(), 256), None)  # no descriptor metadata: no map
    assert bytes(driver.memory)[128:] == THEIRS and tp.rewrites == 0


def test_a_map_unlike_this_module_s_encoding_is_never_replaced(driver, monkeypatch, caplog):
    monkeypatch.setattr(tp, "_encode", lambda arg, metadata, promotion: b"X" * 128 if promotion == 128 else OURS)
    d = tp.promote(descriptor(), 256)
    with caplog.at_level(logging.WARNING, logger="kosmos_moe.tma_promotion"):
        driver.call(d, META)
        driver.call(d, META)
    assert bytes(driver.memory)[128:] == THEIRS and tp.rewrites == 0
    assert "differs" in tp.status()
    assert sum("disabled" in r.message for r in caplog.records) == 1


def test_tiles_promotion_is_checked():
    assert GPU_TILES.weight_l2_promotion == 256
    for bad in (100, 512):
        with pytest.raises(ValueError, match="weight_l2_promotion"):
            Tiles(weight_l2_promotion=bad)
    assert Tiles(weight_l2_promotion=0).weight_l2_promotion == 0
