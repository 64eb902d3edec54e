"""Plans the viewer tests draw: Llama-3-70B's 80 layers on 64 H100 (pp 4, 1F1B and
interleaved with 2 chunks per device), evaluated in process; a recorded MoE plan (Alpa's
suite fixture) and the demo's tiny CPU plan."""

from __future__ import annotations

import json
from functools import cache
from pathlib import Path

from api.cli.main import main
from planner.plan import Plan

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "same_plans"
LLAMA = [
    "estimate", "--model", "llama3-70b", "--cluster", "dgx-h100", "--nodes", "8", "--dp", "2",
    "--tp", "8", "--pp", "4", "--microbatches", "16", "--global-batch", "64", "--seq", "4096",
    "--zero", "1", "--checkpointing", "selective",
]  # fmt: skip


@cache
def llama(interleaved: bool, out_dir: str) -> Plan:
    path = Path(out_dir) / f"llama-{interleaved}.json"
    extra = ["--schedule", "interleaved_1f1b", "--virtual-stages", "2"] if interleaved else []
    assert main([*LLAMA, *extra, "-o", str(path)]) == 0
    return Plan.from_json(path.read_text())


def recorded(name: str) -> Plan:
    """A recorded plan (the fixtures leave the search's timing out)."""
    doc = json.loads((FIXTURES / f"{name}.json").read_text())
    plan = doc.get("plan", doc)
    plan["search"].setdefault("time_s", 0.0)
    return Plan.model_validate(plan)
