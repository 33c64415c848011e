"""kosmos_moe.deepep_compat.Buffer against DeepEP's own intranode test semantics (interpreter, fp32).

Each check mirrors one assertion of DeepEP's tests/test_intranode.py: the layout tensors,
the received rows grouped by source rank in token order, local expert ids and weights, the
per-expert counts, the cached dispatch, and combine summing each token over its ranks.
"""

import pytest
import torch

from deepep_semantics import E, H, K, check_buffer
from multiprocess import INTERPRET, run_world


@pytest.mark.parametrize("world", [1, 2, 4])
def test_buffer_matches_deepep_semantics(world):
    run_world(world, check_buffer, [11, 0, 17, 6][:world], env=INTERPRET)


def check_unsupported(rank, world):
    from kosmos_moe.deepep_compat import Buffer

    with pytest.raises(NotImplementedError, match="low-latency"):
        Buffer(None, 0, 0, low_latency_mode=True)
    with pytest.raises(NotImplementedError, match="intranode only"):
        Buffer(None, 0, int(1e9))
    buffer = Buffer(None, int(1e9), max_tokens_per_rank=8)
    x = torch.randn(4, H)
    topk_idx = torch.stack([torch.randperm(E)[:K] for _ in range(4)])
    per_rank, _, per_expert, in_rank, _ = buffer.get_dispatch_layout(topk_idx, E)
    with pytest.raises(NotImplementedError, match="FP8"):
        buffer.dispatch((x, torch.ones(4, 1)), num_tokens_per_rank=per_rank, is_token_in_rank=in_rank,
                        num_tokens_per_expert=per_expert, topk_idx=topk_idx, topk_weights=torch.rand(4, K))
    with pytest.raises(NotImplementedError, match="communication stream"):
        buffer.dispatch(x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert,
                        topk_idx=topk_idx, topk_weights=torch.rand(4, K), allocate_on_comm_stream=True)
    with pytest.raises(NotImplementedError, match="num_worst_tokens"):
        buffer.dispatch(x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert,
                        topk_idx=topk_idx, topk_weights=torch.rand(4, K), num_worst_tokens=64)
    with pytest.warns(UserWarning, match="config has no effect"):
        recv_x, _, _, _, handle, _ = buffer.dispatch(
            x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert,
            topk_idx=topk_idx, topk_weights=torch.rand(4, K), config=Buffer.get_dispatch_config(1))
    with pytest.raises(ValueError, match="one row per received token"):
        buffer.combine(recv_x[:2], handle)


def test_unsupported_arguments_are_refused():
    run_world(1, check_unsupported, env=INTERPRET)
