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

import operator
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx
from torch.export import ExportedProgram
from torch.export.graph_signature import InputKind
from torch.utils._pytree import tree_flatten
from torch.utils.flop_counter import FlopCounterMode

from planner.graph.opgraph import OpEdge, OpGraph, OpGraphData, OpNode, TensorMeta

ATTENTION_OPS = {
    "scaled_dot_product_attention",
    "_scaled_dot_product_flash_attention",
    "_scaled_dot_product_efficient_attention",
    "_scaled_dot_product_flash_attention_for_cpu",
    "_scaled_dot_product_cudnn_attention",
}
KIND_BY_OP = {
    **{op: "attention" for op in ATTENTION_OPS},
    "linear": "linear",
    "embedding": "embedding",
    "layer_norm": "norm",
    "native_layer_norm": "norm",
    "rms_norm": "norm",
    "group_norm": "norm",
    "batch_norm": "norm",
    "_native_batch_norm_legit": "norm",
    "_native_batch_norm_legit_functional": "norm",
    "_native_batch_norm_legit_no_training": "norm",
    "native_batch_norm": "norm",
    "conv2d": "conv2d",
    "convolution": "conv2d",
    "max_pool2d": "pool",
    "max_pool2d_with_indices": "pool",
    "avg_pool2d": "pool",
    "adaptive_avg_pool2d": "pool",
    "mean": "reduction",
    "sum": "reduction",
    "amax": "reduction",
    "topk": "reduction",
    "cumsum": "reduction",
    "softmax": "softmax",
    "_softmax": "softmax",
    "log_softmax": "softmax",
    "_log_softmax": "softmax",
    "cross_entropy_loss": "loss",
    "nll_loss": "loss",
    "nll_loss_forward": "loss",
    "mse_loss": "loss",
    "einsum": "einsum",
    "bmm": "matmul",
    "matmul": "matmul",
    "mm": "matmul",
    "addmm": "matmul",
    "baddbmm": "matmul",
    "cat": "concat",
    "scatter": "scatter",
    "scatter_add": "scatter",
    "index_select": "scatter",
    "gather": "scatter",
    "zeros": "constant",
    "ones": "constant",
    "full": "constant",
    "arange": "constant",
    "empty": "constant",
    "zeros_like": "constant",
    "ones_like": "constant",
}
RESHAPE_OPS = {
    "view",
    "_unsafe_view",
    "reshape",
    "transpose",
    "permute",
    "flatten",
    "unflatten",
    "unsqueeze",
    "squeeze",
    "expand",
    "slice",
    "select",
    "t",
    "contiguous",
    "clone",
    "chunk",
    "split",
    "split_with_sizes",
    "alias",
    "detach",
    "repeat_interleave",
    "repeat",
    "narrow",
    "unbind",
    "broadcast_tensors",
    "expand_as",
}


def op_name(target: Any) -> str:
    """`aten.linear.default` -> 'linear'."""
    packet = getattr(target, "_opname", None) or getattr(target, "__name__", str(target))
    return str(packet).split(".")[0]


def classify(target: Any, has_params: bool) -> str:
    name = op_name(target)
    if name in KIND_BY_OP:
        kind = KIND_BY_OP[name]
        if kind == "matmul" and has_params:
            return "linear"
        return kind
    if name in RESHAPE_OPS:
        return "reshape"
    if isinstance(target, torch._ops.OpOverload) and torch.Tag.pointwise in target.tags:
        return "elementwise"
    if name in ("dropout", "native_dropout", "to", "_to_copy", "type_as", "where", "clamp"):
        return "elementwise"
    return "other"


def _meta(t: torch.Tensor) -> TensorMeta:
    return TensorMeta(shape=list(t.shape), dtype=str(t.dtype).removeprefix("torch."))


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


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


def _tensors(value: Any) -> list[torch.Tensor]:
    flat, _ = tree_flatten(value)
    return [t for t in flat if isinstance(t, torch.Tensor)]


