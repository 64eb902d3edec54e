"""Per pipeline chunk, the sums predict() prices per micro-batch (compute, tensor-parallel
communication, recomputation and memory inputs, from a LayerTable's prefix sums), and a
stage's chunks summed."""

from __future__ import annotations

from dataclasses import dataclass

from planner.cluster.profile import ClusterProfile
from planner.evaluate.config import ParallelConfig
from planner.evaluate.layer_table import LayerTable
from planner.parallel import checkpointing


@dataclass
class ChunkCost:
    """One pipeline chunk's sums per micro-batch (time, s; memory inputs, bytes/elements)."""

    fwd: float = 0.0
    bwd: float = 0.0
    comm_fwd: float = 0.0
    comm_bwd: float = 0.0
    recompute: float = 0.0
    p2p: float = 0.0
    overhead: float = 0.0  # the executor's own per-micro-batch cost (measured profiles)
    wgrad: float = 0.0  # the parameter-gradient part of bwd (node_costs.NodeCost.wgrad)
    wgrad_stash: int = 0  # NodeCost.wgrad_stash summed
    step_comm: float = 0.0
    params: int = 0
    saved: int = 0
    saved_outside_layers: int = 0
    saved_after_layers: int = 0  # of saved_outside_layers, what the chunk saves after its layers
    workspace: int = 0  # NodeCost.workspace summed: transient, once per step (not per micro-batch)
    layer_inputs: int = 0
    largest_layer_saved: int = 0
    largest_layer_params: int = 0

    @property
    def total(self) -> float:
        return (
            self.fwd
            + self.bwd
            + self.comm_fwd
            + self.comm_bwd
            + self.recompute
            + self.p2p
            + self.overhead
        )


def chunk_costs(table: LayerTable, ckpt, ranges: list[tuple], kept: list[int]) -> list[ChunkCost]:
    """Per chunk: compute, tp communication, recomputation and memory inputs; `kept`: the
    bytes of its output it keeps per micro-batch, whatever the checkpointing."""
    extra, extra_by_layer = table.tied_elements([a for a, _ in ranges])
    inside_params = table.inside["params"]
    fwd, bwd, comm_fwd, comm_bwd, step_comm, saved, params, outside_saved, wgrad, work, stash = (
        table.prefix(key)
        for key in (
            "all:fwd",
            "all:bwd",
            "all:comm_fwd",
            "all:comm_bwd",
            "all:step_comm",
            "all:saved",
            "all:params",
            "outside:saved",
            "all:wgrad",
            "all:workspace",
            "all:wgrad_stash",
        )
    )
    chunks = []
    for c, (a, b) in enumerate(ranges):
        if extra_by_layer:
            largest_params = max(
                (inside_params[i] + extra_by_layer.get(i, 0) for i in range(a, b)), default=0
            )
        else:
            largest_params = max(inside_params[a:b], default=0)
        ch = ChunkCost(
            fwd=fwd[b] - fwd[a],
            bwd=bwd[b] - bwd[a],
            comm_fwd=comm_fwd[b] - comm_fwd[a],
            comm_bwd=comm_bwd[b] - comm_bwd[a],
            step_comm=step_comm[b] - step_comm[a],
            wgrad=wgrad[b] - wgrad[a],
            # torch's first pipeline stage skips the B pass: its W pass runs the whole
            # backward, so nothing waits between them there
            wgrad_stash=stash[b] - stash[a] if c else 0,
            saved=saved[b] - saved[a] + kept[c],
            params=params[b] - params[a] + extra[c],
            saved_outside_layers=outside_saved[b] - outside_saved[a] + kept[c],
            saved_after_layers=table.saved_after(b - 1),
            workspace=work[b] - work[a],
            layer_inputs=checkpointing.kept_of(table, a, b, ckpt),
            largest_layer_saved=checkpointing.rebuilt_of(table, a, b, ckpt),
            largest_layer_params=largest_params,
        )
        ch.recompute = checkpointing.recompute_of(table, a, b, ckpt)
        chunks.append(ch)
    return chunks


def add_overhead(chunks, cluster: ClusterProfile, config: ParallelConfig, ranges) -> None:
    """The executor's own per-micro-batch costs, where the profile measured them."""
    overhead = cluster.measured.executor_overhead if cluster.measured else None
    if overhead is None:
        return
    per_layer = overhead.tp_layer_microbatch_s * (config.tp > 1)
    per_layer += overhead.fsdp_layer_microbatch_s * (config.dp > 1)
    for c, (a, b) in enumerate(ranges):
        chunks[c].overhead += per_layer * (b - a) + overhead.pp_microbatch_s * (len(ranges) > 1)


class StageSums:
    """A stage's chunks summed in one pass (its per-micro-batch time and memory inputs)."""

    def __init__(self, mine: list[ChunkCost]):
        self.params = self.saved = self.layer_inputs = self.saved_outside_layers = 0
        self.saved_after_layers = min((ch.saved_after_layers for ch in mine), default=0)
        self.workspace = 0
        self.largest_layer_params = self.largest_layer_saved = 0
        self.compute = self.comm = self.overhead = self.step_comm = self.bwd = 0.0
        self.wgrad = 0.0
        self.wgrad_stash = 0
        for ch in mine:
            self.params += ch.params
            self.saved += ch.saved
            self.layer_inputs += ch.layer_inputs
            self.saved_outside_layers += ch.saved_outside_layers
            # a rebuild frees one chunk's: the least of them
            self.saved_after_layers = min(self.saved_after_layers, ch.saved_after_layers)
            self.workspace = max(self.workspace, ch.workspace)
            self.largest_layer_params = max(self.largest_layer_params, ch.largest_layer_params)
            self.largest_layer_saved = max(self.largest_layer_saved, ch.largest_layer_saved)
            self.compute += ch.fwd + ch.bwd + ch.recompute
            self.comm += ch.comm_fwd + ch.comm_bwd + ch.p2p
            self.overhead += ch.overhead
            self.step_comm += ch.step_comm
            self.wgrad += ch.wgrad
            self.wgrad_stash += ch.wgrad_stash
            self.bwd += ch.bwd + ch.recompute + ch.comm_bwd
