"""A small stack of kosmos expert layers trains like the reference backend (GPU, bf16).

Four residual MoE blocks regress a fixed random teacher for 300 Adam steps, once with each
backend from the same initial weights and batches. bf16 rounding differs between the two
paths (other summation orders, fused epilogues), so the curves are not bitwise equal; they
must fall by the same factor and stay within a few percent of each other throughout.
"""

import pytest
import torch
from torch import nn

from kosmos_moe import ExpertLayer
from kosmos_moe.fabric import EmulatedWorld

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="training the fused backend needs a CUDA device"),
]

HIDDEN, TOKENS, STEPS = 264, 1000, 300
SHAPE = dict(hidden_size=HIDDEN, moe_intermediate_size=136, num_experts=16, top_k=4, router="sigmoid_group",
             n_group=4, topk_group=2, routed_scaling_factor=2.0, num_shared_experts=1)


class Stack(nn.Module):
    def __init__(self, backend: str, fabrics=None, blocks: int = 4):
        super().__init__()
        kw = dict(backend=backend, dtype=torch.bfloat16, device="cuda")
        if backend == "kosmos":
            kw.update(max_tokens_per_rank=TOKENS, fused_options=dict(wait_bound=1 << 22))
        self.norms = nn.ModuleList(nn.RMSNorm(HIDDEN, device="cuda", dtype=torch.bfloat16) for _ in range(blocks))
        self.moes = nn.ModuleList(
            ExpertLayer(**SHAPE, **kw, **({"fabric": fabrics[i]} if fabrics else {})) for i in range(blocks)
        )
        self.head = nn.Linear(HIDDEN, HIDDEN, device="cuda", dtype=torch.bfloat16)

    def forward(self, x):
        for norm, moe in zip(self.norms, self.moes):
            x = x + moe(norm(x))
        return self.head(x)


def train(model: Stack, batches, targets) -> list[float]:
    opt = torch.optim.Adam(model.parameters(), lr=2e-3)
    losses = []
    for x, y in zip(batches, targets):
        opt.zero_grad(set_to_none=True)
        loss = torch.nn.functional.mse_loss(model(x).float(), y)
        loss.backward()
        opt.step()
        for moe in model.moes:
            if moe.backend == "kosmos":
                moe.fused().raise_if_failed(block=False)
        losses.append(loss.item())
    return losses


def test_stack_trains_like_reference():
    torch.manual_seed(0)
    teacher = nn.Sequential(nn.Linear(HIDDEN, 4 * HIDDEN), nn.GELU(), nn.Linear(4 * HIDDEN, HIDDEN)).cuda()
    batches = [torch.randn(TOKENS, HIDDEN, device="cuda") for _ in range(STEPS)]
    with torch.no_grad():
        targets = [teacher(x) for x in batches]
    batches = [x.to(torch.bfloat16) for x in batches]

    reference = Stack("reference")
    fused = Stack("kosmos", fabrics=[EmulatedWorld(1, "cuda").rank(0) for _ in range(4)])
    fused.load_state_dict(reference.state_dict())
    ref_losses = train(reference, batches, targets)
    fused_losses = train(fused, batches, targets)
    for moe in fused.moes:
        moe.fused().raise_if_failed()

    ref_t, fused_t = torch.tensor(ref_losses), torch.tensor(fused_losses)
    assert ref_t[-50:].mean() < 0.5 * ref_t[:10].mean(), "the reference itself must learn the task"
    # Window means over 25 steps: each within 5% of the reference's, over the whole run.
    ref_w = ref_t.view(-1, 25).mean(1)
    fused_w = fused_t.view(-1, 25).mean(1)
    rel = ((fused_w - ref_w).abs() / ref_w).max().item()
    assert rel < 0.05, f"loss curves diverge by {rel:.1%}: reference {ref_w.tolist()}, fused {fused_w.tolist()}"
