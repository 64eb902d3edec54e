"""Issue 18's sizing: how many DGX H100 nodes for Llama-3-70B on 15T tokens. Runs the
`autopar size` sweep (8 to 128 nodes, global batch 2,048 x 8,192 tokens: Llama 3's 16M-token
batches) once with an empty cache and once warm, writes the table, the chart (SVG) and the
sizing page with a Chromium screenshot when Debian's chromium is installed.

The GPU-hour price (2.5) is an example input, not a claim about any provider's prices.

Run: python bench/sizing.py   (writes bench/results/sizing.md, sizing-llama3-70b.svg/.png)
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common import RESULTS, header, write

ARGS = (
    "--model llama3-70b --cluster dgx-h100 --min-nodes 8 --max-nodes 128 --global-batch 2048 "
    "--seq 8192 --train-tokens 15T --gpu-hour-price 2.5 --deadline 300d --budget 8200000"
)
CHROMIUM = Path(os.environ.get("AUTOPAR_CHROMIUM", "/usr/bin/chromium"))


def _run(cache: str, out: Path) -> tuple[float, str]:
    env = {**os.environ, "AUTOPAR_CACHE_DIR": cache}
    cmd = [sys.executable, "-m", "api.cli", "size", *ARGS.split(), "-o", str(out)]
    t0 = time.perf_counter()
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True)
    return time.perf_counter() - t0, done.stdout


def _screenshot(html: Path, png: Path) -> bool:
    if not CHROMIUM.exists():
        return False
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=str(CHROMIUM), args=["--no-sandbox"])
        page = browser.new_page(viewport={"width": 1280, "height": 900})
        page.goto(html.as_uri())
        page.screenshot(path=str(png), full_page=True)
        browser.close()
    return True


def main() -> None:
    from api.sizing_chart import sizing_svg
    from api.viewer import render_sizing_page
    from planner.search.sizing import Sizing

    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "sizing.json"
        cold, _ = _run(str(Path(tmp) / "cache"), out)
        warm, table = _run(str(Path(tmp) / "cache"), out)
        sizing = Sizing.model_validate_json(out.read_text())
        html = Path(tmp) / "sizing.html"
        html.write_text(render_sizing_page(sizing))
        (RESULTS / "sizing-llama3-70b.svg").write_text(sizing_svg(sizing) + "\n")
        shot = _screenshot(html, RESULTS / "sizing-llama3-70b.png")
    text = header(
        "How many GPUs: Llama-3-70B on DGX H100 for 15T tokens (issue 18)", f"autopar size {ARGS}"
    )
    text += (
        f"\nSweep of 5 sizes: {cold:.1f} s with an empty cache (one trace, every size "
        f"searched), {warm:.1f} s warm (layouts and cost tables keyed without the node count).\n\n"
        "```\n" + table.rstrip() + "\n```\n\n"
        "Chart: `sizing-llama3-70b.svg`"
        + (", the sizing page in headless Chromium: `sizing-llama3-70b.png`.\n" if shot else ".\n")
    )
    write("sizing.md", text)


if __name__ == "__main__":
    main()
