"""Apply a stage's tensor-parallel shardings with DTensor parallel styles. Strategy names are the
sharding rules' (Megatron's layout uses them too): column-parallel linears (`col`) ->
ColwiseParallel; row-parallel (`row`) -> RowwiseParallel; a vocab-parallel embedding (`vocab`)
-> RowwiseParallel with replicated ids. Head-parallel attention and element-wise followers need
nothing: the model code infers local head counts from shapes. The last stage's column-parallel
head gathers its logits for the loss. Strategies with no executor support yet raise an
ExecutionError that names the node, rather than running something else.
"""

from __future__ import annotations

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from executor.errors import ExecutionError
from planner.executable import REPLICATED, executable
from planner.plan import NodeSharding


def _strategy(s: NodeSharding) -> str:
    return s.strategy.split("|")[-1].removeprefix("tp:")


def tensor_parallel_plan(stage: nn.Module, shardings: list[NodeSharding], head: str | None):
    names = dict(stage.named_modules())
    plan = {}
    for s in shardings:
        strategy = _strategy(s)
        if not executable(s.kind, s.strategy):
            raise ExecutionError(
                f"node {s.node} ({s.module or s.kind}): strategy {s.strategy!r} is not "
                "executable yet (supported on tp: column/row-parallel linears, vocab-parallel "
                "embedding and loss, head-parallel attention, followers)"
            )
        if s.kind not in ("linear", "embedding") or strategy in REPLICATED:
            continue  # attention heads, the loss, followers: run on whatever shard they get
        module = names.get(s.module)
        if isinstance(module, nn.Linear) and strategy == "col":
            gather = s.module == head
            plan[s.module] = (
                ColwiseParallel(output_layouts=Replicate()) if gather else ColwiseParallel()
            )
        elif isinstance(module, nn.Linear) and strategy == "row":
            plan[s.module] = RowwiseParallel()
        elif isinstance(module, nn.Embedding) and strategy == "vocab":
            plan[s.module] = RowwiseParallel(input_layouts=Replicate())
        else:
            raise ExecutionError(
                f"node {s.node}: strategy {s.strategy!r} needs module {s.module!r} to be a "
                f"{'Linear' if s.kind == 'linear' else 'Embedding'} of this stage; it is "
                f"{type(module).__name__ if module is not None else 'missing'}"
            )
    return plan


def apply_tensor_parallel(
    stage: nn.Module, shardings: list[NodeSharding], tp_mesh: DeviceMesh, head: str | None
) -> None:
    if tp_mesh.size() == 1:
        return
    plan = tensor_parallel_plan(stage, shardings, head)
    if plan:
        parallelize_module(stage, tp_mesh, plan)
