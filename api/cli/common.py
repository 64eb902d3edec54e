"""Helpers shared by the `autopar` commands: model and training arguments, progress."""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path

from planner.errors import InputError
from planner.limits import MAX_GLOBAL_BATCH, MAX_NODES, MAX_SEQ
from planner.vocab import ATTENTION_KERNELS, DTYPES, OPTIMIZERS, RUNTIME_NAMES

MAX_STEPS = 10_000_000  # training steps of one run
WEEK_S = 7 * 24 * 3600.0  # the longest wait any timeout here may ask for

# Request fields (as the planner's errors name them) and the flags that set them.
FIELD_FLAGS = {
    "model.name": "--model",
    "model.config": "--config",
    "model.hf_config": "--hf-config",
    "model.graph": "--graph",
    "training.global_batch_size": "--global-batch",
    "training.seq_len": "--seq",
    "training.dtype": "--dtype",
    "training.optimizer": "--optimizer",
    "training.attention": "--attention",
    "training.expert_imbalance": "--expert-imbalance",
    "training.runtime": "--runtime",
    "mesh": "--dp/--tp/--pp",
    "mesh.dp": "--dp",
    "mesh.tp": "--tp",
    "mesh.pp": "--pp",
    "mesh.dp_shard": "--dp-shard",
    "mesh.cp": "--cp",
    "mesh.ep": "--ep",
    "mesh.etp": "--etp",
    "stages[].cpu_offload": "--cpu-offload",
    "stages[].resharded_layers": "--layerwise-zero",
    "search.layerwise_zero": "--layerwise-zero",
    "search.cpu_offload": "--cpu-offload",
    "fp8": "--fp8",
    "search.fp8": "--fp8",
    "schedule.name": "--schedule",
    "schedule.microbatches": "--microbatches",
    "schedule.virtual_stages": "--virtual-stages",
    "zero": "--zero",
    "sequence_parallel": "--sequence-parallel",
    "search.mesh": "--mesh",
    "search.microbatch_size": "--microbatch-size",
    "search.tp_layout": "--tp-layout",
    "search.sequence_parallel": "--sequence-parallel",
    "search.virtual_stages": "--virtual-stages",
    "search.dp_shard": "--dp-shard",
    "search.cp": "--cp",
    "search.solver": "--solver",
    "baseline.kind": "--kind",
}


def flag_for(field: str) -> str | None:
    """The CLI flag that sets a request field (its longest listed prefix), if any: listed
    above, or a pin's (`search.<pin>`)."""
    from planner.pins import PINS

    flags = FIELD_FLAGS | {f"search.{pin.name}": pin.flag for pin in PINS}
    parts = field.split(".")
    for n in range(len(parts), 0, -1):
        flag = flags.get(".".join(parts[:n]))
        if flag:
            return flag
    return None


def global_batch(text: str) -> int | str:
    """--global-batch: a count, or a range / auto that planner.search.batch reads."""
    return count(1, MAX_GLOBAL_BATCH)(text) if text.strip().isdigit() else text


