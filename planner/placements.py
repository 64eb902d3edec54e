"""The one placement vocabulary, from the planner through the plan JSON to the executor.

A placement says how a tensor lies along one mesh axis: "R" (replicated), "S(d)" (sharded on
tensor dim d; negative d counts from the end) or "P" (partial sums, to be reduced). The
executor maps these to DTensor's Replicate(), Shard(d) and Partial(); the names are DTensor's
own short forms. Everything that reads or writes a placement string goes through here.
"""

from __future__ import annotations

import re

REPLICATE = "R"
PARTIAL = "P"
PATTERN = r"^(R|P|S\(-?\d+\))$"  # for schemas (planner.plan)
_SHARD = re.compile(r"^S\((-?\d+)\)$")


def shard(dim: int) -> str:
    return f"S({dim})"


def shard_dim(placement: str) -> int | None:
    """d of "S(d)"; None for "R", "P" or anything else."""
    m = _SHARD.match(placement)
    return int(m.group(1)) if m else None


def is_shard(placement: str) -> bool:
    return shard_dim(placement) is not None


def is_valid(placement: str) -> bool:
    return placement in (REPLICATE, PARTIAL) or is_shard(placement)
