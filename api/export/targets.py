"""The frameworks a plan can be made for (`--export-to`): each exporter's search options (what
its configuration can say) and its own refusals, checked on the plans the search finds, and
the runtime its predictions are made for (planner.runtime)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

from api.export import EXPORTERS, deepspeed, megatron, torchtitan
from api.export.common import ExportError
from planner.errors import InputError
from planner.plan import Plan
from planner.search.space import SearchOptions


@dataclass(frozen=True)
class ExportTarget:
    name: str
    runtime: str  # planner.runtime's name for the framework
    export: Callable[[Plan], str]
    restrict: Callable[[SearchOptions], SearchOptions]  # what its configuration can say

    def refusal(self, plan: Plan) -> str | None:
        """Why the framework cannot run this plan (its exporter's words), or None."""
        try:
            self.export(plan)
        except ExportError as err:
            return str(err)
        return None


def _one_mesh(restrict: Callable[[SearchOptions], SearchOptions], target: str):
    """The exporter's restriction, with every pipeline stage on one mesh: no framework
    places its stages on submeshes of their own (a per_stage pin is refused)."""

    def restricted(options: SearchOptions) -> SearchOptions:
        if options.stage_meshes == ("per_stage",):
            raise InputError(
                "search.stage_meshes",
                f"{target} runs every pipeline stage on one (dp, tp) mesh",
                "uniform",
            )
        return replace(restrict(options), stage_meshes=("uniform",))

    return restricted


TARGETS = {
    module.TARGET: ExportTarget(
        module.TARGET,
        module.TARGET,
        EXPORTERS[module.TARGET],
        _one_mesh(module.restrict, module.TARGET),
    )
    for module in (torchtitan, megatron, deepspeed)
}


def target_training(name: str | None, training: dict, field: str) -> dict:
    """The request's training settings planned for the target's runtime: a runtime the
    request names must be the target's (or autopar's, the default, which the target's
    replaces)."""
    if name is None:
        return training
    if name not in TARGETS:
        raise InputError(field, repr(name), ", ".join(TARGETS))
    runtime = training.get("runtime") or "autopar"
    if runtime not in ("autopar", TARGETS[name].runtime):
        raise InputError(
            field,
            f"plans for {name} are predicted for its runtime, not {runtime}",
            f"training.runtime {TARGETS[name].runtime} or unset",
        )
    return {**training, "runtime": TARGETS[name].runtime}
