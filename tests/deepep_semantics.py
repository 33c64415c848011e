"""DeepEP's intranode test semantics for kosmos_moe.deepep_compat.Buffer, as one rank's check
(run by the CPU test in worlds of processes and by the GPU test at world 1 on CUDA)."""

import torch
import torch.distributed as dist

E, K, H = 16, 4, 24


def check_buffer(rank, world, counts, device="cpu", dtype=torch.float32):
    """One rank's view of two calls; the GPU test runs it at world 1 on CUDA in bf16 too."""
    from kosmos_moe.deepep_compat import Buffer

    buffer = Buffer(dist.group.WORLD if world > 1 else None, int(1e9), max_tokens_per_rank=max(counts) + 1)
    L = E // world
    def data(source, call):
        g = torch.Generator().manual_seed(10 * call + source)
        n = counts[source]
        x = torch.randn(n, H, generator=g)
        scores = torch.rand(n, E, generator=g) + 1
        topk_idx = torch.topk(scores, K, dim=-1, sorted=False)[1]
        if n > 2:
            topk_idx[2, 1] = -1
        return x.to(device, dtype), topk_idx.to(device), torch.rand(n, K, generator=g).to(device)

    for call in range(2):
        n = counts[rank]
        x, topk_idx, topk_w = data(rank, call)
        # What every rank sends (each rank regenerates its peers' inputs from their seeds).
        all_x, all_idx, all_w = zip(*(data(s, call) for s in range(world)))

        # Layout, as DeepEP's test computes it.
        rank_idx = torch.where(topk_idx >= 0, topk_idx // L, -1)
        want_in_rank = (torch.stack([(rank_idx == r).any(1) for r in range(world)], 1) if n
                        else torch.zeros(0, world, dtype=torch.bool, device=device))
        want_per_rank = want_in_rank.sum(0).int()
        want_per_expert = torch.stack([(topk_idx == e).sum() for e in range(E)]).int()
        per_rank, rdma, per_expert, in_rank, _ = buffer.get_dispatch_layout(topk_idx, E)
        assert rdma is None
        assert torch.equal(per_rank, want_per_rank) and torch.equal(per_expert, want_per_expert)
        assert torch.equal(in_rank, want_in_rank)

        recv_x, recv_idx, recv_w, counts_list, handle, event = buffer.dispatch(
            x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert,
            topk_idx=topk_idx, topk_weights=topk_w, async_finish=True)
        event.current_stream_wait()

        rows, idx_rows, w_rows = [], [], []
        for s in range(world):
            for t in range(counts[s]):
                here = (all_idx[s][t] >= rank * L) & (all_idx[s][t] < (rank + 1) * L)
                if here.any():
                    rows.append(all_x[s][t])
                    idx_rows.append(torch.where(here, all_idx[s][t] - rank * L, -1))
                    w_rows.append(torch.where(here, all_w[s][t], 0.0))
        assert recv_x.shape[0] == len(rows)
        if rows:
            torch.testing.assert_close(recv_x, torch.stack(rows), rtol=0, atol=0)
            assert torch.equal(recv_idx, torch.stack(idx_rows))
            torch.testing.assert_close(recv_w, torch.stack(w_rows), rtol=0, atol=0)
        assert counts_list == [int((recv_idx == e).sum()) for e in range(L)]
        assert handle.rank_prefix_matrix[:, rank].tolist() == torch.tensor(
            [sum(1 for t in range(counts[s]) if ((all_idx[s][t] // L) == rank).any()) for s in range(world)]).cumsum(0).tolist()

        # Cached dispatch: same layout, new rows.
        x2 = x * 3
        recv_x2, none_idx, none_w, none_list, handle2, _ = buffer.dispatch(x2, handle=handle)
        assert none_idx is None and none_w is None and none_list is None
        torch.testing.assert_close(recv_x2, recv_x * 3)

        # Combine: each token summed over the ranks it went to; weights likewise.
        combined, combined_w, _ = buffer.combine(recv_x2, handle2, topk_weights=recv_w)
        ranks_per_token = in_rank.sum(1, keepdim=True).clamp(min=1)
        torch.testing.assert_close(combined / ranks_per_token, x2 * (in_rank.sum(1, keepdim=True) > 0), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(combined_w, torch.where(topk_idx >= 0, topk_w, 0.0), rtol=1e-6, atol=1e-6)
