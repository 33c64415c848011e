"""The accuracy rule of the bf16 GPU tests: the fused result against the bf16 reference backend,
both measured against an fp32 evaluation of the same bf16 weights (the truth).

Both the fused kernels and the reference backend compute in bf16 with fp32 accumulation,
rounding intermediates (activations, expert outputs, row gradients) to bf16 at different
points, so neither equals the truth; the fused error (max and mean over a tensor, the max per
expert for the expert weights, so that an expert that few rows reached is held to its own
scale) may be at most twice the reference's. The floor, FLOOR times the largest |truth| of the
tensor (or expert), is one bf16 ulp at that magnitude: a tensor whose reference error happens
to be tiny (a few tokens, an exactly representable sum) must still admit the last rounding of a
correct result to bf16, and of the bf16 ``.grad`` accumulation. Any indexing or reduction bug
is O(1) of the scale and far outside either bound.
"""

from __future__ import annotations

import torch

FLOOR = 2.0 ** -8
MEAN_FLOOR = 1e-6


def accuracy_problem(fused: torch.Tensor | None, ref: torch.Tensor, truth: torch.Tensor, what: str,
                     per_expert: bool = False, floor: float = FLOOR) -> str | None:
    """Why ``fused`` fails the rule above against ``ref`` (both judged by ``truth``), or None."""
    if fused is None:
        return f"{what}: no gradient"
    if fused.shape != truth.shape:
        return f"{what}: shape {tuple(fused.shape)}, expected {tuple(truth.shape)}"
    if truth.numel() == 0:
        return None
    truth = truth.float()
    if not torch.isfinite(fused).all():
        return f"{what}: non-finite values"
    d_fused = (fused.float() - truth).abs()
    d_ref = (ref.float() - truth).abs()
    dims = tuple(range(1, truth.dim())) if per_expert else tuple(range(truth.dim()))
    err_fused, err_ref, scale = d_fused.amax(dims), d_ref.amax(dims), truth.abs().amax(dims)
    bad = err_fused > torch.maximum(2 * err_ref, floor * scale)
    if bad.any():
        return (f"{what}: fused error {err_fused[bad].tolist()[:8]} over twice the bf16 reference's "
                f"{err_ref[bad].tolist()[:8]} (scale {scale[bad].tolist()[:8]})"
                + (f" at experts {bad.nonzero().flatten().tolist()[:8]}" if per_expert else ""))
    mean_fused, mean_ref = d_fused.mean().item(), d_ref.mean().item()
    if mean_fused > 2 * mean_ref + MEAN_FLOOR * truth.abs().max().item():
        return f"{what}: mean fused error {mean_fused:.3g} over twice the bf16 reference's {mean_ref:.3g}"
    return None


def assert_within(fused: torch.Tensor | None, ref: torch.Tensor, truth: torch.Tensor, what: str,
                  per_expert: bool = False, floor: float = FLOOR) -> None:
    """Assert :func:`accuracy_problem` finds nothing."""
    problem = accuracy_problem(fused, ref, truth, what, per_expert, floor)
    assert problem is None, problem
