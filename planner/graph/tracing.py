"""Trace a module into an OpGraph with torch.export on the meta device.

Steps: export the training forward (model + loss) without running it; then interpret the
exported graph once on meta tensors under autograd, which gives per node, exactly and with
no memory:
- forward FLOPs (FlopCounterMode around the node),
- backward FLOPs (grad_fn pre-hooks attribute the backward's FLOPs to the forward node
  whose autograd nodes they are),
- bytes saved for backward (saved-tensor hooks; a tensor is counted once, at the first node
  that saves it; views count as their base; parameters are not activations).
Attention is the exception: the meta device runs the math kernel, which saves the s x s
probabilities, while training on GPUs uses flash/memory-efficient kernels that keep
q, k, v, the output and a float32 logsumexp; we account the latter.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import operator
from collections.abc import Callable
from typing import Any

import torch
import torch.fx
from torch.export import ExportedProgram
from torch.export.graph_signature import InputKind
from torch.utils.flop_counter import FlopCounterMode

from planner.errors import InputError
from planner.graph.assemble import Exported, assemble, tensors
from planner.graph.expand import NotRepeatingError, expand_layers
from planner.graph.flops import custom_flop_formulas
from planner.graph.opgraph import OpGraph
from planner.models import hf


def find_blocks(module: torch.nn.Module) -> list[str]:
    """Paths of the repeated blocks: composite children of ModuleList/Sequential containers
    whose class is the most frequent such child class (GPT blocks, ResNet bottlenecks ...)."""
    containers = (torch.nn.ModuleList, torch.nn.Sequential)
    counts: dict[type, list[str]] = {}
    for path, mod in module.named_modules():
        if not isinstance(mod, containers):
            continue
        for child_name, child in mod.named_children():
            if isinstance(child, torch.nn.ModuleList) or next(child.children(), None) is None:
                continue
            full = f"{path}.{child_name}" if path else child_name
            counts.setdefault(type(child), []).append(full)
    return max(counts.values(), key=len, default=[])


class _Recorder(torch.fx.Interpreter):
    """Runs the exported graph on meta tensors and records per-node facts."""

    def __init__(self, gm: torch.fx.GraphModule, flops: FlopCounterMode):
        super().__init__(gm)
        self.flops = flops
        self.current: str | None = None
        self.values: dict[str, Any] = {}
        self.fwd_flops: dict[str, int] = {}
        self.saved: list[tuple[str, torch.Tensor]] = []
        self.keep: list[torch.Tensor] = []  # keeps ids stable while we hold them

    def run_node(self, n: torch.fx.Node) -> Any:
        if n.op != "call_function" or n.target is operator.getitem:
            out = super().run_node(n)
            self.values[n.name] = out
            return out
        self.current = n.name
        before = self.flops.get_total_flops()
        out = super().run_node(n)
        self.fwd_flops[n.name] = self.flops.get_total_flops() - before
        self.values[n.name] = out
        self.current = None
        return out

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        if self.current is not None:
            self.saved.append((self.current, t))
            self.keep.append(t)
        return t


def trace(
    module: torch.nn.Module,
    example_inputs: tuple,
    *,
    name: str | None = None,
    seq: int | None = None,
    strip_prefix: str = "",
    progress: Callable[[str], None] | None = None,
) -> OpGraph:
    """Trace `module(*example_inputs)` (meta tensors) into an OpGraph.

    The module's forward should return the scalar loss. `strip_prefix` removes a wrapper's
    attribute name (e.g. "model.") from module and parameter paths.
    """
    say = progress or (lambda _msg: None)
    say("export")
    ep: ExportedProgram = torch.export.export(module, tuple(example_inputs), strict=False)
    gm = ep.graph_module
    sig = ep.graph_signature

    def strip(path: str) -> str:
        if strip_prefix and path == strip_prefix.rstrip("."):
            return ""
        return path.removeprefix(strip_prefix) if strip_prefix else path

    # Bind placeholders to the module's own tensors so tied parameters share identity.
    params_by_name = dict(module.named_parameters(remove_duplicate=False))
    buffers_by_name = dict(module.named_buffers(remove_duplicate=False))
    canonical: dict[int, str] = {}
    for pname, p in module.named_parameters(remove_duplicate=False):
        canonical.setdefault(id(p), strip(pname))
    placeholder_param: dict[str, str] = {}
    user_inputs: list[str] = []
    args: list[Any] = []
    user_iter = iter(example_inputs)
    for spec in sig.input_specs:
        pname = spec.arg.name
        if spec.kind == InputKind.PARAMETER:
            p = params_by_name[spec.target]
            placeholder_param[pname] = canonical[id(p)]
            args.append(p)
        elif spec.kind == InputKind.BUFFER:
            args.append(buffers_by_name.get(spec.target, ep.constants.get(spec.target)))
        elif spec.kind in (InputKind.CONSTANT_TENSOR, InputKind.CUSTOM_OBJ):
            args.append(ep.constants[spec.target])
        else:
            user_inputs.append(pname)
            args.append(next(user_iter))

    say("interpret")
    param_ids = {id(p) for p in module.parameters()}
    with FlopCounterMode(display=False, custom_mapping=custom_flop_formulas()) as flops:
        rec = _Recorder(gm, flops)
        with torch.autograd.graph.saved_tensors_hooks(rec.pack, lambda t: t):
            outputs = rec.run(*args)
        loss = tensors(outputs)[0]
        bwd_flops = _backward_flops(gm, rec, loss, flops)

    say("assemble")
    exported = Exported(
        gm=gm,
        ep=ep,
        placeholder_param=placeholder_param,
        user_inputs=user_inputs,
        param_ids=param_ids,
        example_inputs=tuple(example_inputs),
        blocks={strip(p): i for i, p in enumerate(find_blocks(module))},
        strip=strip,
        styled_as=_styled_as(module, strip),
    )
    return assemble(exported, rec, bwd_flops, name, seq)


def _backward_flops(
    gm: torch.fx.GraphModule, rec: _Recorder, loss: torch.Tensor, flops: FlopCounterMode
) -> dict[str, int]:
    """Attribute backward FLOPs to forward nodes via pre-hooks on their autograd nodes."""
    owner: dict[Any, str] = {}
    for n in gm.graph.nodes:
        if n.op != "call_function" or n.target is operator.getitem:
            continue
        stack = [t.grad_fn for t in tensors(rec.values.get(n.name)) if t.grad_fn is not None]
        while stack:
            fn = stack.pop()
            if fn is None or fn in owner or type(fn).__name__ == "AccumulateGrad":
                continue
            owner[fn] = n.name
            stack.extend(nxt for nxt, _ in fn.next_functions if nxt is not None)
    if not loss.requires_grad:
        return {}
    state = {"who": None, "mark": flops.get_total_flops()}
    result: dict[str, int] = {}

    def flush() -> None:
        now = flops.get_total_flops()
        if state["who"] is not None:
            result[state["who"]] = result.get(state["who"], 0) + now - state["mark"]
        state["mark"] = now

    handles = []
    for fn, node_name in owner.items():

        def hook(_grads: Any, node_name: str = node_name) -> None:
            flush()
            state["who"] = node_name

        handles.append(fn.register_prehook(hook))
    try:
        state["mark"] = flops.get_total_flops()
        loss.backward()
        flush()
    finally:
        for h in handles:
            h.remove()
    return result


STYLED_CLASSES = (torch.nn.Linear, torch.nn.Embedding)  # planner.executable.STYLE_MODULES


def _styled_as(module: torch.nn.Module, strip: Callable[[str], str]) -> dict[str, str]:
    """Subclasses of the classes torch's parallel styles shard, by module path: the base
    class's name, which the executor's styles see (an isinstance test)."""
    out = {}
    for path, m in module.named_modules():
        base = next((c for c in STYLED_CLASSES if isinstance(m, c)), None)
        if base is not None and type(m) is not base:
            out[strip(path)] = base.__name__
    return out


def trace_model(
    resolved: Any, batch: int, seq: int | None = None, dtype: str = "bf16", progress=None
) -> OpGraph:
    """Trace a zoo model (planner.models.ResolvedModel) for one micro-batch of `batch`."""
    from planner.models import torch_dtype

    seq = seq or resolved.default_seq
    model = resolved.with_seq(seq)
    tdtype = torch_dtype(dtype)
    period = model.family.layer_period
    layers = getattr(model.config, "layers", None)
    if period is None and model.family.name == "hf" and hf.uniform_layers(model.config):
        period = 1  # a transformers model whose layers are all alike
    if period and isinstance(layers, int) and layers > 3 * period + layers % period:
        # Trace two periods and copy the second (exact: tests/planner/test_expand.py).
        depth = 2 * period + layers % period
        if model.family.name == "hf":
            shallow = hf.with_layers(model.config, depth)
        else:
            shallow = dataclasses.replace(model.config, layers=depth)
        module = _traced_module(dataclasses.replace(model, config=shallow), tdtype)
        inputs = model.example_inputs(batch, seq, tdtype)
        with _own_forward_errors(model):
            graph = trace(module, inputs, name=model.name, seq=seq, strip_prefix="model.")
        try:
            return expand_layers(graph, layers, period)
        except NotRepeatingError:
            pass  # not a shape the expansion reproduces: trace every layer
    module = _traced_module(model, tdtype)
    inputs = model.example_inputs(batch, seq, tdtype)
    with _own_forward_errors(model):
        return trace(
            module, inputs, name=model.name, seq=seq, strip_prefix="model.", progress=progress
        )


@contextlib.contextmanager
def _own_forward_errors(model):
    """A transformers model whose own forward fails at the config's sizes (a head_dim that
    does not match hidden_size / heads, say) is the config's problem: name the field
    (and keep torch's fake-tensor logger from printing the failure first)."""
    fake_log = logging.getLogger("torch._subclasses.fake_tensor")
    level = fake_log.level
    if model.family.name == "hf":
        fake_log.setLevel(logging.CRITICAL)
    try:
        yield
    except RuntimeError as err:
        # a meta kernel's shape check raises RuntimeError itself; export's own limits
        # (data-dependent guards, unsupported ops) raise subclasses and stay what they are
        if model.family.name != "hf" or type(err) is not RuntimeError:
            raise
        kind = getattr(model.config, "model_type", "")
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise InputError(
            "model.hf_config",
            f"transformers' {kind} model fails its own forward with this config: {first}",
            "a config whose sizes agree (hidden_size, num_attention_heads, head_dim, ...)",
        ) from err
    finally:
        fake_log.setLevel(level)


def _traced_module(model, dtype: torch.dtype):
    """The training module to trace: transformers' models with the attention users train
    them with (planner.models.hf.price_as_flash)."""
    module = model.build(dtype)
    if model.family.name == "hf":
        hf.price_as_flash(module.model)
    return module
