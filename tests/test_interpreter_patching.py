"""The interpreter shortcut every CPU kernel test runs under (tests/interpreter_patching.py)
is active with the pinned Triton, and changes no result: one fused forward and backward,
in a process with it and in one without, agree bitwise."""

import os

import torch
import torch.multiprocessing as mp

import interpreter_patching
from fused_cases import CASES, build, tokens


def _forward_backward(rank, patched, path):
    os.environ["TRITON_INTERPRET"] = "1"  # before Triton decorates the kernels
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    if patched:
        assert interpreter_patching.install(), "the shortcut no longer finds the interpreter's pieces"
    counts, hidden = CASES["softmax_shared"]["counts"][:1], CASES["softmax_shared"]["shape"]["hidden_size"]
    _, fused = build(1, "softmax_shared", "none", max_tokens=max(counts))
    x = tokens(counts, hidden, seed=1, positive=False)[0].requires_grad_(True)
    out = fused(x)
    out.backward(torch.randn(out.shape, generator=torch.Generator().manual_seed(0)))
    torch.save({"out": out.detach(), "x.grad": x.grad,
                **{name: p.grad for name, p in fused.named_parameters()}}, path)


def test_shortcut_changes_no_result(tmp_path):
    results = []
    for patched in (True, False):
        path = str(tmp_path / f"patched_{patched}.pt")
        saved = os.environ.get("TRITON_INTERPRET")
        os.environ["TRITON_INTERPRET"] = "1"
        try:
            mp.spawn(_forward_backward, args=(patched, path), nprocs=1, join=True)
        finally:
            if saved is None:
                os.environ.pop("TRITON_INTERPRET")
            else:
                os.environ["TRITON_INTERPRET"] = saved
        results.append(torch.load(path))
    with_shortcut, without = results
    assert with_shortcut.keys() == without.keys()
    for name in with_shortcut:
        assert torch.equal(with_shortcut[name], without[name]), f"{name} differs with the shortcut"
