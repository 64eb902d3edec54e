"""What the executor can run today, so the planner can say whether a plan is executable and,
when asked, search only that space. (The executor imports these sets; the planner does not
import the executor.)

The executor has two ways to run a plan:
- "modules": module-level parallel styles (ColwiseParallel, RowwiseParallel, ...) on the
  model's own modules, FSDP2 on dp, torch.distributed.pipelining across stages. The model
  code then runs on local shards, which is right only for Megatron's pattern of tp
  placements (column-parallel into row-parallel, followers in between), so it takes plans
  whose tp layout is Megatron's and whose strategies all have a style.
- "graph": the exported training graph interpreted node by node with DTensor, every edge
  resharded to the plan's placements (executor/graph_mode.py). It runs any strategy the
  sharding rules offer, on one pipeline stage.
"""

from __future__ import annotations

from typing import Literal

FAMILIES = frozenset({"gpt", "moe", "llama", "mlp"})
GRAPH_FAMILIES = frozenset({"gpt", "moe", "llama"})
ExecutorMode = Literal["modules", "graph"]

REPLICATED = frozenset({"replicate"})
# Per node kind, the tensor-parallel strategies (the sharding rules' names, which Megatron's
# layout uses too) with a module-level executor implementation.
TP_STRATEGIES = {
    "linear": REPLICATED | {"col", "row"},
    "embedding": REPLICATED | {"vocab"},
    "attention": REPLICATED | {"heads"},
    "loss": REPLICATED | {"vocab"},
}
# Kinds whose strategy just follows the tensors it is given (no module to wrap).
FOLLOWERS = frozenset(
    {
        "elementwise",
        "reshape",
        "concat",
        "norm",
        "softmax",
        "input",
        "constant",
        "reduction",
        "scatter",
        "pool",
        "other",
    }
)


def tp_name(strategy: str) -> str:
    """'dp:replicate|tp:col' -> 'col'; Megatron names pass through."""
    return strategy.split("|")[-1].removeprefix("tp:")


def executable(kind: str, strategy: str) -> bool:
    """Whether this node's strategy has a module-level style (the "modules" executor)."""
    name = tp_name(strategy)
    if kind in FOLLOWERS:
        return name in REPLICATED or name.startswith("dim")
    return name in TP_STRATEGIES.get(kind, REPLICATED)


def executor_mode(
    family: str, pipeline_chunks: int, megatron_layout: bool, styles: bool
) -> ExecutorMode | None:
    """How the executor runs a plan, or None if it cannot. `styles`: every node's strategy
    has a module-level style; `pipeline_chunks`: pp x virtual stages."""
    if family not in FAMILIES:
        return None
    if megatron_layout and styles:
        return "modules"
    if pipeline_chunks == 1 and family in GRAPH_FAMILIES:
        return "graph"
    return None


def plan_executor_mode(plan) -> ExecutorMode | None:
    """executor_mode of a Plan (planner.plan.Plan)."""
    styles = all(executable(s.kind, s.strategy) for st in plan.stages for s in st.shardings)
    return executor_mode(
        plan.request.model.family,
        plan.mesh.shape[0] * plan.schedule.virtual_stages,
        plan.tp_layout == "megatron",
        styles,
    )
