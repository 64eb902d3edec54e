"""torchrun worker of `autopar profile-cluster`: times collectives on every mesh-axis grouping
(within a node, across nodes), matmuls and attention at representative shapes, and a large
copy for memory bandwidth; rank 0 writes the raw timings as JSON.

Groups: for each power-of-two size g (and the whole node / world), the first g ranks of node 0
(tier intra_node) and, with several nodes, one rank per node (tier inter_node) plus the whole
world. Each point is the median over repeats of the slowest member's time. Collectives that a
backend lacks (gloo: all-to-all, reduce-scatter) are reported as skipped, not faked.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import socket
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

CPU_SIZES = [2**k for k in range(12, 25, 2)]  # 4 KiB .. 16 MiB
GPU_SIZES = [2**k for k in range(12, 31, 2)]  # 4 KiB .. 1 GiB
CPU_MATMULS = [(256, 256, 256), (512, 512, 512), (1024, 1024, 1024)]
GPU_MATMULS = [(1024, 1024, 1024), (4096, 4096, 4096), (8192, 8192, 8192), (8192, 2048, 8192)]
COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "send_recv")
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _groups(world: int, per_node: int, nnodes: int) -> list[tuple[str, list[int]]]:
    out: list[tuple[str, list[int]]] = []
    sizes = sorted({2**k for k in range(1, per_node.bit_length()) if 2**k <= per_node} | {per_node})
    for g in sizes:
        if g >= 2:
            out.append(("intra_node", list(range(g))))
    if nnodes > 1:
        for g in sorted({2**k for k in range(1, nnodes.bit_length())} | {nnodes}):
            if g >= 2:
                out.append(("inter_node", [n * per_node for n in range(g)]))
        out.append(("inter_node", list(range(world))))
    return out


def _time_op(fn, device: torch.device, group, repeats: int) -> float:
    """Median over repeats of the slowest member's wall time."""
    for _ in range(2):
        fn()
    _sync(device)
    samples = []
    for _ in range(repeats):
        dist.barrier(group=group)
        _sync(device)
        t = time.perf_counter()
        fn()
        _sync(device)
        elapsed = torch.tensor([time.perf_counter() - t], dtype=torch.float64)
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX, group=group)
        samples.append(float(elapsed))
    return statistics.median(samples)


