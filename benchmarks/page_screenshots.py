"""Screenshots of fxstab's HTML pages in headless Chromium, and how long each takes to open.

    fxstab show /tmp/demo.json --html /tmp/demo.html
    fxstab diff /tmp/base.json /tmp/head.json --html /tmp/diff.html
    python benchmarks/page_screenshots.py /tmp/demo.html /tmp/diff.html -o /tmp

Each page is opened from its file (Debian's ``chromium``, driven by the ``playwright`` client
of the test extra; no browser download), the operator that matters is clicked and hovered
(the NaN/inf origin of a map page, the first operator that lost digits on a diff page). Two
screenshots of 1400 x 1000 each: ``OUT/<page>.png``, the top of the page as it opens (the
findings, or the diff's verdict), and ``OUT/<page>_graph.png``, the graph with that operator
selected and hovered. Prints a table: page, size, seconds until the page's script is ready,
the operator shown, the screenshots. docs/pictures.md shows them.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import time
from pathlib import Path

# the operator to show: a map's NaN/inf origin, a diff's first lost operator, else the first
_PICK = """() => {
  const origin = document.querySelector("#graph g.op.origin");
  const lost = document.querySelector("#drops td");
  if (document.querySelector("#verdict") && lost) return lost.textContent;
  if (origin) return origin.dataset.name;
  const first = document.querySelector("#graph g.op");
  return first ? first.dataset.name : null;
}"""


def shoot(pages: list, out: Path, width: int = 1400, height: int = 1000) -> list:
    """Screenshot each page; returns (page, MB, seconds to ready, operator, png) rows."""
    from playwright.sync_api import sync_playwright

    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    if chromium is None:
        raise SystemExit("page_screenshots.py: no chromium on PATH (Debian: apt-get install "
                         "chromium)")
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=chromium, args=["--no-sandbox"])
        try:
            for path in pages:
                page = browser.new_page(viewport={"width": width, "height": height})
                errors: list = []
                page.on("pageerror", lambda e: errors.append(str(e)))
                t0 = time.perf_counter()
                page.goto(path.resolve().as_uri())
                page.wait_for_selector("body[data-ready='1']", timeout=20_000)
                ready = time.perf_counter() - t0
                if errors:
                    raise SystemExit(f"{path}: the page's script failed: {errors[0]}")
                name = page.evaluate(_PICK)
                top = out / f"{path.stem}.png"
                page.screenshot(path=str(top))
                if name:
                    node = page.locator(f'#graph g.op[data-name="{name}"]')
                    page.evaluate("document.querySelector('#graph-section').scrollIntoView()")
                    node.scroll_into_view_if_needed()
                    node.click()
                    node.hover()
                png = out / f"{path.stem}_graph.png"
                page.screenshot(path=str(png))
                rows.append((str(path), path.stat().st_size / 1e6, ready, name or "",
                             f"{top}, {png}"))
                page.close()
        finally:
            browser.close()
    return rows


def main(argv: list | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("pages", nargs="+", type=Path, help="pages written by fxstab ... --html")
    ap.add_argument("-o", "--out", type=Path, default=Path("/tmp"),
                    help="folder of the screenshots (default /tmp)")
    args = ap.parse_args(argv)
    for p in args.pages:
        if not p.is_file():
            raise SystemExit(f"page_screenshots.py: no such page {str(p)!r}")
    rows = shoot(args.pages, args.out)
    w = max(len(r[0]) for r in rows)
    print(f"{'page':<{w}}  {'MB':>6}  {'ready s':>7}  operator shown -> screenshots")
    for page, mb, ready, name, png in rows:
        print(f"{page:<{w}}  {mb:>6.2f}  {ready:>7.2f}  {name} -> {png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
