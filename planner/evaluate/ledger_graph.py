"""Graph mode's own ledger terms (executor.graph_mode, executor.graph_pipeline): what a
plan run node by node with DTensor sends between pipeline stages and for its loss. The
rest of its ledger (layouts' tp events, data parallelism, tied embeddings) is the module
path's (planner.evaluate.ledger)."""

from __future__ import annotations

from planner.cost.schedule_v import device_of_chunk
from planner.graph.dependence import parameter_free
from planner.graph.opgraph import OpGraph
from planner.placements import PARTIAL, shard_dim


def crossing_values(graph: OpGraph, layouts, chunk_of, tp: int) -> list[list[tuple[int, bool]]]:
    """Graph mode (executor.graph_pipeline): per cut after chunk c, each value made at or
    before c and used after it, as (bytes of its local shard, whether a gradient comes back:
    a float that depends on a parameter). Every such value travels through each stage
    between, graph inputs too (the labels, to the loss on the last stage), each in its
    producer's tp placement (partial sums reduced first, so whole)."""
    cuts: list[list[tuple[int, bool]]] = [[] for _ in range(max(chunk_of.values(), default=0))]
    last_use: dict[tuple[str, int], int] = {}
    size: dict[tuple[str, int], tuple[int, bool]] = {}
    free = parameter_free(graph)
    for e in graph.edges:
        key = (e.src, e.src_output)
        last_use[key] = max(last_use.get(key, 0), chunk_of[e.dst])
        outputs = layouts[e.src].outputs
        d = shard_dim(outputs[e.src_output]) if e.src_output < len(outputs) else None
        split = tp > 1 and d is not None and -len(e.shape) <= d < len(e.shape)
        grad = e.dtype.startswith(("float", "bfloat")) and e.src not in free
        size[key] = (e.bytes // tp if split else e.bytes, grad)
    for key, until in last_use.items():
        for c in range(chunk_of[key[0]], until):
            cuts[c].append(size[key])
    return cuts


def graph_loss(comm, config, nodes, layouts) -> None:
    """Graph mode's loss: a mean over a batch split on dp (and on tp where its layout leaves
    it partial) is a partial scalar, all-reduced for the loss each micro-batch, and its
    gradient all-reduced again before the loss's backward (DTensor's cross-entropy rule
    takes it replicated)."""
    m = config.microbatches
    for node in nodes:
        if node.kind != "loss" or not node.outputs:
            continue
        nbytes = node.outputs[0].nbytes
        outputs = layouts[node.name].outputs
        if config.tp > 1 and outputs and outputs[0] == PARTIAL:
            comm.add("all_reduce", "tp", nbytes, 2 * m)
        if config.dp > 1:
            comm.add("all_reduce", "dp", nbytes, 2 * m)


def graph_pipeline(comm, config, c: int, crossing) -> None:
    """Graph mode's sends: each crossing value its own send and receive per micro-batch,
    its gradient back where it has one."""
    m, p = config.microbatches, config.pp
    here = device_of_chunk(config.schedule, c, p)
    if c < len(crossing) and device_of_chunk(config.schedule, c + 1, p) != here:
        for nbytes, grad in crossing[c]:
            comm.add("send", "pp", nbytes, m)
            if grad:
                comm.add("recv", "pp", nbytes, m)
    if c > 0 and device_of_chunk(config.schedule, c - 1, p) != here:
        for nbytes, grad in crossing[c - 1]:
            comm.add("recv", "pp", nbytes, m)
            if grad:
                comm.add("send", "pp", nbytes, m)
