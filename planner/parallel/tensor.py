"""Tensor parallelism on the tp axis: per node a layout (planner.intra_op): Megatron's
pattern, or the ILP's per-node choice among every strategy the sharding rules offer.

Time: each node's compute split and its collectives on the tp axis (planner.evaluate.
node_costs), not overlapped with compute (Megatron-LM 2021). Memory: sharded parameters and
saved tensors count 1/tp. Search: tp divides the devices and either fits in a node or spans
whole nodes (every group sees the same links). Plan fields: mesh.shape[2], tp_layout,
stages[].shardings.
"""

from __future__ import annotations

from planner.graph.opgraph import OpNode
from planner.intra_op.node_layout import NodeLayout
from planner.parallel.choice import Choice
from planner.parallel.technique import Pin, Technique
from planner.placements import REPLICATE, is_shard

_STRATEGIES = "tests/executor/test_strategies.py::test_strategy_matches_single_process_reference"
_EXECUTE = "tests/executor/test_execute.py::test_plan_matches_single_process_reference"
CHOICES = (
    Choice(
        "tp_layout",
        "megatron",
        "executor.tensor_parallel:apply_tensor_parallel",
        f"{_EXECUTE}[pp2xtp2-1f1b]",
    ),
    Choice(
        "tp_layout",
        "per_node",
        "executor.graph_mode:GraphStage",
        f"{_STRATEGIES}[linear-col]",
        # on pipeline stages: executor.graph_pipeline, tests/executor/test_suite_plans.py
    ),
)
# Where a layout comes from, in the search's order; "megatron_sp": Megatron's with sequence
# parallelism (planner.parallel.sequence).
LAYOUT_KINDS = ("ilp", "megatron", "megatron_sp")
MEGATRON_KINDS = ("megatron", "megatron_sp")
# "megatron_sp" with MoE blocks on their tp rank's tokens and experts whole, for the search's
# combinations with expert tp 1 (planner.parallel.expert): not a layout a user pins, the
# consequence of pinning (or searching) expert tp 1
FOLDED_KIND = "megatron_sp_folded"


def tp_layout_name(kind: str) -> str:
    """The plan's tp_layout for a layout source."""
    return "megatron" if kind in MEGATRON_KINDS or kind == FOLDED_KIND else "per_node"


def is_sequence_parallel(kind: str) -> bool:
    return kind in ("megatron_sp", FOLDED_KIND)


def layout_kinds(tp_layout: str | None, sequence_parallel: bool | None) -> tuple[str, ...]:
    """The layout sources a pin of the plan's tp_layout and sequence_parallel leaves."""
    return tuple(
        kind
        for kind in LAYOUT_KINDS
        if (tp_layout is None or tp_layout_name(kind) == tp_layout)
        and (sequence_parallel is None or is_sequence_parallel(kind) == sequence_parallel)
    )


def heads_refusal(model_config: dict, tp: int) -> str | None:
    """Why tp cannot split this model's attention, or None: tensor parallelism gives each
    rank whole heads (q/k/v are column-split and viewed as (-1, head_dim)), so tp must divide
    the attention heads and the key/value heads."""
    for key in ("heads", "kv_heads"):
        value = model_config.get(key)
        if isinstance(value, int) and value > 0 and value % tp:
            return f"tp = {tp} does not divide the model's {key} = {value}"
    return None


def fits_links(tp: int, devices_per_node: int) -> bool:
    """tp groups fit in a node or span whole nodes (so every group sees the same links)."""
    return devices_per_node % tp == 0 or tp % devices_per_node == 0


def local_param_elements(node: OpNode, layout: NodeLayout, tp: int) -> int:
    """Parameter elements per device of the parameters this node owns (tied ones excluded)."""
    return sum(
        m.numel // (tp if is_shard(layout.params.get(p, REPLICATE)) else 1)
        for p, m in node.params.items()
        if p not in node.shared_params
    )


PINS: tuple[Pin, ...] = (
    Pin(
        "tp_layout",
        "choice",
        "the tensor-parallel layout: megatron, or per_node (chosen node by node by the ILP)",
        choices=("megatron", "per_node"),
    ),
)


TECHNIQUE = Technique(
    "tensor",
    order=20,
    pins=PINS,
    choices=CHOICES,
    terms=("planner.parallel.tensor:local_param_elements",),
)
