"""Dispatch and combine alone: kosmos against DeepEP (when importable) and NCCL all_to_all_single.

    python benchmarks/bench_dispatch_combine.py --out results/dispatch_combine.json
    torchrun --nproc-per-node 8 benchmarks/bench_dispatch_combine.py --out results/dispatch_combine.json
    python benchmarks/bench_dispatch_combine.py --smoke          # CPU check of the script
    python benchmarks/bench_dispatch_combine.py --sweep 256 512 1024 2048 4096 --out r/dc.json  # + r/dc.png

DeepEP's test shapes by default: 4096 tokens per rank, hidden 7168, top-8 of 256 experts, bf16,
top-k from random scores. Every path moves the same data: each token once to every rank that
holds one of its experts (DeepEP's normal-mode semantics), and back summed. Bandwidth follows
DeepEP's accounting: the bytes of the received rows (``recv_x.numel() * 2``) per second, the
same figure for combine. Per path: µs and GB/s of dispatch and of combine. ``--sweep`` repeats the measurement
over several token counts per rank and, with ``--out``, plots GB/s against tokens per rank.

* kosmos: ``ExpertExchange`` over ranks (one "expert" per rank, each token's distinct
  destination ranks as its choices): one persistent launch per direction, no host sync.
* NCCL: the rows ordered by destination (an index_select), ``all_to_all_single``, and back
  with a fold (index_add); the split sizes come from one host sync outside the timed region.
* DeepEP: ``Buffer.dispatch`` / ``Buffer.combine`` with the layout from ``get_dispatch_layout``.
"""

from __future__ import annotations

import argparse

from pathlib import Path

from common import ceilings, environment, init, log, markdown_table, plot, timed, write

import torch
import torch.distributed as dist


def make_inputs(args, device, rank):
    g = torch.Generator(device=device).manual_seed(rank + 7919 * args.tokens)
    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    x = torch.randn(args.tokens, args.hidden, device=device, generator=g).to(dtype)
    scores = torch.randn(args.tokens, args.experts, device=device, generator=g).abs() + 1
    topk_idx = torch.topk(scores, args.top_k, dim=-1, sorted=False)[1]
    return x, topk_idx


def rank_choices(topk_idx, experts, world):
    """Each token's distinct destination ranks, ascending, padded with -1; and the token-rank mask."""
    ranks = topk_idx // (experts // world)
    in_rank = torch.zeros(topk_idx.shape[0], world, dtype=torch.bool, device=topk_idx.device)
    in_rank.scatter_(1, ranks, True)
    slots = min(topk_idx.shape[1], world)
    order = torch.where(in_rank, torch.arange(world, device=topk_idx.device), world).sort(dim=1).values[:, :slots]
    return torch.where(order < world, order, -1), in_rank


_EXCHANGES: dict = {}


def bench_kosmos(args, device, x, rank_idx, world):
    from kosmos_moe.exchange import ExpertExchange
    from kosmos_moe.fabric import default_fabric, SymmetricMemoryFabric

    group = dist.group.WORLD
    key = (world, rank_idx.shape[1], args.hidden, args.max_tokens)
    if key not in _EXCHANGES:  # one workspace for a whole sweep
        if device.type == "cuda":
            fabric = SymmetricMemoryFabric(group)
        else:
            fabric = default_fabric(group if world > 1 else None, device)
        _EXCHANGES[key] = ExpertExchange(world, rank_idx.shape[1], args.hidden, args.max_tokens, fabric)
    ex = _EXCHANGES[key]
    ones = torch.ones(rank_idx.shape, dtype=torch.float32, device=device)
    rows, handle = ex.dispatch(x, rank_idx, ones)
    n_recv = int(handle.num_rows)
    state = {}

    def dispatch():
        state["rows"], state["handle"] = ex.dispatch(x, rank_idx, ones)

    t_dispatch = timed(dispatch, device, args.warmup, args.iters)
    y = state["rows"]
    t_combine = timed(lambda: ex.combine(y, state["handle"], weighted=False), device, args.warmup, args.iters)
    out = ex.combine(y, state["handle"], weighted=False)
    expect = x.float() * (rank_idx >= 0).sum(1, keepdim=True)
    err = (out.float() - expect).abs().max().item() if out.numel() else 0.0
    return n_recv, t_dispatch, t_combine, err


def bench_nccl(args, device, x, in_rank, world):
    # Rows ordered by destination rank (token order within each), as DeepEP delivers them.
    dest = torch.nonzero(in_rank.t())  # [pairs, 2]: (rank, token), rank-major
    send_tokens = dest[:, 1]
    send_counts = in_rank.sum(0)
    recv_counts = torch.empty_like(send_counts)
    dist.all_to_all_single(recv_counts, send_counts)
    send_splits, recv_splits = send_counts.tolist(), recv_counts.tolist()  # the host sync, untimed
    recv = torch.empty(sum(recv_splits), args.hidden, dtype=x.dtype, device=device)
    back = torch.empty(len(send_tokens), args.hidden, dtype=x.dtype, device=device)

    def dispatch():
        dist.all_to_all_single(recv, x.index_select(0, send_tokens), recv_splits, send_splits)

    def combine():
        dist.all_to_all_single(back, recv, send_splits, recv_splits)
        torch.zeros(x.shape, dtype=torch.float32, device=device).index_add_(0, send_tokens, back.float())

    return sum(recv_splits), timed(dispatch, device, args.warmup, args.iters), timed(combine, device, args.warmup, args.iters)


