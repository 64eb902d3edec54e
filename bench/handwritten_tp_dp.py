"""dp x tp training of a zoo GPT written by hand with the torch APIs, as a user would write
it without autopar: init_device_mesh, parallelize_module (Megatron's column/row pairs, a
vocab-parallel embedding and a column-parallel head gathering its logits), fully_shard on dp,
SGD. bench/executor_overhead.py runs it beside `autopar execute` on the same configuration.

Run with torchrun: torchrun --nproc-per-node 4 bench/handwritten_tp_dp.py --dp 2 --tp 2 \\
    --out times.json
"""

from __future__ import annotations

import argparse
import json
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import Replicate
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from planner.models import ModelSpec, resolve


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dp", type=int, required=True)
    parser.add_argument("--tp", type=int, required=True)
    parser.add_argument("--config", default='{"layers": 4, "hidden": 256, "heads": 4}')
    parser.add_argument("--vocab", type=int, default=1024)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()

    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (args.dp, args.tp), mesh_dim_names=("dp", "tp"))
    config = {**json.loads(args.config), "vocab": args.vocab}
    torch.manual_seed(0)
    spec = resolve(ModelSpec(name="gpt-350m", config=config)).with_seq(args.seq)
    model = spec.build(torch.float32, device="cpu").model

    styles = {"wte": RowwiseParallel(input_layouts=Replicate())}
    for i in range(len(model.blocks)):
        for name in ("attn.q_proj", "attn.k_proj", "attn.v_proj", "mlp.fc1"):
            styles[f"blocks.{i}.{name}"] = ColwiseParallel()
        for name in ("attn.out_proj", "mlp.fc2"):
            styles[f"blocks.{i}.{name}"] = RowwiseParallel()
    styles["lm_head"] = ColwiseParallel(output_layouts=Replicate())
    parallelize_module(model, mesh["tp"], styles)
    model.lm_head.weight = model.wte.weight  # tied embeddings: sharded alike, tie again
    for block in model.blocks:
        fully_shard(block, mesh=mesh["dp"], reshard_after_forward=False)
    fully_shard(model, mesh=mesh["dp"], reshard_after_forward=False)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)

    dp_rank = mesh["dp"].get_local_rank()
    per_replica = args.batch // args.dp
    times = []
    for step in range(args.steps):
        t0 = time.perf_counter()
        g = torch.Generator().manual_seed(step)
        tokens = torch.randint(0, args.vocab, (args.batch, args.seq + 1), generator=g)
        mine = tokens[dp_rank * per_replica : (dp_rank + 1) * per_replica]
        x, y = mine[:, :-1].contiguous(), mine[:, 1:].contiguous()
        optimizer.zero_grad()
        logits = model(x)
        loss = F.cross_entropy(logits.flatten(0, 1).float(), y.flatten())
        loss.backward()
        optimizer.step()
        times.append(time.perf_counter() - t0)
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, times)
    if dist.get_rank() == 0:
        with open(args.out, "w") as f:
            json.dump(gathered, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
