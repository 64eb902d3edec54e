"""fp8 matmuls: torchao's float8 training over a bf16 run. Each eligible
linear layer (an nn.Linear whose input and output features are multiples of 16, the
fp8 GEMM's need, except the language-model head, whose logits feed the loss) casts its
input, its weight and, in backward, its output gradient to float8 with dynamic scales and
runs its three GEMMs through torch._scaled_mm; recipes "tensorwise" (one scale per tensor)
and "rowwise" (one per row). Parameters, gradients and optimizer state keep their dtypes.

Time, per eligible linear layer and micro-batch (m x k input, n outputs):
- GEMMs: the forward (m, k, n), input-gradient (m, n, k) and weight-gradient (n, m, k) GEMMs
  at the profile's measured fp8 rates by shape (`measured.matmuls` with dtype fp8:
  torch._scaled_mm with tensorwise scales, bench/results/h100_measure.json), else at the
  fp8 peak x efficiency.matmul.
- Casts, memory-bound at the device's memory rate, as torch.compile fuses them: each of the
  input and the weight (forward) and the output gradient (backward) is read twice in the
  activation dtype (the amax, then the scaled cast) and written once in fp8
  (CAST_BYTES_PER_ELEMENT_FP8); the backward GEMMs take the input, weight and output gradient
  transposed, one fp8 read and write each (TRANSPOSE_BYTES_PER_ELEMENT). Derived from the
  recipe, not fitted; checked against the layers measured on an H100 by
  bench/fp8_model.py (bench/results/fp8_model.md).
- rowwise: the tensorwise time x ROWWISE_SLOWDOWN, the median ratio of the two measured
  compiled on the H100 (bench/results/h100_fp8.md, "torch.compile" table: 1.11-1.26x over
  six shapes); with the same memory it never beats tensorwise under this model, so the
  search leaves it out unless pinned (it is chosen for its accuracy, not its speed).
Eager torchao runs the casts as separate kernels and measured 0.1-0.8x bf16's speed there;
the executor compiles each block of an fp8 plan on CUDA (executor.fp8.compile_blocks).

Memory: each eligible layer keeps its own fp8 copy of its input for backward (1 byte per
element; what torch.compile's partitioner saved on the H100: saved bytes in the compiled
table), in place of the activation-dtype input the trace counted at it; eager (CPU kernels,
where the executor does not compile) beside that input. Layers that share
an input (q, k and v) each keep a copy, as torchao casts per module.

Search: on devices with an fp8 peak and CUDA kernels, for bf16 runs, with Megatron's
tensor-parallel layouts (the executor's module path): tensorwise beside no fp8. A CPU
profile with an fp8 peak (cpu-local: torch's software float8 GEMM, bench/cpu_fp8_rate.py)
plans a pinned recipe in any dtype, for the gloo tests that run it.
Plan field: fp8 (null, "tensorwise" or "rowwise").
"""

from __future__ import annotations

import math

from planner.cost import shape_rates
from planner.cost.schedules import WEIGHT_SPLIT
from planner.errors import InputError
from planner.graph.opgraph import OpNode, TensorMeta
from planner.parallel.choice import Choice
from planner.parallel.technique import MODULES_ONLY, Capability, Pin, Technique
from planner.placements import REPLICATE, shard_dim
from planner.vocab import FP8_RECIPES

_TEST = "tests/executor/test_execute.py::test_plan_matches_single_process_reference"
CHOICES = (
    Choice("fp8", None, "executor.fp8:apply_fp8", f"{_TEST}[pp2xtp2-1f1b]"),
    Choice("fp8", "tensorwise", "executor.fp8:apply_fp8", f"{_TEST}[tp4-fp8-tensorwise]"),
    Choice("fp8", "rowwise", "executor.fp8:apply_fp8", f"{_TEST}[dp4-zero3-fp8-rowwise]"),
)
# fp8 first: where it wins, its bar prunes bf16 by bound; rowwise only when pinned
SEARCHED = ("tensorwise", None)
HEAD_NAMES = frozenset({"output", "lm_head", "head"})  # modules left in high precision
ALIGN = 16  # torch._scaled_mm needs both GEMM dims of the weight divisible by 16
CAST_BYTES_PER_ELEMENT_FP8 = 1
TRANSPOSE_BYTES_PER_ELEMENT = 2  # one fp8 read, one fp8 write
# Median of rowwise / tensorwise compiled layer time over the six shapes measured on an H100
# SXM (bench/results/h100_fp8.md: 1.81/1.60, 3.69/3.18, 4.25/3.37, 4.34/3.56, 22.54/20.37,
# 26.19/23.52 ms).
ROWWISE_SLOWDOWN = 1.145


