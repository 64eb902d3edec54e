"""Expert parallelism (ep) on the dp axis: groups of `ep` neighbouring dp ranks split each
mixture-of-experts layer's experts, E / ep to a rank, instead of each holding all of them.
A rank routes its own tokens as before; the tokens bound for another rank's experts are sent
there with one all-to-all over the ep group and the experts' outputs come back with another
(GShard, Lepikhin et al. 2020, section 2.2; Megatron-Core's --expert-model-parallel-size,
torchtitan's expert_parallel_degree, both drawing ep from the data-parallel ranks). Under
context parallelism the ep groups are drawn from the dp x cp ranks, cp innermost, as both do
(Megatron-Core's expert rank order tp-ep-dp-pp over its tp-cp-ep-dp-pp dense order;
torchtitan's ep mesh dp_shard_in_ep x cp): a rank routes the tokens of its sequence shard,
so tokens per rank, and with them each all-to-all, are 1 / cp of a whole sequence's.

Dispatch as the model defines it:
- by capacity (the zoo's GShard MoE): each expert takes at most C tokens of each routing
  group (the model's capacity factor), padded to C, so each rank's all-to-all buffer is the
  dense dispatch tensor [E, groups, C, hidden] whatever the router decides: its bytes are
  known before the run (Megatron-LM's --moe-expert-capacity-factor with
  --moe-pad-expert-input-to-capacity). Rank r sends the slice of its buffer for rank j's
  experts to rank j, receives the other ranks' tokens for its own E / ep experts, computes
  them as one batched GEMM per weight, and sends the outputs back the same way;
- dropless (transformers' MoE models, `routed`): each of a rank's tokens x top-k rows goes
  to the rank of its expert, after a small all-to-all of each expert's row count. A rank
  sends exactly its own rows; what it receives (and sends back) is what the router gave its
  experts, so the ledger states the group's mean and the group's total is exact.

Time: per MoE layer and micro-batch, the dispatch and the combine all-to-all of that buffer
on the ep axis in forward, the same two (their gradients, the opposite way) in backward, and
the forward's again where the layer recomputes. Compute per rank is unchanged: its E / ep
experts run ep ranks' tokens where all E ran its own, the same FLOPs. Capacity makes every
rank's the same (dropped tokens are its price); dropless dispatch is priced with the router
balanced over the ranks (what auxiliary load-balancing losses and DeepSeek-V3's bias
balancing aim at) unless the request states the imbalance (training.expert_imbalance: the
busiest rank's rows over the group's mean, at most ep): that rank's expert GEMMs and its
exchanges then take so much longer, and every rank of the group waits for it.
Capacity dispatch has no such term: each rank's buffer is padded to the same size.
Memory: expert weights, gradients and optimizer state / ep. ZeRO applies to the expert
weights over the expert-data-parallel group, the dp / ep ranks that hold the same experts
(Megatron-Core's expert data parallel group, torchtitan's dp_shard_mod_ep), where their
gradients are synchronised: one collective per MoE layer on that group's links. Activations
are unchanged (the received buffer has the sent one's size).
Search: ep in powers of two dividing the dp x cp ranks and the expert count, for the models
whose MoE layers the executor exchanges (FAMILIES); beside tp > 1 where tp splits each
expert's features (transformers' experts: expert tensor parallelism, Megatron-Core's default
--expert-tensor-parallel-size = tp), each rank's experts then E / ep of 1 / tp of their
features, its all-to-alls on the ep ranks of its tp index. Plan field: mesh.ep.
"""

from __future__ import annotations

from dataclasses import dataclass

from planner.cluster.mesh import MeshAxis, contiguous_axes
from planner.cost.memory import ParamBytes, model_state_bytes
from planner.cost.model import CostModel
from planner.errors import InputError
from planner.evaluate.layer_table import LayerTable
from planner.graph.opgraph import OpGraph
from planner.limits import MAX_DEVICES
from planner.parallel.choice import Choice
from planner.parallel.technique import MODULES_ONLY, Capability, ModelSupport, Pin, Technique
from planner.units import human_bytes

