"""The service under hostile and unlucky clients at once (issue 35), on loopback only:

- 50 clients post plans (tiny GPTs, 40 distinct requests) and read their views and status;
- 40 slow uploads each declare 8 MiB - 1 byte, send 1 MiB and stall (reconnecting when the
  server gives up on them);
- one client cycles through the worst bodies of the issue: a 40 KB padded token count, a
  non-ASCII bearer token, a deeply nested config override, an execution of a sizing's id,
  and requests with made-up HTTP methods;
- a prober asks /healthz every 50 ms.

For `--seconds` (default 60), then until every accepted job has ended (at most 180 s more).
Reported in bench/results/hostile_load.md: /healthz latency, the server's resident memory,
5xx answers, answers by kind, accepted jobs and how many ended, /metrics size. Bounded: a
fixed number of clients, each request with a timeout, the whole run with a deadline.

    .venv/bin/python bench/hostile_load.py [--seconds 60]
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx
import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import header, write
from service_bench import free_port, start_service

TOKEN = "hostile-load-bench"
TINY = {"name": "gpt-350m", "config": {"layers": 2, "hidden": 128, "heads": 4, "vocab": 512}}


def plan_body(batch: int) -> dict:
    return {
        "model": TINY,
        "cluster": {"name": "cpu-local"},
        "training": {"global_batch_size": batch, "seq_len": 64, "dtype": "fp32"},
        "search": {"executable_only": True, "baselines": False},
    }


class Tally:
    def __init__(self) -> None:
        self.codes: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
        self.errors: collections.Counter = collections.Counter()
        self.accepted: set[str] = set()
        self.health_ms: list[float] = []

    def code(self, kind: str, status: int) -> None:
        self.codes[kind][status] += 1

    @property
    def server_errors(self) -> int:
        return sum(n for c in self.codes.values() for s, n in c.items() if s >= 500)


async def poster(
    http: httpx.AsyncClient, tally: Tally, stop: float, seed: int, think_s: float
) -> None:
    i = seed
    while time.monotonic() < stop:
        i += 1
        await asyncio.sleep(think_s)  # a client's pause between rounds (a person's, a poller's)
        try:
            r = await http.post("/v1/plans", json=plan_body(1 + i % 40))
            tally.code("POST /v1/plans", r.status_code)
            if r.status_code in (200, 202):
                job = r.json()["id"]
                tally.accepted.add(job)
                tally.code("GET view", (await http.get(f"/v1/plans/{job}/view")).status_code)
                tally.code("GET plan", (await http.get(f"/v1/plans/{job}")).status_code)
            elif r.status_code in (429, 503):
                await asyncio.sleep(float(r.headers.get("retry-after", 1)))
        except httpx.HTTPError as err:
            tally.errors[type(err).__name__] += 1


async def slow_upload(port: int, tally: Tally, stop: float) -> None:
    head = (
        "POST /v1/plans HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        f"Content-Length: {8 * 2**20 - 1}\r\n\r\n"
    ).encode()
    while time.monotonic() < stop:
        try:
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(head + b" " * 2**20)
            await writer.drain()
            line = await asyncio.wait_for(reader.readline(), max(0.1, stop - time.monotonic()))
            if line.startswith(b"HTTP/"):
                tally.code("stalled upload", int(line.split()[1]))
            writer.close()
        except (TimeoutError, OSError):
            pass
        await asyncio.sleep(1)  # then again: a stalled client that keeps coming back


async def worst(http: httpx.AsyncClient, tally: Tally, stop: float, sizing_id: str) -> None:
    hf = {
        "model_type": "llama",
        "hidden_size": 64,
        "num_attention_heads": 4,
        "num_hidden_layers": 2,
        "vocab_size": 128,
        "intermediate_size": 128,
    }
    bodies = [
        ("padded token count", {**plan_body(8), "run": {"train_tokens": "1" + " " * 40_000 + "x"}}),
        ("deep override", {**plan_body(8), "model": {"hf_config": hf, "config": {"x": "[" * 999}}}),
    ]
    i = 0
    while time.monotonic() < stop:
        i += 1
        try:
            for kind, body in bodies:
                tally.code(kind, (await http.post("/v1/plans", json=body)).status_code)
            r = await http.post(
                "/v1/plans", json=plan_body(8), headers={"Authorization": b"Bearer \xe9"}
            )
            tally.code("non-ASCII token", r.status_code)
            r = await http.post("/v1/executions", json={"plan_id": sizing_id})
            tally.code("execution of a sizing", r.status_code)
            r = await http.request(f"MADEUP{i}", "/v1/plans")
            tally.code("made-up method", r.status_code)
        except httpx.HTTPError as err:
            tally.errors[type(err).__name__] += 1


async def prober(http: httpx.AsyncClient, tally: Tally, stop: float) -> None:
    while time.monotonic() < stop:
        started = time.perf_counter()
        try:
            r = await http.get("/healthz")
            tally.code("GET /healthz", r.status_code)
            tally.health_ms.append((time.perf_counter() - started) * 1e3)
        except httpx.HTTPError as err:
            tally.errors[type(err).__name__] += 1
        await asyncio.sleep(0.05)


async def run(
    port: int, seconds: int, server: psutil.Process, think_s: float
) -> tuple[Tally, dict]:
    tally = Tally()
    base = f"http://127.0.0.1:{port}"
    limits = httpx.Limits(max_connections=200, max_keepalive_connections=100)
    auth = {"Authorization": f"Bearer {TOKEN}"}
    async with httpx.AsyncClient(base_url=base, timeout=30, limits=limits, headers=auth) as http:
        sizing = await http.post(
            "/v1/sizings",
            json={**plan_body(8), "sizing": {"train_tokens": "1T", "max_nodes": 1}},
        )
        sizing_id = sizing.json()["id"]
        await http.get("/v1/plans/none/view")  # templates and routes warm
        rss = {"start": server.memory_info().rss}
        stop = time.monotonic() + seconds
        tasks = [
            asyncio.create_task(poster(http, tally, stop, 1000 * i, think_s)) for i in range(50)
        ]
        tasks += [asyncio.create_task(slow_upload(port, tally, stop)) for _ in range(40)]
        tasks += [
            asyncio.create_task(worst(http, tally, stop, sizing_id)),
            asyncio.create_task(prober(http, tally, stop)),
        ]
        peak = rss["start"]
        while time.monotonic() < stop:
            await asyncio.sleep(0.5)
            peak = max(peak, server.memory_info().rss)
        await asyncio.wait(tasks, timeout=60)
        rss["peak"] = peak
        rss["end"] = server.memory_info().rss
        # Every accepted job ends.
        deadline = time.monotonic() + 180
        pending = set(tally.accepted)
        while pending and time.monotonic() < deadline:
            for job in list(pending):
                state = (await http.get(f"/v1/plans/{job}")).json()["status"]
                if state not in ("queued", "running"):
                    pending.discard(job)
                    tally.code(f"job {state}", 200)
            await asyncio.sleep(1)
        rss["unfinished"] = len(pending)
        rss["metrics_bytes"] = len((await http.get("/metrics")).content)
    return tally, rss


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seconds", type=int, default=60)
    parser.add_argument("--think", type=float, default=1.0, help="a client's pause, s")
    parser.add_argument("--out", default="hostile_load.md")
    args = parser.parse_args()
    os.environ["AUTOPAR_API_TOKENS"] = TOKEN  # the service start_service starts has tokens
    with tempfile.TemporaryDirectory(prefix="autopar-load-") as tmp:
        port = free_port()
        service = start_service(tmp, port)
        try:
            server = psutil.Process(service.pid)
            tally, rss = asyncio.run(run(port, args.seconds, server, args.think))
        finally:
            service.terminate()
            service.wait(timeout=30)
    ms = sorted(tally.health_ms)
    stalled_503 = tally.codes["stalled upload"][503]  # the body budget, with Retry-After
    p99 = ms[min(len(ms) - 1, int(0.99 * len(ms)))] if ms else float("nan")
    growth = (rss["peak"] - rss["start"]) / 2**20
    requests = sum(sum(c.values()) for c in tally.codes.values())
    command = f"python bench/hostile_load.py --seconds {args.seconds} --think {args.think}"
    text = header("Hostile load", command)
    text += "\n".join(
        [
            "`autopar serve` (SQLite, 2 planning workers, default limits) on loopback; the",
            "load from one asyncio process on the same 2 cores (it shares the CPU with the",
            "server and the planning processes), with API tokens set. Each of the 50 clients",
            f"pauses {args.think} s between rounds (a POST, the plan's page, the plan's JSON)",
            "and honours Retry-After; the hostile ones do neither. "
            f"{requests:,} answers in all ({requests / args.seconds:.0f} per second).",
            "",
            "| measure | value | bar |",
            "|---|---:|---|",
            f"| /healthz p50 | {statistics.median(ms):.1f} ms | |",
            f"| /healthz p99 | {p99:.1f} ms | < 200 ms |",
            f"| /healthz max | {ms[-1]:.1f} ms | |",
            f"| server RSS start / peak / end | {rss['start'] / 2**20:.0f} / "
            f"{rss['peak'] / 2**20:.0f} / {rss['end'] / 2**20:.0f} MB | |",
            f"| server RSS growth (peak - start) | {growth:.0f} MB | < 100 MB |",
            f"| 5xx answers but 503 to stalled uploads | {tally.server_errors - stalled_503} | 0 |",
            f"| accepted jobs / still unfinished after 180 s | {len(tally.accepted)} / "
            f"{rss['unfinished']} | every one ends |",
            f"| /metrics size after | {rss['metrics_bytes'] / 1024:.0f} KB | |",
            f"| client-side errors | {dict(tally.errors) or 'none'} | |",
            "",
            "Answers by kind:",
            "",
            "| kind | statuses |",
            "|---|---|",
            *[
                f"| {kind} | {', '.join(f'{s}: {n}' for s, n in sorted(c.items()))} |"
                for kind, c in sorted(tally.codes.items())
            ],
            "",
        ]
    )
    write(args.out, text)


if __name__ == "__main__":
    main()
