"""The runtime that executes a plan is part of its prediction (DESIGN.md: "predicted for the
runtime that will execute it"): autopar's executor, or the framework a plan is exported to.
Each runtime is one declaration (planner.runtime.<name>.RUNTIME) with its sources: how it
lays out a parameter's weights, gradients and optimizer state in device memory at each ZeRO
level it runs, and whether it keeps compute-dtype copies of whole fp32 weights. The memory
terms (planner.cost.memory) read the request's runtime (training.runtime) from here."""

from __future__ import annotations

from planner.runtime.declaration import Runtime
from planner.runtime.runtimes import RUNTIMES, runtime_of

__all__ = ["RUNTIMES", "Runtime", "runtime_of"]