def _collective_fn(name: str, nbytes: int, members: list[int], rank: int, device, group):
    n = len(members)
    elems = max(nbytes // 4, n)
    elems -= elems % n
    x = torch.ones(elems, device=device)
    if name == "all_reduce":
        return lambda: dist.all_reduce(x, group=group)
    if name == "all_gather":
        out = torch.empty(elems, device=device)
        chunk = x[: elems // n].clone()
        return lambda: dist.all_gather_single(out, chunk, group=group)  # torch 2.13 name
    if name == "reduce_scatter":
        out = torch.empty(elems // n, device=device)
        return lambda: dist.reduce_scatter_tensor(out, x, group=group)
    if name == "all_to_all":
        out = torch.empty_like(x)
        return lambda: dist.all_to_all_single(out, x, group=group)
    if name == "send_recv":
        a, b = members[0], members[1]

        def ping() -> None:
            if rank == a:
                dist.send(x, b)
                dist.recv(x, b)
            elif rank == b:
                dist.recv(x, a)
                dist.send(x, a)

        return ping
    raise ValueError(name)


def measure_collectives(args, rank: int, world: int, device, say) -> list[dict]:
    per_node = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    nnodes = max(world // per_node, 1)
    sizes = GPU_SIZES if device.type == "cuda" else CPU_SIZES
    if args.max_bytes:
        sizes = [s for s in sizes if s <= args.max_bytes] or sizes[:1]
    rows = []
    plan = _groups(world, per_node, nnodes)
    total = len(plan) * len(args.collectives) * len(sizes)
    done = 0
    for tier, members in plan:
        group = dist.new_group(members)  # every rank takes part in creating every group
        for name in args.collectives:
            if name == "send_recv" and len(members) != 2:
                done += len(sizes)
                continue
            for nbytes in sizes:
                done += 1
                if rank not in members:
                    continue
                try:
                    fn = _collective_fn(name, nbytes, members, rank, device, group)
                    seconds = _time_op(fn, device, group, args.repeats)
                except (RuntimeError, ValueError) as err:  # the backend lacks it
                    say(f"[{done}/{total}] {name}: skipped ({str(err).splitlines()[0][:80]})")
                    done += len(sizes) - sizes.index(nbytes) - 1
                    break
                seconds = seconds / 2 if name == "send_recv" else seconds  # one way
                row = {
                    "tier": tier,
                    "collective": name,
                    "group_size": len(members),
                    "bytes": nbytes,
                    "seconds": seconds,
                }
                rows.append(row)
                say(
                    f"[{done}/{total}] {tier} {name} x{len(members)} {nbytes / 2**20:.3g} MiB: "
                    f"{seconds * 1e3:.3f} ms"
                )
        dist.barrier()
    return rows


def measure_compute(args, device) -> dict:
    """Run on every rank at once (as in training, ranks share a CPU's cores)."""
    shapes = GPU_MATMULS if device.type == "cuda" else CPU_MATMULS
    matmuls = []
    for dtype_name in args.dtypes:
        dtype = DTYPES[dtype_name]
        for m, k, n in shapes:
            a = torch.randn(m, k, device=device, dtype=dtype)
            b = torch.randn(k, n, device=device, dtype=dtype)
            seconds = _median_time(lambda a=a, b=b: a @ b, device, args.repeats)
            matmuls.append(
                {"dtype": dtype_name, "shape": [m, k, n], "flops_per_s": 2 * m * k * n / seconds}
            )
    attention = []
    b, h, s, d = (4, 32, 2048, 128) if device.type == "cuda" else (1, 8, 256, 64)
    for dtype_name in args.dtypes:
        q = torch.randn(b, h, s, d, device=device, dtype=DTYPES[dtype_name])
        seconds = _median_time(
            lambda q=q: F.scaled_dot_product_attention(q, q, q, is_causal=True),
            device,
            args.repeats,
        )
        attention.append({"dtype": dtype_name, "flops_per_s": 2 * b * h * s * s * d / seconds})
    big = torch.empty((1 << 28) if device.type == "cuda" else (1 << 24), device=device)
    dst = torch.empty_like(big)
    seconds = _median_time(lambda: dst.copy_(big), device, args.repeats)
    return {
        "matmuls": matmuls,
        "attention": attention,
        "memory_bandwidth": 2 * big.numel() * big.element_size() / seconds,
    }


def measure_overlap(device, repeats: int) -> float:
    """Share of an all-reduce hidden when it runs (async) under matmuls of about the same
    duration: (t_comm + t_compute - t_both) / min(t_comm, t_compute), clamped to [0, 1]."""
    x = torch.ones((1 << 26) if device.type == "cuda" else (1 << 22), device=device)
    a = torch.randn(1024, 1024, device=device)
    t_comm = _time_op(lambda: dist.all_reduce(x), device, None, repeats)
    t_one = _time_op(lambda: a @ a, device, None, repeats)
    k = max(1, round(t_comm / max(t_one, 1e-9)))

    def compute() -> None:
        for _ in range(k):
            a @ a

    def both() -> None:
        work = dist.all_reduce(x, async_op=True)
        compute()
        work.wait()

    t_compute = _time_op(compute, device, None, repeats)
    t_both = _time_op(both, device, None, repeats)
    hidden = t_comm + t_compute - t_both
    return min(max(hidden / min(t_comm, t_compute), 0.0), 1.0)


def _median_time(fn, device, repeats: int) -> float:
    fn()
    _sync(device)
    samples = []
    for _ in range(max(repeats, 3)):
        t = time.perf_counter()
        fn()
        _sync(device)
        samples.append(time.perf_counter() - t)
    return statistics.median(samples)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--max-bytes", type=int, default=0)
    p.add_argument("--collectives", default=",".join(COLLECTIVES))
    p.add_argument("--dtypes", default="fp32")
    p.add_argument("--timeout", type=float, default=120)
    args = p.parse_args(argv)
    args.collectives = args.collectives.split(",")
    args.dtypes = args.dtypes.split(",")
    cuda = torch.cuda.is_available()
    local = int(os.environ.get("LOCAL_RANK", 0))
    device = torch.device("cuda", local) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group(
        "nccl" if cuda else "gloo", timeout=datetime.timedelta(seconds=args.timeout)
    )
    rank, world = dist.get_rank(), dist.get_world_size()

    def say(line: str) -> None:
        if rank == 0:
            print(line, flush=True)

    rows = measure_collectives(args, rank, world, device, say)
    say("overlap: all-reduce under matmuls")
    overlap = measure_overlap(device, args.repeats)
    say("compute: matmul, attention, memory bandwidth (all ranks at once)")
    compute = measure_compute(args, device)
    gathered: list = [None] * world
    dist.all_gather_object(gathered, compute)
    if rank == 0:
        device_name = torch.cuda.get_device_name(device) if cuda else "cpu"
        matmuls = []
        for i, m in enumerate(compute["matmuls"]):
            rate = statistics.median(g["matmuls"][i]["flops_per_s"] for g in gathered)
            matmuls.append({**m, "flops_per_s": rate})
        attention = []
        for i, a in enumerate(compute["attention"]):
            rate = statistics.median(g["attention"][i]["flops_per_s"] for g in gathered)
            attention.append({**a, "flops_per_s": rate})
        raw = {
            "when": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
            "where": f"{socket.gethostname()}, {device_name}, {'nccl' if cuda else 'gloo'}, "
            f"torch {torch.__version__}, {world} ranks",
            "world": world,
            "nnodes": max(world // int(os.environ.get("LOCAL_WORLD_SIZE", world)), 1),
            "procs_per_node": int(os.environ.get("LOCAL_WORLD_SIZE", world)),
            "collectives": rows,
            "matmuls": matmuls,
            "attention": attention,
            "memory_bandwidth": statistics.median(g["memory_bandwidth"] for g in gathered),
            "overlap": overlap,
            "kernels": "cuda" if cuda else "cpu",
        }
        Path(args.out).write_text(json.dumps(raw, indent=1))
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