def _returns_alias(target: Any) -> bool:
    """True for view ops (their schema marks the result as aliasing an input)."""
    schema = getattr(target, "_schema", None)
    if schema is None or not schema.returns:
        return False
    return all(r.alias_info is not None for r in schema.returns)


def _jsonable(value: Any) -> Any:
    """Op arguments as JSON: tensors become their producer's name, the rest plain values."""
    if isinstance(value, torch.fx.Node):
        return {"node": value.name}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return str(value)


def _mutates_buffer(n: torch.fx.Node, buffer_names: set[str]) -> bool:
    first = n.args[0] if n.args else None
    return (
        op_name(n.target).endswith("_")
        and isinstance(first, torch.fx.Node)
        and first.name in buffer_names
    )


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
    with FlopCounterMode(display=False) as flops:
        rec = _Recorder(gm, flops)
        with torch.autograd.graph.saved_tensors_hooks(rec.pack, lambda t: t):
            outputs = rec.run(*args)
        loss = _tensors(outputs)[0]
        bwd_flops = _backward_flops(gm, rec, loss, flops)

    say("assemble")
    exported = _Exported(
        gm=gm,
        ep=ep,
        placeholder_param=placeholder_param,
        user_inputs=user_inputs,
        param_ids=param_ids,
        example_inputs=tuple(example_inputs),
        blocks={strip(p): i for i, p in enumerate(find_blocks(module))},
        strip=strip,
    )
    return _assemble(exported, rec, bwd_flops, name, seq)


def _backward_flops(
    gm: torch.fx.GraphModule, rec: _Recorder, loss: torch.Tensor, flops: FlopCounterMode
) -> dict[str, int]:
    """Attribute backward FLOPs to forward nodes via pre-hooks on their autograd nodes."""
    owner: dict[Any, str] = {}
    for n in gm.graph.nodes:
        if n.op != "call_function" or n.target is operator.getitem:
            continue
        stack = [t.grad_fn for t in _tensors(rec.values.get(n.name)) if t.grad_fn is not None]
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


@dataclass(frozen=True)
class _Exported:
    """What `trace` learned from export, handed to `_assemble`."""

    gm: torch.fx.GraphModule
    ep: ExportedProgram
    placeholder_param: dict[str, str]  # placeholder name -> canonical parameter name
    user_inputs: list[str]
    param_ids: set[int]
    example_inputs: tuple
    blocks: dict[str, int]  # block module path -> layer index
    strip: Callable[[str], str]


