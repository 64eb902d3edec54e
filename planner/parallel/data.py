"""Data parallelism on the dp axis: DDP (ZeRO-0) and ZeRO-1/2/3 (FSDP).

Time: gradient reduction (ZeRO 0: all-reduce; 1-2: reduce-scatter + all-gather, an
all-reduce's volume, Rajbhandari et al. 2020, section 7) overlaps with the backward of the
last micro-batch, and in a pipeline with the drain (stage s ends s backward steps early);
ZeRO-3 gathers parameters for forward and backward of every micro-batch and reduce-scatters
gradients, overlapped with that micro-batch's compute (only the excess is exposed). Messages
are what the executor sends: FSDP2 wraps each block (`replicate` for ZeRO-0, `fully_shard` for
ZeRO 1-3), so a layer's gradients are all-reduced (or reduce-scattered, its parameters
all-gathered) in one message: the per-message latency is paid once a layer (DDP's 25 MB
buckets where the layer size is not known). The
profile's `efficiency.overlap` says how much communication can run under compute. Memory:
planner.cost.memory.model_state_bytes shards optimizer state, gradients and parameters by
level, but where FSDP2 reduces once a step over several backwards (torch's pipeline stage,
ZeRO-2 over micro-batches) the gradients are held whole in fp32 until then (the runtime's
holds_whole_gradients). Search: ZeRO-1 is never slower than ZeRO-0 and ZeRO-2 takes
ZeRO-1's time with less memory, so a level is tried only when the one before it does not
fit; ZeRO-3 trades the gradient sync for per-micro-batch gathers and is always tried, but
where the runtime holds gradients whole (a pipeline) on the device ZeRO-2 is never worse
(on_device_groups; ZeRO-3 with CPU offload is still tried).

Layer-wise ZeRO (Galvatron's per-layer choice of strategy under a memory budget, Miao et al.,
VLDB 2023): ZeRO-3 on the first k layers of the stage and ZeRO-2 on the others, k the fewest
that fit. A ZeRO-2 layer keeps its gathered weights from the step's first forward to its
last backward and reduces its gradients once a step (accumulating them whole in fp32 over
the micro-batches); a ZeRO-3 layer gathers for each
micro-batch's forward and backward and reduces each micro-batch's gradients (FSDP2's
`reshard_after_forward` per block, and `set_requires_gradient_sync` /
`set_reshard_after_backward` per block during accumulation). The stage's other parameters
(embeddings, head) stay at ZeRO-3. Only without a pipeline: torch's pipeline stage keeps
every unit gathered from its first backward to the step's reduction
(`set_reshard_after_backward(False)` on the whole stage), so ZeRO-3 already saves nothing on
those layers there. Searched where ZeRO-3 is (beside it: ZeRO-2 layers swap per-micro-batch
gathers for a once-a-step sync, hidden under less compute). Plan field:
stages[].resharded_layers.

HSDP (hybrid sharding; FSDP2 on a 2-D (replicate, shard) dp mesh, torchtitan's
data_parallel_replicate_degree x data_parallel_shard_degree): ZeRO 1-3 shard over groups of
`dp_shard` neighbouring dp ranks (one node's, where the search tries it) and replicate across
the groups: state memory divided by dp_shard, not dp; gathers and reduce-scatters run on the
shard axis's links, and gradients are then all-reduced across the replicas (1/dp_shard of
them, on the replicate axis's links). Searched beside sharding over all of dp for ZeRO 2-3
when dp spans nodes: it trades memory for inter-node traffic.
"""

from __future__ import annotations

from planner.cluster.mesh import MeshAxis, contiguous_axes
from planner.cost.memory import REDUCE_BYTES, ParamBytes
from planner.cost.model import GRAD_BUCKET_BYTES, CostModel
from planner.limits import MAX_DEVICES
from planner.parallel.choice import Choice
from planner.parallel.technique import BOTH_PATHS, MODULES_ONLY, Capability, Pin, Technique
from planner.runtime import runtime_of
from planner.vocab import ZERO_LEVELS

