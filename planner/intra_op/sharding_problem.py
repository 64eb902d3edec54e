"""The intra-operator sharding problem for one stage on one logical mesh: the nodes, their
strategies (planner.intra_op.strategies), the edges between them, and the exact objective and
memory of a full assignment. planner.intra_op.ilp solves it."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

from planner.cluster.mesh import LogicalMesh
from planner.cost.memory import bytes_per_param
from planner.cost.model import CostModel
from planner.errors import AutoparError
from planner.graph.opgraph import OpGraph, OpNode
from planner.intra_op.strategies import Strategy, node_strategies, reshard_cost


class InfeasibleError(AutoparError):
    """No choice of strategies fits the memory budget; `explanation` says why."""

    def __init__(self, explanation: list[str]):
        self.explanation = explanation
        super().__init__(" ".join(explanation))


@dataclass(frozen=True)
class EdgeRef:
    src: str
    src_output: int
    dst: str
    dst_input: int
    nbytes: int
    floating: bool


@dataclass
class SolveStats:
    solver: str
    status: str  # optimal | time_limit | infeasible
    gap: float | None
    variables: int
    constraints: int
    build_s: float
    solve_s: float
    nodes: int
    unique_nodes: int
    dedup_groups: int


@dataclass
class ShardingSolution:
    choices: dict[str, Strategy]
    objective_s: float
    breakdown: dict[str, float]
    memory: dict[str, float]
    stats: SolveStats
    mesh_shape: tuple[int, ...]
    reshard_by_edge: dict[tuple[str, str], float] = field(default_factory=dict)


@dataclass
class ShardingProblem:
    """One stage (a node subset of `graph`) on one logical mesh."""

    graph: OpGraph
    mesh: LogicalMesh
    cost_model: CostModel
    nodes: list[OpNode] | None = None  # default: the whole graph
    microbatches: int = 1
    memory_budget: float | None = None  # bytes per device; default: device memory
    inflight_microbatches: float = 1.0
    optimizer: str = "adamw"
    dedup: bool = True
    zero: int = 3  # the highest ZeRO level on dp: 3 lets nodes store parameters dp-sharded
    executable_only: bool = False  # tp choices restricted to what the executor runs

    def __post_init__(self) -> None:
        self.nodes = list(self.graph.nodes if self.nodes is None else self.nodes)
        names = {n.name for n in self.nodes}
        self.edges = [
            EdgeRef(
                e.src,
                e.src_output,
                e.dst,
                e.dst_input,
                e.bytes,
                e.dtype.startswith(("float", "bfloat")),
            )
            for e in self.graph.edges
            if e.src in names and e.dst in names
        ]
        if self.memory_budget is None:
            self.memory_budget = float(self.mesh.cluster.device.memory_bytes)
        per = bytes_per_param(self.cost_model.dtype, self.optimizer)
        self.bytes_per_param = per.weights + per.grads + per.optimizer
        fanout: dict[tuple[str, int], int] = defaultdict(int)
        for e in self.edges:
            fanout[(e.src, e.src_output)] += 1
        self.strategies: dict[str, list[Strategy]] = {}
        incoming: dict[str, dict[int, float]] = defaultdict(dict)
        for e in self.edges:
            share = 1.0 / fanout[(e.src, e.src_output)] if e.floating else 0.0
            incoming[e.dst][e.dst_input] = share
        for node in self.nodes:
            self.strategies[node.name] = node_strategies(
                node,
                self.mesh,
                self.cost_model,
                self.zero,
                incoming[node.name],
                self.executable_only,
            )

    # --- costs ---------------------------------------------------------------------------
    def node_cost(self, s: Strategy) -> float:
        return s.step_cost(self.microbatches)

    def node_memory(self, s: Strategy) -> float:
        return s.param_elems * self.bytes_per_param + s.saved_bytes * self.inflight_microbatches

    def edge_cost(self, e: EdgeRef, a: tuple[str, ...], b: tuple[str, ...]) -> float:
        return reshard_cost(self.cost_model, e.nbytes, a, b, self.mesh, backward=e.floating)

    def evaluate(self, choices: dict[str, Strategy]) -> tuple[float, dict[str, float]]:
        """Exact objective of a full assignment (used to check the solver and brute force)."""
        parts = {"compute_s": 0.0, "comm_s": 0.0, "grad_sync_s": 0.0, "reshard_s": 0.0}
        for node in self.nodes:
            s = choices[node.name]
            parts["compute_s"] += s.compute_s
            parts["comm_s"] += s.comm_s
            parts["grad_sync_s"] += s.grad_sync_s / self.microbatches
        for e in self.edges:
            a = choices[e.src].outputs[e.src_output]
            b = choices[e.dst].inputs[e.dst_input]
            parts["reshard_s"] += self.edge_cost(e, a, b)
        return sum(parts.values()), parts

    def memory_of(self, choices: dict[str, Strategy]) -> dict[str, float]:
        per = bytes_per_param(self.cost_model.dtype, self.optimizer)
        elems = sum(choices[n.name].param_elems for n in self.nodes)
        acts = sum(choices[n.name].saved_bytes for n in self.nodes) * self.inflight_microbatches
        out = {
            "params": elems * per.weights,
            "grads": elems * per.grads,
            "optimizer": elems * per.optimizer,
            "activations": acts,
        }
        out["total"] = sum(out.values())
        return out

    # --- deduplication -------------------------------------------------------------------
    def representatives(self) -> tuple[dict[str, str], dict[str, int], int]:
        """node -> representative node, representative -> multiplicity, number of groups."""
        rep = {n.name: n.name for n in self.nodes}
        mult = {n.name: 1 for n in self.nodes}
        if not self.dedup:
            return rep, mult, 0
        by_layer: dict[int, list[OpNode]] = defaultdict(list)
        for n in self.nodes:
            if n.layer is not None:
                by_layer[n.layer].append(n)
        groups: dict[tuple, list[int]] = defaultdict(list)
        for layer, members in sorted(by_layer.items()):
            groups[self._signature(members)].append(layer)
        count = 0
        for layers in groups.values():
            if len(layers) < 2:
                continue
            count += 1
            first = by_layer[layers[0]]
            for layer in layers[1:]:
                for a, b in zip(first, by_layer[layer], strict=True):
                    rep[b.name] = a.name
                    mult[b.name] = 0
            for a in first:
                mult[a.name] = len(layers)
        return rep, mult, count

    def _signature(self, members: list[OpNode]) -> tuple:
        index = {n.name: i for i, n in enumerate(members)}
        nodes = tuple(
            (
                n.kind,
                n.op,
                tuple(tuple(t.shape) for t in n.inputs),
                tuple(tuple(t.shape) for t in n.outputs),
                tuple(tuple(m.shape) for m in n.params.values()),
                n.fwd_flops,
                n.saved_bytes,
                tuple(s.name for s in self.strategies[n.name]),
            )
            for n in members
        )
        edges = tuple(
            sorted(
                (index[e.src], e.src_output, index[e.dst], e.dst_input)
                for e in self.edges
                if e.src in index and e.dst in index
            )
        )
        return nodes, edges

    # --- lower bound on memory, for infeasibility ------------------------------------------
    def min_memory(self) -> tuple[float, dict[str, Strategy]]:
        choice = {n.name: min(self.strategies[n.name], key=self.node_memory) for n in self.nodes}
        return self.memory_of(choice)["total"], choice
