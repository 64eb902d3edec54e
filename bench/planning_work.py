"""The rates behind the service's planning-work estimate (planner/search/work.py): seconds per
traced layer and per search unit (combination x layer x devices^0.1), measured on a few requests
of different depth and cluster size, each in a fresh process. The estimate's constants are these
rates' maxima, rounded up.

Run: python bench/planning_work.py   (writes bench/results/planning_work.md)
"""

from __future__ import annotations

import json
import subprocess
import sys

from common import header, write

from planner.search.work import DEVICE_EXPONENT

# (model, config overrides, cluster, nodes, global batch, seq, dtype)
CASES = [
    ("gpt-1.3b", {}, "dgx-a100-80g", 1, 512, 1024, "bf16"),
    ("gpt-1.3b", {}, "dgx-a100-80g", 4, 512, 1024, "bf16"),
    ("gpt-2.6b", {}, "aws-p3.16xlarge", 4, 1024, 1024, "fp16"),
    ("llama3-8b", {}, "dgx-h100", 2, 256, 4096, "bf16"),
    ("gpt-39b", {}, "aws-p3.16xlarge", 8, 1024, 1024, "fp16"),
]

CHILD = """
import json, sys, time
from planner.cluster.profile import load_cluster
from planner.models import ModelSpec, resolve
from planner.request import resolve_request
from planner.search.search import search
from planner.search.work import combinations
name, config, cluster, nodes, gb, seq, dtype = json.loads(sys.argv[1])
model = resolve(ModelSpec(name=name, config=config)).with_seq(seq)
cl = load_cluster(cluster, nodes)
fields = {"global_batch_size": gb, "seq_len": seq, "dtype": dtype}
t0 = time.perf_counter()
inputs = resolve_request({"name": name, "config": config}, cl, fields).trace()
t1 = time.perf_counter()
search(inputs)
t2 = time.perf_counter()
print(json.dumps({"layers": model.config.layers, "devices": cl.num_devices,
                  "combos": combinations(cl, model.config.layers, gb),
                  "trace_s": t1 - t0, "search_s": t2 - t1}))
"""


def main() -> None:
    rows = [
        "| model | cluster | devices | layers | combinations | trace s | s / layer "
        "| search s | s / unit |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for case in CASES:
        out = (
            subprocess.run(
                [sys.executable, "-c", CHILD, json.dumps(case)],
                capture_output=True,
                text=True,
                check=True,
            )
            .stdout.strip()
            .splitlines()[-1]
        )
        r = json.loads(out)
        units = r["combos"] * r["layers"] * r["devices"] ** DEVICE_EXPONENT
        rows.append(
            f"| {case[0]} | {case[2]} x{case[3]} | {r['devices']} | {r['layers']} | "
            f"{r['combos']} | {r['trace_s']:.1f} | {r['trace_s'] / 2 / r['layers']:.3f} | "
            f"{r['search_s']:.1f} | {r['search_s'] / units:.2e} |"
        )
        print(rows[-1], flush=True)
    text = header(
        "Planning work: rates behind planner/search/work.py", "python bench/planning_work.py"
    )
    write("planning_work.md", text + "\n" + "\n".join(rows) + "\n")


if __name__ == "__main__":
    main()
