"""Replace the MoE blocks of a Hugging Face transformers model with ``ExpertLayer``.

```python
from transformers import AutoModelForCausalLM
from kosmos_moe.integrations.transformers import swap_moe_blocks

model = AutoModelForCausalLM.from_pretrained(...)            # Qwen3-MoE or DeepSeek-V3
swapped = swap_moe_blocks(model, group=ep_group)             # rank r keeps experts [r*E/W, (r+1)*E/W)
```

Every ``Qwen3MoeSparseMoeBlock`` and every ``DeepseekV3MoE`` becomes a
:class:`TransformersExpertLayer` (an ``ExpertLayer``) that carries the block's weights and its
routing rule:

- Qwen3-MoE: softmax top-k, renormalised if ``norm_topk_prob``.
- DeepSeek-V3: ``sigmoid_group`` with ``n_group``, ``topk_group``, ``routed_scaling_factor``,
  ``norm_topk_prob``, the ``e_score_correction_bias`` and ``n_shared_experts`` shared experts.

Both expert layouts of transformers are read: v5's fused ``experts.gate_up_proj [E, 2I, H]`` /
``experts.down_proj [E, H, I]`` (also its transposed variant), and v4's ``nn.ModuleList`` of
per-expert MLPs with ``gate_proj`` / ``up_proj`` / ``down_proj`` Linears. With ``group`` set only
this rank's experts are copied out of the block.

The swapped layer returns what the block returned in the installed transformers version:
the hidden states ``[batch, seq, hidden]`` alone (transformers 5), or
``(hidden_states, router_logits)`` where the block returned that pair (Qwen3-MoE in
transformers 4). Router logits are the fp32 ``x @ W_gate^T`` of shape ``[batch*seq, E]``. In
transformers 5 the model collects router logits (``output_router_logits=True``, the auxiliary
load-balancing loss) with forward hooks on the router module; the swapped layer emits its logits
through a child module, ``router_logits``, on which the same hook is installed, so the model's
aux-loss code keeps working.

The parameter names of the swapped layer are those of the transformers v5 block
(``gate.weight``, ``gate.e_score_correction_bias``, ``experts.gate_up_proj``,
``experts.down_proj``, ``shared_experts.{gate,up,down}_proj.weight``), so the state dict of a
model swapped without expert parallelism is a transformers v5 checkpoint.
"""

from __future__ import annotations

import warnings
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from ..distributed import ep_rank_and_world
from ..layer import ExpertLayer
from ..sharing import WorkspacePool, share_workspaces

__all__ = [
    "SUPPORTED_BLOCKS",
    "RouterLogits",
    "TransformersExpertLayer",
    "build_expert_layer",
    "find_moe_blocks",
    "moe_block_state_dict",
    "swap_moe_blocks",
]

#: Class names of the transformers MoE blocks that ``swap_moe_blocks`` replaces, and their kind.
SUPPORTED_BLOCKS: dict[str, str] = {
    "Qwen3MoeSparseMoeBlock": "qwen3_moe",
    "DeepseekV3MoE": "deepseek_v3",
}

# ExpertLayer arguments that swap_moe_blocks derives from the block; passing them is an error.
_DERIVED = frozenset({
    "hidden_size", "moe_intermediate_size", "num_experts", "top_k", "router", "n_group", "topk_group",
    "routed_scaling_factor", "norm_topk_prob", "num_shared_experts", "dtype", "device",
})


