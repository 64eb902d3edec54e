"""Train a tiny Hugging Face Llama with an autopar plan, in your own training loop.

    # 1. plan (one process; the model is traced on the meta device)
    python examples/train_hf_llama.py plan --out plan.json
    # 2. train with the plan on 4 processes (gloo on CPU, NCCL on GPUs)
    torchrun --nproc-per-node 4 examples/train_hf_llama.py train plan.json --steps 10
    # the same loop on one process without autopar, to compare the losses
    python examples/train_hf_llama.py train plan.json --steps 10 --single
    # fine-tuning saved weights (save_pretrained's directory): each rank loads its shards
    python examples/train_hf_llama.py save --out weights
    torchrun --nproc-per-node 4 examples/train_hf_llama.py train plan.json --weights weights
    # the same without building the whole model on every rank (each allocates its shards)
    torchrun --nproc-per-node 4 examples/train_hf_llama.py train plan.json --weights weights --meta
    # padded batches (rows of different lengths, right-padded, with an attention mask)
    torchrun --nproc-per-node 4 examples/train_hf_llama.py train plan.json --pad
    # packed documents (several per row, position_ids counting from 0 in each)
    torchrun --nproc-per-node 4 examples/train_hf_llama.py train plan.json --packed

The model is transformers' own LlamaForCausalLM; autopar.parallelize applies the plan to it
(tensor-parallel styles on its q/k/v/o and MLP projections, FSDP2 on the data-parallel axis,
pipeline stages and schedule when the plan has pp > 1). Everything else is ordinary PyTorch.
"""

from __future__ import annotations

import argparse
import json
import math

import torch
import transformers

import autopar

CONFIG = {
    "vocab_size": 256,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 128,
}
GLOBAL_BATCH, SEQ = 8, 32


def build_model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)  # the same initial weights on every rank
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(**CONFIG))


def save_weights(out: str) -> None:
    """Stand-in for a pretrained checkpoint: a model's weights as transformers saves them."""
    build_model(seed=1234).save_pretrained(out)