_EXEC = "executor.data_parallel:apply_data_parallel"
_TEST = "tests/executor/test_execute.py::test_plan_matches_single_process_reference"
CHOICES = tuple(
    Choice("stages[].zero", z, _EXEC, f"{_TEST}[{case}]")
    for z, case in zip(
        ZERO_LEVELS,
        ("pp2xdp2-1f1b-zero0", "dp4-zero1", "pp2xdp2-interleaved-zero2", "pp2xdp2-gpipe-zero3"),
        strict=True,
    )
)
CHOICES += (Choice("mesh.dp_shard", "hybrid", _EXEC, f"{_TEST}[dp4-hsdp2-zero3]"),)
CHOICES += (
    Choice(
        "stages[].resharded_layers",
        "layer-wise",
        _EXEC,
        "tests/executor/test_layerwise_zero.py::"
        "test_layerwise_zero_matches_the_reference_and_its_ledger[2]",
    ),
)

# Bytes the optimizer step reads and writes per parameter (mixed precision Adam: fp32 param,
# grad, m, v read; param, m, v and the bf16 copy written).
OPTIMIZER_STEP_BYTES = {"adamw": 28, "adam": 28, "sgd_momentum": 20, "sgd": 12}


def hybrid_refusal(dp: int, dp_shard: int, zero: int) -> str | None:
    """Why (dp, dp_shard, zero) is not a hybrid sharding the executor runs, or None."""
    if dp_shard == 0 or dp_shard == dp:
        return None
    if not isinstance(dp_shard, int) or dp_shard < 1 or dp % dp_shard:
        return f"dp_shard {dp_shard!r} does not divide dp {dp}"
    if zero == 0:
        return "hybrid sharding shards ZeRO state; ZeRO-0 shards nothing"
    return None


def shard_options(dp: int, tp: int, zero: int, devices_per_node: int) -> tuple[int, ...]:
    """dp_shard values the search tries: all of dp (0), and under ZeRO 2-3 one node's dp
    ranks when dp spans nodes (HSDP)."""
    node = devices_per_node // tp if devices_per_node % tp == 0 else 0
    if zero < 2 or not 1 < node < dp or dp % node:
        return (0,)
    return (0, node)