class RouterLogits(nn.Module):
    """Emits a layer's fp32 router logits ``[tokens, num_experts]``; holds no parameters.

    transformers 5 records router logits with a forward hook on the router module. The swapped
    layer has no such module, so it routes its logits through this one and the hook is
    installed here instead.
    """

    def forward(self, tokens: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return F.linear(tokens.float(), weight.float())


def _recording_router_logits() -> bool:
    """Whether a transformers output collector that wants router logits is active now."""
    try:
        from transformers.utils.output_capturing import _active_collector
    except ImportError:  # a transformers without this mechanism: emit whenever hooked
        return True
    collected = _active_collector.get()
    return collected is not None and "router_logits" in collected


class TransformersExpertLayer(ExpertLayer):
    """An ``ExpertLayer`` that keeps the calling contract of the transformers block it replaced.

    ``forward`` returns the hidden states, shaped like its input, or
    ``(hidden_states, router_logits)`` with ``return_router_logits=True``. ``source_block``
    names the replaced block's class.
    """

    def __init__(self, *args, return_router_logits: bool = False, source_block: str = "", **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.return_router_logits = return_router_logits
        self.source_block = source_block
        self.router_logits = RouterLogits()

    def forward(self, hidden_states: torch.Tensor):
        out = super().forward(hidden_states)
        emit = self.return_router_logits or (bool(self.router_logits._forward_hooks) and _recording_router_logits())
        if not emit:
            return out
        logits = self.router_logits(hidden_states.reshape(-1, self.config.hidden_size), self.gate.weight)
        return (out, logits) if self.return_router_logits else out

    def extra_repr(self) -> str:
        text = super().extra_repr()
        if self.source_block:
            text += f", from={self.source_block}"
        if self.return_router_logits:
            text += ", returns=(hidden_states, router_logits)"
        return text


# ---------------------------------------------------------------------------------------------
# Reading a block.


def _block_kind(module: nn.Module) -> str | None:
    for cls in type(module).__mro__:
        kind = SUPPORTED_BLOCKS.get(cls.__name__)
        if kind is not None:
            return kind
    return None


def find_moe_blocks(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """``(name, module)`` of every supported transformers MoE block in ``model``, in module order."""
    return [(name, module) for name, module in model.named_modules() if _block_kind(module) is not None]


def _first_attr(objects, names, what: str, block: nn.Module):
    for obj in objects:
        if obj is None:
            continue
        for name in names:
            value = getattr(obj, name, None)
            if value is not None:
                return value
    raise ValueError(f"cannot find {what} ({' or '.join(names)}) on the {type(block).__name__} or its config")


def _is_fused(experts: nn.Module) -> bool:
    return isinstance(getattr(experts, "gate_up_proj", None), torch.Tensor)


def _check_fused_layout(experts: nn.Module, block: nn.Module) -> None:
    name = type(block).__name__
    if getattr(experts, "has_bias", False):
        raise ValueError(f"{name}: experts with biases are not supported by ExpertLayer")
    if getattr(experts, "has_gate", True) is False:
        raise ValueError(f"{name}: experts without a gate projection are not SwiGLU experts")
    if getattr(experts, "is_concatenated", True) is False:
        raise ValueError(f"{name}: interleaved gate/up expert weights are not supported (gate rows must come first)")


def _fused_expert_tensors(experts: nn.Module, get: Callable) -> tuple[torch.Tensor, torch.Tensor]:
    gate_up, down = get(experts.gate_up_proj), get(experts.down_proj)
    if getattr(experts, "is_transposed", False):  # [E, H, 2I] and [E, I, H]
        gate_up, down = gate_up.transpose(1, 2), down.transpose(1, 2)
    return gate_up, down


def _param_value(p: torch.Tensor) -> torch.Tensor:
    return p.detach()


def _param_grad(p: torch.Tensor) -> torch.Tensor:
    return p.grad if p.grad is not None else torch.zeros_like(p)


def moe_block_state_dict(
    block: nn.Module, *, experts: tuple[int, int] | None = None, grad: bool = False
) -> dict[str, torch.Tensor]:
    """A supported block's weights under ``ExpertLayer`` names and layouts.

    ``experts`` selects the global expert range ``[first, last)`` (default: all). Works for the
    fused v5 layout and for v4's ``nn.ModuleList`` of MLPs. With ``grad=True`` it returns the
    parameters' gradients in the same layout (zeros where a gradient is missing); the
    correction-bias buffer is left out then.
    """
    kind = _block_kind(block)
    if kind is None:
        raise TypeError(f"{type(block).__name__} is not one of the supported blocks {sorted(SUPPORTED_BLOCKS)}")
    get = _param_grad if grad else _param_value
    gate = block.gate
    num_experts = gate.weight.shape[0]
    first, last = experts if experts is not None else (0, num_experts)
    out = {"gate.weight": get(gate.weight)}
    if kind == "deepseek_v3" and not grad:
        out["gate.e_score_correction_bias"] = gate.e_score_correction_bias.detach()

    moe = block.experts
    if _is_fused(moe):
        _check_fused_layout(moe, block)
        gate_up, down = _fused_expert_tensors(moe, get)
        if gate_up.shape[0] != num_experts:
            raise ValueError(
                f"{type(block).__name__} holds {gate_up.shape[0]} experts but its gate scores {num_experts}: "
                "the block is already sharded (transformers' own expert parallelism?); swap an unsharded model"
            )
        out["experts.gate_up_proj"] = gate_up[first:last]
        out["experts.down_proj"] = down[first:last]
    elif isinstance(moe, nn.ModuleList):
        if len(moe) != num_experts:
            raise ValueError(f"{type(block).__name__} holds {len(moe)} experts but its gate scores {num_experts}")
        gate_up, down = [], []
        for mlp in moe[first:last]:
            for proj in (mlp.gate_proj, mlp.up_proj, mlp.down_proj):
                if getattr(proj, "bias", None) is not None:
                    raise ValueError(f"{type(block).__name__}: experts with biases are not supported by ExpertLayer")
            gate_up.append(torch.cat([get(mlp.gate_proj.weight), get(mlp.up_proj.weight)], dim=0))
            down.append(get(mlp.down_proj.weight))
        out["experts.gate_up_proj"] = torch.stack(gate_up)
        out["experts.down_proj"] = torch.stack(down)
    else:
        raise ValueError(
            f"{type(block).__name__}.experts is a {type(moe).__name__}: expected fused gate_up_proj/down_proj "
            "tensors (transformers 5) or an nn.ModuleList of MLPs (transformers 4)"
        )

    shared = getattr(block, "shared_experts", None)
    if shared is not None:
        for proj in ("gate_proj", "up_proj", "down_proj"):
            out[f"shared_experts.{proj}.weight"] = get(getattr(shared, proj).weight)
    return out


def _activation_is_silu(modules, config) -> bool:
    acts = [getattr(m, "act_fn", None) for m in modules if m is not None]
    acts = [a for a in acts if a is not None]
    if acts:
        probe = torch.linspace(-4.0, 4.0, 17)
        return all(torch.allclose(act(probe), F.silu(probe)) for act in acts)
    return getattr(config, "hidden_act", None) in ("silu", "swish")


def _returns_router_logits(block: nn.Module, kind: str, hidden: int, dtype, device) -> bool:
    """Whether the block returns ``(hidden_states, router_logits)``: ask the block itself."""
    try:
        with torch.no_grad():
            out = block(torch.zeros(1, 1, hidden, dtype=dtype, device=device))
        return isinstance(out, tuple)
    except Exception:  # e.g. a block on the meta device: fall back on the known contracts
        import transformers

        major = int(transformers.__version__.split(".")[0])
        return kind == "qwen3_moe" and major < 5


def _layer_spec(block: nn.Module, kind: str, model_config) -> dict[str, Any]:
    name = type(block).__name__
    gate = block.gate
    if getattr(gate, "bias", None) is not None:
        raise ValueError(f"{name}: a router with a bias is not supported by ExpertLayer")
    num_experts, hidden = gate.weight.shape
    moe = block.experts
    configs = [getattr(block, "config", None), getattr(moe, "config", None), model_config]
    if _is_fused(moe):
        _check_fused_layout(moe, block)
        gate_up, down = _fused_expert_tensors(moe, lambda p: p)
        intermediate = gate_up.shape[1] // 2
        expert_dtype, expert_device = gate_up.dtype, gate_up.device
        act_modules = [moe]
    elif isinstance(moe, nn.ModuleList) and len(moe) > 0:
        w = moe[0].gate_proj.weight
        intermediate, expert_dtype, expert_device = w.shape[0], w.dtype, w.device
        act_modules = [moe[0]]
    else:
        raise ValueError(f"{name}.experts has an unknown layout ({type(moe).__name__})")
    if _is_fused(moe) and (
        tuple(gate_up.shape[1:]) != (2 * intermediate, hidden) or tuple(down.shape[1:]) != (hidden, intermediate)
    ):
        raise ValueError(
            f"{name}: expert weights gate_up_proj {tuple(gate_up.shape)} / down_proj {tuple(down.shape)} do not "
            f"match hidden size {hidden} (expected [E, 2I, H] and [E, H, I])"
        )

    shared = getattr(block, "shared_experts", None)
    if shared is not None:
        act_modules.append(shared)
    if not _activation_is_silu(act_modules, next((c for c in configs if c is not None), None)):
        raise ValueError(f"{name}: ExpertLayer computes SwiGLU experts; this block's activation is not SiLU")

    spec: dict[str, Any] = dict(hidden_size=hidden, moe_intermediate_size=intermediate, num_experts=num_experts)
    if kind == "qwen3_moe":
        spec.update(
            router="softmax",
            top_k=int(_first_attr([gate, block, *configs], ["top_k", "num_experts_per_tok"], "top_k", block)),
            norm_topk_prob=bool(_first_attr([gate, block, *configs], ["norm_topk_prob"], "norm_topk_prob", block)),
        )
    else:
        holders = [gate, *configs]
        spec.update(
            router="sigmoid_group",
            top_k=int(_first_attr(holders, ["top_k", "num_experts_per_tok"], "top_k", block)),
            n_group=int(_first_attr(holders, ["num_group", "n_group"], "n_group", block)),
            topk_group=int(_first_attr(holders, ["topk_group"], "topk_group", block)),
            routed_scaling_factor=float(
                _first_attr(holders, ["routed_scaling_factor"], "routed_scaling_factor", block)
            ),
            norm_topk_prob=bool(_first_attr(holders, ["norm_topk_prob"], "norm_topk_prob", block)),
        )
    if shared is not None:
        shared_intermediate = shared.gate_proj.weight.shape[0]
        if shared_intermediate % intermediate != 0:
            raise ValueError(
                f"{name}: shared-expert intermediate size {shared_intermediate} is not a multiple of the "
                f"routed experts' {intermediate}"
            )
        spec["num_shared_experts"] = shared_intermediate // intermediate
    for p in [gate.weight, *(shared.parameters() if shared is not None else [])]:
        if p.device != expert_device:
            raise ValueError(f"{name}: the router/shared experts are on {p.device}, the experts on {expert_device}")
    spec["dtype"], spec["device"] = expert_dtype, expert_device
    return spec


def _router_logits_hook_installer():
    try:
        from transformers.utils.output_capturing import install_output_capuring_hook
    except ImportError:
        return None
    return install_output_capuring_hook


def _install_router_logits_hook(layer: TransformersExpertLayer) -> None:
    install = _router_logits_hook_installer()
    if install is not None:
        install(layer.router_logits, "router_logits", 0)


def _warn_if_router_logits_unrecorded(model: nn.Module) -> None:
    if _router_logits_hook_installer() is not None:
        return
    if not any("router_logits" in (getattr(m, "_can_record_outputs", None) or {}) for m in model.modules()):
        return
    import transformers

    warnings.warn(
        f"transformers {transformers.__version__} collects router logits by patching the forward of its own "
        "MoE block classes, which the swapped layers are not: output_router_logits=True (and the auxiliary "
        "load-balancing loss) will find no router logits. With transformers >= 5 they are recorded.",
        stacklevel=3,
    )


def _ep_world(group: dist.ProcessGroup | None, layer_kwargs: dict) -> int:
    fabric = layer_kwargs.get("fabric")
    return fabric.world_size if fabric is not None else ep_rank_and_world(group)[1]


# ---------------------------------------------------------------------------------------------


def build_expert_layer(
    block: nn.Module,
    *,
    backend: str = "reference",
    group: dist.ProcessGroup | None = None,
    max_tokens_per_rank: int | None = None,
    return_router_logits: bool | None = None,
    keep_fp32_router: bool = True,
    model_config=None,
    name: str | None = None,
    **layer_kwargs,
) -> TransformersExpertLayer:
    """One ``TransformersExpertLayer`` with ``block``'s weights (this rank's experts), routing and contract."""
    kind = _block_kind(block)
    label = name or type(block).__name__
    if kind is None:
        raise TypeError(f"{type(block).__name__} is not one of the supported blocks {sorted(SUPPORTED_BLOCKS)}")
    clash = _DERIVED & layer_kwargs.keys()
    if clash:
        raise TypeError(f"{sorted(clash)} come from the transformers block and cannot be passed")
    spec = _layer_spec(block, kind, model_config)
    world = _ep_world(group, layer_kwargs)
    if spec["num_experts"] % world != 0:
        raise ValueError(
            f"{label}: num_experts={spec['num_experts']} is not divisible by the expert-parallel world size {world}"
        )
    if return_router_logits is None:
        return_router_logits = _returns_router_logits(block, kind, spec["hidden_size"], spec["dtype"], spec["device"])
    hidden, intermediate, experts, top_k = (spec.pop(k) for k in ("hidden_size", "moe_intermediate_size",
                                                                   "num_experts", "top_k"))
    layer = TransformersExpertLayer(
        hidden, intermediate, experts, top_k, **spec, group=group, backend=backend,
        max_tokens_per_rank=max_tokens_per_rank, return_router_logits=return_router_logits,
        source_block=type(block).__name__, **layer_kwargs,
    )
    if keep_fp32_router and block.gate.weight.dtype == torch.float32 and spec["dtype"] != torch.float32:
        layer.gate.float()
    state = moe_block_state_dict(block, experts=layer.local_expert_range)
    with torch.no_grad():
        layer.load_state_dict(state, strict=True)  # copies: the block's storage is not kept alive
    sources = dict(block.named_parameters())
    for pname, p in layer.named_parameters():
        if pname.startswith("experts."):
            # v4: a ModuleList of Linears; train the fused tensor if any expert weight trains.
            attr = pname.split(".", 1)[1]
            if _is_fused(block.experts):
                p.requires_grad_(getattr(block.experts, attr).requires_grad)
            else:
                projs = ("gate_proj", "up_proj") if attr == "gate_up_proj" else ("down_proj",)
                p.requires_grad_(any(getattr(m, q).weight.requires_grad for m in block.experts for q in projs))
        elif pname in sources:
            p.requires_grad_(sources[pname].requires_grad)
    layer.train(block.training)
    _install_router_logits_hook(layer)
    return layer


def swap_moe_blocks(
    model: nn.Module,
    backend: str = "reference",
    group: dist.ProcessGroup | None = None,
    max_tokens_per_rank: int | None = None,
    *,
    return_router_logits: bool | None = None,
    keep_fp32_router: bool = True,
    **layer_kwargs,
) -> list[str]:
    """Replace every ``Qwen3MoeSparseMoeBlock`` and ``DeepseekV3MoE`` of ``model`` in place.

    Each block becomes a :class:`TransformersExpertLayer` with the block's router and weights, on
    the block's device and in its experts' dtype. A router weight kept in fp32 beside bf16
    experts, as transformers loads DeepSeek-V3, stays fp32 (``keep_fp32_router=False`` casts it
    to the experts' dtype); the routing math is fp32 either way. With ``group`` (an
    expert-parallel process group of W ranks) rank r keeps experts ``[r*E/W, (r+1)*E/W)``;
    every rank must then run the model in step, as with any expert-parallel layer.
    ``backend='kosmos'`` needs ``max_tokens_per_rank`` (``batch * seq`` of the largest call).
    ``return_router_logits`` overrides the detected block contract; further keyword arguments go
    to ``ExpertLayer`` (``compute_aux_loss``, ``workers_per_rank``, ``fabric``, ...). With the
    fused backend the swapped layers share one workspace per direction
    (:func:`kosmos_moe.share_workspaces`), since the model runs them one after another.

    Returns the names of the replaced modules. Raises ``ValueError`` if ``model`` has no
    supported MoE block, or if an EP world size does not divide a block's experts (checked for
    every block before any is replaced).
    """
    blocks = find_moe_blocks(model)
    if not blocks:
        already = [n for n, m in model.named_modules() if isinstance(m, TransformersExpertLayer)]
        hint = f" ({len(already)} modules were swapped already)" if already else ""
        raise ValueError(
            f"{type(model).__name__} has no MoE block to swap: looked for {' and '.join(SUPPORTED_BLOCKS)}{hint}"
        )
    if any(name == "" for name, _ in blocks):
        raise ValueError("model is itself an MoE block: pass the model that contains it")
    # A block nested in another (not in any transformers model) is swapped with its parent.
    names = [n for n, _ in blocks]
    blocks = [(n, b) for n, b in blocks if not any(n.startswith(p + ".") for p in names if p != n)]

    model_config = getattr(model, "config", None)
    world = _ep_world(group, layer_kwargs)
    for name, block in blocks:  # validate all before replacing any
        experts = block.gate.weight.shape[0]
        if experts % world != 0:
            raise ValueError(
                f"{name}: num_experts={experts} is not divisible by the expert-parallel world size {world}"
            )

    swapped = []
    # The swapped layers run one after another: with the fused backend they share one
    # workspace per direction (kosmos_moe.sharing) unless the caller passed a pool of its own.
    pool = (layer_kwargs.get("fused_options") or {}).get("workspace_pool")
    pool = pool if pool is not None else WorkspacePool()  # an empty pool is falsy (len 0)
    for name, block in blocks:
        layer = build_expert_layer(
            block, backend=backend, group=group, max_tokens_per_rank=max_tokens_per_rank,
            return_router_logits=return_router_logits, keep_fp32_router=keep_fp32_router,
            model_config=model_config, name=name, **layer_kwargs,
        )
        share_workspaces(layer, pool)
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child, layer)
        swapped.append(name)
    _warn_if_router_logits_unrecorded(model)
    return swapped
