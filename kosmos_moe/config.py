"""The shape and routing hyper-parameters of one MoE layer, checked once at construction."""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, replace
from typing import Literal

RouterKind = Literal["softmax", "sigmoid_group"]
ROUTERS: tuple[str, ...] = ("softmax", "sigmoid_group")


def _is_bool(value) -> bool:
    # numpy's bool (np.bool_, named "bool" since numpy 2) is no subclass of Python's.
    return isinstance(value, bool) or (type(value).__module__ == "numpy" and type(value).__name__ in ("bool", "bool_"))


def _is_int(value) -> bool:
    return isinstance(value, numbers.Integral) and not _is_bool(value)


def smallest_expert_count(top_k: int, n_group: int, topk_group: int) -> int:
    """The fewest experts group-limited routing allows (counts must also be multiples of
    ``n_group``): the ``topk_group`` groups a token keeps must hold ``top_k`` experts."""
    return n_group * math.ceil(top_k / topk_group)


@dataclass(frozen=True)
class MoEConfig:
    """Hyper-parameters of an expert layer, independent of parallelism and backend."""

    hidden_size: int
    moe_intermediate_size: int
    num_experts: int
    top_k: int
    router: RouterKind = "softmax"
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    norm_topk_prob: bool = True
    num_shared_experts: int = 0

    def __post_init__(self) -> None:
        # Integers and reals of any kind (numpy's from a config file too) are stored as Python
        # ones; bool is an int to Python, but hidden_size=True is a mistake, not a width of one.
        for name in ("hidden_size", "moe_intermediate_size", "num_experts", "top_k", "n_group", "topk_group"):
            value = getattr(self, name)
            if not _is_int(value) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
            object.__setattr__(self, name, int(value))
        shared = self.num_shared_experts
        if not _is_int(shared) or shared < 0:
            raise ValueError(f"num_shared_experts must be an int >= 0, got {shared!r}")
        object.__setattr__(self, "num_shared_experts", int(shared))
        scale = self.routed_scaling_factor
        if _is_bool(scale) or not isinstance(scale, numbers.Real) or not math.isfinite(scale) or scale <= 0:
            raise ValueError(f"routed_scaling_factor must be a positive finite number, got {scale!r}")
        object.__setattr__(self, "routed_scaling_factor", float(scale))
        if not _is_bool(self.norm_topk_prob):
            raise ValueError(f"norm_topk_prob must be True or False, got {self.norm_topk_prob!r}")
        object.__setattr__(self, "norm_topk_prob", bool(self.norm_topk_prob))
        if self.router not in ROUTERS:
            raise ValueError(f"router must be one of {ROUTERS}, got {self.router!r}")
        if self.top_k > self.num_experts:
            raise ValueError(f"top_k={self.top_k} exceeds num_experts={self.num_experts}")
        if self.router == "softmax" and (self.n_group != 1 or self.topk_group != 1):
            raise ValueError(
                "group-limited routing (n_group/topk_group) is only defined for router='sigmoid_group'; "
                f"got n_group={self.n_group}, topk_group={self.topk_group} with router='softmax'"
            )
        if self.num_experts % self.n_group != 0:
            raise ValueError(f"num_experts={self.num_experts} is not divisible by n_group={self.n_group}")
        if self.topk_group > self.n_group:
            raise ValueError(f"topk_group={self.topk_group} exceeds n_group={self.n_group}")
        experts_per_group = self.num_experts // self.n_group
        if self.topk_group * experts_per_group < self.top_k:
            raise ValueError(
                f"topk_group * (num_experts / n_group) = {self.topk_group} * {experts_per_group} "
                f"= {self.topk_group * experts_per_group} experts survive group selection, "
                f"fewer than top_k={self.top_k}"
            )

    @property
    def experts_per_group(self) -> int:
        return self.num_experts // self.n_group

    @property
    def shared_intermediate_size(self) -> int:
        return self.moe_intermediate_size * self.num_shared_experts

    def with_overrides(self, **overrides) -> "MoEConfig":
        return replace(self, **overrides)


DEEPSEEK_V3 = MoEConfig(
    hidden_size=7168,
    moe_intermediate_size=2048,
    num_experts=256,
    top_k=8,
    router="sigmoid_group",
    n_group=8,
    topk_group=4,
    routed_scaling_factor=2.5,
    norm_topk_prob=True,
    num_shared_experts=1,
)

QWEN3_235B = MoEConfig(
    hidden_size=4096,
    moe_intermediate_size=1536,
    num_experts=128,
    top_k=8,
    router="softmax",
    norm_topk_prob=True,
    num_shared_experts=0,
)
