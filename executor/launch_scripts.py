"""Render cluster launch files for a plan from the templates in deploy/templates.

- Slurm: one task per node, each running torchrun with --nproc-per-node = devices per node and
  a c10d rendezvous on the allocation's first node.
- Kubernetes: a Kubeflow PyTorchJob (one Master + nodes-1 Workers, nprocPerNode devices each,
  c10d rendezvous through the operator's elastic policy), written with a YAML library.
The world size is nodes x devices per node and must equal the plan's ranks (pp x dp x tp,
or its stages' submeshes together).
"""

from __future__ import annotations

import re
import shlex
from importlib import resources
from pathlib import Path

import yaml

from executor.errors import ExecutionError
from planner.plan import Plan

TARGETS = {"slurm": "launch.sbatch", "k8s": "pytorchjob.yaml"}
TIME_LIMIT = re.compile(r"^(\d{1,3}-)?\d{1,3}:\d{2}:\d{2}$")
IMAGE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._/:@-]{0,255}$")


def _template(name: str) -> str:
    return (resources.files("deploy") / "templates" / name).read_text()


def _comment(text: str) -> str:
    """A value safe inside a comment line: one line of printable characters."""
    return re.sub(r"[^A-Za-z0-9._:/ -]", "?", text)[:200]


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
    """The launch file's text. Names and paths are data: shell values are quoted
    (shlex.quote), YAML is written by a YAML library, comments keep one safe line."""
    if target not in TARGETS:
        raise ExecutionError(f"--target: unknown target {target!r} (expected slurm or k8s)")
    if not TIME_LIMIT.match(time_limit):
        raise ExecutionError(f"--time-limit: {time_limit!r} is not [D-]HH:MM:SS")
    if not IMAGE.match(image):
        raise ExecutionError(f"--image: {image!r} is not an image reference")
    for name, value in (("steps", steps), ("port", port), ("cpus_per_task", cpus_per_task)):
        if isinstance(value, bool) or not isinstance(value, int) or not 0 < value < 2**31:
            raise ExecutionError(f"{name}: {value!r} is not a positive integer")
    cluster = plan.request.cluster
    world = plan.mesh.processes  # pp x dp x tp, or the stages' submeshes together
    if cluster.nodes * cluster.devices_per_node != world:
        raise ExecutionError(
            f"mesh: the plan runs on {world} ranks but the cluster has {cluster.nodes} x "
            f"{cluster.devices_per_node} devices"
        )
    job = re.sub(r"[^a-z0-9-]", "-", f"autopar-{plan.request.model.name}".lower())[:52]
    worker = ["-m", "executor.worker", plan_path, "--steps", str(steps), "--out", out_dir]
    about = f"{_comment(plan.request.model.name)} on {_comment(cluster.name)}"
    about += f", mesh {_comment(plan.mesh.summary().replace(' | ', ' / '))}"
    if target == "k8s":
        return _pytorchjob(about, job.strip("-"), cluster, image, ["python", *worker])
    return _template("slurm.sbatch.tmpl").format(
        about=about,
        job_name=job.strip("-"),
        nodes=cluster.nodes,
        gpus_per_node=cluster.devices_per_node,
        port=port,
        time_limit=time_limit,
        cpus_per_task=cpus_per_task,
        worker=shlex.join(worker),
    )


def _pytorchjob(about: str, job: str, cluster, image: str, command: list[str]) -> str:
    """A Kubeflow PyTorchJob: one Master and nodes-1 Workers, c10d rendezvous."""

    def replica(count: int) -> dict:
        container = {
            "name": "pytorch",
            "image": image,
            "command": command,
            "resources": {"limits": {"nvidia.com/gpu": cluster.devices_per_node}},
        }
        return {
            "replicas": count,
            "restartPolicy": "OnFailure",
            "template": {"spec": {"containers": [container]}},
        }

    replicas = {"Master": replica(1)}
    if cluster.nodes > 1:
        replicas["Worker"] = replica(cluster.nodes - 1)
    doc = {
        "apiVersion": "kubeflow.org/v1",
        "kind": "PyTorchJob",
        "metadata": {"name": job},
        "spec": {
            "nprocPerNode": str(cluster.devices_per_node),
            "elasticPolicy": {
                "rdzvBackend": "c10d",
                "minReplicas": cluster.nodes,
                "maxReplicas": cluster.nodes,
            },
            "pytorchReplicaSpecs": replicas,
        },
    }
    head = (
        "# autopar launch manifest for Kubernetes (Kubeflow training operator PyTorchJob):\n"
        f"# {about}.\n# Rendered by `autopar launch-script`.\n"
    )
    return head + yaml.safe_dump(doc, sort_keys=False)


def write_launch_files(
    plan: Plan, target: str, plan_path: str, out_dir: str | Path, **kwargs
) -> list[Path]:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    targets = list(TARGETS) if target == "all" else [target]
    paths = []
    for t in targets:
        path = out / TARGETS[t]
        path.write_text(render(plan, t, plan_path, **kwargs))
        paths.append(path)
    return paths
