"""The names a request, a plan and the executor share, each defined once.

The Literal types are what the schemas (planner.plan, api/service/schemas.py) validate
against; the tuples are the same names for argparse choices and loops.
"""

from __future__ import annotations

from typing import Literal, get_args

ScheduleName = Literal[
    "gpipe",
    "1f1b",
    "interleaved_1f1b",
    "interleaved_zero_bubble",
    "zbv_zero_bubble",
    "dualpipe_v",
    "looped_bfs",
]
DTypeName = Literal["fp32", "bf16", "fp16"]
# The same dtypes as torch (and a traced graph's tensors) name them.
TORCH_DTYPE_NAMES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}
# fp8 matmuls over a bf16 run (planner.parallel.fp8): torchao's float8 training recipes
Fp8Recipe = Literal["tensorwise", "rowwise"]
OptimizerName = Literal["adamw", "adam", "sgd", "sgd_momentum"]
AttentionKernel = Literal["flash", "math"]
# what executes the plan (planner.runtime): autopar's executor or the framework it is exported to
RuntimeName = Literal["autopar", "torchtitan", "megatron", "deepspeed"]
ZeroLevel = Literal[0, 1, 2, 3]  # 0: DDP; 1: optimizer state; 2: + grads; 3: + params (FSDP)
TpLayoutName = Literal["megatron", "per_node"]
# with activation checkpointing on (planner.parallel.checkpointing)
CheckpointPolicyName = Literal["full", "selective", "selective_alternate"]
SolverName = Literal["highs", "cbc"]  # the ILP's MILP solvers (both ship with pip wheels)
BaselineKind = Literal["megatron", "fsdp_tp", "dp", "fsdp"]
# every pipeline stage on one (dp, tp) mesh, or each on its own submesh (Alpa's inter-op pass)
StageMeshesName = Literal["uniform", "per_stage"]

SCHEDULES: tuple[str, ...] = get_args(ScheduleName)
DTYPES: tuple[str, ...] = get_args(DTypeName)
FP8_RECIPES: tuple[str, ...] = get_args(Fp8Recipe)
OPTIMIZERS: tuple[str, ...] = get_args(OptimizerName)
ATTENTION_KERNELS: tuple[str, ...] = get_args(AttentionKernel)
RUNTIME_NAMES: tuple[str, ...] = get_args(RuntimeName)
ZERO_LEVELS: tuple[int, ...] = get_args(ZeroLevel)
SOLVERS: tuple[str, ...] = get_args(SolverName)
BASELINE_KINDS: tuple[str, ...] = get_args(BaselineKind)
STAGE_MESHES: tuple[str, ...] = get_args(StageMeshesName)
