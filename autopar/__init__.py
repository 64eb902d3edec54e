"""autopar's Python API: plan a model's training, then apply the plan in your own loop.

    import autopar
    plan = autopar.plan(hf_config=config, cluster="dgx-h100", nodes=4, global_batch_size=512)
    parallel = autopar.parallelize(model, plan)   # on every rank, under torchrun
    optimizer = parallel.optimizer(torch.optim.AdamW, lr=3e-4)  # ZeRO-1: its own shards
    loss = parallel.step(*parallel.local_batch(tokens, labels))  # fwd + bwd, pipelined if pp > 1
    if parallel.finish_gradients(max_grad_norm=1.0):             # tied sums, fp16 unscale, clip
        optimizer.step()

`autopar.plan` is the CLI's `autopar plan` (trace on meta, search); `autopar.parallelize` is
what the executor applies (tensor-parallel styles, activation checkpointing, FSDP2 at the
plan's ZeRO level, pipeline stages and schedule), like torchtitan's `parallelize_*`.
"""

from autopar.api import Parallelized, load_plan, parallelize, plan
from planner import __version__

__all__ = ["Parallelized", "__version__", "load_plan", "parallelize", "plan"]
