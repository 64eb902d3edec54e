"""A user's own loop over a Mixtral plan with expert tp 1 (every expert whole, ep over the
dp x tp ranks), by autopar.plan and autopar.parallelize, and the same loop on one process
(tests/executor/test_example.py runs both). `plan OUT`, `single OUT`, `train PLAN OUT`:
each writes its JSON to OUT."""

import json
import sys
from pathlib import Path

import torch
import transformers

import autopar

CONFIG = {
    **{"vocab_size": 128, "hidden_size": 64, "intermediate_size": 128},
    **{"num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 4},
    **{"num_local_experts": 4, "num_experts_per_tok": 2, "max_position_embeddings": 64},
}
GLOBAL_BATCH, SEQ = 8, 16


def build() -> torch.nn.Module:
    torch.manual_seed(0)
    return transformers.MixtralForCausalLM(transformers.MixtralConfig(**CONFIG))


def batch(step: int):
    g = torch.Generator().manual_seed(step)
    tokens = torch.randint(1, CONFIG["vocab_size"], (GLOBAL_BATCH, SEQ + 1), generator=g)
    return tokens[:, :-1], tokens[:, 1:], torch.ones(GLOBAL_BATCH, SEQ, dtype=torch.long)


def single(steps: int) -> list[float]:
    model = build()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for step in range(steps):
        optimizer.zero_grad()
        tokens, labels, mask = batch(step)
        logits = model(tokens, attention_mask=mask).logits
        loss = torch.nn.functional.cross_entropy(
            logits.reshape(-1, logits.shape[-1]), labels.reshape(-1)
        )
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


def parallel(plan: str, steps: int) -> tuple[list[float], int]:
    """The losses (averaged over the ranks that have one) and this rank."""
    import torch.distributed as dist

    dist.init_process_group("gloo")
    model = autopar.parallelize(build(), plan)
    optimizer = model.optimizer(torch.optim.SGD, lr=0.1)
    losses = []
    for step in range(steps):
        optimizer.zero_grad()
        loss = model.step(*model.local_batch(*batch(step)))
        if model.finish_gradients(max_grad_norm=1e9):
            optimizer.step()
        value = torch.tensor([loss if loss is not None else 0.0, float(loss is not None)])
        dist.all_reduce(value)
        losses.append(float(value[0] / value[1]))
    rank = dist.get_rank()
    dist.destroy_process_group()
    return losses, rank


if __name__ == "__main__":
    command, *args = sys.argv[1:]
    if command == "plan":
        plan = autopar.plan(
            hf_config={"model_type": "mixtral", **CONFIG},
            cluster="cpu-local",
            global_batch_size=GLOBAL_BATCH,
            seq_len=SEQ,
            dtype="fp32",
            optimizer="sgd",
            mesh=(1, 2, 2),
            ep=4,
            etp=1,
            zero=3,
        )
        Path(args[0]).write_text(plan.to_json())
    elif command == "single":
        Path(args[0]).write_text(json.dumps(single(3)))
    else:
        losses, rank = parallel(args[0], 3)
        if rank == 0:
            Path(args[1]).write_text(json.dumps(losses))
