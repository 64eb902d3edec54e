"""What must hold between a Plan's fields for the executor to run it (planner.plan.Plan
.from_json checks it): the mesh, the stages' layers and ranks, the micro-batches, the
placements."""

from __future__ import annotations

from typing import TYPE_CHECKING

from planner.cost.schedule_v import device_of_chunk
from planner.errors import InputError
from planner.parallel.registry import stores
from planner.placements import shard_dim

if TYPE_CHECKING:
    from planner.plan import NodeSharding, Plan


def check_invariants(plan: Plan, field: str = "plan") -> None:
    """What must hold between a plan's fields for it to run: the mesh's ranks are 0..n-1,
    each once, in a [pp][dp][tp] array of the mesh's shape; stages cover the model's layers in
    order, each on its pipeline row; micro-batches divide the batch; placements name a mesh
    axis each and shard a dimension a tensor can have."""
    if plan.mesh.stage_meshes is not None:
        _check_stage_meshes(plan, field)
        return
    pp, dp, tp = plan.mesh.shape
    world = pp * dp * tp
    ranks = plan.mesh.ranks
    rows = [(len(r), [len(c) for c in r]) for r in ranks]
    if len(ranks) != pp or any(n != dp or any(c != tp for c in cs) for n, cs in rows):
        # either may be the edited one: name the shape, which the ranks are laid out by
        grid = [
            len(ranks),
            len(ranks[0]) if ranks else 0,
            len(ranks[0][0]) if ranks and ranks[0] else 0,
        ]
        raise InputError(
            f"{field}.mesh.shape",
            f"{[pp, dp, tp]} disagrees with mesh.ranks, laid out as {grid} ([pp][dp][tp])",
            "the shape of mesh.ranks, or ranks laid out by the shape",
        )
    flat = sorted(r for row in ranks for col in row for r in col)
    if flat != list(range(world)):
        raise InputError(
            f"{field}.mesh.ranks", "ranks repeat or leave the range", f"0..{world - 1}, once each"
        )
    per_batch = plan.request.training.global_batch_size
    micro = plan.schedule.microbatches
    replicas = dp // (plan.mesh.cp or 1)  # context-parallel ranks share their samples
    if per_batch % replicas or (per_batch // replicas) % micro:
        over = f"dp/cp={replicas}" if plan.mesh.cp else f"dp={dp}"
        raise InputError(
            f"{field}.schedule.microbatches",
            f"{micro} micro-batches do not divide the batch of {per_batch} over {over}",
            "a divisor of global_batch_size / " + ("(dp / cp)" if plan.mesh.cp else "dp"),
        )
    seq = plan.request.training.seq_len
    if plan.mesh.cp and seq % (2 * plan.mesh.cp):
        raise InputError(
            f"{field}.mesh.cp",
            f"2 x cp = {2 * plan.mesh.cp} does not divide the sequence length {seq}",
            "a cp whose 2 x cp load-balanced chunks split the sequence",
        )
    expected = [
        sorted(
            ranks[device_of_chunk(plan.schedule.name, i, pp)][d][t]
            for d in range(dp)
            for t in range(tp)
        )
        for i in range(len(plan.stages))
    ]
    if len(plan.stages) != pp * plan.schedule.virtual_stages:
        raise InputError(
            f"{field}.stages", f"{len(plan.stages)} stages", "pp x schedule.virtual_stages"
        )
    start = 0
    for i, stage in enumerate(plan.stages):
        where = f"{field}.stages[{i}]"
        if len(stage.layers) != 2 or stage.layers[0] != start or stage.layers[1] < start:
            raise InputError(f"{where}.layers", f"{stage.layers}", f"[{start}, end) in order")
        start = stage.layers[1]
        if sorted(stage.ranks) != expected[i]:
            raise InputError(f"{where}.ranks", "not the ranks of its pipeline row", "mesh.ranks")
        if (stage.logical_mesh.dp, stage.logical_mesh.tp) != (dp, tp):
            raise InputError(f"{where}.logical_mesh", "differs from the mesh", f"dp={dp} tp={tp}")
        stored = [s for s in stores().values() if getattr(stage, s.stage_field)]
        if len(stored) > 1 or (stored and stage.activation_checkpointing):
            fields = [s.stage_field for s in stored]
            raise InputError(
                f"{where}.{stored[-1].stage_field}",
                f"with {', '.join(fields[:-1]) or 'activation_checkpointing'}",
                "one of them: an activation store keeps every activation, off the device",
            )
        if stage.resharded_layers is not None and pp > 1:
            raise InputError(
                f"{where}.resharded_layers",
                f"layer-wise ZeRO with pp {pp}",
                "null: torch's pipeline stage keeps every layer gathered from its first backward",
            )
        for sharding in stage.shardings:
            _check_placements(sharding, f"{where}.shardings[{sharding.node}]")
    _check_covered(plan, start, field)


def _check_covered(plan: Plan, end: int, field: str) -> None:
    layers = plan.request.model.config.get("layers")
    if "image_size" in plan.request.model.config:
        layers = None  # an image model's "layers" is its depth (ResNet-50), not its blocks
    if isinstance(layers, int) and end != layers:
        raise InputError(
            f"{field}.stages", f"cover layers [0, {end})", f"[0, {layers}) (the model's)"
        )


def _check_stage_meshes(plan: Plan, field: str) -> None:
    """Stages on submeshes of their own: stage s's ranks are mesh.ranks[s], laid out
    [dp][tp] by stage_meshes[s]; every rank once; one stage per pipeline position; each
    stage's dp splits the pipeline micro-batch."""
    meshes, ranks = plan.mesh.stage_meshes or [], plan.mesh.ranks
    if plan.schedule.virtual_stages != 1 or len(plan.stages) != len(meshes):
        raise InputError(
            f"{field}.stages", f"{len(plan.stages)} stages", "one per entry of mesh.stage_meshes"
        )
    flat = []
    micro = plan.request.training.global_batch_size // plan.schedule.microbatches
    if plan.request.training.global_batch_size % plan.schedule.microbatches:
        raise InputError(
            f"{field}.schedule.microbatches", "do not divide the batch", "a divisor of it"
        )
    start = 0
    for s, (shape, grid, stage) in enumerate(zip(meshes, ranks, plan.stages, strict=False)):
        dp, tp = shape[:2]
        where = f"{field}.stages[{s}]"
        if len(grid) != dp or any(len(row) != tp for row in grid):
            raise InputError(f"{field}.mesh.ranks[{s}]", "not laid out", f"[{dp}][{tp}]")
        own = [r for row in grid for r in row]
        flat += own
        if sorted(stage.ranks) != sorted(own):
            raise InputError(f"{where}.ranks", "not its submesh's", f"mesh.ranks[{s}]")
        if (stage.logical_mesh.dp, stage.logical_mesh.tp) != (dp, tp):
            raise InputError(
                f"{where}.logical_mesh", "differs from its submesh", f"dp={dp} tp={tp}"
            )
        if micro % dp:
            raise InputError(
                f"{field}.mesh.stage_meshes[{s}]",
                f"dp {dp} does not split the micro-batch of {micro}",
                "a divisor of global_batch_size / microbatches",
            )
        if len(stage.layers) != 2 or stage.layers[0] != start or stage.layers[1] < start:
            raise InputError(f"{where}.layers", f"{stage.layers}", f"[{start}, end) in order")
        start = stage.layers[1]
        for sharding in stage.shardings:
            _check_placements(sharding, f"{where}.shardings[{sharding.node}]")
    if len(ranks) != len(meshes) or sorted(flat) != list(range(len(flat))):
        raise InputError(
            f"{field}.mesh.ranks", "ranks repeat or leave the range", "0..n-1, once each"
        )
    _check_covered(plan, start, field)


# A tensor the planner shards has at most this many dimensions (conv weights: 4, attention
# activations: 4; "S(d)" with d past it names no dimension).
MAX_TENSOR_DIMS = 6


def _check_placements(sharding: NodeSharding, where: str) -> None:
    groups = [(f"params.{k}", v) for k, v in sharding.params.items()]
    groups += [(f"inputs[{i}]", v) for i, v in enumerate(sharding.inputs)]
    groups += [(f"outputs[{i}]", v) for i, v in enumerate(sharding.outputs)]
    for label, placements in groups:
        if len(placements) != 2:
            raise InputError(f"{where}.{label}", f"{placements}", "one placement per axis (dp, tp)")
        for p in placements:
            d = shard_dim(p)
            if d is not None and not -MAX_TENSOR_DIMS <= d < MAX_TENSOR_DIMS:
                raise InputError(
                    f"{where}.{label}", f"{p} shards no dimension", f"S(d), |d| < {MAX_TENSOR_DIMS}"
                )
