"""One way in: a planning request (model, cluster, training settings) to the planner's inputs.

The CLI, the service and the benches all call `resolve_request` with the same shapes (the
service's JSON body; the CLI builds that body from its flags), so a field like
`training.global_batch_size` is read, checked and named in errors in one place. Nothing here
opens a path: a Hugging Face config or an OpGraph arrives as parsed JSON.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from dataclasses import dataclass
from functools import cached_property
from typing import Any

from pydantic import ValidationError

from planner.cluster.profile import ClusterProfile
from planner.errors import InputError, input_error_from
from planner.evaluate.predict import GraphFacts
from planner.graph.batch import cluster_layers, graph_at
from planner.graph.opgraph import OpGraph
from planner.plan import ModelRef, TrainingSettings
from planner.vocab import TORCH_DTYPE_NAMES

Say = Callable[[str], None]


def content_hash(obj: object) -> str:
    """A short, stable hash of JSON-able content (model configs, graphs, profiles)."""
    text = json.dumps(obj, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def model_ref(resolved: Any, seq: int) -> ModelRef:
    """ModelRef for a planner.models.ResolvedModel trained at `seq`."""
    model = resolved.with_seq(seq)
    cfg = model.config_dict()
    return ModelRef(
        name=model.name,
        family=model.family.name,
        config=cfg,
        params=model.param_count,
        content_hash=content_hash({"name": model.name, "config": cfg}),
    )


@dataclass(frozen=True)
class PlanningInputs:
    """What the search, the baselines and the evaluator take: the model traced at micro-batch
    1 and 2 (every count is affine in the batch, so any size follows exactly), or a graph
    file's one trace (rescaled linearly), and the request's settings."""

    graph: OpGraph
    second: OpGraph | None
    cluster: ClusterProfile
    training: TrainingSettings
    model: ModelRef
    tokens_per_sample: int

    @cached_property
    def base(self) -> OpGraph:
        """The first graph with layers (a graph without repeated blocks gets balanced ones)."""
        return cluster_layers(self.graph)

    @cached_property
    def second_base(self) -> OpGraph | None:
        """The second trace with the base graph's layers (a graph clustered into layers
        at one batch size keeps that clustering at the other)."""
        if self.second is None or self.base is self.graph:
            return self.second
        nodes = [
            n2.model_copy(update={"layer": n1.layer})
            for n1, n2 in zip(self.base.nodes, self.second.nodes, strict=True)
        ]
        return OpGraph.resized(self.second.data.model_copy(update={"nodes": nodes}), self.second)

    def at(self, microbatch_size: int) -> OpGraph:
        """The graph at this micro-batch size, with the base graph's layers."""
        return cluster_layers(graph_at(self.base, self.second_base, microbatch_size))

    def facts_at(self, microbatch_size: int) -> GraphFacts:
        """at(microbatch_size)'s GraphFacts without building that graph where the two traces
        are one sample apart (the FLOP total is then affine in the batch, as each node's is)."""
        g1, g2 = self.graph, self.second
        if g2 is None or g2.data.batch - g1.data.batch != 1:
            return GraphFacts.of(self.at(microbatch_size))
        f1, f2 = g1.train_flops, g2.train_flops
        flops = f1 + (f2 - f1) * (microbatch_size - g1.data.batch)
        return GraphFacts(microbatch_size, self.base.num_layers, flops)


@dataclass(frozen=True)
class PlanningRequest:
    """A checked request before tracing: the model (zoo/HF resolved, or a graph), settings."""

    cluster: ClusterProfile
    training: TrainingSettings
    model: ModelRef
    tokens_per_sample: int
    layers: int  # for checking a configuration before anything is traced
    resolved: Any = None  # planner.models.ResolvedModel, or None for a graph
    graph: OpGraph | None = None
    # the global batch to search (planner.search.batch.BatchRange); training holds its low end
    batches: Any = None

    def trace(
        self, batches: tuple[int, ...] = (1, 2), say: Say | None = None, workers: int = 1
    ) -> PlanningInputs:
        """Trace at the given micro-batch sizes (a graph request is used as given), side by
        side in `workers` processes."""
        if self.graph is not None:
            return PlanningInputs(
                self.graph, None, self.cluster, self.training, self.model, self.tokens_per_sample
            )
        from planner.graph.trace_cache import trace_batches

        seq, dtype = self.training.seq_len, self.training.dtype
        if batches == (1, 2) and self.resolved.family.name == "hf":
            # transformers' code specialises batch 1 (a no-op expand is left out), so its
            # traces at 1 and 2 differ in structure; 2 and 3 extrapolate to 1 exactly.
            batches = (2, 3)
        if say:
            say(f"tracing {self.resolved.name} (seq {seq}) on the meta device")
        graphs = trace_batches(self.resolved, batches, seq, dtype, workers)
        second = graphs[1] if len(graphs) > 1 else None
        return PlanningInputs(
            graphs[0], second, self.cluster, self.training, self.model, self.tokens_per_sample
        )


