import itertools
import random

import pytest

from planner.cluster.mesh import LogicalMesh
from planner.cluster.profile import load_cluster
from planner.cost.model import CostModel
from planner.graph.opgraph import OpEdge, OpGraph, OpGraphData, OpNode, TensorMeta
from planner.intra_op.ilp import solve
from planner.intra_op.ilp_report import forward_collectives
from planner.intra_op.sharding_problem import InfeasibleError, ShardingProblem
from planner.intra_op.strategies import Strategy
from tests.conftest import traced

DGX = load_cluster("dgx-a100-80g")


def _problem(graph, shape, cluster=DGX, **kw):
    mesh = LogicalMesh.contiguous(cluster, 0, shape)
    return ShardingProblem(graph, mesh, CostModel(cluster), **kw)


# --- optimum equals brute force on random small problems -------------------------------
class RandomProblem(ShardingProblem):
    """Random strategies and random resharding tables on a random DAG."""

    def set_random(self, rng: random.Random) -> None:
        placements = [("R",), ("S(0)",), ("P",)]
        for n in self.nodes:
            k = rng.randint(1, 3)
            self.strategies[n.name] = [
                Strategy(
                    name=f"s{i}",
                    inputs=tuple(rng.choice(placements[:2]) for _ in n.inputs),
                    outputs=(rng.choice(placements),),
                    params=(),
                    compute_s=rng.uniform(0, 10),
                    comm_s=rng.uniform(0, 2),
                    grad_sync_s=rng.uniform(0, 2),
                    param_elems=rng.randint(0, 100),
                    saved_bytes=rng.randint(0, 1000),
                )
                for i in range(k)
            ]
        self.table = {}
        for e in self.edges:
            for a in placements:
                for b in placements:
                    self.table[(e.src, e.dst, e.dst_input, a, b)] = (
                        0.0 if a == b else rng.uniform(0, 5)
                    )

    def edge_cost(self, e, a, b):
        return self.table[(e.src, e.dst, e.dst_input, a, b)]


def _random_graph(rng: random.Random, n: int) -> OpGraph:
    meta = TensorMeta(shape=[4, 4], dtype="float32")
    nodes, edges = [], []
    for i in range(n):
        preds = [j for j in range(i) if rng.random() < 0.4][:2]
        for slot, j in enumerate(preds):
            edges.append(
                OpEdge(
                    src=f"n{j}",
                    dst=f"n{i}",
                    dst_input=slot,
                    shape=[4, 4],
                    dtype="float32",
                    bytes=64,
                )
            )
        nodes.append(
            OpNode(
                name=f"n{i}",
                op="aten.add.Tensor",
                kind="elementwise",
                inputs=[meta] * len(preds),
                outputs=[meta],
            )
        )
    return OpGraph(OpGraphData(batch=4, seq=1, dtype="float32", nodes=nodes, edges=edges))


@pytest.mark.parametrize("seed", range(25))
@pytest.mark.parametrize("solver", ["highs", "cbc"])
def test_ilp_optimum_equals_brute_force(seed, solver):
    rng = random.Random(seed)
    graph = _random_graph(rng, rng.randint(2, 8))
    mesh = LogicalMesh.contiguous(load_cluster("cpu-local"), 0, (1, 2))
    problem = RandomProblem(
        graph,
        mesh,
        CostModel(load_cluster("cpu-local"), "fp32"),
        microbatches=rng.randint(1, 4),
        dedup=False,
        zero=0,
    )
    problem.set_random(rng)
    lists = [problem.strategies[n.name] for n in problem.nodes]
    mems = [
        problem.memory_of(dict(zip([n.name for n in problem.nodes], c, strict=True)))["total"]
        for c in itertools.product(*lists)
    ]
    problem.memory_budget = rng.uniform(min(mems), max(mems))
    best = min(
        problem.evaluate(dict(zip([n.name for n in problem.nodes], combo, strict=True)))[0]
        for combo, mem in zip(itertools.product(*lists), mems, strict=True)
        if mem <= problem.memory_budget
    )
    solution = solve(problem, solver=solver)
    assert solution.objective_s == pytest.approx(best, rel=1e-7, abs=1e-9)
    assert solution.memory["total"] <= problem.memory_budget * (1 + 1e-9)
    assert solution.stats.status == "optimal"


# --- Megatron's layouts emerge ------------------------------------------------------------
def _by_module(graph, solution):
    return {n.module: solution.choices[n.name] for n in graph.nodes if n.module}


