"""Expert parallelism (issue 39) under the cost model:

1. The MoE suite (Alpa's, bench/suite.py: moe-380m on 1 V100 to moe-70b on 64) searched by
   this checkout and by an earlier commit without the ep axis, alternately, each a fresh
   process with an empty disk cache: the chosen plan, its predicted step and the search
   time, before and after, and where expert parallelism changed the plan.
2. Two published MoE architectures, from their config.json values (written below): DeepSeek-V3
   (671B, 256 routed experts of which 8 per token, one shared; DeepSeek-AI 2024, and its
   Hugging Face config.json) on 256 H100 and Mixtral-8x7B (46.7B, 8 experts, top 2; Jiang et
   al. 2024, and its config.json) on 64 H100, each searched, and with ep pinned where the
   search keeps every expert on every rank: the plan, its all-to-all time and expert memory
   (the explanation's sentence) and the search time; and Mixtral's best plan that Megatron-LM
   runs (export_to megatron), predicted for its runtime.

Run: python bench/expert_parallel.py --before 21564c1   (writes results/expert_parallel.md,
     the suite, and results/expert_parallel_published.md; --only suite|published: one of them)
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common import header, write
from suite import SUITES

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # the published configs the tests share (tests/hf_configs.py)
from tests.hf_configs import MIXTRAL_8X7B  # noqa: E402

SUITE = SUITES["moe"][2]  # bench/suite.py's MoE rows: (model, GPUs), fp16, batch 1024
DEEPSEEK_V3 = {  # deepseek-ai/DeepSeek-V3 config.json (the multi-token-prediction layer left out)
    "architectures": ["DeepseekV3ForCausalLM"],
    "model_type": "deepseek_v3",
    "vocab_size": 129280,
    "hidden_size": 7168,
    "intermediate_size": 18432,
    "moe_intermediate_size": 2048,
    "num_hidden_layers": 61,
    "num_attention_heads": 128,
    "num_key_value_heads": 128,
    "n_shared_experts": 1,
    "n_routed_experts": 256,
    "routed_scaling_factor": 2.5,
    "kv_lora_rank": 512,
    "q_lora_rank": 1536,
    "qk_rope_head_dim": 64,
    "v_head_dim": 128,
    "qk_nope_head_dim": 128,
    "n_group": 8,
    "topk_group": 4,
    "num_experts_per_tok": 8,
    "first_k_dense_replace": 3,
    "norm_topk_prob": True,
    "max_position_embeddings": 163840,
    "rope_theta": 10000,
    "rms_norm_eps": 1e-06,
    "tie_word_embeddings": False,
    "hidden_act": "silu",
    "attention_bias": False,
}
# name, config, cluster, nodes, global batch, seq: DeepSeek-V3 trained at 4K tokens (its
# report, section 4.2); 1,024 sequences keep 4 per dp rank at 256 GPUs.
PUBLISHED = [
    ("DeepSeek-V3, 256 H100", DEEPSEEK_V3, "dgx-h100", 32, 1024, 4096),
    ("Mixtral-8x7B, 64 H100", MIXTRAL_8X7B, "dgx-h100", 8, 256, 4096),
]

# Pinned where the search has other choices: Mixtral's experts split over ep beside tp 4
# (each expert's features over tp: expert tensor parallelism, expert tp 4; or whole, ep over
# the dp x tp ranks: expert tp 1), and at 32K tokens over ep ranks drawn from the cp ranks
PINNED = [
    (
        "Mixtral-8x7B, 64 H100",
        MIXTRAL_8X7B,
        *("dgx-h100", 8, 256, 4096),
        {"mesh": (1, 16, 4), "ep": 8, "etp": 4, "sequence_parallel": True},
    ),
    (
        "Mixtral-8x7B, 64 H100",
        MIXTRAL_8X7B,
        *("dgx-h100", 8, 256, 4096),
        {"mesh": (1, 16, 4), "ep": 8, "etp": 1, "sequence_parallel": True},
    ),
    ("Mixtral-8x7B, 64 H100, 32K", MIXTRAL_8X7B, *("dgx-h100", 8, 32, 32768), {"cp": 8, "ep": 8}),
]

SUITE_CHILD = """
import json, sys, time
from planner.cluster.profile import load_cluster
from planner.request import resolve_request
from planner.search.search import NoFeasiblePlan, search
from planner.search.space import SearchOptions, default_workers
sys.path.insert(0, "bench")
from suite import cluster_for
name, gpus = json.loads(sys.argv[1])
t0 = time.perf_counter()
inputs = resolve_request({"name": name}, cluster_for(gpus),
                         {"global_batch_size": 1024, "dtype": "fp16"}).trace()
try:
    plan = search(inputs, SearchOptions(workers=default_workers())).plan
except NoFeasiblePlan:
    print(json.dumps({"step_s": None, "s": time.perf_counter() - t0, "plan": "does not fit"}))
    sys.exit(0)
pp, dp, tp = plan.mesh.shape
print(json.dumps({"step_s": plan.predicted.step_time_s, "s": time.perf_counter() - t0,
    "plan": f"pp{pp} dp{dp} tp{tp} ep{getattr(plan.mesh, 'ep', None) or 1} "
            f"z{plan.stages[0].zero} m{plan.schedule.microbatches}"}))
