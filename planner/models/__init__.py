"""Model zoo: families built on the meta device from a config, registered by name. The
registry (and torch) is imported on first use, so that planner.models.zoo_catalog stays
light."""

from __future__ import annotations

from typing import Any

__all__ = [
    "DTYPES",
    "FAMILIES",
    "ZOO",
    "ModelSpec",
    "ResolvedModel",
    "TrainingModule",
    "list_models",
    "resolve",
    "torch_dtype",
]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from planner.models import registry

        return getattr(registry, name)
    raise AttributeError(f"module 'planner.models' has no attribute {name!r}")