_TEST = "tests/executor/test_expert_parallel.py::test_expert_parallel_matches_the_reference"
_EXEC = "executor.expert_parallel:apply_expert_parallel"
_HF = "tests/executor/test_hf_models.py::test_hf_model_matches_single_process_reference"
CHOICES = (
    Choice("mesh.ep", 1, _EXEC, f"{_TEST}[dp4-ep1-zero0]"),
    Choice("mesh.ep", "2 or more", _EXEC, f"{_TEST}[dp4-ep2-zero0]"),
    Choice(
        "mesh.etp",
        1,
        "executor.expert_parallel:TokenShardBlock",
        f"{_HF}[mixtral-dp2xtp2-ep4-etp1-zero3]",
    ),
)
# Families whose MoE layers the executor's expert parallelism exchanges: the zoo's GShard MoE
# (capacity dispatch, experts as batched weights [E, ...]), and the Hugging Face model types
# whose MoE blocks call transformers' experts module (3-D gate_up_proj and down_proj) with
# the router's choices (dropless dispatch: executor.expert_parallel.RoutedExchange).
FAMILIES = frozenset({"moe"})
HF_TYPES = frozenset({"mixtral", "qwen2_moe", "qwen3_moe", "deepseek_v3"})


SUPPORT = ModelSupport("expert parallelism", FAMILIES, HF_TYPES)


MAX_EP = 256
EXPERT_WEIGHT = "experts."  # the expert weights' names contain it, dim 0 the expert index


ZERO1_REFUSAL = (
    "autopar's executor runs ZeRO-1 with flat buffers (executor.zero1) that do not hold expert "
    "weights split over ep ranks: ZeRO 0, 2 or 3 (or plan for the megatron runtime, whose "
    "distributed optimizer does)"
)


def is_expert_weight(name: str, shape) -> bool:
    """A parameter holding one slice per expert along dim 0 ([E, ...], 3-D)."""
    return EXPERT_WEIGHT in name and len(shape) == 3


def split_over_tp(model_config: dict | None) -> bool:
    """Whether tp splits each expert's features (transformers' experts modules: Megatron's
    layout splits them, planner.intra_op.expert_layout), so that ep runs
    beside tp; the zoo's GShard experts stay whole on each tp rank."""
    config = model_config or {}  # a transformers config, or the planner's summary of one
    return bool(config.get("model_type")) and expert_count(config) > 0


def expert_count(model_config: dict | None) -> int:
    """The routed experts per MoE layer a model config names (0: a dense model)."""
    config = model_config or {}
    for key in ("experts", "num_local_experts", "num_experts", "n_routed_experts"):
        value = config.get(key)
        if isinstance(value, int) and value > 0:
            return value
    return 0


@dataclass(frozen=True)
class ExpertLayers:
    """Per layer position of a graph: the expert weights' elements (all experts), and per
    sample the bytes each MoE layer's dispatch buffer holds (what each of its token
    all-to-alls sends), how many MoE layers the position has and its expert GEMMs' forward
    and backward FLOPs; `routed`: the experts are grouped GEMMs over the rows the router sent
    them (dropless: transformers' MoE), whose share on each rank the routing decides, not a
    capacity-padded buffer (the zoo's GShard); `imbalance`: the request's
    training.expert_imbalance; `features`: each expert's intermediate features (the down
    projection's input width, the smallest over the layers; 0 unknown)."""

    params: list[int]
    exchanged: list[float]
    moe_layers: list[int]
    experts: int = 0
    routed: bool = False
    expert_flops: tuple[list[float], list[float]] = ([], [])
    imbalance: float = 1.0
    features: int = 0

    def split(self, tp: int) -> int:
        """Into how many parts Megatron's layout splits each expert's features at this tp:
        tp for transformers' experts whose features it divides
        (planner.intra_op.expert_layout), else 1."""
        return tp if self.routed and self.features and self.features % tp == 0 else 1

    def busiest(self, ep: int) -> float:
        """The busiest rank's routed rows over the group's mean (1 under capacity dispatch,
        at most ep: every row on one rank)."""
        return min(self.imbalance, ep) if self.routed else 1.0

    @classmethod
    def of(cls, graph: OpGraph, imbalance: float = 1.0) -> ExpertLayers:
        n = max(graph.num_layers, 1)
        params, exchanged, moe_layers = [0] * n, [0.0] * n, [0] * n
        fwd_flops, bwd_flops = [0.0] * n, [0.0] * n
        pos, batch = graph.positions, max(graph.data.batch, 1)
        producer = {(e.dst, e.dst_input): e.src for e in graph.edges}
        by_name = {node.name: node for node in graph.nodes}
        seen: set[str] = set()
        experts, routed, features = 0, False, 0
        for node in graph.nodes:
            own = [k for k, m in node.params.items() if is_expert_weight(k, m.shape)]
            for name in own:
                if name not in seen:
                    seen.add(name)
                    params[pos[node.name]] += _numel(node.params[name].shape)
                    experts = node.params[name].shape[0]
                    if name.endswith("down_proj"):  # [E, hidden, features]
                        width = node.params[name].shape[2]
                        features = min(features, width) if features else width
            weights = own
            if node.kind == "grouped_mm":  # its weights come transposed from another node
                src = by_name.get(producer.get((node.name, 1), ""))
                held = src.params if src is not None else {}
                weights = [k for k, m in held.items() if is_expert_weight(k, m.shape)]
                routed = routed or bool(weights)
            if weights:
                fwd_flops[pos[node.name]] += node.fwd_flops / batch
                bwd_flops[pos[node.name]] += node.bwd_flops / batch
            # the first expert GEMM of a layer reads the dispatched tokens
            if weights and node.inputs and not _reads_expert_output(weights):
                exchanged[pos[node.name]] += node.inputs[0].nbytes / batch
                moe_layers[pos[node.name]] += 1
        flops = (fwd_flops, bwd_flops)
        return cls(params, exchanged, moe_layers, experts, routed, flops, imbalance, features)