"""


def _suite_case(case: tuple, source: Path) -> dict:
    with tempfile.TemporaryDirectory() as cache:
        out = subprocess.run(
            [sys.executable, "-c", SUITE_CHILD, json.dumps(case)],
            capture_output=True,
            text=True,
            check=True,
            cwd=source,
            env={**os.environ, "AUTOPAR_CACHE_DIR": cache, "PYTHONPATH": str(source)},
        )
    return json.loads(out.stdout.strip().splitlines()[-1])


def suite_rows(before: str) -> list[str]:
    rows = []
    with tempfile.TemporaryDirectory() as tree:
        subprocess.run(["git", "worktree", "add", "-f", tree, before], check=True, cwd=ROOT)
        try:
            for case in SUITE:
                old = _suite_case(case, Path(tree))
                new = _suite_case(case, ROOT)
                change = "same plan" if old["plan"] == new["plan"] else "changed"
                steps = [f"{r['step_s']:.3f}" if r["step_s"] else "-" for r in (old, new)]
                ratio = (
                    f"{new['step_s'] / old['step_s'] - 1:+.1%}"
                    if old["step_s"] and new["step_s"]
                    else "-"
                )
                rows.append(
                    f"| {case[0]} | {case[1]} | {old['plan']} | {steps[0]} | "
                    f"{new['plan']} | {steps[1]} | {ratio} | {change} | "
                    f"{old['s']:.1f} | {new['s']:.1f} |"
                )
                print(rows[-1], flush=True)
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", tree], cwd=ROOT, check=False)
    return rows


def _published(name: str, config: dict, cluster: str, nodes: int, batch: int, seq: int, **pins):
    from autopar import api

    t0 = time.perf_counter()
    plan = api.plan(
        hf_config=config,
        cluster=cluster,
        nodes=nodes,
        global_batch_size=batch,
        seq_len=seq,
        **pins,
    )
    seconds = time.perf_counter() - t0
    d = plan.mesh.dims
    st = plan.stages[0]
    line = next((x for x in plan.explanation if x.startswith("Expert parallelism")), "no ep")
    how = ", ".join(f"{k} {v}" for k, v in pins.items()) or "searched"
    how = how.replace("export_to megatron", "for Megatron-LM (export_to)")
    return (
        f"| {name} | {how} | {d.summary()}, {plan.schedule.name}, "
        f"m {plan.schedule.microbatches}, ZeRO-{st.zero}{', fp8' if plan.fp8 else ''} | "
        f"{plan.predicted.step_time_s:.3f} | {plan.predicted.peak_memory_bytes / 2**30:.1f} | "
        f"{seconds:.1f} | {line} |",
        d.ep,
    )


# the MoE model types Megatron-LM's flags build (api.export.megatron.ARCHITECTURES; its
# DeepSeek-V3 needs multi-latent attention flags the exporter does not write)
MEGATRON_TYPES = ("mixtral",)


def published_rows() -> list[str]:
    rows = []
    for name, config, cluster, nodes, batch, seq in PUBLISHED:
        row, ep = _published(name, config, cluster, nodes, batch, seq)
        rows.append(row)
        print(row, flush=True)
        if ep == 1:  # what the search passed over: the experts split within a node
            row, _ = _published(name, config, cluster, nodes, batch, seq, ep=8)
            rows.append(row)
            print(row, flush=True)
        if config["model_type"] in MEGATRON_TYPES:  # the best plan Megatron-LM runs
            row, _ = _published(name, config, cluster, nodes, batch, seq, export_to="megatron")
            rows.append(row)
            print(row, flush=True)
    for name, config, cluster, nodes, batch, seq, pins in PINNED:
        row, _ = _published(name, config, cluster, nodes, batch, seq, **pins)
        rows.append(row)
        print(row, flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--before", required=True, help="a commit without expert parallelism")
    ap.add_argument("--only", choices=("suite", "published"))
    args = ap.parse_args()
    if args.only != "published":
        text = header(
            "Expert parallelism (issue 39): the MoE suite",
            " ".join(["python bench/expert_parallel.py", *sys.argv[1:]]),
        )
        text += "\n".join(
            [
                f"MoE suite (bench/suite.py's: fp16, batch 1024, seq 1024, AWS p3.16xlarge V100), "
                f"searched by commit {args.before} (before) and this checkout (after), each in "
                "a fresh process with an empty cache; search time includes tracing.",
                "",
                "| model | GPUs | before | step s | after | step s | change | plan | "
                "search s before | after |",
                "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
                *suite_rows(args.before),
                "",
            ]
        )
        write("expert_parallel.md", text)
    if args.only != "suite":
        text = header(
            "Expert parallelism (issue 39): published MoE architectures",
            " ".join(["python bench/expert_parallel.py", *sys.argv[1:]]),
        )
        text += "\n".join(
            [
                "Published MoE architectures from their config.json values, planned for "
                "autopar's executor (bf16, the search's defaults); where the search keeps "
                "every expert on every rank, again with ep 8 pinned; and the best plan "
                "Megatron-LM's flags express, predicted for its runtime (export_to megatron); "
                "Mixtral with ep pinned beside tp 4, each expert's features split over tp "
                "(etp 4) or every expert whole with ep drawn from the dp x tp ranks (etp 1, "
                "Megatron-Core's MoE parallel folding), and, at 32K tokens, beside cp 8 (ep "
                "drawn from the cp ranks).",
                "",
                "| model | ep | plan | step s | peak GiB | plan s | expert parallelism |",
                "| --- | --- | --- | --- | --- | --- | --- |",
                *published_rows(),
                "",
            ]
        )
        write("expert_parallel_published.md", text)


if __name__ == "__main__":
    main()
