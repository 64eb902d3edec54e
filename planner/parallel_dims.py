"""The parallel degrees of a plan, named and counted as torchtitan and Megatron-LM count them:
the world is pp x dp x cp x tp, where dp counts data-parallel replicas of the batch (its
dp_replicate x dp_shard under HSDP) and cp the ranks that split each sample's sequence.

Inside a plan the ranks form a 3-D grid `ranks[pp][dp x cp][tp]` (planner.plan.MeshSpec's
`shape`): context-parallel groups are neighbouring ranks along its middle axis, so a grid's
middle extent counts dp and cp together. Requests, commands and printed summaries speak in
these named degrees; `grid` and `of_grid` convert."""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

from planner.errors import InputError


@dataclass(frozen=True)
class ParallelDims:
    pp: int = 1
    dp: int = 1  # replicas of the batch: dp_replicate x dp_shard
    cp: int = 1
    tp: int = 1
    dp_shard: int | None = None  # HSDP's shard groups of dp ranks; None: ZeRO over all of dp
    # the cp group's sequence exchange where it is not all-gather (planner.parallel.context)
    cp_comm: str | None = None
    # dp ranks that split each MoE layer's experts (planner.parallel.expert): drawn from dp,
    # not a factor of the world, as Megatron-LM and torchtitan count it
    ep: int = 1
    # expert tensor parallelism (planner.parallel.expert): 0 as the tp layout splits each
    # expert's features; 1 with tp > 1: experts whole, ep drawn from the dp x tp ranks
    etp: int = 0

    @property
    def folded(self) -> bool:
        """Whether the ep groups span tp ranks (expert tp 1 beside tp > 1: Megatron-Core's
        MoE parallel folding, torchtitan's etp = 1)."""
        return self.etp == 1 and self.tp > 1 and self.ep > 1

    @property
    def world(self) -> int:
        return self.pp * self.dp * self.cp * self.tp

    @property
    def dp_replicate(self) -> int:
        """HSDP's replicas of each shard group (1 without HSDP)."""
        return self.dp // self.dp_shard if self.dp_shard else 1

    @property
    def grid(self) -> tuple[int, int, int]:
        """The plan's rank grid (pp, dp x cp, tp)."""
        return self.pp, self.dp * self.cp, self.tp

    @classmethod
    def of_grid(
        cls,
        grid: tuple[int, int, int] | list[int],
        cp: int | None,
        dp_shard: int | None = None,
        cp_comm: str | None = None,
        ep: int | None = None,
        etp: int | None = None,
    ) -> ParallelDims:
        """The degrees of a rank grid (pp, dp x cp, tp) with `cp` (None: 1), HSDP's
        `dp_shard` (None or all of dp: no HSDP), the sequence exchange (None or
        all_gather: all-gather), expert parallelism's `ep` (None: 1) and expert tp (None:
        as the layout splits the experts)."""
        pp, ranks, tp = grid
        cp = cp or 1
        dp = ranks // cp
        shard = dp_shard if dp_shard and dp_shard < dp else None
        comm = cp_comm if cp > 1 and cp_comm != "all_gather" else None
        return cls(pp, dp, cp, tp, shard, comm, ep or 1, etp or 0)

    def mesh_pin(self) -> str:
        """The mesh as the pin spells it: PPxDPxTP (cp is a pin of its own)."""
        return f"{self.pp}x{self.dp}x{self.tp}"

    def summary(self) -> str:
        """'pp4 dp8 cp2 tp8' (cp where there is context parallelism, with its exchange
        where it is not all-gather: 'cp8 (ulysses)'; ep, within dp, where experts are split:
        'pp1 dp8 (ep4) tp1')."""
        cp = f" cp{self.cp}" if self.cp > 1 else ""
        cp += f" ({self.cp_comm})" if self.cp_comm else ""
        ep = f" (ep{self.ep})" if self.ep > 1 else ""
        if self.folded:  # ep over the dp x (cp x) tp ranks
            ranks = "dp x cp x tp" if self.cp > 1 else "dp x tp"
            return f"pp{self.pp} dp{self.dp}{cp} tp{self.tp} (ep{self.ep} over {ranks})"
        return f"pp{self.pp} dp{self.dp}{ep}{cp} tp{self.tp}"


class Combination(NamedTuple):
    """One (mesh, micro-batch size, cp) combination the search evaluates. `dp` is the rank
    grid's middle extent (dp x cp ranks, as ParallelConfig counts it); `dims` names the
    degrees as torchtitan counts them."""

    pp: int
    dp: int
    tp: int
    mbs: int
    cp: int = 1
    cp_comm: str = "all_gather"  # the cp group's sequence exchange (planner.parallel.context)
    ep: int = 1  # dp ranks that split the experts (planner.parallel.expert)
    etp: int = 0  # expert tp: 0 as the layout splits the experts, 1 with ep over dp x tp

    @property
    def grid(self) -> tuple[int, int, int]:
        return self.pp, self.dp, self.tp

    @property
    def dims(self) -> ParallelDims:
        grid, cp, comm = self.grid, self.cp, self.cp_comm
        return ParallelDims.of_grid(grid, cp, cp_comm=comm, ep=self.ep, etp=self.etp)

    @property
    def folded(self) -> bool:
        return self.dims.folded

    @property
    def replicas(self) -> int:
        """The batch is split over dp / cp replicas."""
        return self.dp // self.cp

    def halved(self) -> Combination:
        """The same tokens per rank with half the cp ranks and half the micro-batch."""
        cp = self.cp // 2
        comm = self.cp_comm if cp > 1 else Combination._field_defaults["cp_comm"]
        return self._replace(mbs=self.mbs // 2, cp=cp, cp_comm=comm)


def pinned_grid(
    mesh: tuple[int, int, int] | list[int], cp: int | None, devices: int | None, field: str
) -> tuple[int, int, int]:
    """The rank grid of a pinned mesh [pp, dp, tp] with a pinned `cp` (None: 1), where the
    world is pp x dp x cp x tp. A mesh that fills the world only when cp is counted inside dp
    (the meaning before torchtitan's counting was adopted) gets an error that says so."""
    pp, dp, tp = mesh
    cp = cp or 1
    dims = ParallelDims(pp, dp, cp, tp)
    if devices is not None and dims.world != devices:
        old = pp * dp * tp == devices and cp > 1 and dp % cp == 0
        hint = (
            f"; --cp counts its own ranks, as torchtitan and Megatron-LM count them (before, "
            f"cp was taken out of dp): the same split is mesh {pp}x{dp // cp}x{tp} with cp {cp}"
            if old
            else ""
        )
        raise InputError(
            field,
            f"{pp}x{dp}x{tp} with cp {cp} is pp x dp x cp x tp = {dims.world} ranks, but the "
            f"cluster has {devices} devices{hint}",
            "pp x dp x cp x tp equal to the device count",
        )
    return dims.grid