def test_two_layer_mlp_gets_megatron_layout():
    graph = traced("mlp", batch=2, seq=1, hidden=4096, ffn_hidden=16384, layers=1)
    problem = _problem(graph, (1, 4))
    solution = solve(problem)
    chosen = _by_module(graph, solution)
    assert chosen["blocks.0.fc1"].name == "dp:replicate|tp:col"
    assert chosen["blocks.0.fc2"].name == "dp:replicate|tp:row"
    assert forward_collectives(problem, solution) == ["all_reduce"]


GPT_BLOCK = {"layers": 1, "hidden": 2048, "heads": 16}


def _gpt_block_strategies(graph, solution):
    chosen = _by_module(graph, solution)
    attention = next(solution.choices[n.name] for n in graph.nodes if n.kind == "attention")
    return chosen, attention


def test_gpt_block_with_tight_memory_gets_megatron_layout():
    # Micro-batch 1: parameters, not activations, dominate memory (Megatron's regime).
    graph = traced("gpt-1.3b", batch=1, seq=1024, **GPT_BLOCK)
    roomy = solve(_problem(graph, (1, 8)))
    replicated = _problem(graph, (1, 8)).memory_of(
        {
            n.name: s[0]
            for n, s in zip(graph.nodes, _problem(graph, (1, 8)).strategies.values(), strict=True)
        }
    )["total"]
    tight = solve(_problem(graph, (1, 8), memory_budget=replicated / 6))
    chosen, attention = _gpt_block_strategies(graph, tight)
    for proj in ("q_proj", "k_proj", "v_proj"):
        assert chosen[f"blocks.0.attn.{proj}"].name == "dp:replicate|tp:col"
    assert attention.name == "dp:replicate|tp:heads"
    assert chosen["blocks.0.attn.out_proj"].name == "dp:replicate|tp:row"
    assert chosen["blocks.0.mlp.fc1"].name == "dp:replicate|tp:col"
    assert chosen["blocks.0.mlp.fc2"].name == "dp:replicate|tp:row"
    assert tight.memory["total"] <= replicated / 6
    assert tight.objective_s >= roomy.objective_s


def test_tiny_gpt_block_on_slow_links_gets_data_parallel():
    slow = load_cluster("cpu-local")
    graph = traced("gpt-1.3b", batch=16, seq=128, layers=1, hidden=64, heads=2, vocab=256)
    solution = solve(_problem(graph, (1, 4), cluster=slow))
    chosen, attention = _gpt_block_strategies(graph, solution)
    linears = [
        chosen[m] for m in chosen if m.startswith("blocks.0") and m.endswith(("proj", "fc1", "fc2"))
    ]
    assert len(linears) == 6
    assert all(s.name in ("dp:replicate|tp:batch", "dp:replicate|tp:seq") for s in linears)
    assert attention.name == "dp:replicate|tp:batch"


def test_more_memory_never_costs_more():
    graph = traced("gpt-1.3b", batch=8, seq=1024, **GPT_BLOCK)
    problem = _problem(graph, (2, 4))
    floor, _ = problem.min_memory()
    objectives = []
    for factor in (1.0, 1.3, 2, 4, 16):
        problem.memory_budget = floor * factor
        objectives.append(solve(problem).objective_s)
    assert all(b <= a * (1 + 1e-9) for a, b in itertools.pairwise(objectives))


def test_dedup_and_full_give_the_same_objective():
    graph = traced("gpt-1.3b", batch=4, seq=256, layers=4, hidden=512, heads=8)
    for shape in ((1, 8), (2, 4)):
        full = solve(_problem(graph, shape, dedup=False))
        dedup = solve(_problem(graph, shape, dedup=True))
        assert dedup.stats.unique_nodes < full.stats.unique_nodes
        assert dedup.stats.dedup_groups == 1
        assert dedup.objective_s == pytest.approx(full.objective_s, rel=1e-6)


def test_infeasible_memory_is_explained():
    graph = traced("gpt-1.3b", batch=8, seq=1024, **GPT_BLOCK)
    problem = _problem(graph, (1, 2), memory_budget=100 * 2**20)
    with pytest.raises(InfeasibleError) as info:
        solve(problem)
    text = " ".join(info.value.explanation)
    assert "Does not fit" in text and "over the 100.0 MiB budget" in text
    assert "Largest terms: activations" in text and "optimizer" in text
    assert "It fits on a" in text and "mesh of" in text


def test_time_limited_solve_reports_its_status():
    graph = traced("gpt-1.3b", batch=4, seq=256, layers=2, hidden=512, heads=8)
    solution = solve(_problem(graph, (2, 4), dedup=False), solver="cbc", time_limit=60)
    assert solution.stats.status == "optimal"  # well inside its limit: proven optimal
    assert solution.stats.variables > 0 and solution.stats.constraints > 0


