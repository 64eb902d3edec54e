"""How much work planning a request takes, estimated before any of it starts.

The service refuses a request whose estimate exceeds its per-job time limit (a 422 naming
what is too big) instead of starting a job that the limit would kill. The estimate counts
what the search's cost grows with: traced layers (two traces), and the (mesh, micro-batch,
context-parallel degree) combinations the search evaluates, each of which runs the stage DP
over the layers. The rates
are measured by `bench/planning_work.py` on the 2-core development machine
(bench/results/planning_work.md) and rounded up, so the estimate errs long.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from planner.cluster.profile import ClusterProfile

# Seconds per traced layer (one trace, meta device) and per search unit, a (combination x
# layer x devices^0.1); both the largest rate in bench/results/planning_work.md, rounded up.
# With shallow traces, per-layer tables and lower bounds the cost grows little with
# devices: llama3-70b on 64, 256 and 1,024 H100 took 17, 21 and 22 s of search
# (bench/results/search_scale.md), which devices^0.1 covers; tracing is nearly flat in depth
# now, so the per-layer rate errs long for deep models.
TRACE_S_PER_LAYER = 0.1
SEARCH_S_PER_UNIT = 3e-3
DEVICE_EXPONENT = 0.1
# The search clusters a graph without repeated blocks into at most this many layers.
MAX_CLUSTERED_LAYERS = 16


@dataclass(frozen=True)
class Work:
    layers: int
    devices: int
    combinations: int
    trace_s: float
    search_s: float

    @property
    def seconds(self) -> float:
        return self.trace_s + self.search_s

    def describe(self) -> str:
        return (
            f"about {self.seconds:,.0f} s: {self.layers:,} layers traced twice and "
            f"{self.combinations:,} mesh x micro-batch combinations on {self.devices:,} devices"
        )


def combinations(
    cluster: ClusterProfile, layers: int, global_batch: int, family: str = "", seq_len: int = 0
) -> int:
    """(pp, dp, tp, micro-batch size, cp) combinations the default search evaluates (cp for
    the model family and sequence length: planner.parallel.context.cp_options). A cp
    combination's sequence exchanges are counted once: they share its tables, and searching
    three of them instead of one took 1.10x (cold) to 1.23x (warm) the time at 128K
    (bench/results/search_ab_long_context.md): inside the rates' margin (the largest
    measured, 2.04e-3 s per unit, times 1.23 is below SEARCH_S_PER_UNIT)."""
    return _count(
        cluster.num_devices, cluster.devices_per_node, layers, global_batch, family, seq_len
    )


@lru_cache(maxsize=1024)
def _count(
    devices: int, per_node: int, layers: int, global_batch: int, family: str, seq_len: int
) -> int:
    """The count, which depends on the cluster only through its devices and devices per
    node (planner.search.space.meshes), kept per shape: enumerating them took 10-20 ms a
    request on large clusters, repeated for every request (and a sizing's every size)."""
    from planner.parallel import context
    from planner.search import space

    meshes = space.grids(devices, per_node, max(layers, 1), None)
    return len(
        space.combinations(
            meshes,
            global_batch,
            space.SearchOptions(),
            lambda dp: context.cp_options(family, seq_len, dp, None),
        )
    )


def planning_work(
    cluster: ClusterProfile,
    layers: int,
    global_batch: int,
    traced: bool = True,
    family: str = "",
    seq_len: int = 0,
) -> Work:
    """The estimate for a model of `layers` repeated blocks (`traced`: from a model spec,
    so two traces; False: from a graph, no tracing) of `family` at `seq_len` tokens."""
    combos = combinations(cluster, layers, global_batch, family, seq_len)
    units = combos * max(layers, 1) * cluster.num_devices**DEVICE_EXPONENT
    trace_s = 2 * layers * TRACE_S_PER_LAYER if traced else 0.0
    return Work(layers, cluster.num_devices, combos, trace_s, units * SEARCH_S_PER_UNIT)
