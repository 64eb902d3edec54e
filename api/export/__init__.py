"""Plans as the configuration of the frameworks users already train with: a torchtitan job
config (TOML), Megatron-LM arguments, a DeepSpeed JSON. Each exporter writes what its framework
can express and raises ExportError naming the plan field it cannot (never a silent
approximation)."""

from __future__ import annotations

from collections.abc import Callable

from api.export import deepspeed, megatron, torchtitan
from api.export.common import ExportError

EXPORTERS: dict[str, Callable] = {
    "torchtitan": torchtitan.export,
    "megatron": megatron.export,
    "deepspeed": deepspeed.export,
}
SUFFIX = {"torchtitan": ".toml", "megatron": ".args", "deepspeed": ".json"}

__all__ = ["EXPORTERS", "SUFFIX", "ExportError"]
