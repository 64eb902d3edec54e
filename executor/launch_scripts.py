"""Render cluster launch files for a plan from the templates in deploy/templates.

- Slurm: one task per node, each running torchrun with --nproc-per-node = devices per node and
  a c10d rendezvous on the allocation's first node.
- Kubernetes: a Kubeflow PyTorchJob (one Master + nodes-1 Workers, nprocPerNode devices each,
  c10d rendezvous through the operator's elastic policy).
The world size is nodes x devices per node and must equal the plan's pp x dp x tp.
"""

from __future__ import annotations

import re
from importlib import resources
from pathlib import Path

from executor.errors import ExecutionError
from planner.plan import Plan

TARGETS = {
    "slurm": ("slurm.sbatch.tmpl", "launch.sbatch"),
    "k8s": ("pytorchjob.yaml.tmpl", "pytorchjob.yaml"),
}


def _template(name: str) -> str:
    return (resources.files("deploy") / "templates" / name).read_text()


def render(
    plan: Plan,
    target: str,
    plan_path: str,
    *,
    steps: int = 100,
    out_dir: str = "runs",
    image: str = "autopar:latest",
    port: int = 29500,
    time_limit: str = "02:00:00",
    cpus_per_task: int = 16,
) -> str:
    if target not in TARGETS:
        raise ExecutionError(f"--target: unknown target {target!r} (expected slurm or k8s)")
    cluster = plan.request.cluster
    pp, dp, tp = plan.mesh.shape
    world = pp * dp * tp
    if cluster.nodes * cluster.devices_per_node != world:
        raise ExecutionError(
            f"mesh: pp*dp*tp = {world} but the cluster has {cluster.nodes} x "
            f"{cluster.devices_per_node} devices"
        )
    job = re.sub(r"[^a-z0-9-]", "-", f"autopar-{plan.request.model.name}".lower())[:52]
    values = dict(
        model=plan.request.model.name,
        cluster=cluster.name,
        pp=pp,
        dp=dp,
        tp=tp,
        job_name=job.strip("-"),
        nodes=cluster.nodes,
        gpus_per_node=cluster.devices_per_node,
        workers=cluster.nodes - 1,
        plan_path=plan_path,
        steps=steps,
        out_dir=out_dir,
        image=image,
        port=port,
        time_limit=time_limit,
        cpus_per_task=cpus_per_task,
    )
    return _template(TARGETS[target][0]).format(**values)


def write_launch_files(
    plan: Plan, target: str, plan_path: str, out_dir: str | Path, **kwargs
) -> list[Path]:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    targets = list(TARGETS) if target == "all" else [target]
    paths = []
    for t in targets:
        path = out / TARGETS[t][1]
        path.write_text(render(plan, t, plan_path, **kwargs))
        paths.append(path)
    return paths