def refusal(recipe: str | None, device_kernels: str, peaks: dict, dtype: str) -> str | None:
    """Why fp8 matmuls (this recipe) cannot be planned for this device and dtype, or None."""
    if recipe is None:
        return None
    if recipe not in FP8_RECIPES:
        return f"{recipe!r} is not a recipe; expected one of {', '.join(FP8_RECIPES)}"
    if "fp8" not in peaks:
        return "the cluster's device has no fp8 peak (fp8 tensor cores: Ada, Hopper and later)"
    if device_kernels == "cpu":  # torch's software float8 GEMM, in any training dtype
        return None
    if device_kernels != "cuda":
        return "fp8 matmuls are planned for CUDA devices and CPUs"
    if dtype != "bf16":
        return f"fp8 matmuls run inside a bf16 run; the training dtype is {dtype}"
    return None


def schedule_refusal(recipe: str | None, schedule: str) -> str | None:
    """Why fp8 cannot run under this schedule, or None: torchao's float8 linear computes its
    input and weight gradients in one backward, so the zero-bubble schedules' split backward
    (input gradients, then weight gradients) runs it twice, casts and GEMMs, which the plan
    does not price (the second pass's amax all-reduces: bench/results/ledger_property.md)."""
    if recipe is not None and schedule in WEIGHT_SPLIT:
        return f"{schedule} splits backward in two; torchao's fp8 linear runs its backward whole"
    return None


def searched(pinned, runs: bool, device, dtype: str) -> tuple[str | None, ...]:
    """The recipes to search (None: no fp8) with a layout the module path `runs` (or not):
    the pinned ones, or SEARCHED where the device has fp8 for this dtype."""
    if pinned is not None:
        return pinned if runs else tuple(r for r in pinned if r is None)
    # a CPU's software float8 is for tests: planned when pinned, never searched
    able = device.kernels == "cuda"
    able = able and refusal("tensorwise", device.kernels, device.peak_flops, dtype) is None
    return SEARCHED if runs and able else (None,)


def worth_evaluating(tables: dict) -> list[tuple]:
    """(recipe, table) of `tables` (recipe -> cost table or None) the search evaluates: those
    with a table, less the bf16 one where the fp8 table is no worse in any per-layer cost
    (LayerTable.no_worse_than: every bf16 configuration then has an fp8 one as fast and
    as small)."""
    fp8_table = next((t for r, t in tables.items() if r and t is not None), None)
    return [
        (recipe, table)
        for recipe, table in tables.items()
        if table is not None
        and not (recipe is None and fp8_table is not None and fp8_table.no_worse_than(table))
    ]


def check_pin(pinned, device, dtype: str, module_family: bool) -> None:
    """fp8 pinned where it cannot run is the user's to change: say why."""
    for recipe in pinned or ():
        why = refusal(recipe, device.kernels, device.peak_flops, dtype)
        if why is None and recipe is not None and not module_family:
            why = "the executor swaps the linear modules of its own stage models only"
        if why:
            raise InputError("search.fp8", why, "off, or a bf16 run on a device with fp8")


def eligible(node: OpNode) -> bool:
    """Whether torchao converts the module behind this node (executor.fp8.fp8_eligible)."""
    if node.op != "aten.linear.default" or node.module_type.rsplit(".", 1)[-1] != "Linear":
        return False
    if node.module.rsplit(".", 1)[-1] in HEAD_NAMES:
        return False
    operands = shape_rates.gemm_operands(node)
    if operands is None or not operands[0]:
        return False
    n, k = operands[1]
    return n % ALIGN == 0 and k % ALIGN == 0


def cast_bytes(m: int, k: int, n: int, act_bytes: int) -> tuple[float, float]:
    """(forward, backward) bytes the casts move for one (m, k, n) layer (module docstring)."""
    per_cast = 2 * act_bytes + CAST_BYTES_PER_ELEMENT_FP8
    fwd = per_cast * (m * k + k * n)
    bwd = per_cast * m * n + TRANSPOSE_BYTES_PER_ELEMENT * (m * k + k * n + m * n)
    return fwd, bwd


def weight_cast_bytes(k: int, n: int, act_bytes: int) -> tuple[float, float]:
    """The part of cast_bytes that is the weight's (the same for any number of tokens)."""
    return (2 * act_bytes + CAST_BYTES_PER_ELEMENT_FP8) * k * n, TRANSPOSE_BYTES_PER_ELEMENT * k * n


def saved_bytes(node: OpNode, traced_saved: int, compiled: bool = True) -> int:
    """`node`'s saved bytes with fp8: its input's fp8 copy in place of the traced input
    (the part of traced_saved that is the input, where the trace counted it at this node);
    eager (the executor compiles on CUDA only) beside it: torchao's float8 linear keeps the
    activation-dtype input too."""
    x = node.inputs[0]
    kept = traced_saved if not compiled else traced_saved - min(traced_saved, x.nbytes)
    return kept + x.numel * CAST_BYTES_PER_ELEMENT_FP8


