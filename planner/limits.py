"""Bounds on every size a request can name, with the reason for each.

A request (CLI or HTTP) that names a size past these bounds is refused before any work starts,
naming the field. The bounds are generous for real training: each is an order of magnitude or
more above the largest published configuration, so they only stop sizes that no model or
cluster has (and that would otherwise make tracing or the search run without bound).
"""

from __future__ import annotations

import dataclasses
import math
import re
from typing import Annotated, Any

from pydantic import Field

from planner.errors import InputError

# Clusters. The largest announced training clusters hold ~100k GPUs in ~12.5k nodes (xAI
# Colossus, Meta's 2024 H100 clusters): 100,000 nodes leave room for 8x that.
MAX_NODES = 100_000
# GB200 NVL72 puts 72 GPUs in one NVLink domain, NVL576 576: 1,024 per node covers both.
MAX_DEVICES_PER_NODE = 1_024
MAX_DEVICES = 1_048_576  # 2^20 devices in total
# Per-device figures: 1 EFLOP/s (B200 dense fp4 is ~1e16), 1 PiB of memory, 1 PB/s of
# bandwidth, 1 s per message hop; past these a profile is a typo, not a device.
MAX_FLOPS = 1e18
MAX_MEMORY_BYTES = 2**50
MAX_BANDWIDTH = 1e15
MAX_LATENCY_S = 1.0
MAX_MEASURED_POINTS = 10_000  # rows in a profile's measured lists

# Models. Llama-3-405B has 126 layers, GPT-3 96; 10,000 is ~80x the deepest dense LLM.
MAX_LAYERS = 10_000
MAX_WIDTH = 1_048_576  # hidden, ffn, channels: 2^20 (largest published hidden: 25,600)
MAX_HEADS = 65_536
MAX_VOCAB = 4_194_304  # 2^22 (largest published vocabularies: ~256k)
MAX_EXPERTS = 65_536
# the busiest expert-parallel rank's routed rows over the mean: at most ep (every row on one
# rank); ep itself is at most planner.parallel.expert.MAX_EP
MAX_EXPERT_IMBALANCE = 256.0
MAX_CONFIG_INT = 16_777_216  # 2^24: any other integer a model config names
MAX_CONFIG_FLOAT = 1e12  # rope_theta of long-context models is ~1e6-1e7
MAX_PARAMS = 10**15  # 1 quadrillion parameters: ~2,000x the largest published model

# Training. 10M tokens per sequence is ~10x the longest published context training
# (Llama 4 Scout at 256K pre-training, 10M claimed at inference).
MAX_SEQ = 10_000_000
MAX_GLOBAL_BATCH = 16_777_216  # 2^24 samples (Llama 3 405B: 2,048 x 8K sequences)
MAX_MICROBATCHES = 1_048_576
# Schedules timed by replaying their order (planner.cost.schedule_v) build ~3 actions per
# chunk and micro-batch: 2^21 of them take ~1 s and ~100 MB; the search's own cap (8 pp
# micro-batches) stays under it up to pp = 200.
MAX_REPLAYED_ACTIONS = 2_097_152

# Graphs from `autopar trace`: one int field (FLOPs, bytes, dims) at most 2^62, so no sum
# over a graph can leave float range.
MAX_GRAPH_INT = 2**62
# A dimension a cluster profile measured at (matmul shapes, attention sizes): at most 2^53,
# the largest range a JSON number holds exactly as a double (clients and schema checkers
# that compare in doubles take 2^62 + 95 for 2^62, which the service then refuses).
MAX_MEASURED_DIM = 2**53

# Field limits for config keys by name; other ints use MAX_CONFIG_INT.
CONFIG_INT_LIMITS = {
    "layers": MAX_LAYERS,
    "hidden": MAX_WIDTH,
    "ffn_hidden": MAX_WIDTH,
    "channels": MAX_WIDTH,
    "width": MAX_WIDTH,
    "heads": MAX_HEADS,
    "kv_heads": MAX_HEADS,
    "vocab": MAX_VOCAB,
    "experts": MAX_EXPERTS,
    "seq_len": MAX_SEQ,
    "image_size": 65_536,
}

# Names that end up in file names, launch scripts and job names: letters, digits, ". _ - : /"
# (zoo names, "hf:LlamaForCausalLM", "org/model"), never whitespace, quotes or shell syntax.
MODEL_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:/-]{0,199}$")
CLUSTER_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")

# Annotated types for pydantic models.
BoundedGraphInt = Annotated[int, Field(ge=0, le=MAX_GRAPH_INT)]
FiniteFloat = Annotated[float, Field(allow_inf_nan=False)]


def check_int(field: str, value: Any, low: int, high: int, why: str = "") -> int:
    """`value` as an int in [low, high], else an InputError naming `field`."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise InputError(field, f"{value!r} is not an integer", f"an integer in [{low}, {high}]")
    if not low <= value <= high:
        extra = f"; {why}" if why and value > high else ""
        raise InputError(field, f"{value} is out of range{extra}", f"an integer in [{low}, {high}]")
    return value


def check_config(config: Any, prefix: str) -> None:
    """Every numeric field of a model config dataclass within its bound."""
    for f in dataclasses.fields(config):
        value = getattr(config, f.name)
        field = f"{prefix}.{f.name}"
        if isinstance(value, bool) or value is None:
            continue
        if isinstance(value, int):
            check_int(field, value, 0, CONFIG_INT_LIMITS.get(f.name, MAX_CONFIG_INT))
        elif isinstance(value, float) and (
            not math.isfinite(value) or abs(value) > MAX_CONFIG_FLOAT
        ):
            raise InputError(field, f"{value!r} is not a usable number", "a finite number")
