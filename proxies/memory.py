"""The memory a training run holds per rank at its optimizer step, known before the model is built.

The optimizer step is where the training state peaks (the activations are freed by then):

- the weights, in the compute dtype;
- fp32 masters where the weights are low precision (``proxies.optim.MasterWeights``);
- fp32 gradients on the masters (``MasterWeights.grads_to_master``; the bf16 gradients are
  freed one by one as they move, so the two never coexist whole);
- AdamW's two fp32 moments, made at the first step and kept;
- AdamW's temporaries: torch's multi-tensor implementation, its default on the GPU, makes
  ``sqrt(second moment)`` for a whole parameter group at once and frees it before the next
  group's update, so the largest group's temporary adds to everything above; the per-tensor
  loop, its default on the CPU, holds two temporaries of one tensor at a time (the square root
  and its quotient);
- the kosmos backend's fused workspaces, worst-case buffers allocated at the first call and
  held for good: one forward and one backward workspace per distinct layer shape, as the
  proxies' layers share them (``kosmos_moe.share_workspaces``).

Activations (freed before the step, but a peak of their own in the backward), DeepEP's
buffers, the CUDA context and allocator rounding come on top. So this is a floor:
a run whose floor exceeds the device's free memory fails at its first optimizer step, after the
model was built and its first step compiled, and the training script refuses it up front
instead.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from kosmos_moe import ExpertLayer
from kosmos_moe.workspace import workspace_bytes

from .optim import decay_split

GiB = 1 << 30
_FP32 = 4


@dataclasses.dataclass(frozen=True)
class StepMemory:
    """Bytes one rank holds at its optimizer step, by what holds them (see the module's docs)."""

    weights: int
    masters: int
    gradients: int
    moments: int
    step_temporary: int
    workspaces: int = 0

    @property
    def total(self) -> int:
        return self.weights + self.masters + self.gradients + self.moments + self.step_temporary + self.workspaces

    def describe(self) -> str:
        grads = "fp32 gradients" if self.masters or self.moments else "gradients"
        parts = [("weights", self.weights), ("fp32 masters", self.masters), (grads, self.gradients),
                 ("AdamW moments", self.moments), ("the step's temporary", self.step_temporary),
                 ("kosmos workspaces", self.workspaces)]
        listed = ", ".join(f"{name} {size(b)}" for name, b in parts if b)
        return f"{size(self.total)} ({listed})"


def size(nbytes: int) -> str:
    """``nbytes`` in GiB, or MiB below one GiB."""
    return f"{nbytes / GiB:.2f} GiB" if nbytes >= GiB else f"{nbytes / (1 << 20):.2f} MiB"


def step_memory(model: nn.Module, multi_tensor: bool) -> StepMemory:
    """The floor of ``model``'s training state at the optimizer step, from its parameters' shapes
    and dtypes alone: ``model`` may live on the meta device (:func:`proxies.models.build_skeleton`).
    ``multi_tensor``: whether AdamW runs torch's multi-tensor implementation (the GPU's default)
    or its per-tensor loop (the CPU's)."""
    params = list(model.parameters())
    elements = sum(p.numel() for p in params)
    low_precision = sum(p.numel() for p in params if p.dtype != torch.float32)
    if multi_tensor:
        temporary = max((sum(p.numel() for p in group) for group in decay_split(params)), default=0)
    else:
        temporary = 2 * max((p.numel() for p in params), default=0)
    return StepMemory(
        weights=sum(p.numel() * p.element_size() for p in params),
        masters=low_precision * _FP32,
        gradients=elements * _FP32,
        moments=2 * elements * _FP32,
        step_temporary=temporary * _FP32,
        workspaces=workspace_memory(model),
    )


def backward_memory(model: nn.Module) -> StepMemory:
    """The floor of a forward + backward without an optimizer step (the benchmarks' full-expert
    cases): the weights and their gradients, both in the weights' dtype, and the workspaces."""
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    return StepMemory(weights=weights, masters=0, gradients=weights, moments=0, step_temporary=0,
                      workspaces=workspace_memory(model))


def workspace_memory(model: nn.Module) -> int:
    """Bytes of the forward and backward workspaces of ``model``'s kosmos layers on one rank,
    one pair per distinct (shape, EP size, token bound, dtype): layers that share them hold one
    (``kosmos_moe.share_workspaces``). At the GPU's default tiles; 0 without kosmos layers."""
    pairs: dict[tuple, int] = {}
    for layer in model.modules():
        if isinstance(layer, ExpertLayer) and layer.backend == "kosmos":
            key = (layer.config, layer.ep_world, layer.max_tokens_per_rank, layer.experts.gate_up_proj.dtype)
            if key not in pairs:
                pairs[key] = sum(workspace_bytes(*key).values())
    return sum(pairs.values())


def shortfall(need: StepMemory, free_bytes: int, where: str) -> str | None:
    """Why a run needing ``need`` cannot run in ``free_bytes``, or None if its floor fits."""
    if need.total <= free_bytes:
        return None
    at = "at the optimizer step" if need.moments else "at the end of the backward"
    return (f"the training state needs at least {need.describe()} per rank {at}, "
            f"more than the {size(free_bytes)} free on {where} (activations come on top); use fewer --layers "
            f"or --num-experts, a smaller --vocab-size, or split the experts over more GPUs with torchrun "
            f"and --ep-size")