def _reads_expert_output(weights: list[str]) -> bool:
    """Whether these are a layer's second expert GEMM's weights (named like the output
    projection: GShard's wo, transformers' down_proj), which read the experts' own output."""
    return any(w.rsplit(".", 1)[-1] in ("wo", "down_proj", "w2") for w in weights)


def _numel(shape) -> int:
    out = 1
    for d in shape:
        out *= d
    return out


def refusal(
    family: str,
    model_config: dict | None,
    ep: int,
    dp: int,
    tp: int = 1,
    cp: int = 1,
    zero: int | None = None,
    dp_shard: int = 0,
    etp: int = 0,
) -> str | None:
    """Why this model and mesh cannot split experts over `ep` dp ranks (dp x tp ranks with
    `etp` 1), or None."""
    if ep != 1 and (why := SUPPORT.refusal(family, model_config)):
        return why
    experts = expert_count(model_config)
    split = split_over_tp(model_config)
    return mesh_refusal(experts, ep, dp, tp, cp, zero, dp_shard, split_over_tp=split, etp=etp)


def mesh_refusal(
    experts: int,
    ep: int,
    dp: int,
    tp: int = 1,
    cp: int = 1,
    zero: int | None = None,
    dp_shard: int = 0,
    runtime: str = "autopar",
    split_over_tp: bool = False,
    etp: int = 0,
) -> str | None:
    """Why `ep` does not split these experts on this mesh (`dp`: its dp x cp ranks, from
    which ep is drawn; `split_over_tp`: each expert's features split over tp, as
    transformers' experts are, so ep runs beside tp; `etp` 1: ep drawn from the dp x tp
    ranks, experts whole), whatever the model, or None (ZeRO-1 is refused for autopar's
    executor only: Megatron-LM's distributed optimizer shards expert state over the
    expert-data-parallel group)."""
    if etp not in (0, 1):
        return f"expert tp {etp!r}: 1 (experts whole, ep over dp x tp) or as tp splits them"
    if ep == 1:
        return None if etp == 0 else "expert tp 1 folds ep over the tp ranks: ep > 1"
    folded = etp == 1
    ranks = dp * tp if folded else dp
    if not isinstance(ep, int) or ep < 1 or ranks % ep:
        return f"ep {ep!r} does not divide {'dp x tp ' if folded else 'dp '}{ranks}"
    if experts <= 0:
        return "the model has no experts to split"
    if experts % ep:
        return f"ep {ep} does not divide the {experts} experts"
    if folded and (why := _folding_refusal(ep, tp, cp, split_over_tp)):
        return why
    if tp > 1 and not split_over_tp:
        return (
            "expert parallelism runs with tp 1 for this model (its experts are not split over "
            "tp: only transformers' experts modules are)"
        )
    if cp > 1 and not folded and ep % cp and cp % ep:
        return (
            f"ep {ep} and cp {cp}: one a multiple of the other (ep groups of whole cp groups, "
            "or within one)"
        )
    if zero == 1 and runtime == "autopar":
        return ZERO1_REFUSAL
    if 0 < dp_shard < dp:
        return "expert parallelism with HSDP is not run"
    return None