def batch(step: int, pad: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A global batch of token ids, next-token labels and the attention mask (yours: a real
    data loader). Padded: each row a document of its own length, right-padded with token 0,
    the labels of padding -100 (as transformers' collators mark them)."""
    g = torch.Generator().manual_seed(step)
    tokens = torch.randint(1, CONFIG["vocab_size"], (GLOBAL_BATCH, SEQ + 1), generator=g)
    mask = torch.ones_like(tokens)
    if pad:
        lengths = torch.randint(2, SEQ + 2, (GLOBAL_BATCH, 1), generator=g)
        mask = (torch.arange(SEQ + 1) < lengths).long()
        tokens = tokens * mask
    labels = tokens[:, 1:].masked_fill(mask[:, 1:] == 0, -100)
    return tokens[:, :-1], labels, mask[:, :-1]


def packed_batch(step: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A global batch of packed documents: each row holds several documents of random
    lengths end to end, their positions counting from 0 in each (as transformers'
    DataCollatorWithFlattening lays them out), the label of a document's last token -100
    (the next token is another document's)."""
    g = torch.Generator().manual_seed(10_000 + step)
    tokens = torch.randint(1, CONFIG["vocab_size"], (GLOBAL_BATCH, SEQ), generator=g)
    positions = torch.zeros_like(tokens)
    labels = torch.full_like(tokens, -100)
    for row in range(GLOBAL_BATCH):
        start = 0
        while start < SEQ:
            length = min(int(torch.randint(3, 13, (1,), generator=g)), SEQ - start)
            positions[row, start : start + length] = torch.arange(length)
            labels[row, start : start + length - 1] = tokens[row, start + 1 : start + length]
            start += length
    return tokens, labels, positions


def make_plan(args: argparse.Namespace) -> None:
    plan = autopar.plan(
        hf_config=transformers.LlamaConfig(**CONFIG),
        cluster="cpu-local",  # 4 processes on this machine; e.g. "dgx-h100" with nodes=...
        global_batch_size=GLOBAL_BATCH,
        seq_len=SEQ,
        dtype="fp32",
        mesh=tuple(int(x) for x in args.mesh.split("x")) if args.mesh else None,
        sequence_parallel=getattr(args, "sequence_parallel", None),
    )
    with open(args.out, "w") as f:
        f.write(plan.to_json())
    pp, dp, tp = plan.mesh.shape
    print(f"wrote {args.out}: pp {pp} x dp {dp} x tp {tp}, {plan.schedule.name}")


def loss_of(logits: torch.Tensor, labels: torch.Tensor, smoothing: float = 0.0) -> torch.Tensor:
    flat = logits.flatten(0, 1).float()
    return torch.nn.functional.cross_entropy(flat, labels.flatten(), label_smoothing=smoothing)


def train_single(
    steps: int,
    weights: str | None = None,
    smoothing: float = 0.0,
    pad: bool = False,
    packed: bool = False,
) -> list[float]:
    load = transformers.LlamaForCausalLM.from_pretrained
    model = load(weights) if weights else build_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=False)
    losses = []
    for step in range(steps):
        optimizer.zero_grad()
        if packed:
            tokens, labels, positions = packed_batch(step)
            # without a key/value cache: with one, transformers does not mask by documents
            logits = model(tokens, position_ids=positions, use_cache=False).logits
        else:
            tokens, labels, mask = batch(step, pad)
            logits = model(tokens, attention_mask=mask).logits
        loss = loss_of(logits, labels, smoothing)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        losses.append(loss.item())
    return losses


def train_parallel(
    plan_path: str,
    steps: int,
    weights: str | None = None,
    smoothing: float = 0.0,
    pad: bool = False,
    meta: bool = False,
    packed: bool = False,
) -> list[float]:
    import torch.distributed as dist

    dist.init_process_group("gloo" if not torch.cuda.is_available() else "nccl")
    # your own loss on the last stage's logits (the default: next-token cross entropy)
    loss_fn = (lambda logits, labels: loss_of(logits, labels, smoothing)) if smoothing else None
    if meta:  # no memory until parallelize: each rank then allocates only its own shards
        with torch.device("meta"):
            model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**CONFIG))
    else:
        model = build_model()
    parallel = autopar.parallelize(model, plan_path, loss_fn=loss_fn)
    if weights:  # every rank reads the tensors of its stages and keeps its shards of them
        parallel.load_state_dict(weights)
    if meta and dist.get_rank() == 0:
        # the rest of the model stays on the meta device; a DTensor holds its local shard
        local = [p.to_local() if hasattr(p, "to_local") else p for p in model.parameters()]
        held = sum(t.numel() for t in local if not t.is_meta)
        total = sum(p.numel() for p in model.parameters())
        print(f"rank 0 allocated {held:,} of the model's {total:,} parameters")
    optimizer = parallel.optimizer(torch.optim.AdamW, lr=1e-3, foreach=False)
    losses = []
    for step in range(steps):
        optimizer.zero_grad()
        # padded rows: the loss is the mean over the batch's real labels, as one process has it
        if packed:  # each stage masks attention within documents by their positions
            tokens, labels, positions = packed_batch(step)
            loss = parallel.step(*parallel.local_batch(tokens, labels, position_ids=positions))
        else:
            loss = parallel.step(*parallel.local_batch(*batch(step, pad)))
        if parallel.finish_gradients(max_grad_norm=1.0):
            optimizer.step()
        # The last pipeline stage has the loss; data-parallel replicas average theirs.
        value = torch.tensor([loss if loss is not None else 0.0, float(loss is not None)])
        dist.all_reduce(value)
        losses.append(float(value[0] / value[1]))
    dist.destroy_process_group()
    return losses


def main() -> None:
    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("plan")
    p.add_argument("--out", default="plan.json")
    p.add_argument("--mesh", help="pin pp x dp x tp, e.g. 2x1x2")
    p.add_argument(
        "--sequence-parallel", action=argparse.BooleanOptionalAction, help="pin (default: searched)"
    )
    t = sub.add_parser("train")
    t.add_argument("plan")
    t.add_argument("--steps", type=int, default=10)
    t.add_argument("--single", action="store_true", help="one process, no autopar")
    t.add_argument("--losses", help="write the losses here (JSON)")
    t.add_argument("--weights", help="start from these weights (a save_pretrained directory)")
    t.add_argument("--label-smoothing", type=float, default=0.0, help="a loss of your own")
    t.add_argument("--pad", action="store_true", help="rows of different lengths, padded")
    t.add_argument("--meta", action="store_true", help="build on the meta device (with --weights)")
    t.add_argument("--packed", action="store_true", help="several documents per row")
    s = sub.add_parser("save")
    s.add_argument("--out", default="weights")
    args = parser.parse_args()
    if args.command == "plan":
        return make_plan(args)
    if args.command == "save":
        return save_weights(args.out)
    if args.single:
        losses = train_single(args.steps, args.weights, args.label_smoothing, args.pad, args.packed)
    else:
        losses = train_parallel(
            *(args.plan, args.steps, args.weights, args.label_smoothing, args.pad, args.meta),
            packed=args.packed,
        )
    import os

    if int(os.environ.get("RANK", "0")) == 0:
        print(f"loss {losses[0]:.4f} -> {losses[-1]:.4f} (ln vocab = {math.log(256):.4f})")
        if args.losses:
            with open(args.losses, "w") as f:
                json.dump(losses, f)


if __name__ == "__main__":
    main()
