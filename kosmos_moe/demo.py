"""A short demo: build a small expert layer, run forward and backward, print what happened.

Run with ``python -m kosmos_moe.demo``.
"""

from __future__ import annotations

import argparse
import time

import torch

from kosmos_moe import ExpertLayer


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--tokens", type=int, default=512)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--intermediate", type=int, default=128)
    parser.add_argument("--experts", type=int, default=16)
    parser.add_argument("--top-k", type=int, default=4)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)

    torch.manual_seed(args.seed)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    layer = ExpertLayer.deepseek_v3(
        hidden_size=args.hidden,
        moe_intermediate_size=args.intermediate,
        num_experts=args.experts,
        top_k=args.top_k,
        compute_aux_loss=True,
        device=device,
        dtype=dtype,
    )
    print(f"layer: {layer.extra_repr()}")
    print(f"parameters: {sum(p.numel() for p in layer.parameters()):,} on {device} in {dtype}")

    x = torch.randn(args.tokens, args.hidden, device=device, dtype=dtype, requires_grad=True)
    start = time.perf_counter()
    y = layer(x)
    loss = y.float().pow(2).mean() + 0.01 * layer.aux_loss
    loss.backward()
    elapsed = time.perf_counter() - start

    load = layer.tokens_per_expert
    print(f"forward+backward of {args.tokens} tokens took {elapsed * 1e3:.1f} ms")
    print(f"output {tuple(y.shape)}, loss {loss.item():.5f}, switch aux loss {layer.aux_loss.item():.4f}")
    print(f"tokens per expert: min {int(load.min())}, max {int(load.max())}, total {int(load.sum())} "
          f"(= tokens x top_k = {args.tokens * args.top_k})")
    grads = {name: p.grad.norm().item() for name, p in layer.named_parameters()}
    for name, norm in grads.items():
        print(f"  grad norm {name:32s} {norm:.4e}")
    print(f"  grad norm {'input':32s} {x.grad.norm().item():.4e}")
    used = layer.update_router_bias()
    bias = layer.gate.e_score_correction_bias
    print(f"bias update from load {used.tolist()}: bias now in [{bias.min().item():+.4f}, {bias.max().item():+.4f}]")


if __name__ == "__main__":
    main()