def _folding_refusal(ep: int, tp: int, cp: int, split_over_tp: bool) -> str | None:
    if tp == 1:
        return "expert tp 1 folds ep over the tp ranks: tp > 1"
    if ep % tp:
        return f"ep {ep} over dp x tp: a multiple of tp {tp} (ep groups of whole tp groups)"
    groups = ep // tp  # ep over dp x cp x tp: groups of whole tp groups, nested with cp's
    if cp > 1 and groups % cp and cp % groups:
        return (
            f"ep {ep} over tp {tp} and cp {cp}: ep / tp a multiple or a divisor of cp (ep "
            "groups of whole cp groups, or within one)"
        )
    if not split_over_tp:
        return "expert tp 1 runs transformers' MoE blocks (the zoo's GShard MoE keeps tp 1)"
    return None


def zero_levels(levels: tuple[int, ...], ep: int, runtime: str) -> tuple[int, ...]:
    """The ZeRO levels of `levels` that run with experts split over ep ranks."""
    return tuple(z for z in levels if ep == 1 or z != 1 or runtime != "autopar")


def check_pin(
    pinned: int | None,
    family: str,
    model_config: dict | None,
    combos: list,
    zero_stages: tuple[int, ...] = (0, 1, 2, 3),
    runtime: str = "autopar",
    meshes: list[tuple[int, int, int]] = (),
    etp: int | None = None,
) -> None:
    """An ep (or expert tp) pinned where no searched mesh (`meshes`: (pp, dp, tp)) or ZeRO
    level can use it is the user's to change: say why rather than that nothing fits."""
    mode = 1 if etp == 1 else 0
    if etp is not None and not any(c.etp == mode for c in combos):
        tried = sorted({(dp, tp) for _, dp, tp in meshes})
        if mode == 0:
            why = f"no searched mesh has tp {etp} (searched: tp {sorted({t for _, t in tried})})"
        else:
            ep = pinned or 0
            reasons = (
                refusal(family, model_config, ep or max(tp, 2), dp, tp, etp=1) for dp, tp in tried
            )
            why = next((r for r in reasons if r), None)
            why = why or "no searched mesh has tp > 1 and dp x tp ranks an ep over them divides"
        raise InputError("search.etp", why, "an expert tp the model and the meshes allow")
    if pinned is None or pinned == 1:
        return
    if not zero_levels(zero_stages, pinned, runtime):
        raise InputError("search.ep", ZERO1_REFUSAL, "ZeRO 0, 2 or 3 (search.zero)")
    if any(c.ep == pinned for c in combos):
        return
    tried = sorted({(dp, tp) for _, dp, tp in meshes})
    reasons = (refusal(family, model_config, pinned, dp, tp) for dp, tp in tried)
    # the model's own reason first (its experts, its type), then a searched mesh's
    why = refusal(family, model_config, pinned, pinned) or next((r for r in reasons if r), None)
    why = why or f"no searched mesh has dp x cp ranks that ep {pinned} divides"
    raise InputError("search.ep", why, "an ep the model's experts and the meshes allow")


def ep_options(
    family: str,
    model_config: dict | None,
    dp: int,
    tp: int,
    cp: int,
    pinned: int | None,
    etp: int | None = None,
) -> tuple[tuple[int, int], ...]:
    """(ep, expert tp) pairs the search tries on a mesh: the pins, or 1 and every power of
    two that divides dp and the expert count (expert tp 0: as the layout splits them), and
    with tp > 1 every multiple of tp dividing dp x tp and the experts with expert tp 1
    (folded over the tp ranks). A pinned expert tp 1 keeps only the folded pairs; a pinned
    expert tp N > 1, the others on meshes of tp N."""
    if etp is not None and etp > 1 and tp != etp:
        return ()
    out: list[tuple[int, int]] = []
    for folded in (False, True):
        if etp is not None and folded != (etp == 1):
            continue
        mode = 1 if folded else 0
        if pinned is not None:
            if refusal(family, model_config, pinned, dp, tp, cp, etp=mode) is None:
                out.append((pinned, mode))
            continue
        if not folded:
            out.append((1, 0))
        ep = 2
        while ep <= min(dp * (tp if folded else 1), expert_count(model_config), MAX_EP):
            if refusal(family, model_config, ep, dp, tp, cp, etp=mode) is None:
                out.append((ep, mode))
            ep *= 2
    return tuple(out)


