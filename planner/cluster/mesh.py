"""Logical device meshes over a cluster's ranks, and the link each mesh axis communicates over."""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from math import prod

from planner.cluster.profile import ClusterProfile
from planner.errors import InputError


@dataclass(frozen=True)
class MeshAxis:
    """One axis of a logical mesh as the cost model sees it."""

    name: str
    size: int
    bandwidth: float  # bytes/s per device, datasheet (efficiency applied by the cost model)
    latency: float  # seconds per hop
    crosses_nodes: bool

    @property
    def tier(self) -> str:
        return "inter_node" if self.crosses_nodes else "intra_node"


@dataclass(frozen=True)
class LogicalMesh:
    """A row-major (dp, tp) mesh over `ranks` (the last axis varies fastest)."""

    cluster: ClusterProfile
    ranks: tuple[int, ...]
    shape: tuple[int, ...]
    axis_names: tuple[str, ...] = ("dp", "tp")

    def __post_init__(self) -> None:
        size = 1
        for d in self.shape:
            size *= d
        if size != len(self.ranks):
            raise InputError(
                "mesh", f"shape {self.shape} has {size} devices but {len(self.ranks)} ranks given"
            )
        if len(self.shape) != len(self.axis_names):
            raise InputError("mesh", f"{len(self.shape)} dims but axes {self.axis_names}")

    @classmethod
    def contiguous(
        cls, cluster: ClusterProfile, first_rank: int, shape: tuple[int, ...]
    ) -> LogicalMesh:
        n = 1
        for d in shape:
            n *= d
        return cls(cluster, tuple(range(first_rank, first_rank + n)), tuple(shape))

    def groups(self, axis: int) -> list[list[int]]:
        """Device groups that communicate along `axis` (one per other-axes coordinate)."""
        stride = 1
        for d in self.shape[axis + 1 :]:
            stride *= d
        size = self.shape[axis]
        block = stride * size
        out = []
        for start in range(0, len(self.ranks), block):
            for offset in range(stride):
                out.append([self.ranks[start + offset + k * stride] for k in range(size)])
        return out

    @cached_property
    def axes(self) -> tuple[MeshAxis, ...]:
        result = []
        for i, name in enumerate(self.axis_names):
            worst = None
            for group in self.groups(i):
                bw, lat, crosses = self.cluster.group_link(group)
                if worst is None or bw < worst[0]:
                    worst = (bw, lat, crosses)
            assert worst is not None
            bw, lat, crosses = worst
            if self.shape[i] == 1:
                crosses = False
            result.append(MeshAxis(name, self.shape[i], bw, lat, crosses))
        return tuple(result)

    def axis(self, name: str) -> MeshAxis:
        return self.axes[self.axis_names.index(name)]


_AXES: dict[tuple, tuple[ClusterProfile, tuple[MeshAxis, ...]]] = {}


def contiguous_axes(
    cluster: ClusterProfile,
    first_rank: int,
    shape: tuple[int, ...],
    names: tuple[str, ...] = ("dp", "tp"),
) -> tuple[MeshAxis, ...]:
    """The axes of LogicalMesh.contiguous(cluster, first_rank, shape), memoised: on nodes of
    equal devices they depend only on where the block starts within its node (finding them
    walks every rank, which on 16,384 devices costs milliseconds per configuration)."""
    offset = first_rank % cluster.devices_per_node
    key = (id(cluster), offset, tuple(shape), names)
    hit = _AXES.get(key)
    if hit is None or hit[0] is not cluster:  # the profile object is kept, so ids stay unique
        if len(_AXES) > 4096:
            _AXES.clear()
        ranks = tuple(range(offset, offset + prod(shape)))
        hit = (cluster, LogicalMesh(cluster, ranks, tuple(shape), names).axes)
        _AXES[key] = hit
    return hit[1]
