"""Measure on a lent GPU what the cost model's GPU terms rest on; writes one JSON file.

Run where a CUDA device is (the device tool's machine; see bench/README.md for the command):

    python bench/gpu_measure.py --out gpu.json [--graphs DIR]

What it times, each as the median of CUDA-event timings after warm-ups, on random data:
- `gemm`: `F.linear(x[m,k], w[n,k])` in bf16 over a grid of m, k, n (powers of two), and the
  same GEMM in fp8 (e4m3) through `torch._scaled_mm` with tensorwise and rowwise scales;
- `gemm_pipelined`: the same bf16 and tensorwise fp8 grid with GEMMs under 1 ms timed back to
  back (no launch latency), as the h200 profile's table;
- `attention`: `scaled_dot_product_attention` (causal, head dim 128) forward, and forward plus
  backward, over batch x heads and sequence lengths;
- `memory`: element-wise ops (add, mul, silu) and rms_norm forward+backward, bytes per second;
- `layers`: autopar's own Llama block (planner.models.llama, what the executor runs) at the
  8B, 70B and 405B widths: one layer's forward+backward time and activation memory, as the
  difference between a 2-layer and a 1-layer model (embedding and head cancel);
- `tp_layers`: the same block with one tensor-parallel rank's widths (tp 2-8), no communication;
- `ckpt_layers`: some of those under the executor's full and selective checkpointing;
- `fp8_linear`: torchao's Float8Linear (tensorwise, rowwise) against nn.Linear, with casts;
- `fp8_compiled`: the same under torch.compile at a few Llama shapes;
- `layer_gemms`: each linear layer of a tensor-parallel rank's block at its own (non-grid)
  shape: forward, input- and weight-gradient GEMMs and autograd's forward + backward, back
  to back and alone (issue 38's small and thin GEMMs);
- `long_attention`: causal attention from 8K to 128K tokens (beyond the grid's 32K);
- `fp8_layer`: one Llama-3-70B tp4 rank's block in bf16 and torchao float8, eager and compiled;
- `saved`: what rms_norm, causal attention and silu keep for backward on the device;
- `op_times` (with --graphs): every distinct operator of the traced OpGraph JSON files in DIR,
  timed as `autopar profile-ops` does (planner.cluster.profiling.profile_nodes).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

DIMS = [256, 512, 1024, 2048, 4096, 8192, 16384, 32768]
MAX_GEMM_FLOPS = 2 * 2**43  # the largest grid points, ~25 ms each on an H100
ATTN_BH = [(1, 4), (1, 8), (1, 16), (1, 32), (2, 32), (1, 64), (1, 128)]
ATTN_SEQ = [1024, 2048, 4096, 8192, 16384, 32768]
LAYER_SHAPES = {  # name: (hidden, heads, kv_heads, ffn, batch, seq)
    "llama3-8b": (4096, 32, 8, 14336, 2, 8192),
    "llama3-8b-b1": (4096, 32, 8, 14336, 1, 8192),
    "llama3-70b": (8192, 64, 8, 28672, 1, 8192),
    "llama3-405b": (16384, 128, 8, 53248, 1, 8192),
}


def event_time(fn, warmup: int = 3, repeats: int = 10) -> float:
    """Median seconds of `fn` by CUDA events."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    samples = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) / 1e3)
    return statistics.median(samples)