def axes(
    cluster, first_rank: int, dp: int, ep: int, tp: int, folded: bool = False
) -> tuple[MeshAxis, MeshAxis]:
    """(the ep axis, the expert-data-parallel axis) of the stage whose first rank is
    `first_rank`: ep neighbouring dp ranks (stride tp), and across those groups; folded over
    tp: ep neighbouring ranks, and across those."""
    if folded:
        edp, ep_axis = contiguous_axes(cluster, first_rank, (dp * tp // ep, ep), ("edp", "ep"))
        return ep_axis, edp
    edp, ep_axis, _ = contiguous_axes(cluster, first_rank, (dp // ep, ep, tp), ("edp", "ep", "tp"))
    return ep_axis, edp


def scaled_table(
    table: LayerTable,
    ep: int,
    layers: ExpertLayers,
    mbs: int,
    tp: int,
    cm: CostModel,
    cp: int = 1,
    folded: bool = False,
) -> LayerTable:
    """`table` as one rank of an ep group runs it: each MoE layer's dispatch and combine
    all-to-alls (forward, again in recomputation, and backward) on the ep axis of the first
    stage's ranks, 1 / ep of the expert weights' elements in its parameters, and those
    elements per position (LayerTable.expert_params), which the stage's state shards over
    the expert-data-parallel group; with a stated imbalance, the busiest rank's longer
    expert GEMMs and exchanges; under context parallelism (`table` a cp rank's) a rank's
    tokens are 1 / cp of its micro-batch's, and folded over tp (`folded`: `table` the
    folded layout's) 1 / tp. Cached on the table per (ep, mbs, imbalance, cp, folded)."""
    busiest = layers.busiest(ep)
    key = f"ep:{ep}:{mbs}:{busiest}:{cp}:{folded}"
    if ep == 1:
        return table
    if key in table.derived:
        return table.derived[key]  # type: ignore[return-value]
    # the ep axis's links: those of ep neighbouring ranks (of dp ranks, stride tp, unless
    # folded over tp), wherever dp extends beyond them
    axis, _ = axes(cm.cluster, 0, ep // tp if folded else ep, ep, tp, folded)
    features = 1 if folded else layers.split(tp)  # tp already splits each expert's features
    tokens = mbs / cp / (tp if folded else 1)  # a rank's samples' worth of routed tokens
    share = tp if folded else features  # the part of a sample's expert rows a rank computes
    held = [n // features for n in layers.params]
    inside = {k: list(v) for k, v in table.inside.items()}
    for layer in range(table.num_positions):
        # a rank's parameters: its 1 / ep of the experts (what the bounds and ZeRO-3's
        # gathered layer read); the stage's state splits them off (stage_experts)
        inside["params"][layer] -= held[layer] - held[layer] // ep
        calls = layers.moe_layers[layer]
        if not calls:
            continue
        each = layers.exchanged[layer] / calls * tokens
        seconds = 2 * calls * cm.all_to_all(each * busiest, axis)
        if busiest > 1:  # its experts' extra rows, forward (and again in recomputation) and back
            rows = mbs / cp * (busiest - 1) / share
            fwd_flops, bwd_flops = (f[layer] * rows for f in layers.expert_flops)
            inside["fwd"][layer] += cm.compute_time(fwd_flops, 0)
            inside["bwd"][layer] += cm.compute_time(bwd_flops, 0)
            inside["wgrad"][layer] += cm.compute_time(bwd_flops, 0) / 2  # the weights' half
        if layers.routed:  # the row counts first (forward only)
            counts = calls * cm.all_to_all(8 * layers.experts, axis)
            inside["comm_fwd"][layer] += counts
            inside["selective_recompute"][layer] += counts
            inside["selective_alternate_recompute"][layer] += counts
        inside["comm_fwd"][layer] += seconds
        inside["comm_bwd"][layer] += seconds
        inside["selective_recompute"][layer] += seconds
        inside["selective_alternate_recompute"][layer] += seconds
    out = LayerTable(
        table.num_positions,
        inside,
        {k: list(v) for k, v in table.outside.items()},
        list(table.layer_inputs),
        list(table.cut_bytes),
        dict(table.before_layers),
        table.uses,
        list(table.largest_outputs),
        expert_params=[n // ep for n in held],
    )
    table.derived[key] = out
    return out


def stage_experts(table: LayerTable, ranges: list[tuple[int, int]]) -> int:
    """Elements of expert weights a rank holds (1 / ep of the experts) in the layer ranges of
    a stage's chunks; 0 without expert parallelism."""
    if not table.expert_params:
        return 0
    return sum(sum(table.expert_params[a:b]) for a, b in ranges)


def zero3_comm(cm: CostModel, edp: MeshAxis, local: int, per: ParamBytes, layer: int) -> float:
    """ZeRO-3 on the expert weights: each micro-batch's gathers (forward and backward) and
    gradient reduce-scatter of a rank's E / ep experts over the expert-data-parallel group
    (none where each rank's experts are its own)."""
    if edp.size == 1 or not local:
        return 0.0
    gather = cm.bucketed("all_gather", local * per.weights, edp, layer * per.weights)
    return 2 * gather + cm.bucketed("reduce_scatter", local * per.grads, edp, layer * per.grads)


def explanation(graph: OpGraph, cm: CostModel, config, training, device_ranges) -> str | None:
    """What expert parallelism costs and saves on the device whose layers exchange most
    (`device_ranges`: each device's chunks' layer ranges), in a sentence; None without it."""
    if config.ep == 1:
        return None
    layers = ExpertLayers.of(graph, training.expert_imbalance)
    busiest_rows = layers.busiest(config.ep)
    experts = next(
        m.shape[0] for n in graph.nodes for k, m in n.params.items() if is_expert_weight(k, m.shape)
    )
    folded = config.folded
    ep_axis, _ = axes(cm.cluster, 0, config.dp, config.ep, config.tp, folded)
    mbs, edp = max(graph.data.batch, 1), config.edp
    features = 1 if folded else layers.split(config.tp)  # each expert's features split over tp
    # a rank's share of the micro-batch's tokens, as samples: its cp (or folded: tp) shard's
    tokens = mbs / config.cp / (config.tp if folded else 1)
    busiest = (0.0, 0)
    for ranges in device_ranges:
        seconds, held = 0.0, 0
        for a, b in ranges:
            for layer in range(a, b):
                if calls := layers.moe_layers[layer]:
                    each = layers.exchanged[layer] / calls * tokens
                    seconds += 4 * calls * cm.all_to_all(each * busiest_rows, ep_axis)
                held += layers.params[layer] // config.ep // features
        busiest = max(busiest, (seconds * config.microbatches, held))
    seconds, held = busiest
    state = sum(model_state_bytes(held, training.dtype, training.optimizer, config.zero, edp))
    links = "across nodes" if ep_axis.crosses_nodes else "within a node"
    ranks = "dp x cp" if config.cp > 1 else "dp"
    ranks = f"{ranks} x tp" if folded else ranks
    whole = " (expert tp 1: each expert whole, each MoE block on its tp rank's tokens)"
    whole = whole if folded else ""
    return (
        f"Expert parallelism: groups of {config.ep} {ranks} ranks split each MoE layer's {experts} "
        f"experts ({experts // config.ep} per rank{whole}, their ZeRO-{config.zero} state over the "
        f"{edp} ranks holding the same); the token all-to-alls {links} take {seconds:.3f} s "
        f"per step on the busiest device (2 forward and 2 backward per MoE layer and "
        f"micro-batch, before recomputation), and its experts' weights, gradients and "
        f"optimizer state {human_bytes(state)}"
        + (
            f"; priced with the busiest rank routed {busiest_rows:g}x the group's mean rows "
            "(training.expert_imbalance), its expert GEMMs and exchanges as much longer."
            if busiest_rows > 1
            else "."
        )
    )


PINS: tuple[Pin, ...] = (
    Pin(
        "ep",
        "count",
        "expert parallelism: groups of N dp ranks (dp x cp under context parallelism) split "
        "each MoE layer's experts and exchange tokens with all-to-alls (1: none; default: "
        "searched for MoE models)",
        low=1,
        high=MAX_DEVICES,
        metavar="N",
    ),
    Pin(
        "etp",
        "count",
        "expert tensor parallelism: 1 keeps every expert whole and draws the ep groups from "
        "the dp x tp ranks, each MoE block on its tp rank's sequence shard (Megatron-Core's "
        "MoE parallel folding); N > 1 splits each expert's features over tp = N "
        "(Megatron-Core's default); default: both searched",
        low=1,
        high=MAX_DEVICES,
        metavar="N",
    ),
)


TECHNIQUE = Technique(
    "expert",
    order=45,
    pins=PINS,
    choices=CHOICES,
    terms=(
        "planner.parallel.expert:scaled_table",
        "planner.parallel.expert:stage_experts",
        "planner.parallel.expert:zero3_comm",
    ),
    capabilities=(
        Capability(
            "expert_parallel",
            MODULES_ONLY,
            "graph mode does not exchange tokens between expert-parallel ranks (mesh.ep)",
        ),
    ),
)