def count(low: int, high: int) -> Callable[[str], int]:
    """An argparse type: an integer in [low, high] (argparse names the flag on error)."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if not low <= value <= high:
            raise argparse.ArgumentTypeError(f"{value} is not in [{low}, {high:,}]")
        return value

    parse.__name__ = "integer"
    return parse


def seconds(high: float) -> Callable[[str], float]:
    """An argparse type: a finite number of seconds in (0, high]."""

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
        if not 0 < value <= high:  # also refuses NaN
            raise argparse.ArgumentTypeError(f"{text} is not in (0, {high:g}]")
        return value

    parse.__name__ = "number"
    return parse


def progress_printer(enabled: bool) -> Callable[[str], None]:
    started = time.perf_counter()

    def say(step: str) -> None:
        if enabled:
            print(f"  [{time.perf_counter() - started:5.1f}s] {step}", file=sys.stderr, flush=True)

    return say


def write_or_print(text: str, output: str | None) -> None:
    if output:
        Path(output).write_text(text + "\n")
        print(f"wrote {output}", file=sys.stderr)
    else:
        print(text)


def add_model_args(p: argparse.ArgumentParser, graph: bool = True) -> None:
    g = p.add_argument_group("model (one of)")
    g.add_argument("--model", help="zoo model name (see `autopar models`)")
    g.add_argument(
        "--hf-config",
        help="Hugging Face config.json of a causal LM transformers builds (Llama, Mistral, "
        "Qwen, Mixtral, DeepSeek, GPT-2, Gemma, Phi ...; without transformers installed: "
        "Llama-family configs only)",
    )
    if graph:
        g.add_argument("--graph", help="OpGraph JSON written by `autopar trace`")
    g.add_argument(
        "--config", nargs="*", metavar="KEY=VALUE", help="override model parameters: layers=12"
    )


def model_fields(args: argparse.Namespace) -> dict:
    """The model flags as a request body's `model`: {name, config}, {hf_config, config} or
    {graph} (files are read here, on the user's machine; the planner gets their JSON)."""
    from planner.models.config import parse_key_values
    from planner.models.hf_config import load_hf_config

    overrides = parse_key_values(args.config)
    if getattr(args, "graph", None):
        return {"graph": _read_json(args.graph, "--graph")}
    if args.hf_config:
        return {"hf_config": load_hf_config(args.hf_config), "config": overrides}
    if not args.model:
        raise InputError("--model", "missing", "a zoo model name, --hf-config or --graph")
    return {"name": args.model, "config": overrides}


def training_fields(args: argparse.Namespace) -> dict:
    """The training flags as a request body's `training` (unset ones left to the planner)."""
    return {
        "global_batch_size": args.global_batch,
        "seq_len": args.seq,
        "dtype": args.dtype,
        "optimizer": args.optimizer,
        "attention": args.attention,
        "runtime": args.runtime,
        "expert_imbalance": args.expert_imbalance,
    }


def planning_request(args: argparse.Namespace):
    """The one request path (planner.request), as the service takes it."""
    from planner.request import resolve_request

    return resolve_request(model_fields(args), cluster_from_args(args), training_fields(args))


def resolve_model(args: argparse.Namespace):
    """A zoo or Hugging Face model from the flags (for commands without training settings)."""
    from planner.models import ModelSpec, resolve

    fields = model_fields(args)
    if "graph" in fields:
        raise InputError("--graph", "this command traces a model", "--model or --hf-config")
    return resolve(ModelSpec(**fields))


def read_graph(path: str):
    """An OpGraph from a file written by `autopar trace`."""
    from planner.graph.opgraph import OpGraph

    try:
        text = Path(path).read_text()
    except OSError as err:
        raise InputError("--graph", f"cannot read {path}: {err.strerror}") from None
    return OpGraph.from_json(text, field="--graph")


def _read_json(path: str, flag: str):
    try:
        text = Path(path).read_text()
    except OSError as err:
        raise InputError(flag, f"cannot read {path}: {err.strerror}") from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as err:
        raise InputError(flag, f"{path} is not valid JSON: {err}") from None


def add_cluster_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--cluster", required=True, help="bundled profile name or YAML path")
    p.add_argument("--nodes", type=count(1, MAX_NODES), help="override the profile's node count")
    p.add_argument(
        "--op-db", help="operator profile database (autopar profile-ops): measured op times"
    )
    p.add_argument(
        "--memory-headroom",
        metavar="SHARE|AMOUNT",
        help="device memory every plan leaves free for allocator fragmentation and the "
        "runtime: a share ('0.08', '8%%') or an amount ('4GiB'); 0 plans to the last byte "
        "(default: 5%%)",
    )


def cluster_from_args(args: argparse.Namespace):
    """The --cluster profile with --nodes, --memory-headroom and --op-db applied."""
    from planner.cluster.headroom import with_headroom
    from planner.cluster.profile import load_cluster
    from planner.cluster.profiling import inline_op_db

    cluster = load_cluster(args.cluster, args.nodes)
    cluster = with_headroom(cluster, args.memory_headroom, field="--memory-headroom")
    op_db = getattr(args, "op_db", None)
    return inline_op_db(cluster, op_db) if op_db else cluster


def add_precision_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--dtype",
        choices=DTYPES,
        help="training precision (default: the best the device supports: bf16, else fp16; "
        "fp8 matmuls inside a bf16 run: --fp8)",
    )
    p.add_argument("--optimizer", default="adamw", choices=OPTIMIZERS)
    p.add_argument(
        "--attention", default="flash", choices=ATTENTION_KERNELS, help="attention kernel"
    )
    p.add_argument(
        "--runtime",
        default="autopar",
        choices=RUNTIME_NAMES,
        help="what will execute the plan: autopar's executor, or the framework it is exported "
        "to; its memory layout and ZeRO levels are planned for (planner/runtime/)",
    )
    p.add_argument(
        "--expert-imbalance",
        type=float,
        metavar="F",
        help="expert parallelism with dropless routing: the busiest rank's routed rows over "
        "the group's mean (default 1: balanced; DeepSeek-V3's MaxVio + 1)",
    )


def add_training_args(p: argparse.ArgumentParser) -> None:
    add_cluster_args(p)
    p.add_argument(
        "--global-batch",
        type=global_batch,
        required=True,
        help="samples per step; `autopar plan` also takes LO-HI or auto (1 to 16 per GPU) "
        "and searches the batch for tokens/s (planner/search/batch.py)",
    )
    p.add_argument("--seq", type=count(1, MAX_SEQ))
    add_precision_args(p)


def progress_bar(enabled: bool):
    """A progress bar per planning step on stderr (rich; only on a terminal)."""
    if not enabled:
        return lambda _step, _done, _total: None
    from rich.console import Console
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
        TimeRemainingColumn,
    )

    state: dict = {}

    def show(step: str, done: int, total: int) -> None:
        if state.get("step") != step:
            if "bar" in state:
                state["bar"].stop()
            bar = Progress(
                TextColumn("  {task.description}"),
                BarColumn(),
                MofNCompleteColumn(),
                TimeElapsedColumn(),
                TextColumn("eta"),
                TimeRemainingColumn(),
                console=Console(stderr=True),
            )
            bar.start()
            state.update(step=step, bar=bar, task=bar.add_task(step, total=total))
        state["bar"].update(state["task"], completed=done, total=total)
        if done >= total:
            state.pop("bar").stop()
            state.pop("step")

    return show


def mesh_arg(text: str) -> tuple[int, int, int]:
    """argparse type of --mesh: "PPxDPxTP", e.g. "2x2x1"."""
    from planner.parallel.technique import mesh_of

    if (mesh := mesh_of(text)) is None:
        raise argparse.ArgumentTypeError(
            f"{text!r}: expected PPxDPxTP with three positive integers, e.g. 2x2x1"
        )
    pp, dp, tp = mesh
    return pp, dp, tp


def add_executable_args(p: argparse.ArgumentParser) -> None:
    """Whether the search returns only plans the executor runs (the default)."""
    group = p.add_mutually_exclusive_group()
    group.add_argument(
        "--executable-only",
        dest="executable_only",
        action="store_true",
        default=True,
        help="only plans `autopar execute` runs (the default)",
    )
    group.add_argument(
        "--allow-non-executable",
        dest="executable_only",
        action="store_false",
        help="the best plan under the cost model even where the executor cannot run it (the "
        "plan says why)",
    )
