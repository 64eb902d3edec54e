"""Headless Chromium (Debian's, driven by Playwright) with the network off: /docs, /redoc and a
plan view render their content from the app's own assets; screenshots go to test-output/."""

from __future__ import annotations

import os
import time
from pathlib import Path
from urllib.parse import urlparse

import httpx
import pytest

from planner.vocab import BASELINE_KINDS
from tests.service.conftest import make_settings, plan_body, serve

CHROMIUM = os.environ.get("AUTOPAR_CHROMIUM", "/usr/bin/chromium")
OUTPUT = Path(os.environ.get("AUTOPAR_TEST_OUTPUT", "test-output")) / "screenshots"
FLAGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]


@pytest.fixture(scope="module")
def browser():
    from playwright.sync_api import sync_playwright

    assert Path(CHROMIUM).exists(), f"{CHROMIUM} missing: `make test` installs Debian's chromium"
    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, headless=True, args=FLAGS)
        yield b
        b.close()


class Offline:
    """A page whose requests may only go to the local server; records every failure."""

    def __init__(self, browser, base: str):
        self.context = browser.new_context(viewport={"width": 1280, "height": 900})
        self.page = self.context.new_page()
        self.failures: list[str] = []
        local = urlparse(base).netloc
        self.context.route("**/*", self._route(local))
        self.page.on("requestfailed", lambda r: self.failures.append(f"failed {r.url}"))
        self.page.on(
            "response",
            lambda r: r.status >= 400 and self.failures.append(f"{r.status} {r.url}"),
        )
        self.page.on("pageerror", lambda e: self.failures.append(f"script error {e}"))
        # A script, style or image the page's Content-Security-Policy blocked.
        self.page.on(
            "console",
            lambda m: "Content Security Policy" in m.text and self.failures.append(m.text),
        )

    def _route(self, local: str):
        def handle(route):
            url = urlparse(route.request.url)
            if url.scheme in ("data", "blob") or url.netloc == local:
                route.continue_()
            else:
                self.failures.append(f"blocked external {route.request.url}")
                route.abort("internetdisconnected")

        return handle

    def close(self):
        self.context.close()


def _shot(page, name: str) -> Path:
    OUTPUT.mkdir(parents=True, exist_ok=True)
    path = OUTPUT / f"{name}.png"
    page.screenshot(path=str(path), full_page=True)
    assert path.stat().st_size > 10_000  # a rendered page, not a blank one
    return path


def test_docs_and_redoc_work_offline_and_try_it_out_plans(browser, tmp_path):
    with serve(make_settings(tmp_path), start_workers=False) as base:
        tab = Offline(browser, base)
        page = tab.page
        page.goto(f"{base}/docs")
        page.wait_for_selector(".opblock-summary-path", timeout=30_000)
        paths = page.locator(".opblock-summary-path").all_inner_texts()
        assert "/v1/plans" in [p.replace("\u200b", "") for p in paths]
        # One click on "Try it out" + Execute posts the worked example (gpt-1.3b, dgx-a100-80g).
        post = page.locator(".opblock-post", has_text="/v1/plans").first
        post.locator(".opblock-summary").click()
        post.locator("button.try-out__btn").click()
        post.locator("button.execute").click()
        live = post.locator(".live-responses-table tbody .response-col_status").first
        live.wait_for(timeout=30_000)
        status = live.inner_text()
        assert status.strip().startswith("202"), status
        _shot(page, "docs")
        listed = httpx.get(f"{base}/v1/plans").json()["items"]
        assert listed and listed[0]["model"] == "gpt-1.3b"

        page.goto(f"{base}/redoc")
        # (wait_for_function evaluates a string in the page, which the CSP forbids)
        page.get_by_text("Plan a model on a cluster").first.wait_for(
            state="attached", timeout=30_000
        )
        _shot(page, "redoc")
        tab.close()
        assert tab.failures == [], tab.failures


