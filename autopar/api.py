"""`autopar.plan` and `autopar.parallelize` (see the package docstring)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from planner.plan import Plan


def _hf_dict(hf_config: Any) -> dict | None:
    """A transformers config object or a config.json body, as the planner reads it."""
    if hf_config is None or isinstance(hf_config, dict):
        return hf_config
    to_dict = getattr(hf_config, "to_dict", None)
    if to_dict is None:
        raise TypeError("hf_config: a dict (config.json) or a transformers PretrainedConfig")
    return to_dict()


def plan(
    model: str | None = None,
    *,
    cluster: str = "dgx-a100-80g",
    nodes: int | None = None,
    global_batch_size: int | str | tuple[int, int],
    seq_len: int | None = None,
    dtype: str = "bf16",
    optimizer: str = "adamw",
    runtime: str = "autopar",
    expert_imbalance: float = 1.0,
    config: dict | None = None,
    hf_config: Any = None,
    executable_only: bool = True,
    mesh: tuple[int, int, int] | None = None,
    schedule: str | None = None,
    virtual_stages: int | None = None,
    zero: int | None = None,
    checkpointing: bool | str | None = None,
    microbatch_size: int | None = None,
    tp_layout: str | None = "megatron",
    sequence_parallel: bool | None = None,
    dp_shard: int | None = None,
    cp: int | None = None,
    cp_comm: str | None = None,
    cpu_offload: bool | None = None,
    fp8: str | None = None,
    ep: int | None = None,
    etp: int | None = None,
    stage_meshes: str | None = None,
    layerwise_zero: bool | None = None,
    memory_headroom: float | str | None = None,
    export_to: str | None = None,
) -> Plan:
    """The best plan for a zoo model (`model`, with `config` overrides) or a Hugging Face
    model (`hf_config`: a transformers config or a config.json dict) on a cluster profile
    (a bundled name or a YAML path, `nodes` of it). Pinned choices (the keywords from `mesh`,
    as (pp, dp, tp), to `fp8`: planner.pins) are kept; the rest is searched.
    `global_batch_size`: samples per step, or a range to search for the most tokens/s
    ("LO-HI", (LO, HI), or "auto": 1 to 16 per device; planner.search.batch).
    `memory_headroom` is kept free per device (a share or "4GiB"; default 5%). `fp8`: "off",
    "tensorwise" or "rowwise" pins fp8 matmuls (default: searched where the device has them).
    `stage_meshes` "per_stage" asks for each pipeline stage on its own submesh (Alpa's
    inter-operator pass; `autopar execute` runs such plans, `parallelize` takes one mesh).
    `tp_layout` defaults to Megatron's, the layout `parallelize` applies to a model's own
    modules (None also searches per-node layouts, which `autopar execute` runs). Raises
    planner.errors.InputError naming the field for bad input, and
    planner.search.search.NoFeasiblePlan when nothing fits. `export_to` ("torchtitan",
    "megatron" or "deepspeed"): the best plan that framework can express, predicted for its
    runtime (api.export.targets)."""
    from api.export.targets import TARGETS, target_training
    from planner.cluster.headroom import with_headroom
    from planner.cluster.profile import load_cluster
    from planner.planning import plan_request
    from planner.request import resolve_request, search_options

    profile = load_cluster(cluster, nodes=nodes, field="cluster", nodes_field="nodes")
    profile = with_headroom(profile, memory_headroom, field="memory_headroom")
    training = {
        "global_batch_size": global_batch_size,
        "seq_len": seq_len,
        "dtype": dtype,
        "optimizer": optimizer,
        "runtime": runtime,
        "expert_imbalance": expert_imbalance,
    }
    request = resolve_request(
        {"name": model, "config": config or {}, "hf_config": _hf_dict(hf_config)},
        profile,
        target_training(export_to, training, "export_to"),
    )
    pins = {
        "mesh": list(mesh) if mesh else None,
        "schedule": schedule,
        "virtual_stages": virtual_stages,
        "zero": zero,
        "checkpointing": checkpointing,
        "microbatch_size": microbatch_size,
        "tp_layout": tp_layout,
        "sequence_parallel": sequence_parallel,
        "dp_shard": dp_shard,
        "cp": cp,
        "cp_comm": cp_comm,
        "cpu_offload": cpu_offload,
        "fp8": fp8,
        "ep": ep,
        "etp": etp,
        "stage_meshes": stage_meshes,
        "layerwise_zero": layerwise_zero,
    }
    options = search_options({"executable_only": executable_only, **pins})
    target = TARGETS[export_to] if export_to else None
    return plan_request(request, options, target=target).plan


def load_plan(path: str | Path) -> Plan:
    return Plan.from_json(Path(path).read_text())


@dataclass
class Parallelized:
    """This rank's part of the model under a plan: `modules` (its pipeline stages, to hand
    to an optimizer via `parameters()`), `schedule` (a torch.distributed.pipelining schedule
    when pp > 1), and `step`, one batch's forward and backward on this rank."""

    plan: Plan
    parallel: Any  # executor.parallelize.ParallelModel
    mesh: Any  # the ("pp", "dp", "tp") DeviceMesh
    # built on the meta device: its parameters hold no values until load_state_dict
    awaiting_weights: bool = False

    @property
    def modules(self) -> list[nn.Module]:
        return [stage for _, stage in self.parallel.stages]

    @property
    def schedule(self):
        return self.parallel.schedule

    def parameters(self) -> list[nn.Parameter]:
        return self.parallel.parameters

    def local_batch(
        self,
        tokens: torch.Tensor,
        labels: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
    ) -> tuple:
        """`step`'s arguments for this rank from a global batch (the same on every rank):
        its data-parallel replica's samples and, under context parallelism, its chunks of
        their sequence. With `attention_mask` (1 for a real token, 0 for padding), the labels
        of padded tokens are left out of the loss (see `step`); with `position_ids` (packed
        documents), this rank's rows of them are passed on."""
        from executor.context_parallel import local_batch

        if attention_mask is not None:
            labels = padded_labels(labels, attention_mask)
        dp_rank = self.mesh["dp"].get_local_rank()
        x, y = local_batch(tokens, labels, self.plan, dp_rank)
        if position_ids is None:
            return x, y
        _check_positions(position_ids, tokens.shape, "position_ids")
        positions, _ = local_batch(position_ids, position_ids, self.plan, dp_rank)
        return x, y, None, positions

    def step(
        self,
        tokens: torch.Tensor,
        labels: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
    ) -> float | None:
        """Forward and backward of this rank's batch (`local_batch`) in the plan's
        micro-batches, pipeline schedule and precision; the mean loss where this rank
        computes it (the last pipeline stage), else None. Gradients are full-batch means
        across data-parallel ranks.

        Padded batches: labels equal to -100 are left out (transformers' collators mark
        padding so), and so are those of tokens `attention_mask` marks 0. The loss and its
        gradients are then the mean over the whole batch's counted labels, as one process
        computes them, however they fall into micro-batches and data-parallel ranks. The
        padding must be on the right of each row: under causal attention a real token never
        sees a later pad, so no mask enters the model (left padding would need one, and is
        refused).

        Packed documents: `position_ids` of the tokens' shape, counting from 0 at the start
        of each document in a row (as transformers' DataCollatorWithFlattening makes them);
        every stage passes them to the model, whose attention masks then keep each token
        within its document (transformers builds them from the positions). Hugging Face
        models, without context parallelism."""
        from executor.precision import autocast
        from executor.training import forward_backward

        if self.awaiting_weights:
            raise ValueError(
                "model: built on the meta device, its parameters hold no values yet; call "
                "load_state_dict (a checkpoint or a state dict) before the first step"
            )
        device = next(iter(self.parameters())).device
        if attention_mask is not None:
            labels = padded_labels(labels, attention_mask)
        inputs = {}
        if position_ids is not None:
            self._check_packing()
            _check_positions(position_ids, tokens.shape, "position_ids")
            inputs["position_ids"] = position_ids.to(device)
        self.parallel.labels_per_share = self._labels_per_share(labels, device)
        x, y = tokens.to(device), labels.to(device)
        m = self.plan.schedule.microbatches
        with autocast(self.plan.request.training.dtype, device):
            return forward_backward(self.plan, self.parallel, x, y, m, inputs)

    def _check_packing(self) -> None:
        """Packed documents need a model that takes position_ids and masks attention by
        them: a Hugging Face model on the module path, without context parallelism (whose
        exchanges assume one causal sequence per row)."""
        model = self.plan.request.model
        if model.family != "hf" or self.parallel.global_inputs:
            raise ValueError(
                "position_ids: packed documents need a Hugging Face model run on its own "
                f"modules (transformers masks attention by them); this plan runs "
                f"{'graph mode' if self.parallel.global_inputs else f'a {model.family} model'}"
            )
        if (self.plan.mesh.cp or 1) > 1:
            raise ValueError(
                "position_ids: packed documents under context parallelism are not supported "
                f"(this plan has cp {self.plan.mesh.cp}); expected one document per row"
            )

    def _labels_per_share(self, labels: torch.Tensor, device) -> float | None:
        """The batch's counted labels per micro-batch and data-parallel rank (summed over the
        dp group), or None where every label of the batch counts."""
        import torch.distributed as dist

        from executor.parallelize import IGNORE_INDEX

        counts = torch.tensor(
            [int((labels != IGNORE_INDEX).sum()), labels.numel()], dtype=torch.float64
        )
        dp = self.plan.mesh.shape[1]
        if dp > 1:
            counts = counts.to(device)
            dist.all_reduce(counts, group=self.mesh["dp"].get_group())
        counted, total = (float(c) for c in counts.cpu())
        if counted == total:
            return None
        if counted == 0:
            raise ValueError("labels: every label of the batch is ignored (-100 or padding)")
        if (self.plan.mesh.cp or 1) > 1:
            raise ValueError(
                "labels: ignored labels (padding) under context parallelism are not "
                "supported; expected a batch whose every label counts"
            )
        return counted / (self.plan.schedule.microbatches * dp)

    def optimizer(self, factory, **kwargs):
        """The optimizer for this rank: `factory(params, **kwargs)` (e.g. torch.optim.AdamW)
        over `parameters()`, or, where the plan's ZeRO level is 1, over this rank's shards of
        them (executor.zero1: it reduces the gradients and gathers the parameters itself).
        ZeRO-1 plans need it; for the others building your own is the same."""
        from executor.training import plan_optimizer

        self._optimizer = plan_optimizer(self.parallel, lambda params: factory(params, **kwargs))
        return self._optimizer

    def load_state_dict(self, source: dict[str, torch.Tensor] | str | Path) -> None:
        """Load full (unsharded) weights into this rank's parts: a state dict keyed by the
        model's own parameter names, or a `save_pretrained` checkpoint (a directory of
        safetensors files, or one such file). Each rank reads only the tensors its pipeline
        stages hold and keeps its own shards of them (torch's set_model_state_dict slices
        each full tensor as the parameter's DTensor placements say); a weight tied to the
        input embeddings and left out of the checkpoint (transformers saves tied weights
        once) is loaded from them. Call after `parallelize`, before building the optimizer."""
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            set_model_state_dict,
        )

        settings = (self.plan.request.model.config or {}).get("settings") or {}
        tied = settings.get("tie_word_embeddings", False)
        for module in self.modules:
            wanted = set(module.state_dict())
            state = _read_weights(source, wanted, tied)
            if missing := sorted(wanted - set(state)):
                raise ValueError(
                    f"{source if not isinstance(source, dict) else 'state dict'}: no tensor "
                    f"for {', '.join(missing[:3])}{' ...' if len(missing) > 3 else ''} "
                    "(expected the model's own parameter names)"
                )
            state.update(self._own_experts(module, state))
            options = StateDictOptions(full_state_dict=True, strict=True)
            set_model_state_dict(module, state, options=options)
        self.awaiting_weights = False

    def _own_experts(self, module: nn.Module, state: dict) -> dict[str, torch.Tensor]:
        """Under expert parallelism, this rank's experts of each full expert weight in
        `state` (dim 0 the expert index; executor.expert_parallel keeps the ep rank's
        consecutive E / ep of them); under expert tensor parallelism, of those this tp
        rank's features (executor.expert_parallel.feature_slice)."""
        from executor.expert_parallel import feature_slice

        ep = self.plan.mesh.ep or 1
        split = {id(m) for m in getattr(self.parallel, "split_experts", ())}
        held = {id(m) for m in self.parallel.experts} if ep > 1 else set()
        if not held and not split:
            return {}
        out = {}
        for prefix, sub in module.named_modules():
            if id(sub) not in held | split:
                continue
            for name, _ in sub.named_parameters(recurse=False):
                key = f"{prefix}.{name}" if prefix else name
                if key not in state:
                    continue
                weight = state[key]
                if id(sub) in held:
                    rank, local = self.mesh["ep"].get_local_rank(), weight.shape[0] // ep
                    weight = weight[rank * local : (rank + 1) * local]
                if id(sub) in split:
                    tp = self.mesh["tp"]
                    weight = feature_slice(weight, name, tp.size(), tp.get_local_rank())
                out[key] = weight
        return out

    def finish_gradients(self, max_grad_norm: float = 1.0) -> bool:
        """Call after `step`, before `optimizer.step()`: sums tied embeddings' gradients
        across pipeline stages, under ZeRO-1 reduce-scatters them, undoes fp16 loss scaling
        and clips the global gradient norm (over every stage). False when fp16 gradients
        overflowed: skip that optimizer step."""
        from executor.training import finish_gradients

        optimizer = getattr(self, "_optimizer", None)
        if self.parallel.zero1_units and optimizer is None:
            raise ValueError(
                "stages[].zero: this plan shards the optimizer state (ZeRO-1); build the "
                "optimizer with parallel.optimizer(torch.optim.AdamW, ...)"
            )
        pp_group = self.mesh.get_group("pp") if self.plan.mesh.shape[0] > 1 else None
        return finish_gradients(self.parallel, max_grad_norm, pp_group, optimizer)