def _assemble(
    x: _Exported, rec: _Recorder, bwd_flops: dict[str, int], name: str | None, seq: int | None
) -> OpGraph:
    gm, ep, placeholder_param, user_inputs = x.gm, x.ep, x.placeholder_param, x.user_inputs
    param_ids, blocks, strip, example_inputs = x.param_ids, x.blocks, x.strip, x.example_inputs
    # Where each tensor came from: id -> (node, output index); views resolve to their base.
    origin: dict[int, tuple[str, int]] = {}
    sizes: dict[tuple[str, int], int] = {}
    for n in gm.graph.nodes:
        if n.op == "placeholder" and n.name in placeholder_param:
            continue
        if n.op not in ("placeholder", "call_function") or n.target is operator.getitem:
            continue
        for i, t in enumerate(_tensors(rec.values.get(n.name))):
            base = t._base if t._base is not None else t
            root = origin.get(id(base), (n.name, i))
            origin.setdefault(id(t), root)
            sizes.setdefault(root, _nbytes(base))

    def root_of(t: torch.Tensor) -> tuple[str, int] | None:
        for cand in (t, t._base):
            if cand is not None and id(cand) in origin:
                return origin[id(cand)]
        return None

    def is_param(t: torch.Tensor) -> bool:
        return id(t) in param_ids or (t._base is not None and id(t._base) in param_ids)

    saved_by_node: dict[str, int] = {}
    counted_roots: set[tuple[str, int]] = set()
    counted_internal: set[int] = set()
    attention_nodes = {
        n.name
        for n in gm.graph.nodes
        if n.op == "call_function" and op_name(n.target) in ATTENTION_OPS
    }
    # Which values depend on the batch (flow from a user input): the rest (RoPE tables, say)
    # stays the same size whatever the batch, which rescaling to another batch must know.
    batch_dep: dict[str, bool] = {}
    for n in gm.graph.nodes:
        if n.op == "placeholder":
            batch_dep[n.name] = n.name in user_inputs
        else:
            args = tree_flatten((n.args, n.kwargs))[0]
            batch_dep[n.name] = any(
                batch_dep.get(a.name, False) for a in args if isinstance(a, torch.fx.Node)
            )
    fixed_by_node: dict[str, int] = {}
    for node_name, t in rec.saved:
        if node_name in attention_nodes or is_param(t):
            continue
        root = root_of(t)
        if root is not None:
            if root in counted_roots:
                continue
            counted_roots.add(root)
            size = sizes[root]
            fixed = not batch_dep.get(root[0], True)
        else:
            base = t._base if t._base is not None else t
            if id(base) in counted_internal:
                continue
            counted_internal.add(id(base))
            size = _nbytes(base)
            fixed = not batch_dep.get(node_name, True)
        saved_by_node[node_name] = saved_by_node.get(node_name, 0) + size
        if fixed:
            fixed_by_node[node_name] = fixed_by_node.get(node_name, 0) + size
    for n in gm.graph.nodes:
        if n.name not in attention_nodes:
            continue
        extra = 0
        for arg in n.args[:3]:
            root = root_of(rec.values[arg.name]) if isinstance(arg, torch.fx.Node) else None
            if root is not None and root not in counted_roots:
                counted_roots.add(root)
                extra += sizes[root]
        out = _tensors(rec.values[n.name])[0]
        extra += _nbytes(out) + out[..., 0].numel() * 4  # output + float32 logsumexp
        counted_roots.add(origin[id(out)])
        saved_by_node[n.name] = saved_by_node.get(n.name, 0) + extra

    buffer_names = {
        spec.arg.name
        for spec in ep.graph_signature.input_specs
        if spec.kind in (InputKind.BUFFER, InputKind.CONSTANT_TENSOR)
    }
    # Nodes, folding getitem into edges from the tuple-producing node.
    source_of: dict[str, tuple[str, int]] = {}
    nodes: list[OpNode] = []
    edges: list[OpEdge] = []
    owned_params: set[str] = set()
    for pos, pname in enumerate(user_inputs):
        t = example_inputs[pos]
        nodes.append(
            OpNode(
                name=pname, op="input", kind="input", outputs=[_meta(t)], bytes_written=_nbytes(t)
            )
        )
        source_of[pname] = (pname, 0)
    for n in gm.graph.nodes:
        if n.op != "call_function":
            continue
        if _mutates_buffer(n, buffer_names):
            continue  # e.g. BatchNorm's num_batches_tracked += 1: not part of the step's math
        if n.target is operator.getitem:
            src, _ = source_of.get(n.args[0].name, (n.args[0].name, 0))
            source_of[n.name] = (src, int(n.args[1]))
            continue
        out_tensors = _tensors(rec.values.get(n.name))
        if not out_tensors:
            continue
        source_of[n.name] = (n.name, 0)
        stack = n.meta.get("nn_module_stack") or {}
        paths = [(strip(p), getattr(t, "__name__", str(t))) for p, t in stack.values()]
        module_path, module_type = paths[-1] if paths else ("", "")
        layer = next((blocks[p] for p, _ in reversed(paths) if p in blocks), None)
        arg_nodes = [a for a in tree_flatten((n.args, n.kwargs))[0] if isinstance(a, torch.fx.Node)]
        params: dict[str, TensorMeta] = {}
        shared: list[str] = []
        inputs: list[TensorMeta] = []
        read = 0
        operands: list[list[Any]] = []  # tensor arguments in call order
        for a in arg_nodes:
            if a.name in placeholder_param:
                pname = placeholder_param[a.name]
                operands.append(["param", pname])
                t = rec.values[a.name]
                params[pname] = _meta(t)
                read += _nbytes(t)
                if pname in owned_params:
                    shared.append(pname)
                owned_params.add(pname)
                continue
            if a.name not in source_of:
                operands.append(["buffer", a.name])  # buffers and constants: not activations
                continue
            val = rec.values[a.name]
            ts = _tensors(val)
            if not ts:
                continue
            operands.append(["input", len(inputs)])
            t = ts[0]
            src, idx = source_of[a.name]
            edges.append(
                OpEdge(
                    src=src,
                    dst=n.name,
                    src_output=idx,
                    dst_input=len(inputs),
                    shape=list(t.shape),
                    dtype=str(t.dtype).removeprefix("torch."),
                    bytes=_nbytes(t),
                )
            )
            inputs.append(_meta(t))
            read += _nbytes(t)
        is_view = _returns_alias(n.target)
        written = 0 if is_view else sum(_nbytes(t) for t in out_tensors)
        kind = classify(n.target, bool(params))
        attrs: dict[str, Any] = {"args": [_jsonable(a) for a in n.args], "operands": operands}
        attrs.update({k: _jsonable(v) for k, v in n.kwargs.items()})
        if kind == "einsum" and n.args and isinstance(n.args[0], str):
            attrs["equation"] = n.args[0]
        nodes.append(
            OpNode(
                name=n.name,
                op=str(n.target),
                kind=kind,
                module=module_path,
                module_type=module_type,
                layer=layer,
                inputs=inputs,
                outputs=[_meta(t) for t in out_tensors],
                params=params,
                shared_params=shared,
                attrs=attrs,
                fwd_flops=int(rec.fwd_flops.get(n.name, 0)),
                bwd_flops=int(bwd_flops.get(n.name, 0)),
                bytes_read=0 if is_view else read,
                bytes_written=written,
                param_bytes=sum(m.nbytes for k, m in params.items() if k not in shared),
                saved_bytes=saved_by_node.get(n.name, 0),
                saved_fixed_bytes=fixed_by_node.get(n.name, 0),
                batch_invariant=not batch_dep.get(n.name, True),
                is_view=is_view,
            )
        )
    out_node = next(n for n in gm.graph.nodes if n.op == "output")
    user_out = [a for a in tree_flatten(out_node.args)[0] if isinstance(a, torch.fx.Node)]
    outputs = [source_of[a.name][0] for a in user_out[:1] if a.name in source_of]
    first = example_inputs[0]
    dtype_of = next((p.dtype for p in ep.state_dict.values() if p.is_floating_point()), first.dtype)
    data = OpGraphData(
        model=name,
        batch=int(first.shape[0]) if first.dim() else 1,
        seq=int(seq if seq is not None else (first.shape[1] if first.dim() > 1 else 1)),
        dtype=str(dtype_of).removeprefix("torch."),
        nodes=nodes,
        edges=edges,
        outputs=outputs,
    )
    return OpGraph(data)


def trace_model(
    resolved: Any, batch: int, seq: int | None = None, dtype: str = "bf16", progress=None
) -> OpGraph:
    """Trace a zoo model (planner.models.ResolvedModel) for one micro-batch of `batch`."""
    from planner.models import torch_dtype

    seq = seq or resolved.default_seq
    model = resolved.with_seq(seq)
    tdtype = torch_dtype(dtype)
    module = model.build(tdtype)
    inputs = model.example_inputs(batch, seq, tdtype)
    return trace(module, inputs, name=model.name, seq=seq, strip_prefix="model.", progress=progress)
