"""A configuration to evaluate: mesh (pp, dp, tp), micro-batches, schedule, ZeRO level and
checkpointing, and how the model's layers are split into pipeline chunks. Errors name the
plan's fields (`mesh.tp`); the CLI shows its own flag beside them."""

from __future__ import annotations

from dataclasses import dataclass

from planner.cluster.profile import ClusterProfile
from planner.cost.schedule_v import holds_every_chunk_at_once
from planner.cost.schedules import check_schedule
from planner.errors import InputError
from planner.graph.opgraph import OpGraph
from planner.parallel import data, expert, fp8, offload
from planner.parallel.checkpointing import PARTIAL, modes
from planner.parallel.pipeline import not_runnable, replay_refusal, zero_refusal
from planner.parallel.registry import exchange_of, exchanges, store_of
from planner.parallel.tensor import heads_refusal
from planner.parallel_dims import ParallelDims
from planner.runtime import runtime_of
from planner.units import plural
from planner.vocab import ZERO_LEVELS


@dataclass(frozen=True)
class ParallelConfig:
    dp: int
    tp: int
    pp: int
    microbatches: int
    schedule: str = "1f1b"
    virtual_stages: int = 1
    zero: int = 0
    checkpointing: bool | str = False  # planner.parallel.checkpointing.modes()
    # HSDP (planner.parallel.data): ZeRO shards over groups of dp_shard neighbouring dp ranks
    # and replicates across them; 0 shards over all of dp.
    dp_shard: int = 0
    # Context parallelism (planner.parallel.context): groups of cp neighbouring dp ranks split
    # each sample's sequence; the batch is split over dp / cp replicas.
    cp: int = 1
    # how the cp group exchanges attention's inputs (planner.parallel.registry.exchanges)
    cp_comm: str = "all_gather"
    # CPU offload of ZeRO-3's shards (planner.parallel.offload)
    offload: bool = False
    # fp8 matmuls' recipe (planner.parallel.fp8), None for none
    fp8: str | None = None
    # Expert parallelism (planner.parallel.expert): groups of ep neighbouring dp ranks split
    # each MoE layer's experts; expert tp (etp) 1 beside tp > 1: the ep groups drawn from the
    # dp x tp ranks instead, experts whole (0: as the layout splits them)
    ep: int = 1
    etp: int = 0
    # Layer-wise ZeRO (planner.parallel.data): with ZeRO-3, the fewest first layers that fit
    # at ZeRO-3, the others at ZeRO-2
    layerwise_zero: bool = False

    @property
    def dims(self) -> ParallelDims:
        """The degrees as torchtitan and Megatron-LM count them (dp without the cp ranks)."""
        grid = (self.pp, self.dp, self.tp)
        shard = self.dp_shard or None
        return ParallelDims.of_grid(grid, self.cp, shard, self.cp_comm, self.ep, self.etp)

    @property
    def folded(self) -> bool:
        """Whether the ep groups span tp ranks (ParallelDims.folded)."""
        return self.dims.folded

    @property
    def edp(self) -> int:
        """The expert-data-parallel ranks: those holding the same experts, over which their
        gradients are synchronised and their ZeRO state sharded."""
        return self.dp * (self.tp if self.folded else 1) // self.ep

    @property
    def replicas(self) -> int:
        """How many dp ranks take samples of their own (dp / cp)."""
        return self.dp // self.cp

    @property
    def shard_degree(self) -> int:
        """How many dp ranks share one copy of the sharded state (dp without HSDP)."""
        return self.dp_shard or self.dp

    @property
    def hybrid(self) -> bool:
        return 0 < self.dp_shard < self.dp

    @property
    def dense_state_holding(self) -> tuple[int, int]:
        """(pp, micro-batches) that decide how the runtime holds every parameter's gradients
        (Runtime.holds_whole_gradients), for estimates that price all parameters alike:
        with experts, whose ZeRO group may be one rank holding them as the layout says
        (predict prices them apart), and where a device does not hold all its chunks' at
        once (schedule_v.holds_every_chunk_at_once), those of a step without a pipeline and
        one micro-batch, never more bytes."""
        every = holds_every_chunk_at_once(
            self.schedule, self.pp, self.microbatches, self.virtual_stages
        )
        return (self.pp, self.microbatches) if self.ep == 1 and every else (1, 1)

    def validate(
        self,
        cluster: ClusterProfile,
        global_batch: int,
        layers: int,
        model_config: dict | None = None,
        dtype: str = "bf16",
        runtime: str = "autopar",
    ) -> None:
        for name, field in (
            ("dp", "mesh.dp"),
            ("tp", "mesh.tp"),
            ("pp", "mesh.pp"),
            ("microbatches", "schedule.microbatches"),
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise InputError(field, f"{value!r} is not a positive integer", ">= 1")
        if self.dp * self.tp * self.pp != cluster.num_devices:
            raise InputError(
                "mesh",
                f"pp x dp x cp x tp = {self.dp * self.tp * self.pp} but the cluster has "
                f"{cluster.num_devices} devices ({plural(cluster.nodes, 'node')} x "
                f"{cluster.devices_per_node})",
                "a product equal to the device count",
            )
        if not isinstance(self.cp, int) or self.cp < 1 or self.dp % self.cp:
            why = f"{self.cp!r} does not divide dp {self.dp}"
            raise InputError("mesh.cp", why, "a divisor of dp")
        if self.cp_comm not in exchanges():
            raise InputError("mesh.cp_comm", repr(self.cp_comm), ", ".join(exchanges()))
        if self.cp > 1 and (
            why := exchange_of(self.cp_comm).refusal(model_config or {}, self.cp, self.tp)
        ):
            raise InputError("mesh.cp_comm", why, "another exchange, cp or tp (all_gather: any)")
        if global_batch % (self.replicas * self.microbatches):
            per = "dp/cp" if self.cp > 1 else "dp"
            raise InputError(
                "training.global_batch_size",
                f"{global_batch} is not divisible by {per}*microbatches = "
                f"{self.replicas * self.microbatches}",
                f"a multiple of {per} * microbatches",
            )
        check_schedule(self.schedule, self.virtual_stages)
        why = heads_refusal(model_config or {}, self.tp)
        if why:
            raise InputError("mesh.tp", why, "a tp that divides the attention and key/value heads")
        if self.checkpointing not in modes():
            raise InputError(
                "stages[].activation_checkpointing",
                f"{self.checkpointing!r} is not a checkpointing mode",
                ", ".join(str(m).lower() for m in modes()),
            )
        if self.zero not in ZERO_LEVELS:
            raise InputError("zero", f"{self.zero!r} is not a ZeRO stage", "0, 1, 2 or 3")
        why = zero_refusal(self.schedule, self.zero)
        if why:
            raise InputError("zero", why, "ZeRO 0 to 2, or another schedule")
        if why := runtime_of(runtime).refusal(self.zero):
            raise InputError("zero", why, "a ZeRO level the runtime runs (training.runtime)")
        why = data.hybrid_refusal(self.dp, self.dp_shard, self.zero)
        if why:
            raise InputError("mesh.dp_shard", why, "a divisor of dp, with ZeRO 1-3")
        store = store_of(self.checkpointing)
        if store is not None and (why := store.refusal(cluster)):
            expected = f"a cluster {store.label} runs on"
            raise InputError(f"stages[].{store.stage_field}", why, expected)
        why = self.layerwise_zero and data.layerwise_refusal(
            self.pp,
            self.dp,
            self.zero,
            self.hybrid,
            self.offload,
            self.ep,
            self.checkpointing == PARTIAL,
            runtime,
        )
        if why:
            raise InputError("stages[].resharded_layers", why, "one ZeRO level for all layers")
        why = offload.refusal(self.zero, self.dp, cluster) if self.offload else None
        if why:
            raise InputError("stages[].cpu_offload", why, "ZeRO-3 on a profile with a host link")
        device = cluster.device
        why = fp8.refusal(self.fp8, device.kernels, device.peak_flops, dtype)
        if why:
            raise InputError("fp8", why, "no fp8, or a bf16 run on a device with fp8 tensor cores")
        why = expert.mesh_refusal(
            expert.expert_count(model_config),
            self.ep,
            self.dp,
            self.tp,
            self.cp,
            self.zero,
            self.dp_shard,
            runtime,
            split_over_tp=expert.split_over_tp(model_config),
            etp=self.etp,
        )
        if why:
            raise InputError("mesh.ep", why, "a divisor of dp and of the experts, or 1")
        if self.cp > 1 and self.hybrid:
            raise InputError(
                "mesh.cp", "context parallelism with HSDP is not supported", "dp_shard unset"
            )
        chunks = self.pp * self.virtual_stages
        if layers < chunks:
            raise InputError(
                "mesh.pp",
                f"{chunks} pipeline chunks but the model has only {layers} layers",
                f"pp * virtual_stages <= {layers}",
            )
        why = replay_refusal(self.schedule, self.pp, self.virtual_stages, self.microbatches)
        if why:
            raise InputError("schedule.microbatches", why, "fewer micro-batches")
        why = not_runnable(self.schedule, self.pp, self.microbatches)
        if why:
            raise InputError("schedule.microbatches", why, "more micro-batches, or gpipe")

    def microbatch_size(self, global_batch: int) -> int:
        return global_batch // (self.replicas * self.microbatches)

    def ranks(self) -> list[list[list[int]]]:
        """Global ranks as [pp][dp][tp], tp fastest (tp groups on neighbouring devices)."""
        dp, tp = self.dp, self.tp
        return [
            [[s * dp * tp + d * tp + t for t in range(tp)] for d in range(dp)]
            for s in range(self.pp)
        ]


def split_layers(num_layers: int, chunks: int) -> list[tuple[int, int]]:
    """Contiguous, balanced [start, end) layer ranges."""
    base, extra = divmod(num_layers, chunks)
    out, start = [], 0
    for c in range(chunks):
        end = start + base + (1 if c < extra else 0)
        out.append((start, end))
        start = end
    return out


def assign_chunks(graph: OpGraph, ranges: list[tuple[int, int]]) -> dict[str, int]:
    """Chunk index per node: by layer position (nodes outside layers go with their
    neighbours: embedding with the first chunk, head and loss with the last)."""
    chunk_of_layer = {}
    for c, (a, b) in enumerate(ranges):
        for layer in range(a, b):
            chunk_of_layer[layer] = c
    pos = graph.positions
    return {n.name: chunk_of_layer[pos[n.name]] for n in graph.nodes}
