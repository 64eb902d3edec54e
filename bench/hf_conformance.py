"""Which transformers decoder classes run as planned: each model type built from a tiny config
(tests/hf_configs.py TINY_DECODER plus what the type needs to build), planned with a pinned
mesh on cpu-local, run on 4 forked gloo ranks for 2 steps and compared with the
single-process reference of the same transformers model (losses and every parameter to
1e-5) and with its plan's ledger (tests/executor/ledger_check.py, the executor tests'
checker). A survey, not a test: the types the tests run are in
tests/executor/test_hf_models.py; this finds the ones that do not yet run as planned.

Run: python bench/hf_conformance.py [--meshes 2x1x2 1x2x2 ...] [--types llama ...]
(~3 min per mesh on 2 cores)
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import sys
import tempfile
from pathlib import Path

from common import header, write

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

# What each type needs beyond TINY_DECODER to build at hidden 64 with 4 heads: an explicit
# head_dim where its default is not hidden / heads, dropout off where it defaults on.
TYPES: dict[str, dict] = {
    "llama": {},
    "mistral": {},
    "qwen2": {},
    "qwen3": {},
    "gemma": {"head_dim": 16},
    "gemma2": {"head_dim": 16},
    "gemma3_text": {"head_dim": 16},
    "olmo": {},
    "olmo2": {},
    "granite": {"embedding_multiplier": 4.0},
    "starcoder2": {},
    "cohere": {},
    "stablelm": {},
    "phi": {},
    "helium": {"head_dim": 16},
    "exaone4": {},
    "ernie4_5": {},
    "arcee": {},
    "seed_oss": {"attention_dropout": 0.0, "residual_dropout": 0.0},
    "apertus": {},
    # mixture-of-experts decoders: a router and experts in place of the MLP
    "mixtral": {"num_local_experts": 4},
    "qwen2_moe": {
        **{"moe_intermediate_size": 32, "shared_expert_intermediate_size": 64},
        **{"num_experts": 4, "num_experts_per_tok": 2},
    },
    "qwen3_moe": {"moe_intermediate_size": 32, "num_experts": 4, "num_experts_per_tok": 2},
    # multi-head latent attention, a dense first layer, then routed and shared experts
    "deepseek_v3": {
        **{"num_key_value_heads": 4, "moe_intermediate_size": 32, "n_routed_experts": 4},
        **{"num_experts_per_tok": 2, "n_shared_experts": 1, "n_group": 1, "topk_group": 1},
        **{"first_k_dense_replace": 1, "kv_lora_rank": 16, "q_lora_rank": None},
        **{"qk_rope_head_dim": 8, "qk_nope_head_dim": 8, "v_head_dim": 16},
    },
}
SEQUENCE_PARALLEL = ("--sequence-parallel", "on")


def survey(model_type: str, extra: dict, mesh: str, pins: tuple[str, ...], tmp: Path) -> str:
    import pytest

    from api.cli.main import main as cli
    from executor.local_ranks import run_local
    from executor.reference import distributed_losses, distributed_params, reference_run
    from planner.executable import plan_executor_mode
    from planner.plan import Plan
    from tests.executor.ledger_check import check_ledger
    from tests.hf_configs import TINY_DECODER

    config, out = tmp / f"{model_type}.json", tmp / f"{model_type}-{mesh}.plan.json"
    config.write_text(json.dumps({"model_type": model_type, **TINY_DECODER, **extra}))
    args = ["plan", "--hf-config", str(config), "--cluster", "cpu-local", "--global-batch", "8"]
    args += ["--seq", "16", "--dtype", "fp32", "--optimizer", "sgd", "--no-baselines"]
    args += ["--executable-only", "--mesh", mesh, "--tp-layout", "megatron", "-o", str(out)]
    err = io.StringIO()
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
        code = cli([*args, *pins])
    if code != 0:
        why = (err.getvalue().strip().splitlines() or ["?"])[-1].removeprefix("error: ")
        return "refused: " + why.split(";")[0].split(" (")[0][:120]
    plan = Plan.from_json(out.read_text())
    try:
        ranks = run_local(plan, steps=2, timeout_s=180)
    except RuntimeError as e:
        return "fails: " + str(e).splitlines()[0][:160]
    reference = reference_run(plan, steps=2)
    mode = plan_executor_mode(plan)
    if distributed_losses(ranks, plan) != pytest.approx(reference["losses"], rel=1e-5):
        return f"{mode}: **wrong losses**"
    params = distributed_params(ranks)
    wrong = [n for n, v in params.items() if v != pytest.approx(reference["params"][n], abs=1e-5)]
    if wrong:
        return f"{mode}: **wrong parameters** ({', '.join(wrong[:2])}, ...)"
    try:
        check_ledger(plan, ranks)
    except AssertionError as e:
        rank, what, measured, planned = e.args[0]
        keys = sorted(k for k in set(measured) | set(planned) if measured.get(k) != planned.get(k))
        diff = "; ".join(
            f"{k[0]} on {k[1]}: ran {measured.get(k, (0, 0))}, planned {planned.get(k, (0, 0))}"
            for k in keys
        )
        return f"{mode}: as the reference; ledger differs (rank {rank} {what}: {diff})"
    return f"{mode}: as the reference and as planned"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--meshes", nargs="+", default=["2x1x2", "1x2x2", "1x2x2+sp"])
    parser.add_argument("--types", nargs="+", default=sorted(TYPES))
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for model_type in args.types:
            cells = []
            for spec in args.meshes:
                mesh, _, sp = spec.partition("+")
                pins = SEQUENCE_PARALLEL if sp == "sp" else ()
                cell = survey(model_type, TYPES[model_type], mesh, pins, Path(tmp))
                print(model_type, spec, cell, file=sys.stderr, flush=True)
                cells.append(cell)
            rows.append(f"| {model_type} | " + " | ".join(cells) + " |")
    command = "python bench/hf_conformance.py " + " ".join(sys.argv[1:])
    names = {"2x1x2": "pp2 x tp2", "1x2x2": "dp2 x tp2", "1x2x2+sp": "dp2 x tp2, sequence parallel"}
    text = header("transformers decoders on gloo: run as planned? (issue 41)", command.strip())
    text += "\n\n" + (__doc__ or "").split("\n\n")[0].replace("\n", " ") + "\n\n"
    text += "| model_type | " + " | ".join(names.get(m, m) for m in args.meshes) + " |\n"
    text += "| --- |" + " --- |" * len(args.meshes) + "\n" + "\n".join(rows) + "\n"
    write("hf_conformance.md", text)


if __name__ == "__main__":
    main()