def test_plan_view_renders_offline(browser, tmp_path):
    with serve(make_settings(tmp_path), start_workers=True) as base:
        job = httpx.post(
            f"{base}/v1/plans", json=plan_body(search={"executable_only": True})
        ).json()
        deadline = time.monotonic() + 120
        while httpx.get(f"{base}/v1/plans/{job['id']}").json()["status"] != "done":
            assert time.monotonic() < deadline
            time.sleep(0.3)
        tab = Offline(browser, base)
        page = tab.page
        page.goto(f"{base}/v1/plans/{job['id']}/view")
        page.wait_for_selector("svg.gantt rect")
        assert page.locator(".device").count() == 4  # cpu-local: 1 node x 4 devices
        assert page.locator("svg.gantt rect").count() > 0
        # the plan and one row per baseline family
        assert page.locator("table.baselines tbody tr").count() == 1 + len(BASELINE_KINDS)
        assert "Memory per device" in page.inner_text("body")
        _shot(page, "plan-view")
        tab.close()
        assert tab.failures == [], tab.failures


def _stored(settings, plans: dict) -> None:
    """Plans put in the service's store as finished jobs (made in process, not queued)."""
    import json

    from api.service.store import PlanRow, Store

    store = Store(settings.database_url)
    with store.session() as s:
        for plan_id, plan in plans.items():
            s.add(
                PlanRow(
                    id=plan_id,
                    request_hash=plan_id,
                    status="done",
                    model_name=plan.request.model.name,
                    cluster_name=plan.request.cluster.name,
                    request_json="{}",
                    plan_json=plan.to_json(indent=None),
                    baselines_json=json.dumps([]),
                    created_at=time.time(),
                )
            )
    store.close()


def test_viewer_pages_collapse_layers_draw_comm_lanes_and_compare(browser, tmp_path):
    from tests.api.viewer_plans import llama, recorded

    plans = {
        "llama80": llama(False, str(tmp_path)),
        "interleaved": llama(True, str(tmp_path)),
        "moe": recorded("moe-10b-16gpu"),  # 8 layers a stage: runs of alike layers
    }
    settings = make_settings(tmp_path)
    settings.data_dir.mkdir(parents=True, exist_ok=True)
    _stored(settings, plans)
    with serve(settings, start_workers=False) as base:
        tab = Offline(browser, base)
        page = tab.page
        page.goto(f"{base}/v1/plans/llama80/view")
        page.wait_for_selector("svg.gantt rect.comm")
        # 80 layers over 4 stages: one collapsed row per stage (20 layers each)
        collapsed = page.locator("details.layers.collapsed summary").all_inner_texts()
        assert len(collapsed) == 4 and all("same sharding (20 layers)" in t for t in collapsed)
        assert page.locator("svg.gantt rect.comm.send").count() > 0
        assert page.locator("svg.gantt text.lane.comm").count() == 4
        _shot(page, "viewer-llama3-70b-80-layers")
        page.goto(f"{base}/v1/plans/interleaved/view")
        page.wait_for_selector("svg.gantt rect.pass")
        lanes = page.locator("svg.gantt text.lane.compute").all_text_contents()
        rows = page.locator(".mem-label").all_inner_texts()
        assert lanes == rows == [f"stage {s} (c{s}, c{s + 4})" for s in range(4)]
        assert page.locator(".device[title*='stage 1 · chunks 1, 5']").count() == 16
        _shot(page, "viewer-interleaved")
        page.goto(f"{base}/v1/plans/moe/view")
        page.wait_for_selector("svg.gantt rect.pass")
        assert page.locator("details.layers.collapsed").count() > 0
        _shot(page, "viewer-moe")
        page.goto(f"{base}/v1/plans/compare?a=llama80&b=interleaved")
        page.wait_for_selector("table.comparison")
        assert page.locator("svg.gantt").count() == 2
        body = page.inner_text("table.comparison")
        a, b = plans["llama80"].predicted, plans["interleaved"].predicted
        assert f"{a.step_time_s:.3f} s" in body and f"{b.step_time_s:.3f} s" in body
        _shot(page, "viewer-compare")
        missing = httpx.get(f"{base}/v1/plans/compare", params={"a": "llama80", "b": "nope"})
        assert missing.status_code == 404
        tab.close()
        assert tab.failures == [], tab.failures
