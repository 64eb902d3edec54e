"""Service bench: plan gpt-1.3b on 8 A100s through the API (POST to done), first with an empty
disk cache (cold) and then the same request again (warm: traces and layouts cached), then 50
concurrent clients fetching that stored plan for 30 s (p50/p99 latency, errors).

The service runs as `autopar serve` in its own process (one uvicorn worker, SQLite store); the
load comes from wrk (Debian package) when it is installed, else from a Python asyncio client
(which then shares the CPU with the server and inflates latencies).

    .venv/bin/python bench/service_bench.py [--clients 50] [--seconds 30]
        [--planning-clients 10] [--plans-per-client 10]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import header, write

BODY = {
    "model": {"name": "gpt-1.3b", "config": {}},
    "cluster": {"name": "dgx-a100-80g", "nodes": 1},
    "training": {"global_batch_size": 64, "seq_len": 1024},
}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_service(data_dir: str, port: int) -> subprocess.Popen:
    env = {**os.environ, "AUTOPAR_DATA_DIR": data_dir, "AUTOPAR_CACHE_DIR": f"{data_dir}/cache"}
    exe = Path(sys.executable).with_name("autopar")
    proc = subprocess.Popen(
        [str(exe), "serve", "--port", str(port)],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/healthz").status_code == 200:
                return proc
        except httpx.TransportError:
            time.sleep(0.2)
    proc.kill()
    raise RuntimeError("the service did not start")


def plan_through_api(base: str, body: dict = BODY) -> tuple[str, float, dict]:
    started = time.perf_counter()
    job = httpx.post(f"{base}/v1/plans", json=body, timeout=30).json()
    while True:
        state = httpx.get(f"{base}/v1/plans/{job['id']}", timeout=30).json()
        if state["status"] not in ("queued", "running"):
            return job["id"], time.perf_counter() - started, state
        time.sleep(0.1)


def concurrent_plans(base: str, clients: int, per_client: int, kind: str) -> list[float]:
    """POST to done of `clients` x `per_client` requests, each client one after the other, all
    clients at once. kind "new": gpt-1.3b as BODY at its own (global batch, top_k) per
    request, so that each is a new job and a new search (not the stored plan, not a cached
    answer) whose traces are in the disk cache; "run": BODY with its own run to price
    (run.train_tokens), whose search was answered before: the service prices the disk
    cache's answer for the run in its own process, no job; "same": BODY again (the stored
    plan)."""
    import concurrent.futures

    def client(index: int) -> list[float]:
        out = []
        with httpx.Client(base_url=base, timeout=120) as http:  # one connection per client
            for i in range(per_client):
                body, n = BODY, index * per_client + i
                if kind == "run":
                    body = {**BODY, "run": {"train_tokens": 1e9 * (1 + n)}}
                if kind == "new":
                    training = {**BODY["training"], "global_batch_size": 64 + 8 * (n % 10)}
                    search = {**BODY.get("search", {}), "top_k": 1 + n // 10 % 20}
                    body = {**BODY, "training": training, "search": search}
                started = time.perf_counter()
                state = http.post("/v1/plans", json=body).json()
                while state["status"] in ("queued", "running"):
                    time.sleep(0.05)
                    state = http.get(f"/v1/plans/{state['id']}").json()
                assert state["status"] == "done", state
                out.append(time.perf_counter() - started)
        return out

    with concurrent.futures.ThreadPoolExecutor(clients) as pool:
        return [t for times in pool.map(client, range(clients)) for t in times]


def load_wrk(url: str, clients: int, seconds: int) -> dict:
    out = subprocess.run(
        ["wrk", "-t2", f"-c{clients}", f"-d{seconds}s", "--latency", url],
        capture_output=True,
        text=True,
        check=True,
    ).stdout

    def ms(label: str) -> float:
        m = re.search(rf"{label}\s+([\d.]+)(us|ms|s)\b", out)
        value, unit = float(m.group(1)), m.group(2)
        return value / 1000 if unit == "us" else value * 1000 if unit == "s" else value

    requests = int(re.search(r"(\d+) requests in", out).group(1))
    errors = 0
    m = re.search(r"Non-2xx or 3xx responses: (\d+)", out)
    errors += int(m.group(1)) if m else 0
    m = re.search(r"Socket errors: connect (\d+), read (\d+), write (\d+), timeout (\d+)", out)
    errors += sum(int(x) for x in m.groups()) if m else 0
    return {
        "tool": "wrk -t2",
        "requests": requests,
        "errors": errors,
        "p50_ms": ms("50%"),
        "p90_ms": ms("90%"),
        "p99_ms": ms("99%"),
        "rps": requests / seconds,
    }


def load_python(url: str, clients: int, seconds: int) -> dict:
    latencies: list[float] = []
    errors = 0

    async def client(http: httpx.AsyncClient, stop: float) -> None:
        nonlocal errors
        while time.perf_counter() < stop:
            t = time.perf_counter()
            try:
                r = await http.get(url)
                if r.status_code != 200:
                    errors += 1
            except httpx.HTTPError:
                errors += 1
            latencies.append((time.perf_counter() - t) * 1000)

    async def main() -> None:
        limits = httpx.Limits(max_connections=clients)
        async with httpx.AsyncClient(limits=limits, timeout=30) as http:
            stop = time.perf_counter() + seconds
            await asyncio.gather(*(client(http, stop) for _ in range(clients)))

    asyncio.run(main())
    q = statistics.quantiles(latencies, n=100)
    return {
        "tool": "python httpx asyncio",
        "requests": len(latencies),
        "errors": errors,
        "p50_ms": q[49],
        "p90_ms": q[89],
        "p99_ms": q[98],
        "rps": len(latencies) / seconds,
    }


def _quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--clients", type=int, default=50)
    ap.add_argument("--seconds", type=int, default=30)
    ap.add_argument("--planning-clients", type=int, default=10)
    ap.add_argument("--plans-per-client", type=int, default=10)
    args = ap.parse_args()
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    with tempfile.TemporaryDirectory() as data:
        proc = start_service(data, port)
        try:
            time.sleep(5)  # the fork server's imports, done once at start-up
            plan_id, cold_s, cold = plan_through_api(base)
            # Another batch size: a new job, its traces (per micro-batch) from the disk cache.
            other = {**BODY, "training": {**BODY["training"], "global_batch_size": 128}}
            _, plan_s, state = plan_through_api(base, other)
            _, repeat_s, _ = plan_through_api(base)  # identical: the stored plan (HTTP 200)
            n, per = args.planning_clients, args.plans_per_client
            stored = concurrent_plans(base, n, per, "same")
            runs = concurrent_plans(base, n, per, "run")
            posts = concurrent_plans(base, n, per, "new")
            assert cold["status"] == state["status"] == "done", (cold, state)
            url = f"{base}/v1/plans/{plan_id}"
            size = len(httpx.get(url).content)
            runner = load_wrk if shutil.which("wrk") else load_python
            load = runner(url, args.clients, args.seconds)
        finally:
            proc.terminate()
            proc.wait(timeout=30)
    mesh, wmesh = cold["plan"]["mesh"]["shape"], state["plan"]["mesh"]["shape"]
    text = header(
        "Service: planning through the API, and fetching a stored plan under load",
        f"python bench/service_bench.py --clients {args.clients} --seconds {args.seconds}",
    )
    text += "\n" + "\n".join(
        [
            "## Planning gpt-1.3b on dgx-a100-80g (8 GPUs), global batch 64, seq 1024",
            "",
            "| cache | POST to done | search (in the job) | plan | predicted step |",
            "|---|---|---|---|---|",
            f"| cold, batch 64 | {cold_s:.2f} s | {cold['plan']['search']['time_s']:.2f} s "
            f"| pp{mesh[0]} dp{mesh[1]} tp{mesh[2]} | {cold['step_time_s']:.3f} s |",
            f"| warm, batch 128 | {plan_s:.2f} s | {state['plan']['search']['time_s']:.2f} s "
            f"| pp{wmesh[0]} dp{wmesh[1]} tp{wmesh[2]} | {state['step_time_s']:.3f} s |",
            f"| batch 64 again | {repeat_s:.2f} s | - | the stored plan | |",
            "",
            "POST to done (client's clock, polling every 0.1 s) includes forking the planning",
            "process from the service's fork server (planner, torch and torch._dynamo already",
            "imported), two meta traces (cold) or reading them from the disk cache (warm), the",
            "search (one process: jobs do not fork workers of their own) and the",
            "three baselines. Cold: an empty AUTOPAR_CACHE_DIR; warm: the same model at another",
            "global batch (a new job; traces, layouts and cost tables of the micro-batch sizes",
            "both consider come from the disk cache); again: the identical request, answered",
            "from the store with the plan planned before.",
            "",
            f"## {args.planning_clients} concurrent clients planning, warm",
            "",
            "| requests | POST to done p50 s | p90 s | p99 s | max s |",
            "|---|---|---|---|---|",
            *(
                f"| {what} | {_quantile(t, 0.5):.2f} | {_quantile(t, 0.9):.2f} | "
                f"{_quantile(t, 0.99):.2f} | {max(t):.2f} |"
                for what, t in (
                    ("the same request (stored plan)", stored),
                    ("another run to price (the search's answer cached: no job)", runs),
                    ("new searches", posts),
                )
            ),
            "",
            f"Each of {args.planning_clients} clients sends {args.plans_per_client} requests one "
            "after the other (one connection each, polling every 50 ms), all clients at once: "
            "first the request above again (answered from the store); then the same request "
            "with its own `run.train_tokens`, whose search (independent of the run) the disk "
            "cache answers: the service prices that answer for the run in its own process and "
            "stores it done (201), no planning process; then gpt-1.3b at its own "
            "global batch (64-136) and top_k per request, each a new job and a new search whose "
            "traces are in the disk cache. The service plans AUTOPAR_PLAN_WORKERS (2) jobs at a "
            "time, the rest queue; a job runs the search and the four baseline grids in one "
            "process.",
            "",
            f"## {args.clients} concurrent clients, GET /v1/plans/{{id}} for {args.seconds} s",
            "",
            "| load tool | requests | req/s | errors | p50 ms | p90 ms | p99 ms | body |",
            "|---|---|---|---|---|---|---|---|",
            f"| {load['tool']} | {load['requests']} | {load['rps']:.0f} | {load['errors']} | "
            f"{load['p50_ms']:.1f} | {load['p90_ms']:.1f} | {load['p99_ms']:.1f} | "
            f"{size / 1024:.0f} KiB |",
            "",
            "Target: p99 < 50 ms, zero errors. One uvicorn worker process serves everything.",
            "",
        ]
    )
    write("service.md", text)


if __name__ == "__main__":
    main()
