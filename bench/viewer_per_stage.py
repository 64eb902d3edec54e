"""Issue 40's viewer: a plan whose stages run on submeshes of their own, drawn by the plan
viewer in headless Chromium (the page as `autopar serve` renders it, its CSS inline).

The plan: Alpa's MoE-10B on two p3.16xlarge nodes, batch 1024 fp16, as
tests/planner/test_submesh_search.py searches it (no expert parallelism or checkpointing,
plans the executor cannot run allowed).

Run: python bench/viewer_per_stage.py   (writes results/viewer-per-stage.png)
"""

from __future__ import annotations

import tempfile
from pathlib import Path

from common import RESULTS

from api.viewer import render_page
from planner.cluster.profile import load_cluster
from planner.request import resolve_request
from planner.search.search import search
from planner.search.space import SearchOptions

CHROMIUM = "/usr/bin/chromium"


def main() -> None:
    from playwright.sync_api import sync_playwright

    cluster = load_cluster("aws-p3.16xlarge").with_nodes(2)
    training = {"global_batch_size": 1024, "dtype": "fp16"}
    inputs = resolve_request({"name": "moe-10b"}, cluster, training).trace()
    options = SearchOptions(ep=1, checkpointing=(False,), executable_only=False)
    plan = search(inputs, options).plan
    with tempfile.TemporaryDirectory() as tmp:
        page_file = Path(tmp) / "plan.html"
        page_file.write_text(render_page(plan, []))
        with sync_playwright() as p:
            browser = p.chromium.launch(
                executable_path=CHROMIUM, headless=True, args=["--no-sandbox", "--disable-gpu"]
            )
            page = browser.new_page(viewport={"width": 1280, "height": 900})
            page.goto(page_file.as_uri())
            page.wait_for_selector("svg.gantt")
            page.screenshot(path=str(RESULTS / "viewer-per-stage.png"), full_page=True)
            browser.close()
    print(plan.mesh.summary(), f"{plan.predicted.step_time_s:.3f} s")


if __name__ == "__main__":
    main()
