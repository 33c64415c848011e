"""@triton.jit code of kosmos-moe, installed as ``kosmos_moe.kernels``.

Nothing here knows about nn.Module or torch.distributed: kernels take tensors, a peer-address
table and the local rank.
"""

if __name__ == "kernels":
    # This directory was imported under the top-level name `kernels`: a source checkout's root
    # is on sys.path (`python -m pytest` from it, say). That name belongs to the PyPI package
    # `kernels` (Hugging Face's hub kernels, a dependency of transformers >= 5.25, which imports
    # it whenever it is installed). Load that package in this one's place, so a checkout does
    # not shadow it; `import kernels` then returns it.
    import importlib.machinery as _machinery
    import importlib.util as _util
    import os as _os
    import sys as _sys

    _root = _os.path.dirname(_os.path.dirname(_os.path.abspath(__file__)))
    _elsewhere = [p for p in _sys.path if _os.path.abspath(p or _os.getcwd()) != _root]
    _spec = _machinery.PathFinder.find_spec("kernels", _elsewhere)
    if _spec is not None and _spec.loader is not None:
        _module = _util.module_from_spec(_spec)
        _sys.modules["kernels"] = _module
        _spec.loader.exec_module(_module)
