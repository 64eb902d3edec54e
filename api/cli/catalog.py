"""`autopar models` and `autopar clusters`: the zoo and the bundled cluster profiles."""

from __future__ import annotations

import argparse
import json

from api.render import human_bytes, human_count, table


def cmd_models(args: argparse.Namespace) -> None:
    from planner.models.zoo_catalog import catalog

    rows = catalog()  # no torch import: answers in a fraction of a second
    if args.json:
        print(json.dumps(rows, indent=2))
        return
    print(
        table(
            ["model", "family", "params", "config"],
            [
                [
                    r["name"],
                    r["family"],
                    human_count(r["params"]),
                    " ".join(f"{k}={v}" for k, v in r["config"].items() if v is not None),
                ]
                for r in rows
            ],
        )
    )


def _peak(profile) -> float:
    return max(profile.device.peak_flops.get(k, 0) for k in ("bf16", "fp16", "fp32"))


def cmd_clusters(args: argparse.Namespace) -> None:
    from planner.cluster.profile import bundled_names, load_cluster

    profiles = [load_cluster(n) for n in bundled_names()]
    if args.json:
        print(json.dumps([p.model_dump(mode="json") for p in profiles], indent=2))
        return
    print(
        table(
            [
                "cluster",
                "devices",
                "device",
                "memory",
                "bf16/fp16 peak",
                "intra-node",
                "inter-node",
            ],
            [
                [
                    p.name,
                    f"{p.nodes}x{p.devices_per_node}",
                    p.device.name,
                    human_bytes(p.device.memory_bytes),
                    f"{_peak(p) / 1e12:.1f} TF/s",
                    f"{p.links.intra_node.bandwidth / 1e9:.1f} GB/s",
                    f"{p.links.inter_node.bandwidth / 1e9:.2f} GB/s/node",
                ]
                for p in profiles
            ],
        )
    )


def add_parsers(sub) -> None:
    p = sub.add_parser("models", help="list the model zoo")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_models)

    p = sub.add_parser("clusters", help="list the bundled cluster profiles")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_clusters)
