"""@triton.jit code of kosmos-moe, installed as ``kosmos_moe.kernels``.

Nothing here knows about nn.Module or torch.distributed: kernels take tensors, a peer-address
table and the local rank.
"""
