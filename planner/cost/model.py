"""The one cost model: compute time per node, collectives per mesh axis, resharding.

Compute: roofline, time = max(FLOPs / (peak[dtype] x efficiency.matmul), bytes / (memory
bandwidth x efficiency.memory)); a measured achievable FLOP/s replaces peak x efficiency, and
measured op times (planner/cluster/profiling.py: exact shapes, else interpolated in work between
measured shapes of the same op) replace the formula where present.

Collectives: alpha-beta on a ring (Thakur et al. 2005; the forms NCCL's docs use for
bus bandwidth), n = devices on the axis, B = bytes, beta = link bandwidth x efficiency.comm:
    all_reduce(B)      = 2 (n-1) alpha + 2 (n-1)/n * B / beta      B: the buffer on each device
    all_gather(B)      =   (n-1) alpha +   (n-1)/n * B / beta      B: the gathered (output) size
    reduce_scatter(B)  =   (n-1) alpha +   (n-1)/n * B / beta      B: the input size
    all_to_all(B)      =   (n-1) alpha +   (n-1)/n * B / beta      B: the buffer on each device
    send_recv(B)       =         alpha +             B / beta
Measured tables in the profile (bytes -> seconds for a tier, collective and group size)
replace the formula, interpolated linearly in bytes.
"""

from __future__ import annotations

import bisect
from collections.abc import Mapping
from dataclasses import dataclass

from planner.cluster.mesh import LogicalMesh, MeshAxis
from planner.cluster.profile import ClusterProfile
from planner.cluster.profiling import OpTimes, op_times_from_rows
from planner.cost import shape_rates
from planner.graph.opgraph import OpNode
from planner.parallel import fp8 as fp8_terms
from planner.placements import PARTIAL, REPLICATE, is_shard
from planner.runtime import runtime_of

FUSED_NORMS = frozenset({"aten.rms_norm.default"})
LOSS_OPS = frozenset({"aten.cross_entropy_loss.default", "aten.nll_loss.default"})
MATMUL_KINDS = frozenset({"linear", "matmul", "einsum", "conv2d", "attention", "grouped_mm"})

# Passes over the s x s attention scores of a math (non-flash) kernel, in elements of the
# activation dtype: forward writes scores, reads and writes softmax, reads probabilities for
# P V; backward does about twice that. It keeps the probabilities for backward.
MATH_ATTENTION_FWD_PASSES = 4
MATH_ATTENTION_BWD_PASSES = 8

# DDP's default gradient bucket (torch.nn.parallel.DistributedDataParallel bucket_cap_mb=25).
GRAD_BUCKET_BYTES = 25 * 2**20

# Bytes per training dtype element.
DTYPE_SIZE = {"fp32": 4, "tf32": 4, "bf16": 2, "fp16": 2, "fp8": 1}


def _ring_factor(n: int) -> float:
    return (n - 1) / n


@dataclass(frozen=True)
class NodeTime:
    fwd: float
    bwd: float
    # The part of fwd / bwd that does not grow with the tokens (fp8's weight casts), which a
    # sequence split (planner.parallel.context) leaves whole.
    fixed_fwd: float = 0.0
    fixed_bwd: float = 0.0


