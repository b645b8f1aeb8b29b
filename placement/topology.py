"""Cluster topology for expert parallelism.

Glossary (the names used everywhere in this project):

- logical expert: an expert of the model, ``0 .. num_logical_experts - 1``.
- physical expert (slot): a place on a GPU that holds one replica of a logical expert.
  EP rank (GPU) ``g`` owns the contiguous slots ``[g*S, (g+1)*S)`` with ``S = slots_per_gpu``.
- node: ``m = ep_size // num_nodes`` consecutive GPUs; node ``n`` owns GPUs ``[n*m, (n+1)*m)``.
- redundant experts: ``num_physical_experts - num_logical_experts`` extra slots per layer.

Worked example: DeepSeek-V3 with 256 logical experts and 32 redundant ones on 32 GPUs in 4 nodes:
288 physical experts, 9 slots per GPU, 8 GPUs per node.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from moe_placement.base.limits import MAX_EXPERTS, MAX_RANKS

__all__ = ["Topology"]

# Upper bound of each size (the limit and its name): a corrupt file or a typo cannot make a topology
# whose derived maps (``gpu_of_slot [P]``, a placement's ``[L, P]``) take gigabytes.
_LIMITS = {
    "ep_size": (MAX_RANKS, "MAX_RANKS"),
    "num_physical_experts": (MAX_EXPERTS, "MAX_EXPERTS"),
    "num_nodes": (MAX_RANKS, "MAX_RANKS"),
}


def _divisors_near(n: int, limit: int = 6) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0][:limit]


@dataclass(frozen=True)
class Topology:
    """How physical expert slots map to GPUs and nodes.

    Args:
        ep_size: number of expert-parallel ranks (GPUs), ``G``.
        num_physical_experts: slots per layer over all GPUs, ``P``; must divide by ``ep_size``.
        num_nodes: nodes, ``N``; must divide ``ep_size``.
    """

    ep_size: int
    num_physical_experts: int
    num_nodes: int = 1

    def __post_init__(self) -> None:
        for name in ("ep_size", "num_physical_experts", "num_nodes"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
                raise ValueError(f"{name} must be an integer, got {value!r}")
            if value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
            limit, limit_name = _LIMITS[name]
            if value > limit:
                raise ValueError(
                    f"{name} is {value}, outside the accepted range 1..{limit} ({limit_name} in moe_placement/base/limits.py)"
                )
            object.__setattr__(self, name, int(value))
        if self.num_physical_experts % self.ep_size:
            lo = self.num_physical_experts - self.num_physical_experts % self.ep_size
            hi = lo + self.ep_size
            raise ValueError(
                f"{self.num_physical_experts} physical experts do not divide over ep_size={self.ep_size}; "
                f"use {lo} or {hi} physical experts (change the redundant count by "
                f"{lo - self.num_physical_experts:+d} or {hi - self.num_physical_experts:+d}), "
                f"or an ep_size that divides {self.num_physical_experts} "
                f"(e.g. {_divisors_near(self.num_physical_experts)})"
            )
        if self.ep_size % self.num_nodes:
            raise ValueError(
                f"ep_size={self.ep_size} does not divide over num_nodes={self.num_nodes}; "
                f"use a node count that divides {self.ep_size} (e.g. {_divisors_near(self.ep_size)})"
            )

    @classmethod
    def from_redundant(
        cls, num_logical_experts: int, num_redundant: int, ep_size: int, num_nodes: int = 1
    ) -> Topology:
        """Topology with ``num_logical_experts + num_redundant`` slots per layer."""
        given = dict(
            num_logical_experts=num_logical_experts,
            num_redundant=num_redundant,
            ep_size=ep_size,
            num_nodes=num_nodes,
        )
        for name, v in given.items():
            if isinstance(v, bool) or not isinstance(v, (int, np.integer)):
                raise ValueError(f"Topology.from_redundant: {name} must be an integer, got {v!r}")
        if num_redundant < 0:
            raise ValueError(f"num_redundant must be >= 0, got {num_redundant}")
        if not 1 <= num_logical_experts <= MAX_EXPERTS:
            raise ValueError(
                f"num_logical_experts is {num_logical_experts}, outside the accepted range 1..{MAX_EXPERTS} "
                f"(MAX_EXPERTS)"
            )
        if num_logical_experts + num_redundant > MAX_EXPERTS:
            raise ValueError(
                f"{num_logical_experts} logical + {num_redundant} redundant = {num_logical_experts + num_redundant} "
                f"physical experts per layer, over the accepted {MAX_EXPERTS} (MAX_EXPERTS); use at most "
                f"{MAX_EXPERTS - num_logical_experts} redundant experts"
            )
        total = num_logical_experts + num_redundant
        if isinstance(ep_size, int) and ep_size >= 1 and total % ep_size:
            up = num_redundant + (-total) % ep_size
            down = up - ep_size
            options = f"{down} or {up}" if down >= 0 else f"{up}"
            raise ValueError(
                f"{num_logical_experts} logical + {num_redundant} redundant = {total} physical experts do "
                f"not divide over ep_size={ep_size}; use {options} redundant experts, or another ep_size"
            )
        return cls(ep_size=ep_size, num_physical_experts=total, num_nodes=num_nodes)

    @property
    def slots_per_gpu(self) -> int:
        """``S = P // G``."""
        return self.num_physical_experts // self.ep_size

    @property
    def gpus_per_node(self) -> int:
        """``m = G // N``."""
        return self.ep_size // self.num_nodes

    @property
    def gpu_of_slot(self) -> np.ndarray:
        """int64 ``[P]``: the EP rank that owns each slot."""
        return np.arange(self.num_physical_experts, dtype=np.int64) // self.slots_per_gpu

    @property
    def node_of_gpu(self) -> np.ndarray:
        """int64 ``[G]``: the node of each EP rank."""
        return np.arange(self.ep_size, dtype=np.int64) // self.gpus_per_node

    @property
    def node_of_slot(self) -> np.ndarray:
        """int64 ``[P]``: the node that owns each slot."""
        return self.gpu_of_slot // self.gpus_per_node

    def to_dict(self) -> dict:
        return {
            "ep_size": self.ep_size,
            "num_nodes": self.num_nodes,
            "num_physical_experts": self.num_physical_experts,
            "slots_per_gpu": self.slots_per_gpu,
        }

    @classmethod
    def from_dict(cls, d: dict) -> Topology:
        try:
            topo = cls(
                ep_size=d["ep_size"],
                num_physical_experts=d["num_physical_experts"],
                num_nodes=d.get("num_nodes", 1),
            )
        except KeyError as exc:
            raise ValueError(
                f"topology is missing key {exc.args[0]!r}; expected ep_size, num_physical_experts, num_nodes"
            ) from None
        spg = d.get("slots_per_gpu")
        if spg is not None and spg != topo.slots_per_gpu:
            raise ValueError(
                f"topology says slots_per_gpu={spg} but {topo.num_physical_experts} slots over "
                f"ep_size={topo.ep_size} give {topo.slots_per_gpu}"
            )
        return topo
