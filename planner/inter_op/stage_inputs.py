"""The stage DP's inputs for one configuration: per-layer time and memory from the nodes'
costs, what lies before the first and after the last layer, the pipeline send per stage
boundary, and the memory left for a stage."""

from __future__ import annotations

from planner.cost.memory import state_bytes_per_param
from planner.cost.schedules import inflight_microbatches
from planner.inter_op.stage_dp import StageCosts, partition_stages
from planner.parallel.checkpointing import recompute_time
from planner.parallel.tensor import local_param_elements


def stage_costs(graph, costs, layouts, cfg, training, cluster, cm) -> StageCosts:
    n = max(graph.num_layers, 1)
    state = state_bytes_per_param(training.dtype, training.optimizer, cfg.zero, cfg.dp)
    time_l, static_l, act_l = [0.0] * n, [0.0] * n, [0.0] * n
    first = [0.0, 0.0, 0.0]
    last = [0.0, 0.0, 0.0]
    seen_layer = False
    for node in graph.nodes:
        c = costs[node.name]
        t = c.fwd + c.bwd + c.comm_fwd + c.comm_bwd
        params = local_param_elements(node, layouts[node.name], cfg.tp)
        if node.layer is not None:
            seen_layer = True
            recompute = recompute_time(c.fwd, c.comm_fwd) if cfg.checkpointing else 0.0
            time_l[node.layer] += t + recompute
            static_l[node.layer] += params * state
            act_l[node.layer] += 0 if cfg.checkpointing else c.saved
        else:
            bucket = last if seen_layer else first
            bucket[0] += t
            bucket[1] += params * state
            bucket[2] += c.saved
    if cfg.checkpointing:
        inputs = graph.layer_input_bytes
        for i in range(n):
            act_l[i] += inputs[i]
    mid = graph.cut_bytes[n // 2] if n > 1 else 0
    p2p = 2 * cm.send_recv(mid / cfg.tp, cm.p2p_axis(0, cfg.dp * cfg.tp)) if cfg.pp > 1 else 0
    reserve = max(act_l) if cfg.checkpointing else 0.0
    return StageCosts(
        layer_time=time_l,
        layer_static=static_l,
        layer_act=act_l,
        first_time=first[0],
        last_time=last[0],
        first_static=first[1],
        last_static=last[1],
        first_act=first[2],
        last_act=last[2],
        stage_overhead=p2p,
        capacity=cluster.device.memory_bytes - reserve,
    )


def dp_ranges(graph, costs, layouts, cfg, training, cluster, cm) -> list[tuple[int, int]] | None:
    """The stage DP's layer ranges for this configuration (None when none fits)."""
    inputs = stage_costs(graph, costs, layouts, cfg, training, cluster, cm)
    inflight = [
        inflight_microbatches(cfg.schedule, s, cfg.pp, cfg.microbatches) for s in range(cfg.pp)
    ]
    part = partition_stages(inputs, cfg.pp, cfg.microbatches, inflight)
    return list(part.ranges) if part else None