class CostModel:
    @classmethod
    def of_training(cls, cluster: ClusterProfile, training, fp8: str | None = None) -> CostModel:
        """The cost model a request's training settings (planner.plan.TrainingSettings) price
        with, with this fp8 recipe (None: none)."""
        return cls(
            cluster, training.dtype, attention=training.attention, fp8=fp8, runtime=training.runtime
        )

    def __init__(
        self,
        cluster: ClusterProfile,
        dtype: str = "bf16",
        op_times: OpTimes | None = None,
        attention: str = "flash",
        fp8: str | None = None,
        runtime: str = "autopar",
    ):
        self.cluster = cluster
        self.dtype = dtype
        self.attention = attention
        self.runtime = runtime_of(runtime)  # what executes the plan (planner.runtime)
        self.fp8 = fp8  # torchao's float8 recipe for eligible linear layers (parallel.fp8)
        self._p2p_axes: dict[bool, MeshAxis] = {}  # within a node / across two
        self.peak = cluster.peak_flops(dtype)
        measured = cluster.measured
        achieved = measured.achieved_flops.get(dtype) if measured else None
        self.matmul_rate = achieved or self.peak * cluster.efficiency.matmul
        self.mem_rate = cluster.device.memory_bandwidth * cluster.efficiency.memory
        # Measured operator times (autopar profile-ops): given, or the profile's database.
        self.op_times = op_times or (
            op_times_from_rows(measured.op_times, dtype) if measured else None
        )
        # Measured rates by shape (planner.cost.shape_rates), where the profile has them.
        tables = shape_rates.rate_tables(measured, dtype)
        self.gemm_rates = tables.gemm
        self.attention_fwd, self.attention_bwd = tables.attention_fwd, tables.attention_bwd
        if fp8 is not None:
            self.fp8_gemm_rates = shape_rates.rate_tables(measured, "fp8").gemm
            self.fp8_rate = cluster.peak_flops("fp8") * cluster.efficiency.matmul

    # --- compute -------------------------------------------------------------------------
    def compute_time(self, flops: float, nbytes: float, matmul: bool = True) -> float:
        rate = self.matmul_rate if matmul else self.peak * self.cluster.efficiency.memory
        return max(flops / rate if flops else 0.0, nbytes / self.mem_rate if nbytes else 0.0)

    def node_time(
        self, node: OpNode, shards: int = 1, gemm: tuple[int, int, int] | None = None
    ) -> NodeTime:
        """Forward and backward time of `node` with its work split evenly over `shards`;
        `gemm`: a linear layer's local (m, k, n) where the caller knows its layout
        (shape_rates.gemm_dims; else its weight's output dim is taken as the split one)."""
        if node.is_view or node.kind in ("input", "constant"):
            return NodeTime(0.0, 0.0)
        if self.fp8 is not None and fp8_terms.eligible(node):
            return self._fp8_time(node, shards, gemm)
        if self.op_times is not None:
            hit = self.op_times.lookup(node, shards)
            if hit is not None:
                return NodeTime(*hit)
        moved = node.bytes_read + node.bytes_written
        shaped = self._shaped_time(node, shards, gemm)
        if shaped is not None:
            fwd, bwd = shaped
            return NodeTime(
                max(fwd, moved / shards / self.mem_rate),
                max(bwd, 2 * moved / shards / self.mem_rate),
            )
        matmul = node.kind in MATMUL_KINDS
        fwd = self.compute_time(node.fwd_flops / shards, moved / shards, matmul)
        # Backward reads the output gradient and saved tensors, writes input/param gradients.
        bwd = self.compute_time(node.bwd_flops / shards, 2 * moved / shards, matmul)
        scores = self.attention_scores_bytes(node) / shards
        if scores:
            fwd += MATH_ATTENTION_FWD_PASSES * scores / self.mem_rate
            bwd += MATH_ATTENTION_BWD_PASSES * scores / self.mem_rate
        return NodeTime(fwd, bwd)

    def _shaped_time(self, node: OpNode, shards: int, gemm) -> tuple[float, float] | None:
        """(fwd, bwd) compute seconds from the measured rate tables, None without one."""
        if self.gemm_rates and node.op in shape_rates.LINEAR_OPS:
            dims = gemm or shape_rates.gemm_dims(node, ("S(0)",), (shards,))
            if dims is None:
                return None
            m, k, n = dims
            rate = self.gemm_rates.rate
            per_bwd_flop = (1 / rate((m, n, k)) + 1 / rate((n, m, k))) / 2
            return node.fwd_flops / shards / rate(dims), node.bwd_flops / shards * per_bwd_flop
        if self.attention_fwd and self.attention != "math":
            key = shape_rates.attention_key(node, shards)
            if key is not None:
                return (
                    node.fwd_flops / shards / self.attention_fwd.rate(key),
                    node.bwd_flops / shards / self.attention_bwd.rate(key),
                )
        return None

    def _fp8_time(self, node: OpNode, shards: int, gemm) -> NodeTime:
        """An eligible linear layer under fp8 (planner.parallel.fp8): its GEMMs at the fp8
        rates of their local shapes, plus the casts at the memory rate."""
        m, k, n = gemm or shape_rates.gemm_dims(node, ("S(0)",), (shards,))
        table = self.fp8_gemm_rates
        rate = table.rate if table else (lambda _dims: self.fp8_rate)
        per_bwd_flop = (1 / rate((m, n, k)) + 1 / rate((n, m, k))) / 2
        act = DTYPE_SIZE[self.dtype]
        cast_fwd, cast_bwd = fp8_terms.cast_bytes(m, k, n, act)
        weight_fwd, weight_bwd = fp8_terms.weight_cast_bytes(k, n, act)
        fwd = node.fwd_flops / shards / rate((m, k, n)) + cast_fwd / self.mem_rate
        bwd = node.bwd_flops / shards * per_bwd_flop + cast_bwd / self.mem_rate
        s = fp8_terms.ROWWISE_SLOWDOWN if self.fp8 == "rowwise" else 1.0
        fixed_fwd, fixed_bwd = weight_fwd / self.mem_rate, weight_bwd / self.mem_rate
        return NodeTime(fwd * s, bwd * s, fixed_fwd * s, fixed_bwd * s)

    def workspace_bytes(self, node: OpNode) -> int:
        """Transient bytes beyond the saved tensors while `node` runs backward. The language-
        model loss (cross entropy over fp32 logits) materialises the gradient of its log-
        probabilities and of its input, two logits-sized fp32 buffers, while the saved log-
        probabilities are still held: on an H100 the executor's plans that were predicted to
        fit ran out of memory allocating exactly one such buffer (15.66 GiB for 32,768 tokens
        x 128,256 classes; bench/results/h100_execute.md)."""
        if node.op in LOSS_OPS and node.inputs:
            return 2 * node.inputs[0].nbytes
        return 0

    def saved_bytes(self, node: OpNode, nodes: Mapping[str, OpNode] | None = None) -> int:
        """Bytes `node` keeps for backward with the device's kernels. The trace records what
        torch keeps on meta/CPU; on CUDA rms_norm is one fused kernel that keeps its input and
        one fp32 rstd per row (FusedRmsNormBackward0, seen on an H100: bench/results/
        h100_measure_run2.json `saved`) where the CPU decomposition keeps fp32 copies (a
        Llama layer predicted 32% over the activation memory measured on the H100 before).
        With the graph's nodes by name, the runtime's own kernels where they keep less
        (planner.runtime: Transformer Engine's under Megatron-LM)."""
        saved = node.saved_bytes
        if self.fp8 is not None and fp8_terms.eligible(node):
            compiled = self.cluster.device.kernels == "cuda"  # executor.fp8.compile_blocks
            saved = fp8_terms.saved_bytes(node, saved, compiled)
        if self.cluster.device.kernels == "cuda" and node.op in FUSED_NORMS and node.inputs:
            x = node.inputs[0]
            rows = x.numel // max(x.shape[-1], 1) if x.shape else 1
            saved = min(saved, x.nbytes + 4 * rows)
        if nodes is not None and self.runtime.saved_bytes is not None:
            saved = self.runtime.saved_bytes(node, saved, nodes)
        return saved + self.attention_scores_bytes(node)

    def attention_scores_bytes(self, node: OpNode) -> int:
        """Bytes of the s x s score matrix a math attention kernel materialises (0 with flash);
        it is also what such a kernel keeps for backward."""
        if self.attention != "math" or node.kind != "attention" or len(node.inputs) < 2:
            return 0
        q, k = node.inputs[0], node.inputs[1]
        if len(q.shape) < 2 or len(k.shape) < 2:
            return 0
        elems = q.numel // q.shape[-1] * k.shape[-2]
        return elems * (q.nbytes // max(q.numel, 1))

    # --- collectives ---------------------------------------------------------------------
    def _beta(self, axis: MeshAxis) -> float:
        return axis.bandwidth * self.cluster.efficiency.comm

    def _measured(self, axis: MeshAxis, collective: str, nbytes: float) -> float | None:
        m = self.cluster.measured
        if m is None:
            return None
        points = [
            p
            for p in m.collectives.get(axis.tier, {}).get(collective, [])
            if p.group_size == axis.size
        ]
        if len(points) < 2:
            return None
        points.sort(key=lambda p: p.bytes)
        xs = [p.bytes for p in points]
        i = min(max(bisect.bisect_left(xs, nbytes), 1), len(points) - 1)
        a, b = points[i - 1], points[i]
        slope = (b.seconds - a.seconds) / (b.bytes - a.bytes)
        return max(a.seconds + slope * (nbytes - a.bytes), 0.0)

    def _collective(self, name: str, nbytes: float, axis: MeshAxis, hops: int, volume: float):
        if axis.size <= 1 or nbytes <= 0:
            return 0.0
        measured = self._measured(axis, name, nbytes)
        if measured is not None:
            return measured
        return hops * axis.latency + volume * nbytes / self._beta(axis)

    def all_reduce(self, nbytes: float, axis: MeshAxis) -> float:
        n = axis.size
        return self._collective("all_reduce", nbytes, axis, 2 * (n - 1), 2 * _ring_factor(n))

    def all_gather(self, nbytes: float, axis: MeshAxis) -> float:
        n = axis.size
        return self._collective("all_gather", nbytes, axis, n - 1, _ring_factor(n))

    def reduce_scatter(self, nbytes: float, axis: MeshAxis) -> float:
        n = axis.size
        return self._collective("reduce_scatter", nbytes, axis, n - 1, _ring_factor(n))

    def all_to_all(self, nbytes: float, axis: MeshAxis) -> float:
        n = axis.size
        return self._collective("all_to_all", nbytes, axis, n - 1, _ring_factor(n))

    def bucketed(
        self, name: str, nbytes: float, axis: MeshAxis, bucket: float = GRAD_BUCKET_BYTES
    ) -> float:
        """A collective over gradients or parameters that the framework packs into buckets
        (DDP: 25 MB by default; FSDP2: one per wrapped module, i.e. per layer, pass its bytes):
        (bytes / bucket) x time(one bucket), i.e. the bandwidth term in full and the latency
        in proportion to the bucket share."""
        if axis.size <= 1 or nbytes <= 0:
            return 0.0
        bucket = max(bucket, 1.0)
        return nbytes / bucket * getattr(self, name)(bucket, axis)

    def send_recv(self, nbytes: float, axis: MeshAxis) -> float:
        if nbytes <= 0:
            return 0.0
        measured = self._measured(axis, "send_recv", nbytes)
        if measured is not None:
            return measured
        return axis.latency + nbytes / self._beta(axis)

    def p2p_axis(self, src_rank: int, dst_rank: int) -> MeshAxis:
        """The link between two ranks (pipeline neighbours) as a 2-device axis: within a node
        or across two, whichever ranks (kept per model: every configuration asks)."""
        same = self.cluster.node_of(src_rank) == self.cluster.node_of(dst_rank)
        if same not in self._p2p_axes:
            bw, lat, crosses = self.cluster.group_link([src_rank, dst_rank])
            self._p2p_axes[same] = MeshAxis("pp", 2, bw, lat, crosses)
        return self._p2p_axes[same]

    # --- resharding ----------------------------------------------------------------------
    def reshard(self, nbytes: float, src: list[str], dst: list[str], mesh: LogicalMesh) -> float:
        """Time to turn a tensor of `nbytes` (global size) placed as `src` into `dst`.

        Placements are one string per mesh axis: "R", "S(d)", "P". Axes are converted one at
        a time; the bytes each conversion moves are those of the tensor as sharded by the other
        axes at that moment.
        """
        return sum(
            getattr(self, name)(size, mesh.axes[axis])
            for axis, name, size in reshard_steps(nbytes, src, dst, mesh)
        )


def reshard_steps(
    nbytes: float, src: list[str], dst: list[str], mesh: LogicalMesh
) -> list[tuple[int, str, float]]:
    """The collectives that turn placement `src` into `dst`: (axis, collective, bytes).

    Partial sums are resolved first, then gathers; slicing (R -> S) and choosing a partial
    (R/S -> P) are local and free.
    """
    cur = list(src)
    steps = []
    for i in sorted(range(len(cur)), key=lambda i: _order(cur[i], dst[i])):
        a, b = cur[i], dst[i]
        if a == b:
            continue
        local = nbytes / _shard_divisor(cur, mesh, exclude=i)
        if a == PARTIAL and b == REPLICATE:
            steps.append((i, "all_reduce", local))
        elif a == PARTIAL and is_shard(b):
            steps.append((i, "reduce_scatter", local))
        elif is_shard(a) and b == REPLICATE:
            steps.append((i, "all_gather", local))
        elif is_shard(a) and is_shard(b):
            steps.append((i, "all_to_all", local / mesh.shape[i]))
        cur[i] = b
    return steps


def _order(a: str, b: str) -> int:
    if a == b:
        return 3
    if a == PARTIAL:
        return 0
    if is_shard(a) and b == REPLICATE:
        return 1
    return 2


def _shard_divisor(placements: list[str], mesh: LogicalMesh, exclude: int) -> int:
    div = 1
    for j, p in enumerate(placements):
        if j != exclude and is_shard(p):
            div *= mesh.shape[j]
    return div