def gemm_grid(say, pipelined: bool = False) -> list[dict]:
    """`pipelined`: a GEMM under 1 ms is timed back to back (pipelined_time), without the
    ~10-15 us of launch latency a lone call between two events adds (on the H200, 2026-11-27:
    the 0.3 ms-and-under GEMMs of tensor-parallel layers took 20-60% less so, which is what a
    training step whose CPU runs ahead sees; bench/results/h200_checks.md); the lone time is
    kept as `*_alone`. Rowwise fp8 is left out then (the profiles use tensorwise)."""
    rows = []
    e4m3 = torch.float8_e4m3fn

    def timed(row, name, fn):
        alone = event_time(fn, 2, 5) if pipelined else event_time(fn)
        row[name] = pipelined_time(fn) if pipelined and alone < 1e-3 else alone
        if pipelined:
            row[f"{name}_alone"] = alone

    for m in DIMS:
        for k in DIMS:
            for n in DIMS:
                flops = 2 * m * k * n
                if flops > MAX_GEMM_FLOPS:
                    continue
                x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
                w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
                row = {"m": m, "k": k, "n": n}
                timed(row, "bf16", lambda x=x, w=w: F.linear(x, w))
                xf, wf = x.to(e4m3), w.to(e4m3)
                one = torch.ones((), device="cuda")
                timed(
                    row,
                    "fp8_tensorwise",
                    lambda a=xf, b=wf, s=one: torch._scaled_mm(
                        a, b.t(), s, s, out_dtype=torch.bfloat16
                    ),
                )
                if pipelined:
                    rows.append(row)
                    continue
                sa = torch.ones(m, 1, device="cuda")
                sb = torch.ones(1, n, device="cuda")
                try:
                    row["fp8_rowwise"] = event_time(
                        lambda a=xf, b=wf, sa=sa, sb=sb: torch._scaled_mm(
                            a, b.t(), sa, sb, out_dtype=torch.bfloat16
                        )
                    )
                except RuntimeError as err:
                    row["fp8_rowwise_error"] = str(err).splitlines()[0][:200]
                rows.append(row)
        say(f"gemm m={m}: {len(rows)} shapes")
    return rows


def attention_grid(say) -> list[dict]:
    rows = []
    for b, h in ATTN_BH:
        for s in ATTN_SEQ:
            if b * h * s > 2**22:  # ~40 ms forward+backward at the largest
                continue
            q, k, v = (
                torch.randn(b, h, s, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
                for _ in range(3)
            )
            fwd, total = _attention_times(q, k, v)
            rows.append(
                {"batch": b, "heads": h, "seq": s, "head_dim": 128, "fwd": fwd, "fwd_bwd": total}
            )
        say(f"attention b={b} h={h}")
    return rows


def _attention_times(q, k, v, warmup: int = 3, repeats: int = 10) -> tuple[float, float]:
    fwd = event_time(
        lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True), warmup, repeats
    )
    grad = torch.randn_like(q)

    def both():
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        torch.autograd.grad(o, (q, k, v), grad)

    return fwd, event_time(both, warmup, repeats)


def memory_ops(say) -> list[dict]:
    rows = []
    for log2 in (20, 22, 24, 26, 28):
        for row in _memory_cases(2**log2):
            rows.append(row)
        say(f"memory 2^{log2}")
    return rows


