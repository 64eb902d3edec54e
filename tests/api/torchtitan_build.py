"""torchtitan's own build of an exported job config, as its Trainer does it up to the first
step (torchtitan/train.py: ParallelDims from the config, its device mesh, the model of the
config's name and flavor on the meta device, its model converters (float8), its loss, then
its pipelining function or its parallelize function), for one rank of the plan's world on
torch's fake process group. Run as a script, one case per argument (a JSON list
[config path, world size, rank]); prints one JSON line per case: what torchtitan built, or
the error it raised. A subprocess: the fake process group and torchtitan's global state
stay out of the test process.

One shim, for a machine without CUDA: torchtitan takes "cuda" as its device type where torch
finds no accelerator (torchtitan/tools/utils.py), and FSDP2 would ask CUDA for the current
device; the build runs with the CPU as its device type (nothing is allocated: the model is on
the meta device), and its float8 converter, which wants an SM89 GPU, with its `emulate`
switch (torchtitan's own for testing without one), which takes the model eager (the
exported config compiles it)."""

import json
import os
import sys

import torch
import torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore


def build(path: str, world: int, rank: int) -> dict:
    import torchtitan.distributed.parallel_dims as parallel_dims
    from torchtitan.config import TORCH_DTYPE_MAP, ConfigManager
    from torchtitan.distributed.parallel_dims import ParallelDims
    from torchtitan.protocols import train_spec as train_spec_module
    from torchtitan.protocols.model_converter import build_model_converters
    from torchtitan.tools import utils

    if not torch.cuda.is_available():
        utils.device_type, utils.device_module = "cpu", torch.cpu
        parallel_dims.device_type = "cpu"
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    try:
        config = ConfigManager().parse_args(["--job.config_file", path])
        if not torch.cuda.is_available() and "quantize.linear.float8" in config.model.converters:
            config.quantize.linear.float8.emulate = True  # its converter's switch: eager only
            config.compile.enable = False
        par = config.parallelism
        dims = ParallelDims(
            dp_shard=par.data_parallel_shard_degree,
            dp_replicate=par.data_parallel_replicate_degree,
            cp=par.context_parallel_degree,
            tp=par.tensor_parallel_degree,
            pp=par.pipeline_parallel_degree,
            ep=par.expert_parallel_degree,
            etp=par.expert_tensor_parallel_degree,
            world_size=world,
        )
        dims.build_mesh()
        spec = train_spec_module.get_train_spec(config.model.name)
        args = spec.model_args[config.model.flavor]
        args.update_from_config(config)
        dtype = TORCH_DTYPE_MAP[config.training.dtype]
        with torch.device("meta"), utils.set_default_dtype(dtype):
            model = spec.model_cls(args)
        build_model_converters(config, dims).convert(model)
        loss = spec.build_loss_fn(config, parallel_dims=dims)
        if dims.pp_enabled:
            device = torch.device("cpu")
            fn = spec.pipelining_fn
            _, parts, _, _ = fn(model, dims, config, device, args, spec.parallelize_fn, loss)
        else:
            parts = [spec.parallelize_fn(model, dims, config)]
        layers = [sorted(int(k) for k in part.layers) for part in parts]
        kinds = sorted({type(p).__name__ for part in parts for p in part.parameters()})
        fsdp = any(type(m).__name__.startswith("FSDP") for part in parts for m in part.modules())
        # the mesh dimensions the experts' weights are placed on (expert parallelism: "ep")
        experts = sorted(
            {
                dim
                for part in parts
                for name, p in part.named_parameters()
                if ".experts." in name and hasattr(p, "device_mesh")
                for dim in p.device_mesh.mesh_dim_names or ()
            }
        )
        layers = [[ls[0], ls[-1] + 1] for ls in layers]
        return {"layers": layers, "params": kinds, "fsdp": fsdp, "expert_mesh": experts}
    except Exception as err:  # what torchtitan refuses, reported to the test
        return {"error": f"{type(err).__name__}: {err}"}
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("LOCAL_RANK", "0")
    for case in sys.argv[1:]:
        print(json.dumps(build(*json.loads(case))), flush=True)
