"""``ExpertLayer``: the drop-in MoE block (router + routed experts + optional shared experts)."""

from __future__ import annotations

import contextlib
import copy
import pickle

from dataclasses import asdict
from typing import Mapping

import torch
import torch.distributed as dist
from torch import nn

from .balance import switch_aux_loss, tokens_per_expert, update_correction_bias, BIAS_UPDATE_RATE
from .config import DEEPSEEK_V3, QWEN3_235B, MoEConfig
from .distributed import ep_rank_and_world
from .experts import GroupedExperts, SharedExperts
from .fabric import Fabric, default_fabric
from .reference import reference_expert_forward
from .router import Router

BACKENDS: tuple[str, ...] = ("reference", "kosmos", "deepep")

_EXPERT_PARAMS = ("experts.gate_up_proj", "experts.down_proj")


def _autocast_on(device_type: str) -> bool:
    return torch.amp.is_autocast_available(device_type) and torch.is_autocast_enabled(device_type)


class ExpertLayer(nn.Module):
    """A token-choice SwiGLU mixture-of-experts layer with expert parallelism.

    ``forward`` maps ``[..., hidden_size]`` to the same shape. With ``group`` set, the layer is
    one rank of an expert-parallel group of size W: rank r holds the experts
    ``[r*E/W, (r+1)*E/W)``, routes its own tokens and exchanges rows with its peers. The router
    and the shared experts are replicated on every rank.

    Parameter names follow Hugging Face transformers v5 (``gate.weight``,
    ``gate.e_score_correction_bias``, ``experts.gate_up_proj``, ``experts.down_proj``,
    ``shared_experts.{gate,up,down}_proj.weight``), so checkpoints load without reshaping.

    Backends: ``reference`` (permute, all-to-all, grouped GEMM; the oracle and baseline),
    ``kosmos`` (one persistent Triton launch per direction; needs ``max_tokens_per_rank``) and
    ``deepep`` (DeepEP's Buffer for the exchange, grouped-GEMM experts; ``deepep_buffer`` may
    pass any Buffer with DeepEP's API, e.g. ``kosmos_moe.deepep_compat.Buffer``).

    ``fused_options`` are keyword arguments of the kosmos launcher
    (:class:`kosmos_moe.fused.FusedForward`): tile sizes, ``profile``, and ``save_gate_up``, the
    gate/up projection rows a training forward keeps for the backward per (token, choice) of a
    rank's batch (default 1.25; with one rank every row; 0 keeps none and the backward redoes
    the projections, for the least activation memory), and ``save_shared`` (default True),
    whether it keeps the shared experts' projections too (``2 I_s`` values per token) or
    their backward recomputes their forward, and ``wait_bound``, the polls after which a
    kernel waiting for a peer gives up and the layer raises
    :class:`~kosmos_moe.ExpertLayerTimeout` naming the rank and what it waited for (default
    2**27 on a GPU, under a minute on an H200; 15,000 under Triton's interpreter, about a
    minute on a two-core CPU).

    After each call, ``tokens_per_expert`` holds the number of this rank's (token, k)
    assignments per global expert and, when ``compute_aux_loss`` is set, ``aux_loss`` holds the
    switch load-balancing loss for the caller to add to its objective.
    """

    def __init__(
        self,
        hidden_size: int,
        moe_intermediate_size: int,
        num_experts: int,
        top_k: int,
        *,
        router: str = "softmax",
        n_group: int = 1,
        topk_group: int = 1,
        routed_scaling_factor: float = 1.0,
        norm_topk_prob: bool = True,
        num_shared_experts: int = 0,
        group: dist.ProcessGroup | None = None,
        backend: str = "reference",
        max_tokens_per_rank: int | None = None,
        compute_aux_loss: bool = False,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
        fabric: Fabric | None = None,
        workers_per_rank: int | None = None,
        fused_options: dict | None = None,
        deepep_buffer=None,
    ) -> None:
        super().__init__()
        self.config = MoEConfig(
            hidden_size=hidden_size,
            moe_intermediate_size=moe_intermediate_size,
            num_experts=num_experts,
            top_k=top_k,
            router=router,
            n_group=n_group,
            topk_group=topk_group,
            routed_scaling_factor=routed_scaling_factor,
            norm_topk_prob=norm_topk_prob,
            num_shared_experts=num_shared_experts,
        )
        if backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
        if max_tokens_per_rank is not None and max_tokens_per_rank < 1:
            raise ValueError(f"max_tokens_per_rank must be positive, got {max_tokens_per_rank}")
        if backend == "kosmos" and max_tokens_per_rank is None:
            raise ValueError(
                "backend='kosmos' sizes its buffers for the worst case up front: pass max_tokens_per_rank "
                "(the most tokens one rank feeds the layer in one call)"
            )
        if backend == "deepep" and deepep_buffer is None:
            import importlib.util

            from .deepep_backend import INSTALL_HINT

            if importlib.util.find_spec("deep_ep") is None:
                raise ImportError(INSTALL_HINT)
        if backend != "kosmos" and (fused_options or workers_per_rank is not None):
            raise ValueError("fused_options and workers_per_rank are only used by backend='kosmos'")
        if workers_per_rank is not None and (
                isinstance(workers_per_rank, bool) or not isinstance(workers_per_rank, int) or workers_per_rank < 1):
            raise ValueError(f"workers_per_rank must be a positive int, got {workers_per_rank!r}")
        if fused_options:
            from .fused import check_fused_options

            check_fused_options(fused_options)
        if deepep_buffer is not None and backend != "deepep":
            raise ValueError("deepep_buffer is only used by backend='deepep'")
        if fabric is not None and backend != "kosmos":
            raise ValueError("a fabric is only used by backend='kosmos'")
        if fabric is not None and group is not None:
            raise ValueError("pass either group (a torch.distributed EP group) or fabric, not both")
        self.group = group
        if fabric is not None:
            self.ep_rank, self.ep_world = fabric.rank, fabric.world_size
        else:
            self.ep_rank, self.ep_world = ep_rank_and_world(group)
        if num_experts % self.ep_world != 0:
            raise ValueError(
                f"num_experts={num_experts} is not divisible by the expert-parallel world size {self.ep_world}"
            )
        self.num_local_experts = num_experts // self.ep_world
        self.backend = backend
        self.max_tokens_per_rank = max_tokens_per_rank
        self.compute_aux_loss = compute_aux_loss

        factory = {"dtype": dtype, "device": device}
        self.gate = Router(self.config, **factory)
        self.experts = GroupedExperts(self.num_local_experts, hidden_size, moe_intermediate_size, **factory)
        self.shared_experts = (
            SharedExperts(hidden_size, self.config.shared_intermediate_size, **factory)
            if num_shared_experts > 0
            else None
        )
        self.register_buffer(
            "tokens_per_expert", torch.zeros(num_experts, dtype=torch.int64, device=device), persistent=False
        )
        self.register_buffer(
            "load_since_bias_update", torch.zeros(num_experts, dtype=torch.int64, device=device), persistent=False
        )
        self.aux_loss: torch.Tensor | None = None
        self._fabric = fabric
        self._workers_per_rank = workers_per_rank
        self._fused_options = dict(fused_options or {})
        self._fused = None
        self._deepep_buffer = deepep_buffer

    # ----------------------------------------------------------------------------------------
    # Copies (EMA and averaged models deep-copy the model) and pickling.

    _HANDLES = ("group", "_fabric", "_deepep_buffer")  # communication handles: shared, never copied

    def __deepcopy__(self, memo: dict) -> "ExpertLayer":
        """A copy with copied parameters and buffers that shares this rank's process group,
        fabric, DeepEP buffer and workspace pool, and builds its own fused workspace at its first
        call unless the pool has one (a collective, like the original's: every rank copies its
        layer). Copied, the launcher
        would have kept the original's address table, and the copy's kernels would have run
        in the original's workspace while the copy read its routing from its own."""
        for handle in [getattr(self, name) for name in self._HANDLES] + [self._fused_options.get("workspace_pool")]:
            if handle is not None:
                memo[id(handle)] = handle
        new = type(self).__new__(type(self))
        memo[id(self)] = new
        # aux_loss: the last call's, part of that call's graph (a non-leaf cannot be copied).
        state = {k: v for k, v in self.__dict__.items() if k not in ("_fused", "aux_loss")}
        new.__dict__.update(copy.deepcopy(state, memo))
        new._fused = None
        new.aux_loss = None
        return new

    def __copy__(self) -> "ExpertLayer":
        """A shallow copy, as for any module: the same parameters, buffers, handles and launcher."""
        new = type(self).__new__(type(self))
        new.__dict__.update(self.__dict__)
        return new

    def __getstate__(self) -> dict:
        """For pickling (``torch.save`` of the module): everything but the fused launcher, which
        is rebuilt at the first call. A layer holding a process group, fabric or DeepEP buffer
        cannot be pickled; save its ``state_dict`` instead."""
        held = [name.lstrip("_") for name in self._HANDLES if getattr(self, name) is not None]
        if held:
            raise pickle.PicklingError(
                f"this ExpertLayer holds a {', '.join(held)} (process-local handles): save its state_dict instead"
            )
        # A workspace pool pickles empty (WorkspacePool.__getstate__): the layers of one pickled
        # model still share one after loading.
        return {**self.__dict__, "_fused": None, "aux_loss": None}

    # ----------------------------------------------------------------------------------------
    # Presets for the two production layer shapes.

    @classmethod
    def deepseek_v3(cls, **overrides) -> "ExpertLayer":
        """The DeepSeek-V3 MoE layer: H 7168, I 2048, 256 experts + 1 shared, top-8 of 4/8 groups."""
        return cls._from_preset(DEEPSEEK_V3, overrides)

    @classmethod
    def qwen3_235b(cls, **overrides) -> "ExpertLayer":
        """The Qwen3-235B-A22B MoE layer: H 4096, I 1536, 128 experts, softmax top-8."""
        return cls._from_preset(QWEN3_235B, overrides)

    @classmethod
    def _from_preset(cls, preset: MoEConfig, overrides: dict) -> "ExpertLayer":
        kwargs = {**asdict(preset), **overrides}
        positional = [kwargs.pop(k) for k in ("hidden_size", "moe_intermediate_size", "num_experts", "top_k")]
        return cls(*positional, **kwargs)

    # ----------------------------------------------------------------------------------------

    @property
    def local_expert_range(self) -> tuple[int, int]:
        """The global ids ``[first, last)`` of the experts this rank holds."""
        first = self.ep_rank * self.num_local_experts
        return first, first + self.num_local_experts

    def _autocast_dtype(self, hidden_states: torch.Tensor) -> torch.dtype | None:
        """The dtype to run in when torch.autocast is on and would lower this fp32 layer's
        precision (a floating input of fp32 or of that dtype); else None."""
        device = hidden_states.device.type
        if not _autocast_on(device) or self.experts.gate_up_proj.dtype != torch.float32:
            return None
        dtype = torch.get_autocast_dtype(device)
        if dtype == torch.float32 or hidden_states.dtype not in (torch.float32, dtype):
            return None
        return dtype

    def _check_input(self, hidden_states: torch.Tensor) -> None:
        weight = self.experts.gate_up_proj  # the layer's dtype; the gate may be fp32 beside it
        if self.gate.weight.dtype not in (weight.dtype, torch.float32):
            raise TypeError(f"the gate's weight is {self.gate.weight.dtype}, the experts' {weight.dtype}: the gate "
                            "must be in the experts' dtype or in fp32")
        if not torch.is_floating_point(hidden_states):
            raise TypeError(f"hidden_states must be a floating-point tensor, got dtype {hidden_states.dtype}")
        if hidden_states.dim() < 1 or hidden_states.shape[-1] != self.config.hidden_size:
            raise ValueError(
                f"hidden_states must have last dimension hidden_size={self.config.hidden_size}, "
                f"got shape {tuple(hidden_states.shape)}"
            )
        if hidden_states.device != weight.device:
            raise ValueError(
                f"hidden_states is on {hidden_states.device} but the layer's weights are on {weight.device}"
            )
        if hidden_states.dtype != weight.dtype:
            raise TypeError(
                f"hidden_states has dtype {hidden_states.dtype} but the layer's weights are {weight.dtype}; "
                "cast the input or the layer"
            )

    def fused(self):
        """The fused-forward launcher of this rank (built on first use; backend='kosmos')."""
        if self._fused is None:
            from .fused import FusedForward

            fabric = self._fabric or default_fabric(self.group, self.gate.weight.device)
            if fabric.device != self.gate.weight.device:
                raise ValueError(f"the fabric is on {fabric.device}, the layer's weights on {self.gate.weight.device}")
            options = dict(self._fused_options)
            # A layer that can train builds its backward workspace with the forward's, so that
            # no rank allocates while its peers' kernels wait for it.
            options.setdefault("backward", any(p.requires_grad for p in self.parameters()))
            self._fused = FusedForward(
                self.config, fabric, self.max_tokens_per_rank, self._workers_per_rank, **options
            )
        return self._fused

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        compute = self._autocast_dtype(hidden_states)
        if compute is None:
            return self._checked_forward(hidden_states)
        # What autocast does for nn.Linear, for the whole layer: it runs as its copy in
        # autocast's dtype would, with the gradients going to its fp32 parameters through the
        # casts (made anew at every call). The router keeps its fp32 weight, as DeepSeek-V3's
        # checkpoints keep it beside bf16 experts. The parameters are swapped in place for the
        # call, not through functional_call, which would run the module's hooks a second time.
        params = {name: p if name == "gate.weight" else p.to(compute) for name, p in self.named_parameters()}
        with torch.nn.utils.stateless._reparametrize_module(self, params):
            return self._checked_forward(hidden_states.to(compute))

    def _checked_forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        try:
            self._check_input(hidden_states)
        except (TypeError, ValueError) as exc:
            if self.backend == "kosmos" and self.ep_world > 1:  # peers must not be left in this call's collectives
                self.fused().join_refused_call(self, self._trains(hidden_states), str(exc))
            raise
        # The layer computes in its parameters' dtype (the router and the fold in fp32), as
        # the fused kernel does: torch.autocast would otherwise run the reference's fold and
        # the shared experts' GEMMs in its own dtype, and change its results. (An fp32 layer
        # under autocast has been cast above.)
        device = hidden_states.device.type
        with torch.autocast(device, enabled=False) if _autocast_on(device) else contextlib.nullcontext():
            return self._forward(hidden_states)

    def _forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        leading = hidden_states.shape[:-1]
        tokens = hidden_states.reshape(-1, self.config.hidden_size)
        if self.backend == "kosmos":
            return self._unflatten(self._kosmos_forward(tokens), leading)
        routing = self.gate(tokens)

        self._record_load(tokens_per_expert(routing.experts, self.config.num_experts))
        self.aux_loss = (
            switch_aux_loss(routing.scores, routing.experts, self.config.num_experts)
            if self.compute_aux_loss
            else None
        )

        if self.backend == "deepep":
            from .deepep_backend import deepep_expert_forward, make_buffer

            if self._deepep_buffer is None:
                self._deepep_buffer = make_buffer(self.group, self.config.hidden_size, tokens.dtype)
            out = deepep_expert_forward(tokens, routing, self.experts, self.config.num_experts, self._deepep_buffer)
        else:
            out = reference_expert_forward(tokens, routing, self.experts, self.config.num_experts, self.group)
        if self.shared_experts is not None:
            out = out + self.shared_experts(tokens)
        return self._unflatten(out, leading)

    def _unflatten(self, out: torch.Tensor, leading: torch.Size) -> torch.Tensor:
        # No view where none is needed (2-D input): FSDP2 warns on a module returning a view.
        return out if out.shape[:-1] == leading else out.reshape(*leading, self.config.hidden_size)

    # Opaque to torch.compile: the launch keeps its workspace, epochs and error records on the
    # host, which Dynamo cannot trace (it failed on the workspace's byte views); a compiled
    # model runs this call eagerly between its compiled regions.
    @torch.compiler.disable
    def _kosmos_forward(self, tokens: torch.Tensor) -> torch.Tensor:
        self._check_unsharded()
        launcher = self.fused()
        routed = (self.gate.weight, self.experts.gate_up_proj, self.experts.down_proj)
        shared = tuple(self.shared_experts.parameters()) if self.shared_experts is not None else ()
        if self._trains(tokens):
            from .fused import FusedExpertsFunction

            launched = launcher(tokens, self, keep_routing=True)
            # Before the node: autograd runs the ready node made last first, and the fused
            # backward must be the rank's first (see FusedExpertsFunction).
            self._recompute_aux_loss(tokens)
            out, top_e = FusedExpertsFunction.apply(tokens, launched, launcher, self.shared_experts, *routed, *shared)
        else:
            out, top_e = launcher(tokens, self)  # inference: nothing saved
            self._recompute_aux_loss(tokens)
        self._record_load(tokens_per_expert(top_e, self.config.num_experts))
        return out

    @torch.no_grad()
    def _record_load(self, counts: torch.Tensor) -> None:
        self.tokens_per_expert.copy_(counts)
        # A forward run by the autograd engine is activation checkpointing's recompute of a
        # call already counted (the reentrant and non-reentrant kinds both recompute inside
        # the backward's graph task; torch.utils.checkpoint tells them apart the same way).
        if torch._C._current_graph_task_id() == -1:
            self.load_since_bias_update.add_(counts)

    def _check_unsharded(self) -> None:
        """The kernels read the gate's, experts' and shared experts' parameters without calling
        those modules, so FSDP2 hooks on them never gather their shards."""
        from torch.distributed.tensor import DTensor

        sharded = [name for name, p in self.named_parameters() if isinstance(p, DTensor)]
        if sharded:
            raise RuntimeError(
                f"backend='kosmos' found {', '.join(sharded)} still sharded (DTensor) at the call: its kernels read "
                "the parameters of the layer's gate, experts and shared experts as plain local tensors, without "
                "calling those modules. With FSDP2, wrap the ExpertLayer as a whole (fully_shard(layer)), not those "
                "submodules; other DTensor shardings of them are not supported"
            )

    def _trains(self, tokens: torch.Tensor) -> bool:
        """Whether a call on ``tokens`` builds a graph for a backward (else it keeps nothing)."""
        return torch.is_grad_enabled() and (tokens.requires_grad or any(p.requires_grad for p in self.parameters()))

    def _recompute_aux_loss(self, tokens: torch.Tensor) -> None:
        # The kernel keeps the router scores on chip; the auxiliary loss recomputes them.
        self.aux_loss = None
        if self.compute_aux_loss:
            routing = self.gate(tokens)
            self.aux_loss = switch_aux_loss(routing.scores, routing.experts, self.config.num_experts)

    # ----------------------------------------------------------------------------------------
    # Load balancing and checkpoints.

    @torch.no_grad()
    def update_router_bias(
        self, rate: float = BIAS_UPDATE_RATE, group: dist.ProcessGroup | None = None
    ) -> torch.Tensor:
        """Apply one aux-loss-free balancing step from the load seen since the last step.

        Call once per optimizer step. The load is summed over the expert-parallel group and,
        if given, over ``group`` as well (e.g. the data-parallel group), so that every replica
        of the router applies the same update. Returns the global load that was used.
        """
        bias = self.gate.e_score_correction_bias
        if bias is None:
            raise RuntimeError("update_router_bias needs router='sigmoid_group'; softmax routing has no bias")
        load = self.load_since_bias_update.clone()
        for g in {self.group, group} - {None}:
            dist.all_reduce(load, group=g)
        update_correction_bias(bias, load, rate)
        self.load_since_bias_update.zero_()
        return load

    def load_full_state_dict(self, state_dict: Mapping[str, torch.Tensor], strict: bool = True):
        """Load a checkpoint holding all ``num_experts`` experts, keeping this rank's slice."""
        first, last = self.local_expert_range
        local = {}
        for name, tensor in state_dict.items():
            if name in _EXPERT_PARAMS:
                if tensor.shape[0] != self.config.num_experts:
                    raise ValueError(
                        f"{name} has {tensor.shape[0]} experts, expected all {self.config.num_experts}"
                    )
                tensor = tensor[first:last]
            local[name] = tensor
        return self.load_state_dict(local, strict=strict)

    def extra_repr(self) -> str:
        c = self.config
        return (
            f"hidden={c.hidden_size}, intermediate={c.moe_intermediate_size}, experts={c.num_experts} "
            f"(local {self.num_local_experts} on rank {self.ep_rank}/{self.ep_world}), top_k={c.top_k}, "
            f"router={c.router}, shared={c.num_shared_experts}, backend={self.backend}"
        )