def _memory_cases(n: int) -> list[dict]:
    rows = []
    x = torch.randn(n // 4096, 4096, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    y = torch.randn_like(x)
    wn = torch.ones(4096, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    g = torch.randn_like(x)
    cases = {
        "add": (lambda: x + y, 3 * 2 * n),
        "mul": (lambda: x * y, 3 * 2 * n),
        "silu": (lambda: F.silu(x), 2 * 2 * n),
        "copy": (lambda: x.clone(), 2 * 2 * n),
        "rms_norm_fwd": (lambda: F.rms_norm(x, (4096,), wn, 1e-5), 2 * 2 * n),
        "rms_norm_fwd_bwd": (
            lambda: torch.autograd.grad(F.rms_norm(x, (4096,), wn, 1e-5), (x, wn), g),
            7 * 2 * n,
        ),
    }
    for name, (fn, nbytes) in cases.items():
        seconds = event_time(fn)
        rows.append(
            {"op": name, "elements": n, "seconds": seconds, "bytes_per_s": nbytes / seconds}
        )
    return rows


def _config(hidden, heads, kv, ffn, layers, seq):
    from planner.models.llama import LlamaConfig

    return LlamaConfig(
        hidden=hidden,
        layers=layers,
        heads=heads,
        kv_heads=kv,
        ffn_hidden=ffn,
        vocab=4096,
        seq_len=seq,
        rope_theta=500000.0,
    )


@contextlib.contextmanager
def _bf16_on_gpu():
    """Modules built inside are created in bf16 directly on the GPU (no CPU init)."""
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device("cuda"):
            yield
    finally:
        torch.set_default_dtype(torch.float32)


def _llama(hidden, heads, kv, ffn, layers, seq):
    from planner.models.llama import Llama

    with _bf16_on_gpu():
        return Llama(_config(hidden, heads, kv, ffn, layers, seq))


def layer_times(say) -> list[dict]:
    rows = []
    for name, (hidden, heads, kv, ffn, batch, seq) in LAYER_SHAPES.items():
        found = {}
        for layers in (1, 2):
            model = _llama(hidden, heads, kv, ffn, layers, seq)
            tokens = torch.randint(0, 4096, (batch, seq), device="cuda")

            def step(model=model, tokens=tokens):
                logits = model(tokens)
                F.cross_entropy(logits.flatten(0, 1).float(), tokens.flatten()).backward()

            step()
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
            logits = model(tokens)
            after_fwd = torch.cuda.memory_allocated() - base
            del logits
            model.zero_grad(set_to_none=True)
            seconds = event_time(step, warmup=2, repeats=5)
            found[layers] = (seconds, after_fwd)
            del model
            torch.cuda.empty_cache()
        rows.append(
            {
                "model": name,
                "hidden": hidden,
                "heads": heads,
                "kv_heads": kv,
                "ffn": ffn,
                "batch": batch,
                "seq": seq,
                "layer_fwd_bwd_s": found[2][0] - found[1][0],
                "layer_activation_bytes": found[2][1] - found[1][1],
                "one_layer_model_s": found[1][0],
            }
        )
        say(
            f"layer {name}: {rows[-1]['layer_fwd_bwd_s'] * 1e3:.2f} ms, "
            f"{rows[-1]['layer_activation_bytes'] / 2**30:.2f} GiB"
        )
    return rows


TP_SHAPES = [  # (name, tp): one rank's share of a Megatron tensor-parallel layer
    ("llama3-8b", 2),
    ("llama3-8b", 4),
    ("llama3-8b", 8),
    ("llama3-70b", 4),
    ("llama3-70b", 8),
    ("llama3-405b", 8),
]


def _tp_block(hidden, heads, kv, ffn, tp, seq):
    """autopar's Llama block with the widths one tensor-parallel rank holds: column-parallel
    q/k/v and w1/w3 (outputs / tp), row-parallel o and w2 (inputs / tp), as torch's TP styles
    leave the module's local computation (communication not included)."""
    from torch import nn

    from planner.models.llama import LlamaBlock

    cfg = _config(hidden, heads, kv, ffn, 1, seq)
    with _bf16_on_gpu():
        block = LlamaBlock(cfg)
        att, mlp, hd = block.attention, block.feed_forward, cfg.head_dim
        att.q_proj = nn.Linear(hidden, hidden // tp, bias=False)
        att.k_proj = nn.Linear(hidden, kv * hd // tp, bias=False)
        att.v_proj = nn.Linear(hidden, kv * hd // tp, bias=False)
        att.o_proj = nn.Linear(hidden // tp, hidden, bias=False)
        mlp.w1 = nn.Linear(hidden, ffn // tp, bias=False)
        mlp.w3 = nn.Linear(hidden, ffn // tp, bias=False)
        mlp.w2 = nn.Linear(ffn // tp, hidden, bias=False)
        return block


CKPT_SHAPES = [("llama3-8b", 1), ("llama3-8b", 8), ("llama3-70b", 8), ("llama3-405b", 8)]


def ckpt_layer_times(say) -> list[dict]:
    """tp_layer_times under the executor's activation checkpointing (full and selective)."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    from executor.checkpointing import checkpoint_kwargs

    rows = []
    for policy in ("full", "selective"):
        for row in tp_layer_times(
            say, CKPT_SHAPES, lambda b, p=policy: checkpoint_wrapper(b, **checkpoint_kwargs(p))
        ):
            rows.append({**row, "policy": policy})
    return rows


def tp_layer_times(say, shapes=None, wrap=None) -> list[dict]:
    rows = []
    for name, tp in shapes or TP_SHAPES:
        hidden, heads, kv, ffn, batch, seq = LAYER_SHAPES[name]
        block = _tp_block(hidden, heads, kv, ffn, tp, seq)
        block = wrap(block) if wrap else block
        x = torch.randn(batch, seq, hidden, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        grad = torch.randn_like(x)

        def step(block=block, x=x, grad=grad):
            torch.autograd.grad(block(x), [x, *block.parameters()], grad)

        step()
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        y = block(x)
        saved = torch.cuda.memory_allocated() - base  # the output is the next layer's input
        del y
        rows.append(
            {
                "model": name,
                "tp": tp,
                "batch": batch,
                "seq": seq,
                "layer_fwd_bwd_s": event_time(step, warmup=2, repeats=10),
                "layer_activation_bytes": saved,
            }
        )
        say(
            f"tp layer {name} tp{tp}: {rows[-1]['layer_fwd_bwd_s'] * 1e3:.2f} ms, "
            f"{saved / 2**30:.2f} GiB"
        )
        del block, x, grad
        torch.cuda.empty_cache()
    return rows


FP8_DIMS = [1024, 4096, 8192, 16384]


def fp8_linear_times(say) -> list[dict]:
    """torchao Float8Linear (tensorwise, rowwise) against nn.Linear, forward and
    forward+backward under bf16 autocast with fp32 weights (as the executor trains), casts
    included; and the bytes each keeps for backward."""
    from executor.fp8 import FP8_RECIPES, apply_fp8

    rows = []
    device = torch.device("cuda")
    for m in (2048, 8192, 16384):
        for k in FP8_DIMS:
            for n in FP8_DIMS:
                row = {"m": m, "k": k, "n": n}
                for recipe in ("bf16", *FP8_RECIPES):
                    layer = torch.nn.Sequential(torch.nn.Linear(k, n, bias=False)).to(device)
                    if recipe != "bf16":
                        apply_fp8(layer, recipe, device)
                    row[recipe] = _linear_times(layer, m, k)
                rows.append(row)
        say(f"fp8 linear m={m}")
    return rows


COMPILED_SHAPES = [
    (8192, 4096, 4096),
    (8192, 4096, 14336),
    (8192, 14336, 4096),
    (8192, 8192, 8192),
    (16384, 8192, 28672),
    (16384, 16384, 16384),
]


def fp8_compiled_times(say) -> list[dict]:
    """fp8_linear_times with the layer under torch.compile (how torchao means float8
    training to run: the amax, scale and cast ops fused into few kernels)."""
    from executor.fp8 import FP8_RECIPES, apply_fp8

    rows = []
    device = torch.device("cuda")
    for m, k, n in COMPILED_SHAPES:
        row = {"m": m, "k": k, "n": n}
        for recipe in ("bf16", *FP8_RECIPES):
            torch._dynamo.reset()
            layer = torch.nn.Sequential(torch.nn.Linear(k, n, bias=False)).to(device)
            if recipe != "bf16":
                apply_fp8(layer, recipe, device)
            row[recipe] = _linear_times(torch.compile(layer), m, k)
        rows.append(row)
        say(
            f"fp8 compiled {m}x{k}x{n}: "
            + ", ".join(f"{r} {row[r]['fwd_bwd'] * 1e3:.2f} ms" for r in ("bf16", *FP8_RECIPES))
        )
    return rows


def _linear_times(layer, m: int, k: int) -> dict:
    x = torch.randn(m, k, device="cuda", requires_grad=True)

    def fwd():
        with torch.autocast("cuda", dtype=torch.bfloat16):
            return layer(x)

    out = fwd()
    grad = torch.randn_like(out)

    def both():
        torch.autograd.grad(fwd(), [x, *layer.parameters()], grad)

    kept = []
    with torch.autograd.graph.saved_tensors_hooks(
        lambda t: (kept.append(t.numel() * t.element_size()), t)[1], lambda t: t
    ):
        fwd()
    return {"fwd": event_time(fwd), "fwd_bwd": event_time(both), "saved_bytes": sum(kept)}


SHAPE_MODELS = {  # name: (hidden, heads, kv_heads, ffn)
    "llama3.2-1b": (2048, 32, 8, 8192),
    "llama3-8b": (4096, 32, 8, 14336),
    "llama3-70b": (8192, 64, 8, 28672),
}
SHAPE_CASES = [  # (model, tp, tokens per micro-batch): issue 38's small and thin GEMMs
    ("llama3.2-1b", 1, 4096),
    ("llama3.2-1b", 2, 4096),
    ("llama3-8b", 1, 4096),
    ("llama3-8b", 2, 8192),
    ("llama3-70b", 4, 8192),
    ("llama3-70b", 8, 8192),
]
LONG_ATTENTION = [(1, 8), (1, 16)]  # batch x heads: 70B at tp 8 and tp 4
LONG_SEQ = [8192, 16384, 32768, 65536, 131072]


def pipelined_time(fn, inner: int = 20, repeats: int = 7) -> float:
    """Median seconds of one `fn` when `inner` run back to back between two CUDA events: the
    CPU enqueues ahead of the GPU, as in a training step, so a small kernel's launch latency
    is not counted (unless the CPU cannot keep up, which is then what it costs)."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    samples = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(inner):
            fn()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) / 1e3 / inner)
    return statistics.median(samples)


def layer_gemms(say) -> list[dict]:
    """Each linear layer of a tensor-parallel rank's Llama block at its own shape (not on the
    powers-of-two grid), bf16, each timed back to back (pipelined_time): the forward GEMM,
    the input-gradient and weight-gradient GEMMs as autograd issues them (`mm` of the output
    gradient with the weight, of its transpose with the input), and nn.Linear's forward +
    backward through autograd; also each timed alone between two events (`*_alone`: launch
    latency included), what planner.cost.shape_rates prices from the grid."""
    rows = []
    for name, tp, tokens in SHAPE_CASES:
        hidden, heads, kv, ffn = SHAPE_MODELS[name]
        hd = hidden // heads
        linears = {
            "q": (hidden, hidden // tp),
            "kv": (hidden, kv * hd // tp),
            "o": (hidden // tp, hidden),
            "w1": (hidden, ffn // tp),
            "w2": (ffn // tp, hidden),
        }
        for layer, (k, n) in linears.items():
            x = torch.randn(tokens, k, device="cuda", dtype=torch.bfloat16, requires_grad=True)
            w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16, requires_grad=True)
            grad = torch.randn(tokens, n, device="cuda", dtype=torch.bfloat16)
            cases = {
                "fwd": lambda x=x, w=w: F.linear(x, w),
                "dgrad": lambda g=grad, w=w: torch.mm(g, w.detach()),
                "wgrad": lambda g=grad, x=x: torch.mm(g.t(), x.detach()),
                "fwd_bwd": lambda x=x, w=w, g=grad: torch.autograd.grad(F.linear(x, w), (x, w), g),
            }
            row = {"model": name, "tp": tp, "layer": layer, "m": tokens, "k": k, "n": n}
            for case, fn in cases.items():
                row[case] = pipelined_time(fn)
                row[f"{case}_alone"] = event_time(fn)
            rows.append(row)
        say(f"gemms {name} tp{tp} m={tokens}")
    return rows


def long_attention(say) -> list[dict]:
    """Causal attention beyond the table's 32K (issue 38: 128K+ was under-predicted)."""
    rows = []
    for b, h in LONG_ATTENTION:
        for s in LONG_SEQ:
            q, k, v = (
                torch.randn(b, h, s, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
                for _ in range(3)
            )
            fwd, total = _attention_times(q, k, v, 1, 3)
            rows.append(
                {
                    "batch": b,
                    "heads": h,
                    "seq": s,
                    "head_dim": 128,
                    "fwd": fwd,
                    "fwd_bwd": total,
                }
            )
            del q, k, v
        say(f"long attention b={b} h={h}")
    return rows


FP8_LAYER = ("llama3-70b", 4)  # one rank's block of a Llama-3-70B tp4 run


def fp8_layer_times(say) -> list[dict]:
    """One tensor-parallel rank's Llama-3-70B block (tp 4, 8192 tokens) as the executor
    trains it (fp32 weights, bf16 autocast) in bf16 and under torchao float8 (tensorwise,
    rowwise), eager and under torch.compile: forward + backward time and the bytes kept."""
    from executor.fp8 import FP8_RECIPES, apply_fp8

    name, tp = FP8_LAYER
    hidden, heads, kv, ffn, batch, seq = LAYER_SHAPES[name]
    device = torch.device("cuda")
    rows = []
    for compiled in (False, True):
        for recipe in ("bf16", *FP8_RECIPES):
            torch._dynamo.reset()
            block = _tp_block(hidden, heads, kv, ffn, tp, seq).float()
            if recipe != "bf16":
                apply_fp8(block, recipe, device)
            run = torch.compile(block) if compiled else block
            x = torch.randn(batch, seq, hidden, device="cuda", requires_grad=True)

            def fwd(run=run, x=x):
                with torch.autocast("cuda", dtype=torch.bfloat16):
                    return run(x)

            grad = torch.randn_like(fwd())

            def both(fwd=fwd, block=block, x=x, grad=grad):
                torch.autograd.grad(fwd(), [x, *block.parameters()], grad)

            both()
            kept: list[int] = []
            with torch.autograd.graph.saved_tensors_hooks(
                lambda t, kept=kept: (kept.append(t.numel() * t.element_size()), t)[1],
                lambda t: t,
            ):
                fwd()
            rows.append(
                {
                    "model": name,
                    "tp": tp,
                    "tokens": batch * seq,
                    "recipe": recipe,
                    "compiled": compiled,
                    "fwd": event_time(fwd, 2, 10),
                    "fwd_bwd": event_time(both, 2, 10),
                    "saved_bytes": sum(kept),
                }
            )
            say(
                f"fp8 layer {recipe} {'compiled' if compiled else 'eager'}: "
                f"{rows[-1]['fwd_bwd'] * 1e3:.2f} ms"
            )
            del block, run, x, grad
            torch.cuda.empty_cache()
    return rows


def saved_tensors(say) -> dict:
    """What rms_norm and attention keep for backward on this device (shapes, dtypes)."""
    out = {}
    x = torch.randn(2, 1024, 4096, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w = torch.ones(4096, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    q = torch.randn(1, 8, 1024, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    cases = {
        "rms_norm": lambda: F.rms_norm(x, (4096,), w, 1e-5),
        "sdpa_causal": lambda: F.scaled_dot_product_attention(q, q * 1, q * 1, is_causal=True),
        "silu": lambda: F.silu(x),
    }
    for name, fn in cases.items():
        seen = []

        def pack(t, seen=seen):
            seen.append({"shape": list(t.shape), "dtype": str(t.dtype)})
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            y = fn()
        out[name] = {"saved": seen, "grad_fn": type(y.grad_fn).__name__}
        say(f"saved {name}: {out[name]}")
    return out


def op_times(graph_dir: Path, say) -> dict:
    from planner.cluster.profiling import distinct_ops, profile_nodes
    from planner.graph.opgraph import OpGraph

    out = {}
    for path in sorted(graph_dir.glob("*.json")):
        graph = OpGraph.from_json(path.read_text())
        nodes = distinct_ops([graph])
        out[path.stem] = profile_nodes(nodes, "cuda", repeats=10)
        say(f"op_times {path.stem}: {len(out[path.stem])} of {len(nodes)} operators")
    return out


def _smi() -> str:
    try:
        return subprocess.run(
            [
                "nvidia-smi",
                "--query-gpu=name,power.limit,clocks.max.sm,clocks.max.mem,driver_version",
                "--format=csv",
            ],
            capture_output=True,
            text=True,
            timeout=30,
        ).stdout
    except (OSError, subprocess.SubprocessError) as err:
        return str(err)


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--graphs", type=Path)
    p.add_argument("--parts", default="gemm,attention,memory,layers,tp_layers,saved,op_times")
    args = p.parse_args()

    def say(line: str) -> None:
        print(f"[{time.strftime('%H:%M:%S')}] {line}", flush=True)

    result: dict = {
        "when": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
        "torch": torch.__version__,
        "device": torch.cuda.get_device_name(),
        "sms": torch.cuda.get_device_properties(0).multi_processor_count,
        "nvidia_smi": _smi(),
    }
    parts = {
        "gemm": gemm_grid,
        "gemm_pipelined": lambda say: gemm_grid(say, pipelined=True),
        "attention": attention_grid,
        "memory": memory_ops,
        "layers": layer_times,
        "tp_layers": tp_layer_times,
        "ckpt_layers": ckpt_layer_times,
        "fp8_linear": fp8_linear_times,
        "fp8_compiled": fp8_compiled_times,
        "saved": saved_tensors,
        "layer_gemms": layer_gemms,
        "long_attention": long_attention,
        "fp8_layer": fp8_layer_times,
    }
    for name in args.parts.split(","):
        try:
            if name == "op_times":
                if args.graphs:
                    result[name] = op_times(args.graphs, say)
            else:
                result[name] = parts[name](say)
        except Exception as err:  # keep what the other parts measured
            result[f"{name}_error"] = f"{type(err).__name__}: {err}"
            say(f"{name} failed: {err}")
        Path(args.out).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
