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
        page.wait_for_function(
            "document.body.innerText.includes('Plan a model on a cluster')", timeout=30_000
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
