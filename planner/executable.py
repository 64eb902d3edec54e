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
  sharding rules offer, on any number of pipeline stages (executor/graph_pipeline.py).
"""

from __future__ import annotations

from planner.intra_op.expert_layout import EXPERT_SPLITS, TOKENS
from planner.parallel.registry import store_of, techniques
from planner.parallel.technique import BOTH_PATHS, MODULES_ONLY, ExecutorMode

__all__ = ["BOTH_PATHS", "MODULES_ONLY", "RUNS"]

# hf: transformers' models; graph: a user's model traced by `autopar trace` (its factory is
# given to `autopar execute --model`).
FAMILIES = frozenset({"gpt", "moe", "llama", "mlp", "hf", "wresnet", "graph"})
GRAPH_FAMILIES = frozenset({"gpt", "moe", "llama", "wresnet", "hf", "graph"})
MODULE_FAMILIES = FAMILIES - {"wresnet", "graph"}  # with stage modules (stage_model.py)

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


# Modules torch's ColwiseParallel / RowwiseParallel shard (module_type of the graph node).
STYLE_MODULES = frozenset({"Linear", "Embedding"})
TP_SPLITS = frozenset({"col", "row", "vocab"})


def tp_name(strategy: str) -> str:
    """'dp:replicate|tp:col' -> 'col'; Megatron names pass through."""
    return strategy.split("|")[-1].removeprefix("tp:")


def executable(kind: str, strategy: str, module_type: str = "") -> bool:
    """Whether this node's strategy has a module-level style (the "modules" executor).
    `module_type` (the graph node's, when known): a split needs a module the style shards."""
    name = tp_name(strategy)
    if name == TOKENS:  # a node of a MoE block on its tp rank's tokens: the block's style
        return True  # (executor.tensor_parallel.TokenShardBlock) runs the block as it is
    if kind == "grouped_mm":  # transformers' experts split over tp (expert tensor parallelism)
        return name in REPLICATED or name.startswith("dim") or name in EXPERT_SPLITS
    if kind in FOLLOWERS:
        return name in REPLICATED or name.startswith("dim")
    module_class = module_type.rsplit(".", 1)[-1]
    splits = kind in ("linear", "embedding") and name in TP_SPLITS
    if splits and module_type and module_class not in STYLE_MODULES:
        return False
    return name in TP_STRATEGIES.get(kind, REPLICATED)


def not_executable_reason(
    family: str,
    megatron_layout: bool,
    nodes: list[tuple[str, str, str, str]],
) -> str | None:
    """Why the executor cannot run a plan, or None when it can. `nodes`: (name, kind, tp
    strategy, module type) of every node."""
    return executor_mode_and_reason(family, megatron_layout, nodes)[1]


def family_not_executable(family: str) -> str | None:
    """Why no plan of a model family can run, or None."""
    if family in FAMILIES:
        return None
    return (
        f"the executor builds gpt, llama, moe, mlp, wresnet and Hugging Face models; this plan's "
        f"model is a {family} model"
    )


def executor_mode_and_reason(
    family: str,
    megatron_layout: bool,
    nodes: list[tuple[str, str, str, str]],
) -> tuple[ExecutorMode | None, str | None]:
    if family not in FAMILIES:
        return None, family_not_executable(family)
    bad = next(
        ((n, k, s, t) for n, k, s, t in nodes if not executable(k, s, t)),
        None,
    )
    if megatron_layout and bad is None and family in MODULE_FAMILIES:
        return "modules", None
    if family in GRAPH_FAMILIES:
        return "graph", None
    if bad is not None:
        name, kind, strategy, module_type = bad
        what = f" on a {module_type}" if module_type else ""
        why = (
            f"node {name} ({kind}{what}) uses tensor-parallel strategy {tp_name(strategy)!r}, "
            "which no module-level parallel style applies"
        )
    else:
        why = "its tensor-parallel layout is chosen node by node (not Megatron's)"
    return None, f"{why}, and graph mode does not run {family} models"


# Which of the executor's two paths runs each technique: the one table the planner (to_plan,
# the search's options and fp8 recipes) and the executor (graph_parallelize) read, with the
# reason a path refuses what it does not run. Each row is declared by its technique
# (planner.parallel.registry).
#
# Graph mode replicates parameters over dp (ZeRO-0) and sums each FSDP2 unit's gradients in
# one all-reduce (executor/graph_data_parallel.py), as the plan prices. It has no FSDP2
# units to gather and shard: ZeRO-1/2 and HSDP are not run; ZeRO-3 as placements (the ILP's
# "+zero3" strategies) gathers each parameter at each use through DTensor's redistribute,
# and its gradients come back partly all-reduced, partly reduce-scattered: neither what the
# plan's ledger nor its time prices, so it is refused too.
_ROWS = [row for t in techniques() for row in t.capabilities]
RUNS: dict[str, frozenset[ExecutorMode]] = {row.key: row.paths for row in _ROWS}
GRAPH_MODE_REFUSALS = {row.key: row.graph_refusal for row in _ROWS if row.graph_refusal}


def runs(mode: ExecutorMode | None, technique: str) -> bool:
    """Whether the executor's `mode` path runs `technique` (a key of RUNS)."""
    return mode in RUNS[technique]


GRAPH_ZERO_LEVELS = tuple(z for z in range(4) if runs("graph", f"zero{z}"))


def graph_mode_refusal(
    dp: int,
    zero: int,
    hybrid: bool,
    *,
    cpu_offload: bool = False,
    checkpointing: bool | str = False,
    fp8: str | None = None,
    expert_parallel: bool = False,
) -> str | None:
    """Why graph mode cannot run a plan with these techniques, or None (RUNS): what the
    planner marks not executable there and the executor refuses (executor.
    graph_parallelize). A ZeRO level matters only where dp > 1; checkpointing, where it
    names an activation store."""
    if dp > 1 and not runs("graph", f"zero{zero}"):
        return GRAPH_MODE_REFUSALS[f"zero{zero}"]
    used = {"hsdp": hybrid, "cpu_offload": cpu_offload}
    used["fp8"] = bool(fp8)
    used["expert_parallel"] = expert_parallel
    if (store := store_of(checkpointing)) is not None:
        used[store.capability] = True
    for technique, on in used.items():
        if on and not runs("graph", technique):
            return GRAPH_MODE_REFUSALS[technique]
    return None


def execution_refusal(plan) -> tuple[str, str] | None:
    """(the plan's field, why) autopar's executor does not run this plan, or None: the plan
    says it cannot be run, or it is planned for another runtime (its memory layout and
    ZeRO levels are that runtime's, not what the executor would do)."""
    if not plan.executable:
        reason = plan.not_executable_reason or "no reason recorded"
        return "executable", f"this plan cannot be run: {reason}"
    runtime = plan.request.training.runtime
    if runtime != "autopar":
        return "request.training.runtime", (
            f"this plan is planned for {runtime}: export it (autopar export --to {runtime}) "
            "or plan again for autopar's executor (--runtime autopar)"
        )
    return None


def plan_executor_mode(plan) -> ExecutorMode | None:
    """How the executor runs a Plan (planner.plan.Plan), or None when the plan says it
    cannot be run."""
    if not plan.executable:
        return None
    nodes = [(s.node, s.kind, s.strategy, "") for st in plan.stages for s in st.shardings]
    return executor_mode_and_reason(
        plan.request.model.family,
        plan.tp_layout == "megatron",
        nodes,
    )[0]
