"""Random pinned plans for the ledger's property check (issue 36): a seeded draw of model (the
zoo's GPT and Llama, transformers' Llama and Qwen2 built from their configs),
mesh (at most 4 ranks), ZeRO level, schedule, checkpointing, sequence parallelism,
micro-batch size and fp8 recipe, planned by `autopar plan` with the default search; each
must run on gloo without the executor refusing it, and its ledger must match the plan's.
`tests/executor/test_ledger_property.py` runs a sample; `bench/ledger_property.py` all."""

from __future__ import annotations

import contextlib
import io
import json
import random
from pathlib import Path

from api.cli import main as cli_main
from planner.plan import Plan
from tests.hf_configs import TINY_DECODER

MODELS = {
    "gpt": ("gpt-350m", {"layers": 4, "hidden": 64, "heads": 4, "vocab": 128}),
    "llama": (
        "llama3-8b",
        {"layers": 4, "hidden": 64, "heads": 8, "kv_heads": 4, "ffn_hidden": 128, "vocab": 128},
    ),
}
# transformers' models by config.json (tests/hf_configs.py's decoder with 4 layers and 8 heads
# in 4 key/value groups, so that tp 4 divides both); the executor runs no sequence
# parallelism on them (planner.parallel.sequence.FAMILIES)
HF_DECODER = {**TINY_DECODER, "num_hidden_layers": 4, "num_attention_heads": 8}
HF_MODELS = {
    "hf-llama": {"model_type": "llama", **HF_DECODER, "num_key_value_heads": 4},
    "hf-qwen2": {
        "architectures": ["Qwen2ForCausalLM"],
        **HF_DECODER,
        "num_key_value_heads": 4,
        "tie_word_embeddings": True,
    },
}
MESHES = [(1, 4, 1), (1, 2, 2), (1, 1, 4), (2, 2, 1), (2, 1, 2)]  # cpu-local's 4 devices
SCHEDULES = ["1f1b", "gpipe", "interleaved_1f1b", "interleaved_zero_bubble", "zbv_zero_bubble"]
ZERO_BUBBLE = ("interleaved_zero_bubble", "zbv_zero_bubble")  # not with ZeRO-3
CHECKPOINTING = ["off", "on", "selective"]


def draw(rng: random.Random) -> tuple[str, list[str]]:
    """A model key and `autopar plan` pins."""
    family = rng.choice(sorted(MODELS) + sorted(HF_MODELS))
    pp, dp, tp = rng.choice(MESHES)
    zero = rng.choice([0, 1, 2, 3]) if dp > 1 else 0
    pins = ["--mesh", f"{pp}x{dp}x{tp}", "--zero", str(zero)]
    schedule = None
    if pp > 1:
        schedule = rng.choice([s for s in SCHEDULES if zero < 3 or s not in ZERO_BUBBLE])
        pins += ["--schedule", schedule]
    checkpointing = rng.choice(CHECKPOINTING)
    # what the planner refuses under a split backward (checkpointing) is not drawn (the
    # draws stay as seeded)
    split = schedule in ZERO_BUBBLE
    pins += ["--checkpointing", "off" if split else checkpointing]
    if tp > 1:
        sp = rng.choice(["on", "off"])
        pins += ["--sequence-parallel", "off" if family in HF_MODELS else sp]
    if rng.random() < 0.5:
        pins += ["--microbatch-size", str(rng.choice([1, 2]))]
    fp8 = rng.choice([None, None, "tensorwise", "rowwise"])  # cpu-local: software float8
    if fp8 and not split:
        pins += ["--fp8", fp8]
    return family, pins


def plan_for(family: str, pins: list[str], tmp: Path) -> Plan | None:
    """The default search's plan under the pins, or None where none fits them."""
    path = tmp / "plan.json"
    if family in HF_MODELS:
        config_path = tmp / f"{family}.json"
        config_path.write_text(json.dumps(HF_MODELS[family]))
        args = ["plan", "--hf-config", str(config_path)]
    else:
        name, config = MODELS[family]
        args = ["plan", "--model", name, "--config", *(f"{k}={v}" for k, v in config.items())]
    args += ["--cluster", "cpu-local", "--global-batch", "8", "--seq", "16", "--dtype", "fp32"]
    args += ["--optimizer", "sgd", "--no-baselines", "-o", str(path), *pins]
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        code = cli_main(args)
    return Plan.from_json(path.read_text()) if code == 0 else None
