"""Model zoo: families built on the meta device from a config, registered by name."""

from planner.models.registry import (
    DTYPES,
    FAMILIES,
    ZOO,
    ModelSpec,
    ResolvedModel,
    TrainingModule,
    list_models,
    resolve,
    torch_dtype,
)

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
