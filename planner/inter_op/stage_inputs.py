"""The stage DP's inputs for one configuration: per-layer time and memory from the layout's
planner.evaluate.layer_table.LayerTable, what lies before the first and after the last layer,
the pipeline send per stage boundary, and the memory left for a stage."""

from __future__ import annotations

import math
from dataclasses import replace

from planner.cost.memory import state_bytes_per_param
from planner.cost.schedules import inflight_microbatches
from planner.evaluate.layer_table import LayerTable
from planner.inter_op.stage_dp import StageCosts, partition_stages
from planner.parallel.checkpointing import kept_per_layer, rebuilt_of, recompute_of
from planner.parallel.registry import store_of


def stage_costs(table: LayerTable, cfg, training, cluster, cm) -> StageCosts:
    n = table.num_positions
    state = state_bytes_per_param(
        training.dtype,
        training.optimizer,
        cfg.zero,
        cfg.shard_degree,
        cfg.offload,
        training.runtime,
        *cfg.dense_state_holding,
    )
    ins, out, pre = table.inside, table.outside, table.before_layers
    store = store_of(cfg.checkpointing)
    time_l, static_l, act_l = [], [], []
    for i in range(n):
        t = ins["fwd"][i] + ins["bwd"][i] + ins["comm_fwd"][i] + ins["comm_bwd"][i]
        t += recompute_of(table, i, i + 1, cfg.checkpointing)
        if store is not None:
            t += store.transfer_time(cluster, ins["saved"][i])
        time_l.append(t)
        static_l.append(ins["params"][i] * state)
        act_l.append(
            kept_per_layer(table, i, cfg.checkpointing) if cfg.checkpointing else ins["saved"][i]
        )

    def outside(key: str) -> float:
        return sum(out[key]) - pre[key]

    def total(sums) -> float:
        return sums("fwd") + sums("bwd") + sums("comm_fwd") + sums("comm_bwd")

    mid = table.cut_bytes[n // 2] if n > 1 else 0
    p2p = 2 * cm.send_recv(mid / cfg.tp, cm.p2p_axis(0, cfg.dp * cfg.tp)) if cfg.pp > 1 else 0
    reserve = max(act_l) if cfg.checkpointing else 0.0
    if store is not None:  # one layer's backward in transit
        reserve = rebuilt_of(table, 0, n, cfg.checkpointing)
    return StageCosts(
        layer_time=time_l,
        layer_static=static_l,
        layer_act=act_l,
        first_time=total(pre.__getitem__),
        last_time=total(outside),
        first_static=pre["params"] * state,
        # the loss's transient buffers, once (planner.cost.model.CostModel.workspace_bytes)
        last_static=outside("params") * state + outside("workspace"),
        first_act=pre["saved"],
        last_act=outside("saved"),
        stage_overhead=p2p,
        capacity=cluster.usable_memory_bytes - reserve,
    )


def dp_ranges(table: LayerTable, cfg, training, cluster, cm) -> list[tuple[int, int]] | None:
    """The stage DP's layer ranges for this configuration (None when none fits). With v
    chunks per device (chunk_ranges) the DP splits the layers into pp x v chunks by time
    alone: a device holds v chunks, whose memory predict() checks together."""
    inputs = stage_costs(table, cfg, training, cluster, cm)
    p, v = cfg.pp, cfg.virtual_stages
    if v > 1:
        return chunk_ranges(inputs, p * v)
    inflight = [inflight_microbatches(cfg.schedule, s, p, cfg.microbatches) for s in range(p)]
    part = partition_stages(inputs, p, cfg.microbatches, inflight)
    return list(part.ranges) if part else None


def chunk_ranges(inputs: StageCosts, chunks: int) -> list[tuple[int, int]] | None:
    """The fastest split into `chunks` contiguous chunks (its slowest chunk as fast as can
    be), memory aside: the first and last chunks, which carry the embedding and the head,
    get fewer layers."""
    timed = replace(inputs, layer_static=None, layer_act=None, capacity=math.inf)
    part = partition_stages(timed, chunks, 1, [1.0] * chunks)
    return list(part.ranges) if part else None
