"""Cold `autopar estimate` of transformers models whose layers are all alike, at this checkout
and at an earlier commit (`--before REV`, run from a git worktree): since the layers-alike
check (planner.models.hf.uniform_layers) such a model is traced from two layers and expanded,
where it was traced whole. Wall seconds of the whole command, empty AUTOPAR_CACHE_DIR per run;
'same' compares the plans' predictions.

Run: python bench/hf_trace_latency.py --before 3f3a0c6 --runs 3
(writes bench/results/hf_trace_latency.md)"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common import header, write

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from tests.hf_configs import QWEN3_30B_A3B  # noqa: E402

LLAMA31_8B = {  # meta-llama/Llama-3.1-8B config.json
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "vocab_size": 128256,
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "max_position_embeddings": 131072,
    "rope_theta": 500000.0,
    "rms_norm_eps": 1e-05,
    "tie_word_embeddings": False,
    "hidden_act": "silu",
}
CASES = {  # name: config, estimate flags
    "Qwen3-30B-A3B, dp16 ep8": (QWEN3_30B_A3B, "--nodes 2 --dp 16 --zero 3 --ep 8 --seq 512"),
    "Llama-3.1-8B, dp8": (LLAMA31_8B, "--nodes 1 --dp 8 --zero 3 --seq 4096"),
}


def run(checkout: Path, config: dict, flags: str, work: Path) -> tuple[float, dict]:
    path = work / "config.json"
    path.write_text(json.dumps(config))
    out = work / "plan.json"
    args = [sys.executable, "-m", "api.cli", "estimate", "--hf-config", str(path)]
    args += ["--cluster", "dgx-h100", "--global-batch", "16", *flags.split(), "-o", str(out)]
    env = {**os.environ, "AUTOPAR_CACHE_DIR": tempfile.mkdtemp(), "PYTHONPATH": str(checkout)}
    started = time.perf_counter()
    subprocess.run(args, cwd=checkout, env=env, check=True, capture_output=True)
    return time.perf_counter() - started, json.loads(out.read_text())["predicted"]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--before", required=True)
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp())
    before = work / "before"
    subprocess.run(["git", "worktree", "add", "-f", str(before), args.before], cwd=ROOT, check=True)
    rows = []
    try:
        for name, (config, flags) in CASES.items():
            times, predicted = {}, {}
            for label, checkout in (("before", before), ("now", ROOT)):
                got = [run(checkout, config, flags, work) for _ in range(args.runs)]
                times[label] = [t for t, _ in got]
                predicted[label] = got[0][1]
            same = "yes" if predicted["before"] == predicted["now"] else "**no**"
            rows.append(
                f"| {name} | {statistics.median(times['before']):.1f} | "
                f"{statistics.median(times['now']):.1f} | {same} |"
            )
            print(rows[-1], flush=True)
    finally:
        subprocess.run(["git", "worktree", "remove", "--force", str(before)], cwd=ROOT)
    text = header(
        "Cold estimates of transformers models, traced from two layers",
        __doc__.split("Run: ")[1].split("\n")[0],
    )
    text += "\n".join(
        [
            f"Median of {args.runs} runs each, the machine otherwise idle; before: "
            f"{args.before} (every transformers model traced whole).",
            "",
            "| case | before s | now s | same prediction |",
            "| --- | --- | --- | --- |",
            *rows,
            "",
        ]
    )
    write("hf_trace_latency.md", text)


if __name__ == "__main__":
    main()
