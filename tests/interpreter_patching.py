"""Triton's interpreter, without re-patching ``triton.language`` at every device-function call.

Under ``TRITON_INTERPRET=1`` a kernel launch patches the language module's builtins once for
the launch (``GridExecutor`` calls ``_patch_lang`` and restores it at the end), and then every
call of a ``@triton.jit`` helper inside the kernel patches them again, walking the modules
with ``inspect.getmembers``. The persistent kernels call small helpers in every pass (claims,
picks, signals) and the re-patching dominated: one fused forward and backward of a world of
one rank (tests/test_fused_backward_cpu.py's softmax_shared case) took 3.7 s on the CI
machine, 2.3 s without it, with bitwise the same results. A re-patch inside a launch that
already patched the same modules changes nothing: those patches are in place until the
launch's restore at the end. So inside a launch, a helper whose modules are patched skips
it. The kernels run unchanged.

If Triton's interpreter no longer has the pieces this relies on, :func:`install` does nothing.
"""

from __future__ import annotations

import functools
import inspect


@functools.lru_cache(maxsize=None)
def _language_modules(fn) -> frozenset[int]:
    """The language modules ``_patch_lang(fn)`` patches (those among ``fn``'s globals); asked at
    every helper call, so kept per function."""
    import triton.language as tl

    return frozenset(id(v) for v in fn.__globals__.values() if inspect.ismodule(v) and v in (tl, tl.core))


def install() -> bool:
    """Install the shortcut in this process; return whether it is active."""
    try:
        from triton.runtime import interpreter
    except ImportError:
        return False
    executor = getattr(interpreter, "GridExecutor", None)
    patch_lang = getattr(interpreter, "_patch_lang", None)
    scope_type = getattr(interpreter, "_LangPatchScope", None)
    if executor is None or patch_lang is None or scope_type is None:
        return False
    if getattr(patch_lang, "_kosmos_shortcut", False):
        return True

    launches: list[frozenset[int] | None] = []  # per running launch: the modules patched so far (None: none yet)

    original_call = executor.__call__

    @functools.wraps(original_call)
    def call(self, *args, **kwargs):
        launches.append(None)
        try:
            return original_call(self, *args, **kwargs)
        finally:
            launches.pop()

    @functools.wraps(patch_lang)
    def patch(fn):
        if not launches:
            return patch_lang(fn)
        modules = _language_modules(fn)
        if launches[-1] is not None and modules <= launches[-1]:
            return scope_type()  # nothing patched, nothing to restore
        # The launch's own patch, or a helper seeing another module (``triton.language.core``
        # from the standard library's helpers): patched now, it stays patched for the launch.
        scope = patch_lang(fn)
        launches[-1] = modules | (launches[-1] or frozenset())
        return scope

    patch._kosmos_shortcut = True
    executor.__call__ = call
    interpreter._patch_lang = patch
    return True
