"""Workspaces shared by the fused layers of a model.

Each fused layer needs a forward workspace and, when it trains, a backward one, sized for the
worst case (:mod:`kosmos_moe.workspace`): 2.8 GiB per DeepSeek-V3 layer at 4096 tokens on one
rank, 15.5 GiB at EP=8. Nothing in them outlives a call: the backward rebuilds its layout from
the forward's saved choices, and a call's results are copied out before it returns. So the
layers of a model, which run one after another on a rank's stream, can all use one workspace
per direction and layout, as DeepEP's layers share one buffer:

    pool = kosmos_moe.share_workspaces(model)   # before the model's first call, on every rank

Every rank must share the same way (they build the same model), since a workspace is made by a
collective. Layers that run concurrently (on different streams) must not share.
"""

from __future__ import annotations

from torch import nn

from .fabric import Fabric, Workspace
from .workspace import WorkspaceLayout


class WorkspacePool:
    """One workspace per (direction, fabric domain, layout), made at its first request.

    Pass it to layers as ``fused_options={"workspace_pool": pool}``, or let
    :func:`share_workspaces` do so. A call that leaves a shared workspace inconsistent (a
    timeout) fails every layer that uses it, including layers that have not run yet: rebuild
    them with a new pool.
    """

    def __init__(self) -> None:
        self._workspaces: dict[tuple, Workspace] = {}

    def workspace(self, fabric: Fabric, layout: WorkspaceLayout, direction: str) -> Workspace:
        key = (direction, fabric.domain(), layout.key())
        if key not in self._workspaces:
            self._workspaces[key] = fabric.workspace(layout.nbytes)  # a collective: every rank asks alike
        return self._workspaces[key]

    def __len__(self) -> int:
        return len(self._workspaces)

    def __getstate__(self) -> dict:
        # Pickled (with a model) or copied on its own, a pool comes back empty: workspaces are
        # process-local, and the layers that shared it share the new one.
        return {"_workspaces": {}}

    @property
    def nbytes(self) -> int:
        """Bytes of this rank's workspaces in the pool."""
        return sum(w.local.numel() for w in self._workspaces.values())


def share_workspaces(model: nn.Module, pool: WorkspacePool | None = None) -> WorkspacePool:
    """Let every ``backend="kosmos"`` :class:`~kosmos_moe.ExpertLayer` in ``model`` use
    ``pool`` (a new one by default) for its workspaces; return the pool. Call it before the
    layers' first calls, on every rank."""
    from .layer import ExpertLayer

    pool = pool if pool is not None else WorkspacePool()
    for name, module in model.named_modules():
        if not isinstance(module, ExpertLayer) or module.backend != "kosmos":
            continue
        if module._fused is not None and module._fused.workspace is not None:
            raise ValueError(f"{name or 'the layer'} has run already and holds its own workspace: share the "
                             "workspaces before the model's first call")
        module._fused_options["workspace_pool"] = pool
        module._fused = None  # rebuilt with the pool at the first call
    return pool