def resolve_request(
    model: dict[str, Any], cluster: ClusterProfile, training: dict[str, Any]
) -> PlanningRequest:
    """Check and resolve `model` ({name, config, hf_config} or {graph}) and `training` (the
    TrainingSettings fields; seq_len defaults to the model's; global_batch_size may be a
    range to search: planner.search.batch). Errors name the field."""
    training, batches = batch_bounds(training, cluster)
    if model.get("graph") is not None:
        graph = OpGraph.from_json(json.dumps(model["graph"]), field="model.graph")
        embeddings = [n for n in graph.nodes if n.kind == "embedding" and n.params]
        # the vocabulary: rows of the first embedding table (synthetic tokens stay in range)
        vocab = next(iter(embeddings[0].params.values())).shape[0] if embeddings else None
        ref = ModelRef(
            name=graph.data.model or "graph",
            family="graph",
            config={"vocab": vocab} if vocab else {},
            params=graph.param_count,
            content_hash=content_hash(model["graph"]),
        )
        # the graph's tensor sizes are its trace's: another dtype would price other bytes
        traced = {v: k for k, v in TORCH_DTYPE_NAMES.items()}.get(graph.data.dtype)
        wanted = training.get("dtype")
        if traced is not None and wanted not in (None, traced):
            raise InputError(
                "training.dtype",
                f"{wanted!r}, but the graph was traced in {traced} (model.graph.dtype)",
                f"{traced}, or trace again with --dtype {wanted}",
            )
        settings = _training({**training, "dtype": wanted or traced}, graph.data.seq, cluster)
        layers = max(cluster_layers(graph).num_layers, 1)
        return PlanningRequest(
            cluster, settings, ref, settings.seq_len, layers, graph=graph, batches=batches
        )
    from planner.models import ModelSpec, resolve

    resolved = resolve(
        ModelSpec(
            name=model.get("name"),
            config=model.get("config") or {},
            hf_config=model.get("hf_config"),
        )
    )
    settings = _training(training, resolved.default_seq, cluster)
    layers = getattr(resolved.with_seq(settings.seq_len).config, "layers", 1)
    tokens = settings.seq_len if resolved.family.tokens_per_sample else 1
    return PlanningRequest(
        cluster,
        settings,
        model_ref(resolved, settings.seq_len),
        tokens,
        layers if isinstance(layers, int) else 1,
        resolved=resolved,
        batches=batches,
    )


def default_dtype(cluster: ClusterProfile) -> str:
    """The training dtype a request that names none gets: the best the device has a peak
    for (bf16, else fp16, else fp32: a V100 has no bf16)."""
    peaks = cluster.device.peak_flops
    return next((d for d in ("bf16", "fp16") if d in peaks), "fp32")


def batch_bounds(fields: dict[str, Any], cluster: ClusterProfile) -> tuple[dict, Any]:
    """`fields` with a global batch range ("LO-HI", [LO, HI], "auto") replaced by its low
    end, and the range (planner.search.batch.BatchRange; None for a number)."""
    from planner.search.batch import BatchRange, parse_global_batch

    value = fields.get("global_batch_size")
    if value is None:
        return fields, None
    parsed = parse_global_batch(value, cluster.num_devices)
    if isinstance(parsed, BatchRange):
        return {**fields, "global_batch_size": parsed.low}, parsed
    return {**fields, "global_batch_size": parsed}, None


def _training(
    fields: dict[str, Any], default_seq: int, cluster: ClusterProfile
) -> TrainingSettings:
    values = {k: v for k, v in fields.items() if v is not None}
    values.setdefault("seq_len", default_seq)
    values.setdefault("dtype", default_dtype(cluster))
    try:
        return TrainingSettings(**values)
    except ValidationError as err:
        raise input_error_from(err, prefix="training") from None


def search_options(fields: dict[str, Any]):
    """A request body's `search` as planner.search.space.SearchOptions: what is pinned, how
    many alternatives; the CLI adds its process-local knobs (workers, solver, ILP and search
    time limits)."""
    from planner.pins import PINS
    from planner.search.space import SearchOptions, pinned_options

    keys = ("workers", "solver", "ilp_time_limit", "time_limit")
    local = {k: fields[k] for k in keys if k in fields}
    return SearchOptions(
        executable_only=fields.get("executable_only", True),
        top_k=fields.get("top_k", 5),
        **local,
        **pinned_options(**{pin.name: pin.check(fields.get(pin.name)) for pin in PINS}),
    )
