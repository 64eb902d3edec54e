"""Pipelines whose stages run on different submeshes (a per-stage plan: Alpa's inter-operator
pass, planner.evaluate.submeshes): each stage its own (dp, tp) DeviceMesh, the boundary
activations resharded between them, and 1F1B run by this module (torch's schedules take one
pp group whose ranks are stage for stage alike).

The boundary reshard, as Alpa's cross-mesh resharding: one micro-batch's boundary tensor,
flattened, is split into pieces, one per rank of a stage: dp rank d holds rows d of dp (the
pipeline micro-batch split over the stage's dp), and within them tp rank t the t-th of tp
equal parts. A sending stage's rank sends the part of its own piece that each receiving
rank's piece covers (every element once, point to point); each receiving rank then
all-gathers its dp rank's rows over its tp group. So every rank of a stage sends its share
of its rows' elements (1/tp of them) and receives 1/tp of its own rows' before the gather,
forward and, for the gradient, backward alike (planner.evaluate.submeshes prices the same
and planner.evaluate.ledger predicts these messages).

The micro-batches are taken from the global batch in order (micro-batch i is rows
[i B/m, (i+1) B/m)), each stage's dp ranks splitting each of them: the boundary between two
stages then only moves rows within a micro-batch, whatever the two dp degrees.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from executor.errors import ExecutionError
from executor.mesh import HYBRID_DIMS, OWN, needs_own_dim

# The boundary's dtype in the first step's shape message (the step's messages are sized by it)
DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
SHAPE_MESSAGE = 8  # int64s: dtype code, number of dims, the dims of one row


@dataclass(frozen=True)
class StageGrid:
    """A stage's ranks as the plan lays them out: [dp][tp], tp fastest."""

    ranks: tuple[tuple[int, ...], ...]

    @property
    def dp(self) -> int:
        return len(self.ranks)

    @property
    def tp(self) -> int:
        return len(self.ranks[0])

    @property
    def flat(self) -> list[int]:
        return [r for row in self.ranks for r in row]

    def coordinate(self, rank: int) -> tuple[int, int]:
        for d, row in enumerate(self.ranks):
            if rank in row:
                return d, row.index(rank)
        raise ValueError(f"rank {rank} is not in this stage")

    def piece(self, d: int, t: int, numel: int) -> tuple[int, int]:
        """The elements of one micro-batch's flat boundary tensor (`numel` of them) that
        rank (d, t) sends or receives: its dp rank's rows, then its tp rank's part of them."""
        rows = numel // self.dp
        part = rows // self.tp
        start = d * rows + t * part
        return start, start + part

    def rows(self, d: int, count: int) -> slice:
        """Dp rank d's rows of a micro-batch of `count` rows."""
        each = count // self.dp
        return slice(d * each, (d + 1) * each)


def grids(plan) -> list[StageGrid]:
    return [StageGrid(tuple(tuple(row) for row in grid)) for grid in plan.mesh.ranks]


