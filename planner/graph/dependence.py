"""Which values of a traced graph depend on the model's parameters. Those that do not (rotary
tables, attention masks, the labels: functions of the inputs and constants alone) are not
sent between pipeline stages on the module path (each stage makes its own) and get no
gradient in graph mode's pipeline (executor.graph_pipeline.with_parameters)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import networkx as nx

if TYPE_CHECKING:
    from planner.graph.opgraph import OpGraph


def parameter_free(graph: OpGraph) -> frozenset[str]:
    """The nodes whose values depend on no parameter."""
    g = graph.nx
    with_params: set[str] = set()
    for name in nx.topological_sort(g):
        if graph.by_name[name].params or any(p in with_params for p in g.predecessors(name)):
            with_params.add(name)
    return frozenset(g.nodes) - with_params
