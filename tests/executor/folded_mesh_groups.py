"""Prints, as JSON, every rank's ep, cp, dp and tp groups of executor.mesh's mesh for context
parallelism with expert tp 1, built on torch's fake process group (no processes) for each
world size tests/executor/test_folded_mesh.py asks about: `python folded_mesh_groups.py
'[[dp, cp, tp, ep], ...]'`."""

import json
import sys

import torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore

from executor.mesh import _context_and_folded_expert_mesh
from planner.parallel_dims import ParallelDims

out = {}
for dp, cp, tp, ep in json.loads(sys.argv[1]):
    dims = ParallelDims(pp=1, dp=dp, cp=cp, tp=tp, ep=ep, etp=1)
    groups = []
    for rank in range(dp * cp * tp):
        dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=dp * cp * tp)
        mesh = _context_and_folded_expert_mesh(dims, "cpu", False)
        groups.append({k: mesh[k].mesh.flatten().tolist() for k in ("ep", "cp", "dp", "tp")})
        dist.destroy_process_group()
    out[f"{dp} {cp} {tp} {ep}"] = groups
print(json.dumps(out))