def build_stage_meshes(plan, device_type: str) -> tuple[DeviceMesh, object]:
    """This rank's stage mesh ("dp", "tp"; under HSDP ("dp_replicate", "dp_shard", "tp") with
    "dp" their flattening, as executor.mesh builds one) and the group the stages' messages
    go over (every rank). Every rank builds every stage's mesh, in stage order: creating a
    process group is collective over the whole job."""
    rank, world = dist.get_rank(), dist.get_world_size()
    layout = grids(plan)
    expected = sum(len(g.flat) for g in layout)
    if expected != world:
        raise ExecutionError(
            f"mesh: the plan's stages run on {expected} processes, {world} were started"
        )
    mine = None
    own = needs_own_dim(plan)  # a one-rank dim last (executor.mesh)
    for grid, shape in zip(layout, plan.mesh.stage_meshes, strict=True):
        ranks = torch.tensor(grid.ranks, dtype=torch.int64)
        if len(shape) == 3:  # HSDP: dp as (replicate, shard), the shard groups neighbours
            dp, tp, shard = shape
            ranks = ranks.reshape(dp // shard, shard, tp)
            names = (*HYBRID_DIMS, "tp")
        else:
            names = ("dp", "tp")
        if own:
            ranks, names = ranks.unsqueeze(-1), (*names, OWN)
        mesh = DeviceMesh(device_type, ranks, mesh_dim_names=names)
        if len(shape) == 3:
            mesh[HYBRID_DIMS]._flatten("dp")
        if rank in grid.flat:
            mine = mesh
    group = dist.new_group(list(range(world)))
    assert mine is not None, "every rank is in one stage (the plan's checks)"
    return mine, group


class SubmeshPipeline:
    """1F1B over stages on their own submeshes, with the calls of torch's schedules
    (`step(*inputs, target=, losses=)`): the first stage is given the global batch, the last
    the global labels; each takes its dp rank's rows of every micro-batch. The order is
    torch's Schedule1F1B's (min(m, p - s) forwards, then one backward and one forward at a
    time) and data parallelism is handled as its stages handle it: gradients reduced once,
    after the last backward, and divided by the micro-batch count."""

    def __init__(self, plan, module, index: int, mesh: DeviceMesh, group, loss_fn, device):
        self.module, self.index, self.loss_fn, self.device = module, index, loss_fn, device
        self.grids = grids(plan)
        self.m = plan.schedule.microbatches
        self.micro = plan.request.training.global_batch_size // self.m  # rows a micro-batch
        self.group = group
        self.grid = self.grids[index]
        self.d, self.t = self.grid.coordinate(dist.get_rank())
        if self.micro % self.grid.dp:
            raise ExecutionError(
                f"stages[{index}]: a pipeline micro-batch of {self.micro} samples does not "
                f"split over its dp {self.grid.dp}"
            )
        self.tp_group = mesh["tp"].get_group() if self.grid.tp > 1 else None
        # one row's shape and the dtype of the tensors crossing each end: "in" from the
        # stage before, "out" to the one after (told once, on the first step)
        self.ends: dict[str, tuple[tuple[int, ...], torch.dtype]] = {}

    def step(self, *args, target=None, losses=None, return_outputs: bool = True) -> None:
        first, last = self.index == 0, self.index == len(self.grids) - 1
        inputs = args[0] if args else None
        if (first and inputs is None) or (last and target is None):
            raise ExecutionError("pipeline: the first stage takes the batch, the last its labels")
        saved: dict[int, tuple] = {}
        sends: list = []
        for action, i in one_f_one_b(self.m, len(self.grids), self.index):
            if action == "F":
                saved[i] = self._forward(i, inputs, target, losses, sends)
            else:
                self._backward(i, *saved.pop(i), sends)
        for work in sends:
            work.wait()
        self._reduce_gradients()

    def _mine(self, batch: torch.Tensor, i: int) -> torch.Tensor:
        """This rank's rows of micro-batch i of a global batch."""
        rows = batch[i * self.micro : (i + 1) * self.micro]
        return rows[self.grid.rows(self.d, self.micro)]

    def _forward(self, i: int, inputs, target, losses, sends) -> tuple:
        last = self.index == len(self.grids) - 1
        if self.index == 0:
            x = self._mine(inputs, i)
        else:
            x = self._receive(i, self.grids[self.index - 1], "in").requires_grad_(True)
        out = self.module(x)
        if last:
            loss = self.loss_fn(out, self._mine(target, i))
            if losses is not None:
                losses.append(loss.detach())
            return x, loss
        sends += self._send(i, out.detach(), self.grids[self.index + 1], "out")
        return x, out

    def _backward(self, i: int, x, out, sends) -> None:
        self._hold_gradient_sync()
        if self.index == len(self.grids) - 1:
            out.backward()
        else:
            after = self.grids[self.index + 1]
            grad = self._receive(i, after, "out")
            if after.dp != self.grid.dp:
                # each rank's loss is the mean over its own rows and data parallelism
                # averages over dp: a row's gradient carries dp / B of the stage it comes
                # from, and this stage's average needs its own dp / B (exact where the
                # ratio is a power of two)
                grad.mul_(self.grid.dp / after.dp)
            torch.autograd.backward(out, grad)
        if self.index > 0:
            sends += self._send(i, x.grad.detach(), self.grids[self.index - 1], "in")

    # -- data parallelism: reduced once a step, as torch's pipeline stages do ---------------

    def _hold_gradient_sync(self) -> None:
        from torch.distributed.fsdp import FSDPModule

        if isinstance(self.module, FSDPModule):
            self.module.set_is_last_backward(False)
            self.module.set_reshard_after_backward(False)
            self.module.set_requires_gradient_sync(False)

    def _reduce_gradients(self) -> None:
        """FSDP2's post-backward for the whole step (what torch's stage does after its last
        backward), then the mean over micro-batches."""
        from torch.distributed._composable.replicate_with_fsdp import ReplicateModule, replicate
        from torch.distributed.fsdp import FSDPModule, fully_shard

        module = self.module
        if isinstance(module, FSDPModule):
            module.set_is_last_backward(True)
            module.set_reshard_after_backward(True)
            module.set_requires_gradient_sync(True)
            owner = replicate if isinstance(module, ReplicateModule) else fully_shard
            state = owner.state(module)
            for unit in state._state_ctx.all_states:
                for group in unit._fsdp_param_groups:
                    group.post_backward()
            state._root_post_backward_final_callback()
        for p in module.parameters():
            if p.grad is not None:
                p.grad.div_(self.m)

    # -- the boundary reshard ----------------------------------------------------------------

    def _numel(self, end: str) -> int:
        """Elements of one micro-batch's tensor at this end."""
        n = self.micro
        for size in self.ends[end][0]:
            n *= size
        if n % (self.grid.dp * self.grid.tp):
            raise ExecutionError(
                f"stages[{self.index}]: a micro-batch's boundary tensor ({n} elements) does "
                f"not split into dp {self.grid.dp} x tp {self.grid.tp} equal pieces"
            )
        return n

    def _send(self, i: int, tensor: torch.Tensor, theirs: StageGrid, end: str) -> list:
        """Isend the parts of this rank's piece that the pieces of `theirs` ranks cover (a
        forward activation at the "out" end, a gradient at the "in" end)."""
        if end not in self.ends:  # the first forward send: tell the next stage once
            self.ends[end] = (tuple(tensor.shape[1:]), tensor.dtype)
            self._send_shape(theirs, end)
        numel = self._numel(end)
        held = self.d * (numel // self.grid.dp)  # where this rank's rows start
        flat = tensor.contiguous().view(-1)
        start, stop = self.grid.piece(self.d, self.t, numel)
        works = []
        tag = _tag(i, end == "out")
        for (lo, hi), peer in _overlaps(theirs, numel, start, stop):
            works.append(dist.isend(flat[lo - held : hi - held], peer, group=self.group, tag=tag))
        return works

    def _receive(self, i: int, theirs: StageGrid, end: str) -> torch.Tensor:
        """This rank's rows of micro-batch i's tensor at `end`: its piece point to point,
        then the rest of its rows from its tp group."""
        if end not in self.ends:
            self._receive_shape(theirs, end)
        shape, dtype = self.ends[end]
        numel = self._numel(end)
        start, stop = self.grid.piece(self.d, self.t, numel)
        buffer = torch.empty(stop - start, dtype=dtype, device=self.device)
        tag = _tag(i, end == "in")
        works = [
            dist.irecv(buffer[lo - start : hi - start], peer, group=self.group, tag=tag)
            for (lo, hi), peer in _overlaps(theirs, numel, start, stop)
        ]
        for work in works:
            work.wait()
        if self.tp_group is not None:
            rows = torch.empty(numel // self.grid.dp, dtype=dtype, device=self.device)
            dist.all_gather_single(rows, buffer, group=self.tp_group)
            buffer = rows
        return buffer.view(self.micro // self.grid.dp, *shape)

    def _send_shape(self, theirs: StageGrid, end: str) -> None:
        """The row shape and dtype of a stage's output, from its first rank to every rank of
        the next stage, before the first micro-batch's (as torch's stages infer shapes on
        the first step)."""
        if end != "out" or (self.d, self.t) != (0, 0):
            return
        shape, dtype = self.ends[end]
        message = torch.zeros(SHAPE_MESSAGE, dtype=torch.int64)
        message[0], message[1] = DTYPES.index(dtype), len(shape)
        message[2 : 2 + len(shape)] = torch.tensor(shape)
        for peer in theirs.flat:
            dist.send(message.to(self.device), peer, group=self.group, tag=SHAPE_TAG)

    def _receive_shape(self, theirs: StageGrid, end: str) -> None:
        message = torch.zeros(SHAPE_MESSAGE, dtype=torch.int64, device=self.device)
        dist.recv(message, theirs.ranks[0][0], group=self.group, tag=SHAPE_TAG)
        code, dims, *rest = message.tolist()
        self.ends[end] = (tuple(rest[:dims]), DTYPES[code])


SHAPE_TAG = 1 << 20


def one_f_one_b(m: int, stages: int, index: int) -> list[tuple[str, int]]:
    """Stage `index`'s actions in torch's Schedule1F1B order: ("F" | "B", micro-batch)."""
    order = [("F", i) for i in range(min(m, stages - index))]
    forwards = len(order)
    for b in range(m):
        order.append(("B", b))
        if forwards < m:
            order.append(("F", forwards))
            forwards += 1
    return order


def _overlaps(theirs: StageGrid, numel: int, start: int, stop: int):
    """((lo, hi), rank) for each rank of `theirs` whose piece meets [start, stop)."""
    for d, row in enumerate(theirs.ranks):
        for t, peer in enumerate(row):
            lo, hi = theirs.piece(d, t, numel)
            lo, hi = max(lo, start), min(hi, stop)
            if lo < hi:
                yield (lo, hi), peer


def _tag(i: int, forward: bool) -> int:
    """Micro-batch i's activation forward or its gradient back."""
    return 2 * i + (0 if forward else 1)
