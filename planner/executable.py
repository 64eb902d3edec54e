"""What the executor can run today, so the planner can say whether a plan is executable and,
when asked, search only that space. (The executor imports these sets; the planner does not
import the executor.)"""

from __future__ import annotations

FAMILIES = frozenset({"gpt", "moe", "llama", "mlp"})

REPLICATED = frozenset({"replicate", "replicated"})
# Per node kind, the tensor-parallel strategies with an executor implementation.
TP_STRATEGIES = {
    "linear": REPLICATED | {"col", "column_parallel", "row", "row_parallel"},
    "embedding": REPLICATED | {"vocab", "vocab_parallel"},
    "attention": REPLICATED | {"heads", "head_parallel"},
    "loss": REPLICATED | {"vocab", "vocab_parallel_loss"},
}
# Kinds whose strategy just follows the tensors it is given (no module to wrap).
FOLLOWERS = frozenset(
    {
        "elementwise",
        "reshape",
        "concat",
        "norm",
        "softmax",
        "input",
        "constant",
        "reduction",
        "scatter",
        "pool",
        "other",
    }
)


def tp_name(strategy: str) -> str:
    """'dp:replicate|tp:col' -> 'col'; Megatron names pass through."""
    return strategy.split("|")[-1].removeprefix("tp:")


def executable(kind: str, strategy: str) -> bool:
    name = tp_name(strategy)
    if kind in FOLLOWERS:
        return name in REPLICATED or name == "sharded" or name.startswith("dim")
    return name in TP_STRATEGIES.get(kind, REPLICATED)