def bench_deepep(args, device, x, topk_idx):
    import deep_ep

    buffer = deep_ep.Buffer(dist.group.WORLD, int(1e9), 0)
    weights = torch.ones(topk_idx.shape, dtype=torch.float32, device=device)
    per_rank, _, per_expert, in_rank, _ = buffer.get_dispatch_layout(topk_idx, args.experts)
    state = {}

    def dispatch():
        state["out"] = buffer.dispatch(x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank,
                                       num_tokens_per_expert=per_expert, topk_idx=topk_idx, topk_weights=weights)

    t_dispatch = timed(dispatch, device, args.warmup, args.iters)
    recv_x, _, _, _, handle, _ = state["out"]
    t_combine = timed(lambda: buffer.combine(recv_x, handle), device, args.warmup, args.iters)
    return recv_x.shape[0], t_dispatch, t_combine


def measure(args, device, world: int, rank: int) -> list[dict]:
    """Every path at ``args.tokens`` tokens per rank: one row each, kosmos first."""
    x, topk_idx = make_inputs(args, device, rank)
    rank_idx, in_rank = rank_choices(topk_idx, args.experts, world)
    es = x.element_size()
    rows = []

    def add(path, n_recv, t_d, t_c, **extra):
        nbytes = n_recv * args.hidden * es
        rows.append({"path": path, "tokens": args.tokens, "recv_tokens": n_recv, "dispatch_us": t_d * 1e6,
                     "combine_us": t_c * 1e6, "dispatch_gbps": nbytes / t_d / 1e9, "combine_gbps": nbytes / t_c / 1e9,
                     **extra})
        log(f"[{path}] {args.tokens} tokens/rank; rank 0: {n_recv} received, dispatch {t_d * 1e6:.1f} us, "
            f"combine {t_c * 1e6:.1f} us")

    n, t_d, t_c, err = bench_kosmos(args, device, x, rank_idx, world)
    add("kosmos", n, t_d, t_c, max_abs_err=err)
    n, t_d, t_c = bench_nccl(args, device, x, in_rank, world)
    add("nccl all_to_all_single" if device.type == "cuda" else "gloo all_to_all_single", n, t_d, t_c)
    try:
        n, t_d, t_c = bench_deepep(args, device, x, topk_idx)
        add("deepep", n, t_d, t_c)
    except ImportError:
        log("[deepep] not importable here: skipped (build it from https://github.com/deepseek-ai/DeepEP)")
    base = rows[0]
    for r in rows:
        r["kosmos_speedup_dispatch"] = r["dispatch_us"] / base["dispatch_us"]
        r["kosmos_speedup_combine"] = r["combine_us"] / base["combine_us"]
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--sweep", type=int, nargs="+", default=None, help="token counts per rank (replaces --tokens)")
    p.add_argument("--hidden", type=int, default=7168)
    p.add_argument("--top-k", type=int, default=8)
    p.add_argument("--experts", type=int, default=256)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU: checks the script")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    if args.smoke:
        args.tokens, args.hidden, args.top_k, args.experts, args.warmup, args.iters = 24, 32, 4, 8, 1, 2
    device = init(args.smoke)
    world, rank = dist.get_world_size(), dist.get_rank()
    if args.experts % world:
        raise SystemExit(f"--experts {args.experts} does not divide over {world} ranks")
    ceil = ceilings(device, args.smoke)
    log(f"ceilings: {ceil}")
    token_counts = args.sweep or [args.tokens]
    if args.smoke and args.sweep:
        token_counts = [8, 24]
    args.max_tokens = max(token_counts)
    rows = []
    for tokens in token_counts:
        args.tokens = tokens
        rows += measure(args, device, world, rank)
    results = {"environment": environment(device), "ceilings": ceil, "args": vars(args), "rows": rows}
    table = markdown_table(rows, [
        ("path", "path", ""), ("tokens", "tokens/rank", "d"), ("recv_tokens", "recv tokens (rank 0)", "d"),
        ("dispatch_us", "dispatch µs", ".1f"), ("dispatch_gbps", "dispatch GB/s", ".1f"),
        ("combine_us", "combine µs", ".1f"), ("combine_gbps", "combine GB/s", ".1f"),
        ("kosmos_speedup_dispatch", "kosmos speedup (dispatch)", ".2f"),
        ("kosmos_speedup_combine", "kosmos speedup (combine)", ".2f"),
    ])
    write(results, table, args.out)
    if args.out and len(token_counts) > 1 and rank == 0:
        series = {}
        for r in rows:
            for direction in ("dispatch", "combine"):
                xs, ys = series.setdefault(f"{r['path']} {direction}", ([], []))
                xs.append(r["tokens"])
                ys.append(r[f"{direction}_gbps"])
        png = str(Path(args.out).with_suffix(".png"))
        if plot(png, f"dispatch/combine, {world} rank(s), hidden {args.hidden}, top-{args.top_k} of {args.experts}",
                "tokens per rank", "GB/s (received-row bytes, DeepEP's accounting)", series):
            log(f"plot: {png}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