def padded_labels(labels: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """`labels` with those of padded tokens (mask 0) set to -100; the padding must be on the
    right of each row (see Parallelized.step)."""
    from executor.parallelize import IGNORE_INDEX

    if attention_mask.shape != labels.shape:
        raise ValueError(
            f"attention_mask: shape {tuple(attention_mask.shape)}, expected the labels' "
            f"{tuple(labels.shape)}"
        )
    mask = attention_mask.to(torch.int64)
    if not bool(((mask == 0) | (mask == 1)).all()):
        raise ValueError("attention_mask: expected 1 for a real token and 0 for padding")
    later_real = mask[:, 1:] > mask[:, :-1]  # a real token after a pad in the same row
    if bool(later_real.any()):
        row = int(later_real.any(dim=1).nonzero()[0])
        raise ValueError(
            f"attention_mask: row {row} has a real token after padding (left padding or "
            "packed documents); expected right padding, each row's real tokens first "
            "(packed documents: position_ids counting from 0 in each, no attention_mask)"
        )
    return labels.masked_fill(mask == 0, IGNORE_INDEX)


def _check_positions(position_ids: torch.Tensor, shape: torch.Size, field: str) -> None:
    """Packed documents' positions: integers of the tokens' shape, counting up by one
    within a document and from 0 at the start of each."""
    if not isinstance(position_ids, torch.Tensor) or position_ids.dtype.is_floating_point:
        raise ValueError(f"{field}: expected an integer tensor of the tokens' shape")
    if position_ids.shape != shape:
        raise ValueError(
            f"{field}: shape {tuple(position_ids.shape)}, expected the tokens' {tuple(shape)}"
        )
    steps = position_ids[:, 1:] - position_ids[:, :-1]
    starts = position_ids[:, 1:][steps != 1]
    if bool((position_ids[:, 0] != 0).any()) or bool((starts != 0).any()):
        raise ValueError(
            f"{field}: expected each row to count 0, 1, 2, ... within a document and to "
            "start each document at 0"
        )


# transformers' names of an output head tied to the input embeddings, per the base model
TIED_HEAD = ("lm_head.weight", ("model.embed_tokens.weight", "transformer.wte.weight"))


def _read_weights(source, wanted: set[str], tied: bool) -> dict[str, torch.Tensor]:
    """The tensors named in `wanted` from a state dict or from safetensors files (read one
    tensor at a time, only those named, in one pass: a tied head's embeddings with them)."""
    head, embeddings = TIED_HEAD
    reading = wanted | set(embeddings) if tied and head in wanted else wanted
    if isinstance(source, dict):
        found = {k: v for k, v in source.items() if k in reading}
        files: list[Path] = []
    else:
        path = Path(source)
        files = sorted(path.glob("*.safetensors")) if path.is_dir() else [path]
        if not files or not all(f.is_file() for f in files):
            raise ValueError(f"{source}: no safetensors checkpoint (save_pretrained's files)")
        found = {}
    from safetensors import safe_open

    for file in files:
        with safe_open(str(file), framework="pt") as f:
            for key in f.keys():  # noqa: SIM118 (safe_open has keys(), no iteration)
                if key in reading:
                    found[key] = f.get_tensor(key)
    if reading is not wanted and head not in found:
        source_key = next((k for k in embeddings if k in found), None)
        if source_key is not None:
            found[head] = found[source_key]
    return {k: v for k, v in found.items() if k in wanted}


def parallelize(model: nn.Module, plan: Plan | str | Path, mesh=None, loss_fn=None) -> Parallelized:
    """Apply `plan` to `model` on this rank (call on every rank of a torchrun job, after
    `torch.distributed.init_process_group`). `model` is the model the plan was made for: a
    transformers causal LM (the plan's modules are its own paths) or a zoo model from
    `planner.models`; build it from the same seed on every rank, or, a transformers model,
    on the meta device (`with torch.device("meta"):`), which allocates nothing until each
    rank materializes its own stages' shards: then load its weights (`load_state_dict`)
    before the first step. `mesh`: a ("pp", "dp",
    "tp") DeviceMesh, default one built from the plan. `loss_fn(logits, labels)`: your loss,
    a scalar mean over the micro-batch (default: next-token cross entropy); not where the
    plan computes the loss on vocabulary-sharded logits (its head split over tp), whose
    cross entropy torch's loss_parallel runs."""
    import torch.distributed as dist

    from executor.mesh import build_mesh
    from executor.parallelize import parallelize as apply_plan
    from executor.tensor_parallel import vocab_parallel_loss
    from planner.executable import execution_refusal, plan_executor_mode

    plan = plan if isinstance(plan, Plan) else load_plan(plan)
    if refused := execution_refusal(plan):
        raise ValueError(f"plan.{refused[0]}: {refused[1]}")
    if plan.mesh.stage_meshes is not None:
        raise ValueError(
            "plan.mesh.stage_meshes: parallelize applies plans whose pipeline stages share "
            "one (dp, tp) mesh; this one runs each stage on its own submesh (run it with "
            "`autopar execute`, or plan with stage_meshes='uniform')"
        )
    if plan_executor_mode(plan) != "modules":
        raise ValueError(
            "plan.tp_layout: parallelize applies plans whose tensor-parallel layout is "
            "Megatron's to the model's own modules; this one is chosen node by node (make it "
            "with tp_layout='megatron', or run it with `autopar execute`)"
        )
    vocab_loss = vocab_parallel_loss(plan)
    if loss_fn is not None and vocab_loss:
        raise ValueError(
            "loss_fn: this plan computes the loss on vocabulary-sharded logits (the head split "
            "over tp, cross entropy under torch's loss_parallel); expected a plan whose head "
            "is not vocab-parallel, or the default loss"
        )
    device = next(model.parameters()).device
    on_meta = device.type == "meta"
    if on_meta:  # each rank allocates its own stages' shards, on its own device
        cuda = torch.cuda.is_available()
        device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    mesh = mesh if mesh is not None else build_mesh(plan, device.type)
    family = plan.request.model.family
    parallel = apply_plan(plan, model, family, mesh, dist.get_rank(), device, loss_fn)
    return Parallelized(plan, parallel, mesh, awaiting_weights=on_meta)