def data_axes(cluster, first_rank: int, cfg) -> tuple[MeshAxis, MeshAxis | None]:
    """(the axis ZeRO shards over, the axis across HSDP's replicas or None) of the stage
    whose first rank is `first_rank`: dp, or under HSDP its inner dp_shard ranks."""
    if not cfg.hybrid:
        return contiguous_axes(cluster, first_rank, (cfg.dp, cfg.tp))[0], None
    shape = (cfg.dp // cfg.dp_shard, cfg.dp_shard, cfg.tp)
    replicate, inner, _ = contiguous_axes(cluster, first_rank, shape, ("replicate", "dp", "tp"))
    return inner, replicate


def on_device_groups(
    dp: int, allowed: tuple[int, ...], runtime: str, pp: int, microbatches: int, ep: int = 1
) -> list[list[int]]:
    """zero_groups with the model state on the device. Where the runtime holds ZeRO-2's and
    ZeRO-3's gradients whole (Runtime.holds_whole_gradients: torch's pipeline stages),
    ZeRO-3 keeps every weight gathered beside its shards, more memory than ZeRO-2's whole
    weights, and adds the gathers: ZeRO-2 takes ZeRO-3's place, a group of its own (tried
    whether or not ZeRO-1 fits: FSDP2 reducing once a step with its mixed-precision policy
    can beat ZeRO-1's autocast casts of every micro-batch). Experts' own ZeRO groups aside."""
    groups = zero_groups(dp, allowed)
    declared = runtime_of(runtime)
    dominated = (
        ep == 1
        and {2, 3} <= set(allowed)
        and declared.holds_whole_gradients(2, dp, pp, microbatches)
        and declared.holds_whole_gradients(3, dp, pp, microbatches)
    )
    if not dominated:
        return groups
    rest = [[z for z in grp if z not in (2, 3)] for grp in groups]
    return [grp for grp in rest if grp] + [[2]]


def zero_groups(dp: int, allowed: tuple[int, ...]) -> list[list[int]]:
    """ZeRO levels to try, in groups: within a group a later level is tried only when the
    earlier ones do not fit (see the module docstring)."""
    order = (1, 2, 0) if dp > 1 else (0,)
    groups = [[z for z in order if z in allowed]]
    if dp > 1 and 3 in allowed:
        groups.append([3])
    return [grp for grp in groups if grp] or [[0]]


def zero3_exposed(
    cm: CostModel,
    axis: MeshAxis,
    params: int,
    per: ParamBytes,
    compute: float,
    overlap: float,
    layer_params: int = 0,
    replicate: MeshAxis | None = None,
    extra: float = 0.0,
) -> float:
    """ZeRO-3's per-micro-batch gathers (forward and backward) and gradient reduce-scatter
    that the micro-batch's compute does not hide (`layer_params`: FSDP2's unit, elements);
    under HSDP `axis` is the shard axis and the reduced shards are all-reduced across
    `replicate`; `extra`: further seconds of transfers beside them (CPU offload's copies)."""
    zero_comm = zero3_comm(cm, axis, params, per, layer_params, replicate)
    return exposed(zero_comm + extra, compute, overlap)


def zero3_comm(
    cm: CostModel,
    axis: MeshAxis,
    params: int,
    per: ParamBytes,
    layer_params: int = 0,
    replicate: MeshAxis | None = None,
) -> float:
    """ZeRO-3's collectives per micro-batch, hidden or not (zero3_exposed)."""
    gather = _fsdp("all_gather", cm, axis, params, per.weights, layer_params)
    zero_comm = 2 * gather + _fsdp("reduce_scatter", cm, axis, params, per.grads, layer_params)
    return zero_comm + _across_replicas(cm, axis, replicate, params, per, layer_params)


def _across_replicas(cm, shard: MeshAxis, replicate, params: int, per, layer: int) -> float:
    """HSDP's all-reduce of each shard group's reduced gradients across the replicas."""
    if replicate is None or replicate.size == 1:
        return 0.0
    return _fsdp(
        "all_reduce", cm, replicate, -(-params // shard.size), per.grads, layer // shard.size
    )


def exposed(comm: float, compute: float, overlap: float) -> float:
    """What communication run under `compute` adds to it, as profile-cluster measures the
    overlap (executor.profile_worker.measure_overlap: both together take comm + compute -
    overlap x min(comm, compute)): the part longer than the compute, and the share of the
    rest not hidden (contention slows the compute it runs under)."""
    return max(0.0, comm - compute) + (1.0 - overlap) * min(comm, compute)


def gradient_sync(
    cm: CostModel,
    axis: MeshAxis,
    params: int,
    per: ParamBytes,
    zero: int,
    layer_params: int = 0,
    replicate: MeshAxis | None = None,
) -> float:
    """The once-per-step gradient synchronisation over dp (0 under ZeRO-3 and for dp = 1);
    under HSDP `axis` is the shard axis, and `replicate` the axis across the replicas."""
    if zero == 3 or (axis.size == 1 and replicate is None):
        return 0.0
    if zero in (1, 2):
        return (
            _fsdp("reduce_scatter", cm, axis, params, per.grads, layer_params)
            + _fsdp("all_gather", cm, axis, params, per.weights, layer_params)
            + _across_replicas(cm, axis, replicate, params, per, layer_params)
        )
    return _fsdp("all_reduce", cm, axis, params, per.grads, layer_params)


def reductions_per_step(config, runtime: str, zero: int | None = None) -> int:
    """How often a step of `config` reduces the gradients over dp (and with them a replicated
    weight's tp-partial gradient) at ZeRO level `zero` (default: the plan's), as the runtime
    runs it (its declaration's reduces_every_backward: autopar's executor at ZeRO-3 only,
    torchtitan at every level)."""
    zero = config.zero if zero is None else zero
    declared = runtime_of(runtime)
    return declared.reductions_per_step(zero, config.dp, config.pp, config.microbatches)


def reduced_in_backward(zero: int, dp: int, pp: int, microbatches: int, runtime: str) -> bool:
    """Whether FSDP2 reduce-scatters each unit's gradients in its own backward (each
    micro-batch's, or the one micro-batch's): the unit being reduced holds its gradients
    unsharded meanwhile, and the stage's root unit (embeddings, head: reduced after the
    whole backward) from its backward on. Elsewhere they are accumulated whole
    (planner.cost.memory.model_state_bytes) or there is no FSDP2."""
    declared = runtime_of(runtime)
    if dp == 1 or zero not in declared.fsdp2_levels:
        return False
    return not declared.holds_whole_gradients(zero, dp, pp, microbatches)


def unsharded_in_backward(table, root: int, largest_layer: int, first_stage: bool) -> int:
    """Parameters whose gradients a stage holds unsharded at once where FSDP2 reduces in
    each backward (reduced_in_backward): the root unit's (`root`) are reduced after the
    whole backward, those of its parameters used after the layers (head, final norm, a tied
    embedding's head use) made first and held throughout, those used only before them (an
    untied embedding) made last, when no layer's are left; each layer's from its backward to
    its reduction, one at a time."""
    tied_after = sum(u.elements for u in table.uses if u.tied and u.layer is None)
    before = max(int(table.before_layers["params"]) - tied_after, 0) if first_stage else 0
    before = min(before, root)
    return root - before + max(largest_layer, before)


def layerwise_refusal(
    pp: int,
    dp: int,
    zero: int,
    hybrid: bool,
    offload: bool,
    ep: int,
    partial_checkpointing: bool,
    runtime: str,
) -> str | None:
    """Why layer-wise ZeRO (ZeRO-3 on a stage's first layers, ZeRO-2 on the rest) does not
    apply to this configuration, or None."""
    if zero != 3 or dp == 1:
        return "layer-wise ZeRO mixes ZeRO-3 and ZeRO-2 layers: it needs ZeRO-3 over dp > 1"
    if pp > 1:
        return (
            "with a pipeline, torch's stage keeps every layer gathered from its first backward "
            "to the step's reduction: a ZeRO-2 layer would save nothing there"
        )
    if runtime != "autopar":
        return f"{runtime}'s configuration sets one ZeRO level for all layers"
    if hybrid or offload or ep > 1:
        return "layer-wise ZeRO is not combined with HSDP, CPU offload or expert parallelism"
    if partial_checkpointing:
        return "layer-wise ZeRO is not combined with partial checkpointing (both pick layers)"
    return None


def kept_weight_bytes(
    params: int, per: ParamBytes, shards: int, whole_gradients: bool = False
) -> int:
    """What a layer's `params` add on a device when it keeps its gathered weights (ZeRO-2)
    instead of their 1 / shards (ZeRO-3): its weights whole less their shard, and where its
    gradients accumulate over micro-batches (`whole_gradients`), FSDP2's whole fp32
    gradients less their shard (planner.runtime.declaration.Runtime.holds_whole_gradients)."""
    added = int(params * per.weights) - -(-int(params * per.weights) // shards)
    return added + (kept_gradient_bytes(params, per, shards) if whole_gradients else 0)


def kept_gradient_bytes(params: int, per: ParamBytes, shards: int) -> int:
    """What a ZeRO-2 layer's gradients add when they accumulate whole in fp32 over the
    micro-batches instead of their 1 / shards."""
    return params * REDUCE_BYTES - -(-int(params * per.grads) // shards)


def fewest_resharded(
    layer_params: list[int],
    root: int,
    per: ParamBytes,
    shards: int,
    budget: float,
    whole_gradients: bool = False,
) -> tuple[int, int]:
    """Layer-wise ZeRO on one device: `layer_params` its layers' parameters in order, `root`
    the stage's other parameters (at ZeRO-3), `budget` the bytes left beside the sharded
    state and the activations. The fewest first layers k at ZeRO-3 for which what the
    others keep (kept_weight_bytes) and the largest ZeRO-3 unit's gather buffer (one unit
    gathered while it computes, as planner.cost.memory.model_state_bytes counts for ZeRO-3)
    fit (all of them when none does): (k, those bytes)."""
    kept = sum(kept_weight_bytes(n, per, shards, whole_gradients) for n in layer_params)
    largest = root
    for k in range(len(layer_params) + 1):
        needed = kept + largest * per.weights
        if needed <= budget or k == len(layer_params):
            return k, needed
        kept -= kept_weight_bytes(layer_params[k], per, shards, whole_gradients)
        largest = max(largest, layer_params[k])
    raise AssertionError("unreachable")


def _fsdp(name: str, cm: CostModel, axis: MeshAxis, params: int, size: float, layer: int):
    """An FSDP2 collective over `params` elements of `size` bytes, one message per layer of
    `layer` elements (DDP's 25 MB buckets where the layer size is not known)."""
    bucket = layer * size if layer else GRAD_BUCKET_BYTES
    return cm.bucketed(name, params * size, axis, bucket)


def exposed_sync(sync: float, overlap: float, backward: float, stage: int) -> float:
    """Gradient buckets are reduced while backward still runs (DDP/FSDP overlap): the last
    micro-batch's backward hides part of the sync, and in 1F1B/GPipe stage s finishes its last
    backward s micro-batch-backwards before stage 0 ends the step."""
    return exposed(sync, backward * (1 + stage), overlap)


def optimizer_step_time(params: int, zero: int, dp: int, optimizer: str, mem_rate: float) -> float:
    """The optimizer step is memory-bound; ZeRO >= 1 updates 1/dp of the parameters."""
    local = params if zero == 0 else -(-params // dp)
    return local * OPTIMIZER_STEP_BYTES[optimizer] / mem_rate


PINS: tuple[Pin, ...] = (
    Pin("zero", "choice", "the ZeRO stage on dp", choices=ZERO_LEVELS),
    Pin(
        "layerwise_zero",
        "switch",
        "with ZeRO-3 and no pipeline: ZeRO-3 on the fewest first layers that fit, ZeRO-2 on "
        "the others (default: searched beside ZeRO-3)",
    ),
    Pin(
        "dp_shard",
        "count",
        "HSDP: ZeRO shards over groups of N dp ranks and replicates across them (0: over all "
        "of dp)",
        low=0,
        high=MAX_DEVICES,
        metavar="N",
    ),
)


TECHNIQUE = Technique(
    "data",
    order=60,
    pins=PINS,
    choices=CHOICES,
    terms=(
        "planner.parallel.data:gradient_sync",
        "planner.parallel.data:zero3_exposed",
        "planner.parallel.data:optimizer_step_time",
    ),
    capabilities=(
        Capability("zero0", BOTH_PATHS),
        *(
            Capability(
                f"zero{z}",
                MODULES_ONLY,
                f"graph mode replicates parameters over dp (ZeRO-0); it does not run ZeRO-{z} "
                "(plan on the module path: tp_layout megatron)",
            )
            for z in (1, 2, 3)
        ),
        Capability("hsdp", MODULES_ONLY, "graph mode does not run hybrid sharding (mesh.dp_shard)"),
    ),
)
