"""Expert tensor parallelism in Megatron's layout: transformers' experts modules (their
grouped matmuls over 3-D weights) split over tp as Megatron-Core splits them by default
(--expert-tensor-parallel-size = tp; torchtitan's etp = tp): each expert's gate/up projection
by its output features ("cols"), its down projection by its input features ("contract"), on
every rank's whole tokens; the module's output, a partial sum, is all-reduced in forward,
and its float inputs' gradients (the tokens, the router's weights) in backward. Executed by
executor.expert_parallel.apply_expert_tensor_parallel.

Or expert tp 1 beside tp (the plan's mesh.etp = 1, planner.parallel.expert): under sequence
parallelism each MoE block runs on its tp rank's sequence shard (`fold_moe_blocks`), every
node of it on 1 / tp of the tokens with its weights whole; the router's and shared experts'
gradients, partial sums over the shards, are all-reduced over tp once a step (as sequence
parallelism's norms), the experts' are the ep technique's. Executed by
executor.tensor_parallel.TokenShardBlock."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable

from planner.graph.opgraph import OpGraph, OpNode, TensorMeta
from planner.intra_op.node_layout import NodeLayout
from planner.parallel.expert import is_expert_weight
from planner.placements import REPLICATE, shard

# The grouped matmuls' tp strategies (the sharding rules' names for grouped_mm: its weight's
# output columns, its contracted dim), and the expert weight's dim each splits ([E, 2F, H]
# gate/up and [E, H, F] down, transformers' layout: the matmuls read them transposed)
EXPERT_SPLITS = {"cols": 1, "contract": 2}
# The strategy of a node of a MoE block run on its tp rank's share of the tokens (expert tp
# 1): its rows split over tp, its weights whole.
TOKENS = "tokens"


def experts_modules(nodes: Iterable) -> frozenset[str]:
    """The modules holding transformers' expert grouped matmuls (its experts modules), from
    nodes with a `kind` and a `module` path (the graph's or a plan's shardings)."""
    return frozenset(n.module for n in nodes if n.kind == "grouped_mm" and n.module)


def moe_blocks(nodes: Iterable) -> frozenset[str]:
    """transformers' mixture-of-experts blocks: the modules holding an experts module (its
    grouped matmuls), from nodes with a `kind` and a `module` path."""
    return frozenset(m.rpartition(".")[0] for m in experts_modules(nodes) if "." in m)


def token_shard_layout(node: OpNode, states: list[str], tp: int, seq_dim: int) -> NodeLayout:
    """A node of a MoE block on its tp rank's share of the tokens (the module docstring):
    its compute and saved tensors 1 / tp, its weights whole, the gradients of those not the
    experts' (3-D, one slice per expert) all-reduced over tp once a step; outputs sharded on
    the tokens (the sequence dim of [batch, seq, hidden], else dim 0)."""
    lay = NodeLayout(strategy=TOKENS, compute_shards=tp, saved_shards=tp, inputs=list(states))
    lay.params = {name: REPLICATE for name in node.params}
    for name, meta in node.params.items():
        if not is_expert_weight(name, meta.shape):
            lay.step_comm.append(("all_reduce", meta.nbytes))
    lay.outputs = [
        shard(seq_dim) if len(m.shape) == 3 else shard(0) if m.shape else REPLICATE
        for m in node.outputs
    ]
    return lay


def expert_tensor_parallel(graph: OpGraph, own: dict[str, NodeLayout], tp: int) -> None:
    """Each experts module of the laid-out nodes split over tp (the module docstring): the
    first grouped matmul "cols", what follows it on its output split too, the matmul reading
    that "contract"; the transposed weights' nodes hold their weights split; one forward
    all-reduce of the module's output, one backward of each float input from outside it.
    Left replicated where a split does not divide."""
    by_name = graph.by_name
    producer = {(e.dst, e.dst_input): e.src for e in graph.edges}
    consumers: dict[str, list] = defaultdict(list)
    inputs: dict[str, list] = defaultdict(list)
    for e in graph.edges:
        consumers[e.src].append(e)
        inputs[e.dst].append(e)
    for module in sorted(experts_modules(graph.nodes)):
        nodes = [n for n in graph.nodes if n.name in own and _in_module(n, module)]
        names = {n.name for n in nodes}
        mms = [n for n in nodes if n.kind == "grouped_mm"]
        if len(mms) != 2 or not all(_expert_weight_node(graph, n, producer) for n in mms):
            continue
        first, second = mms
        if own[first.name].strategy == TOKENS:  # expert tp 1: whole experts on token shards
            continue
        weights = [by_name[producer[(n.name, 1)]] for n in mms]
        # the grouped matmuls read [E, hidden, 2F] (gate and up halves) and [E, F, hidden]
        features = weights[1].outputs[0].shape[1]
        if features % tp or weights[0].outputs[0].shape[-1] != 2 * features:
            continue
        split = {first.name}
        for n in nodes[nodes.index(first) + 1 : nodes.index(second)]:
            if any(e.src in split for e in inputs[n.name]):
                split.add(n.name)
        for name in split | {second.name}:
            lay = own[name]
            lay.compute_shards = tp
            lay.saved_shards = 1 if name == first.name else tp
            if name not in (first.name, second.name):
                lay.strategy = f"dim{len(by_name[name].outputs[0].shape) - 1}"
        own[first.name].strategy, own[second.name].strategy = "cols", "contract"
        for weight, strategy in zip(weights, ("cols", "contract"), strict=True):
            own[weight.name].params = {
                name: shard(EXPERT_SPLITS[strategy]) for name in weight.params
            }
        entering: set[tuple[str, int]] = set()  # each input once, however many read it
        for n in nodes:
            for e in inputs[n.name]:
                meta = n.inputs[e.dst_input]
                tensor = (e.src, e.src_output)
                if e.src not in names and _floating(meta) and tensor not in entering:
                    entering.add(tensor)
                    own[n.name].bwd_comm.append(("all_reduce", meta.nbytes))
            leaving = any(e.dst not in names for e in consumers[n.name])
            if leaving and _floating(n.outputs[0]):
                own[n.name].fwd_comm.append(("all_reduce", n.outputs[0].nbytes))


def _floating(meta: TensorMeta) -> bool:
    return meta.dtype.startswith(("float", "bfloat"))


def _in_module(node: OpNode, module: str) -> bool:
    return bool(node.module) and (node.module == module or node.module.startswith(module + "."))


def _expert_weight_node(graph: OpGraph, mm: OpNode, producer: dict) -> bool:
    """Whether a grouped matmul reads its weight [E, k, n] from a node transposing a 3-D
    parameter [E, n, k] of its own module (transformers' experts)."""
    src = graph.by_name.get(producer.get((mm.name, 1), ""))
    if src is None or len(src.params) != 1 or not src.outputs:
        return False
    (meta,) = src.params.values()
    e, k, n = src.outputs[0].shape if len(src.outputs[0].shape) == 3 else (0, 0, 0)
    return list(meta.shape) == [e, n, k] and src.module == mm.module
