"""The intra-operator sharding problem for one stage on one logical mesh: the nodes, their
strategies (planner.intra_op.strategies), the edges between them, and the exact objective and
memory of a full assignment. planner.intra_op.ilp solves it."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field

from planner.cluster.mesh import LogicalMesh
from planner.cost.memory import bytes_per_param
from planner.cost.model import CostModel
from planner.errors import AutoparError
from planner.graph.layer_groups import layer_signature
from planner.graph.opgraph import OpGraph, OpNode
from planner.intra_op.strategies import Strategy, node_strategies, renamed, reshard_cost


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


class OwnChoices(Mapping[str, Strategy]):
    """node -> chosen strategy with the node's own parameter names; `raw` holds each block
    copy's representative's strategy (same placements and costs), renamed on first access."""

    def __init__(self, problem: ShardingProblem, raw: dict[str, Strategy]):
        self.problem, self.raw = problem, raw
        self._own: dict[str, Strategy] = {}
        self._nodes: dict[str, OpNode] | None = None

    def __getitem__(self, name: str) -> Strategy:
        if name not in self._own:
            if self._nodes is None:
                self._nodes = {n.name: n for n in self.problem.nodes}
            self._own[name] = self.problem.own(self._nodes[name], self.raw[name])
        return self._own[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self.raw)

    def __len__(self) -> int:
        return len(self.raw)


@dataclass
class ShardingSolution:
    choices: Mapping[str, Strategy]
    objective_s: float
    breakdown: dict[str, float]
    memory: dict[str, float]
    stats: SolveStats
    mesh_shape: tuple[int, ...]
    reshard_by_edge: dict[tuple[str, str], float] = field(default_factory=dict)

    @property
    def raw(self) -> Mapping[str, Strategy]:
        """Each node's strategy, a block copy's under its representative's parameter names
        (the same placements and costs): cheaper than `choices` where names do not matter."""
        return self.choices.raw if isinstance(self.choices, OwnChoices) else self.choices


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
            self.memory_budget = float(self.mesh.cluster.usable_memory_bytes)
        per = bytes_per_param(self.cost_model.dtype, self.optimizer)
        self.bytes_per_param = per.weights + per.grads + per.optimizer
        fanout: dict[tuple[str, int], int] = defaultdict(int)
        for e in self.edges:
            fanout[(e.src, e.src_output)] += 1
        self._edge_memo: dict[tuple, float] = {}
        incoming: dict[str, dict[int, float]] = defaultdict(dict)
        for e in self.edges:
            share = 1.0 / fanout[(e.src, e.src_output)] if e.floating else 0.0
            incoming[e.dst][e.dst_input] = share
        self._copies = self._identical_layers(incoming)
        self.strategies: dict[str, list[Strategy]] = {}
        # A node identical to one in an earlier copy shares its strategy list (placements and
        # costs are the same; parameter names are the first copy's until own() renames).
        self._copy_of = {b.name: a for a, b in self._node_pairs()}
        for node in self.nodes:
            first = self._copy_of.get(node.name)
            if first is not None:
                self.strategies[node.name] = self.strategies[first.name]
                continue
            self.strategies[node.name] = node_strategies(
                node,
                self.mesh,
                self.cost_model,
                self.zero,
                incoming[node.name],
                self.executable_only,
            )

    def own(self, node: OpNode, strategy: Strategy) -> Strategy:
        """A strategy from `node`'s list with the node's own parameter names."""
        first = self._copy_of.get(node.name)
        return strategy if first is None else renamed([strategy], first, node)[0]

    # --- costs ---------------------------------------------------------------------------
    def node_cost(self, s: Strategy) -> float:
        return s.step_cost(self.microbatches)

    def node_memory(self, s: Strategy) -> float:
        return s.param_elems * self.bytes_per_param + s.saved_bytes * self.inflight_microbatches

    def edge_cost(self, e: EdgeRef, a: tuple[str, ...], b: tuple[str, ...]) -> float:
        key = (e.nbytes, e.floating, a, b)  # identical layers repeat the same few edges
        cost = self._edge_memo.get(key)
        if cost is None:
            cost = reshard_cost(self.cost_model, e.nbytes, a, b, self.mesh, backward=e.floating)
            self._edge_memo[key] = cost
        return cost

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
    def _identical_layers(self, incoming: dict[str, dict[int, float]]) -> dict[int, list[int]]:
        """First layer -> every layer identical to it (same node figures, same gradient
        shares on their inputs, same internal edges), for groups of two or more."""
        by_layer: dict[int, list[OpNode]] = defaultdict(list)
        for n in self.nodes:
            if n.layer is not None:
                by_layer[n.layer].append(n)
        self._by_layer = by_layer
        internal: dict[int, list[EdgeRef]] = defaultdict(list)
        layer_of = {n.name: n.layer for n in self.nodes}
        for e in self.edges:
            if layer_of[e.src] is not None and layer_of[e.src] == layer_of[e.dst]:
                internal[layer_of[e.dst]].append(e)
        whole = len(self.nodes) == len(self.graph.data.nodes)
        groups: dict[tuple, list[int]] = defaultdict(list)
        for layer, members in sorted(by_layer.items()):
            shares = tuple(tuple(sorted(incoming[n.name].items())) for n in members)
            # On the whole graph, the graph's own grouping (worked out once per graph).
            sig = (
                self.graph.layer_groups[layer]
                if whole
                else layer_signature(members, internal[layer])
            )
            groups[(sig, shares)].append(layer)
        return {g[0]: g for g in groups.values() if len(g) > 1}

    def _node_pairs(self):
        """(node of a group's first layer, the same node in a later copy)."""
        for first, layers in self._copies.items():
            for layer in layers[1:]:
                yield from zip(self._by_layer[first], self._by_layer[layer], strict=True)

    def representatives(self) -> tuple[dict[str, str], dict[str, int], int]:
        """node -> representative node, representative -> multiplicity, number of groups."""
        rep = {n.name: n.name for n in self.nodes}
        mult = {n.name: 1 for n in self.nodes}
        if not self.dedup:
            return rep, mult, 0
        for a, b in self._node_pairs():
            rep[b.name] = a.name
            mult[b.name] = 0
        for first, layers in self._copies.items():
            for a in self._by_layer[first]:
                mult[a.name] = len(layers)
        return rep, mult, len(self._copies)

    # --- lower bound on memory, for infeasibility ------------------------------------------
    def min_memory(self) -> tuple[float, dict[str, Strategy]]:
        choice = {n.name: min(self.strategies[n.name], key=self.node_memory) for n in self.nodes}
        return self.memory_of(choice)["total"], choice
