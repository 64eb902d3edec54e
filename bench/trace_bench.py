"""Tracing speed and memory: `trace_model` on the meta device, one fresh process per model so
peak RSS is the trace's own. Target (issue 2): llama3-70b at seq 4096 under 30 s and 4 GB.

Run: python bench/trace_bench.py   (writes bench/results/trace.md)
"""

from __future__ import annotations

import json
import subprocess
import sys

from common import header, write

CASES = [
    ("gpt-1.3b", 1, 1024),
    ("gpt-39b", 1, 1024),
    ("gpt-76b", 1, 1024),
    ("llama3-8b", 1, 8192),
    ("llama3-70b", 1, 4096),
    ("moe-70b", 1, 1024),
    ("wresnet-13b", 1, 1),
]

CHILD = """
import json, resource, sys, time
t0 = time.perf_counter()
from planner.models import ModelSpec, resolve
from planner.graph.tracing import trace_model
t1 = time.perf_counter()
g = trace_model(resolve(ModelSpec(name=sys.argv[1])), int(sys.argv[2]), int(sys.argv[3]), "bf16")
t2 = time.perf_counter()
s = g.summary()
print(json.dumps({"import_s": t1 - t0, "trace_s": t2 - t1, "nodes": s["nodes"],
                  "params": s["params"], "tflop": (s["fwd_flops"] + s["bwd_flops"]) / 1e12,
                  "rss_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6}))
"""


def main() -> None:
    rows = []
    for name, batch, seq in CASES:
        out = subprocess.run(
            [sys.executable, "-c", CHILD, name, str(batch), str(seq)],
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        r = json.loads(out.strip().splitlines()[-1])
        rows.append(
            f"| {name} | {batch} | {seq} | {r['nodes']} | {r['params'] / 1e9:.2f}B | "
            f"{r['tflop']:.0f} | {r['trace_s']:.1f} | {r['rss_gb']:.2f} |"
        )
        print(rows[-1], file=sys.stderr, flush=True)
    text = header("Tracing on the meta device", "python bench/trace_bench.py")
    text += "\n".join(
        [
            "Trace = torch.export + one meta-tensor interpretation (FLOPs fwd/bwd, saved bytes).",
            "Peak RSS is the whole process (Python, torch import and the trace).",
            "",
            "| model | batch | seq | nodes | params | train TFLOP | trace s | peak RSS GB |",
            "|---|---|---|---|---|---|---|---|",
            *rows,
            "",
        ]
    )
    write("trace.md", text)


if __name__ == "__main__":
    main()
