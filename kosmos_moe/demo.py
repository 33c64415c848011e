"""A short demo: build a small expert layer, run forward and backward, print what happened.

Run with ``python -m kosmos_moe.demo``.
"""

from __future__ import annotations

import argparse
import time

import torch

from kosmos_moe import ExpertLayer
from kosmos_moe.config import smallest_expert_count


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m kosmos_moe.demo", description=(__doc__ or "").split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--tokens", type=int, default=512, help="tokens in the batch")
    parser.add_argument("--hidden", type=int, default=256, help="hidden size")
    parser.add_argument("--intermediate", type=int, default=128, help="each expert's intermediate size")
    parser.add_argument("--experts", type=int, default=16,
                        help="routed experts: a multiple of --n-group, enough for --top-k in --topk-group groups")
    parser.add_argument("--top-k", type=int, default=4, help="experts per token")
    parser.add_argument("--n-group", type=int, default=8, help="expert groups of the DeepSeek-V3 router")
    parser.add_argument("--topk-group", type=int, default=4, help="groups a token picks its experts from")
    parser.add_argument("--seed", type=int, default=0)
    return parser


def _check_args(p: argparse.ArgumentParser, a: argparse.Namespace) -> None:
    # --tokens 0 would average over nothing and print a nan loss.
    for name in ("tokens", "hidden", "intermediate", "experts", "top_k", "n_group"):
        if getattr(a, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(a, name)}")
    if not 0 <= a.seed <= 2**64 - 1:  # the unsigned 64-bit seeds of torch's generators
        p.error(f"--seed must be in [0, {2**64 - 1}], got {a.seed}")
    if not 1 <= a.topk_group <= a.n_group:
        p.error(f"--topk-group must be in [1, --n-group={a.n_group}], got {a.topk_group}")
    # The experts split evenly into groups, and the groups a token keeps must hold top_k experts.
    least = smallest_expert_count(a.top_k, a.n_group, a.topk_group)
    if a.experts % a.n_group or a.experts < least:
        p.error(f"--experts must be a multiple of --n-group={a.n_group} and >= {least} ({least}, "
                f"{least + a.n_group}, ...) for --top-k {a.top_k} from --topk-group {a.topk_group} groups, "
                f"got {a.experts}")


def main(argv: list[str] | None = None) -> None:
    parser = build_parser()
    args = parser.parse_args(argv)
    _check_args(parser, args)

    torch.manual_seed(args.seed)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    layer = ExpertLayer.deepseek_v3(
        hidden_size=args.hidden,
        moe_intermediate_size=args.intermediate,
        num_experts=args.experts,
        top_k=args.top_k,
        n_group=args.n_group,
        topk_group=args.topk_group,
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