TABLE_SUFFIX = "+fp8-"


def table_kind(kind: str, recipe: str | None) -> str:
    """The search's name for a layout kind's cost table with this recipe (the layout is the
    same: fp8 changes the linear layers' time and saved bytes, not their placements)."""
    return kind if recipe is None else f"{kind}{TABLE_SUFFIX}{recipe}"


def split_kind(kind: str) -> tuple[str, str | None]:
    """table_kind's inverse: (layout kind, recipe or None)."""
    layout, _, recipe = kind.partition(TABLE_SUFFIX)
    return layout, recipe or None


AMAX_BYTES = 8  # torchao reduces each amax in fp64 (torchao.float8 tensor_to_amax)


def scale_reductions(comm, config, nodes, layouts, recomputed) -> None:
    """fp8 under tp: an amax taken along a dim tp splits is all-reduced over tp before its
    cast (DTensor). Per eligible layer and micro-batch: the forward casts its input and
    weight; backward casts its output gradient for each of its two GEMMs, and (torchao keeps
    the high-precision tensors) its weight and input again.
    - tensorwise: one scalar per cast of a tensor split on tp (its input or output gradient
      split on the features, the last dim; its weight split at all);
    - rowwise: one amax per row, reduced where the row is split: a row-parallel layer's
      input (per token) and weight (per output) in the forward, a column-parallel layer's
      output gradient (per token) and weight (per input feature) in backward's input-
      gradient GEMM; the weight-gradient GEMM's scales run along the tokens, never split.
    `recomputed(layer)`: whether a layer's forward runs again in backward; the last linear
    layer's casts run again too: torchao saves its tensors for
    backward after casting, and torch's checkpoint stops at that save."""
    if config.tp == 1 or config.fp8 is None:
        return
    m = config.microbatches
    tail = {n.layer: i for i, n in enumerate(nodes) if n.layer is not None and n.params}
    for i, node in enumerate(nodes):
        if not eligible(node):
            continue
        lay = layouts[node.name]
        weight = next((k for k in node.params if k.endswith("weight")), "")
        weight_dim = shard_dim(lay.params.get(weight, REPLICATE))
        if weight_dim is not None:
            weight_dim %= 2
        split_in = _features_sharded(lay.inputs, node.inputs)
        split_out = _features_sharded(lay.outputs, node.outputs)
        again = node.layer is not None and recomputed(node.layer) and i <= tail[node.layer]
        forwards = m * (2 if again else 1)
        if config.fp8 == "tensorwise":
            forward = int(split_in) + int(weight_dim is not None)
            calls = forwards * forward + m * (forward + 2 * int(split_out))
            comm.add("all_reduce", "tp", AMAX_BYTES, calls)
            continue
        tokens = math.prod(node.inputs[0].shape[:-1]) // config.cp
        out_features, in_features = node.params[weight].shape
        if split_in:
            comm.add("all_reduce", "tp", tokens * AMAX_BYTES, forwards)
        if weight_dim == 1:
            comm.add("all_reduce", "tp", out_features * AMAX_BYTES, forwards)
        if split_out:
            comm.add("all_reduce", "tp", tokens * AMAX_BYTES, m)
        if weight_dim == 0:
            comm.add("all_reduce", "tp", in_features * AMAX_BYTES, m)


def _features_sharded(placements: list[str], metas: list[TensorMeta]) -> bool:
    """Whether a linear layer's first input (or output) is split on tp along its features,
    the last dim: split on the sequence (sequence parallelism), it is gathered before the
    matmul and its gradient reduce-scattered after, so the cast sees it whole."""
    if not placements or not metas or not metas[0].shape:
        return False
    d = shard_dim(placements[0])
    return d is not None and d % len(metas[0].shape) == len(metas[0].shape) - 1


PINS: tuple[Pin, ...] = (
    Pin(
        "fp8",
        "choice",
        "fp8 matmuls (torchao float8 training) with this recipe, or off (default: tensorwise "
        "searched beside none on devices with fp8 tensor cores, for bf16 runs)",
        choices=("off", *FP8_RECIPES),
    ),
)


TECHNIQUE = Technique(
    "fp8",
    order=10,
    pins=PINS,
    choices=CHOICES,
    terms=(
        "planner.parallel.fp8:cast_bytes",
        "planner.parallel.fp8:weight_cast_bytes",
        "planner.parallel.fp8:saved_bytes",
        "planner.parallel.fp8:scale_reductions",
    ),
    capabilities=(
        Capability(
            "fp8",
            MODULES_ONLY,
            "plan.fp8: graph mode runs the exported aten graph, not the model's linear "
            "modules, which fp8 swaps (torchao); plan on the module path (tp_layout megatron)",
        ),
    ),
)