def test_solver_choice_is_validated():
    graph = traced("mlp", batch=2, seq=1)
    from planner.errors import InputError

    with pytest.raises(InputError, match=r"search\.solver"):
        solve(_problem(graph, (1, 2)), solver="gurobi")


def test_moe_experts_go_expert_parallel_with_an_all_to_all():
    graph = traced("moe-380m", batch=8, seq=512, layers=2, experts=8)
    problem = _problem(graph, (1, 8))
    solution = solve(problem)
    experts = [n for n in graph.nodes if n.kind == "einsum" and n.params]
    assert len(experts) == 2
    for node in experts:
        chosen = solution.choices[node.name]
        assert chosen.name == "dp:replicate|tp:split_e"
        (placements,) = [pl for _, pl in chosen.params]
        assert placements == ("R", "S(0)")  # expert weights sharded by expert
    assert "all_to_all" in forward_collectives(problem, solution)


def test_conv_strategies_and_a_batch_parallel_resnet():
    graph = traced("wresnet-250m", batch=32, seq=1, channels=64, width=2, image_size=64)
    problem = _problem(graph, (1, 4))
    convs = [n for n in graph.nodes if n.kind == "conv2d"]
    names = {s.name.split("|")[1] for n in convs for s in problem.strategies[n.name]}
    assert {"tp:batch", "tp:out_channels", "tp:in_channels"} <= names
    solution = solve(problem)
    chosen = [solution.choices[n.name].name for n in convs]
    assert chosen.count("dp:replicate|tp:batch") > len(convs) / 2


def test_every_piece_of_a_chunk_follows_the_split():
    """rotate_half's chunk on the last dim, split on the batch dim: DTensor gives both pieces
    Shard(0), so a consumer of the second piece needs no reshard (priced as an all-gather of
    its gradient when the second piece was taken as replicated)."""
    from planner.intra_op.sharding_rules import follower_choices

    x = TensorMeta(shape=[4, 8, 16, 8], dtype="float32")
    half = TensorMeta(shape=[4, 8, 16, 4], dtype="float32")
    stats = TensorMeta(shape=[4, 8, 16], dtype="float32")
    chunk = OpNode(
        name="chunk",
        op="aten.chunk.default",
        kind="reshape",
        inputs=[x],
        outputs=[half, half],
        attrs={"args": [None, 2, -1]},
    )
    by_name = {c.name: c for c in follower_choices(chunk, 2)}
    assert by_name["dim0"].outputs == ("S(0)", "S(0)")
    assert by_name["dim2"].outputs == ("S(2)", "S(2)")
    assert "dim3" not in by_name  # the chunked dim itself
    other_rank = chunk.model_copy(update={"outputs": [half, stats]})
    assert {c.name: c for c in follower_choices(other_rank, 2)}["dim0"].outputs == ("S(0)", "R")


def test_a_grouped_matmul_split_by_experts_reduces_its_tokens_gradient():
    """transformers' experts as grouped matmuls (Mixtral's), tokens [m, k] and weights
    [e, k, n], split on the experts: each rank multiplies only its experts' rows, so the
    tokens' gradient is a partial sum over the ranks (all-reduced in backward, as the run
    does), and the output too; a linear's bias (GPT's), added after a row split's sum, is
    not one."""
    from planner.graph.tracing import trace_model
    from planner.intra_op.sharding_rules import einsum_choices, equation_for
    from planner.models import ModelSpec, resolve
    from tests.conftest import traced
    from tests.planner.test_expert_parallel import MIXTRAL

    graph = trace_model(resolve(ModelSpec(hf_config=MIXTRAL)), 2, 16, "fp32")
    mms = [n for n in graph.nodes if n.kind == "grouped_mm"]
    assert mms
    for mm in mms:
        choices = {c.name: c for c in einsum_choices(mm, equation_for(mm), 2)}
        assert choices["experts"].inputs[:2] == ("R", "S(0)")
        assert choices["experts"].outputs[0] == "P"
        assert choices["experts"].partial_input_grads == (0,)
        assert choices["contract"].partial_input_grads == ()  # tokens split with the weights
    gpt = traced("gpt-350m", layers=1, hidden=64, heads=4, vocab=128)
    biased = [
        n for n in gpt.nodes if n.kind == "linear" and any(k.endswith("bias") for k in n.params)
    ]
    assert biased
    for fc in biased:
        row = {c.name: c for c in einsum_choices(fc, equation_for(fc), 2)}["row"]
        assert row.partial_input_grads == () and row.partial_param_grads == ()
