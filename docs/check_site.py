"""Open the built site in headless Chromium as a reader would, and store what it shows.

    python docs/check_site.py            # builds the site, serves it on 127.0.0.1, checks, screenshots

Builds the site (``mkdocs build --strict``) into a temporary folder, serves it on 127.0.0.1 on a
free port, and opens Home, Choose a strategy, a strategy page (its mermaid diagram), a results page
(its plots) and three API reference pages in Debian's ``chromium`` through playwright (no browser
download: ``executable_path=/usr/bin/chromium``, a fresh profile). On each page: no console error,
no page error, no failed request, no request leaving 127.0.0.1 (fonts, CDNs: the site must work
offline), every image loaded (``naturalWidth > 0``, after scrolling so lazy images load), and on
the strategy page the diagram rendered as SVG. Screenshots go to ``docs/results/site_<page>.png``.
Exits 1 naming every problem found, 0 otherwise.

Needs: ``apt-get install -y chromium``, the ``docs`` extra (``pip install -e ".[docs]"``) and, for
offline diagrams, ``make docs-vendor`` (mermaid from npm; the script runs it when it is missing).
"""

from __future__ import annotations

import argparse
import functools
import http.server
import os
import socketserver
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CHROMIUM = "/usr/bin/chromium"
FLAGS = [
    "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking",
    "--disable-component-update", "--disable-sync",
]
# page (site path) -> screenshot name, and what else it must show
PAGES = {
    "index.html": "home",
    "choose.html": "choose",
    "strategies/ring.html": "strategy_ring",
    "measured/claims.html": "results_claims",
    "reference/package.html": "api_package",
    "reference/comm/ps.html": "api_comm_ps",
    "reference/optim.html": "api_optim",
}
MUST_RENDER_DIAGRAM = {"strategies/ring.html"}


def build(site: Path) -> None:
    if not (ROOT / "docs/javascripts/vendor/mermaid.min.js").is_file():
        subprocess.run(["make", "-s", "docs-vendor"], cwd=ROOT, check=False)
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--quiet", "--site-dir", str(site)],
                   cwd=ROOT, env=env, check=True, timeout=600)


def serve(site: Path) -> tuple[socketserver.TCPServer, str]:
    class Quiet(http.server.SimpleHTTPRequestHandler):
        def log_message(self, *args: object) -> None:
            pass

    server = socketserver.ThreadingTCPServer(("127.0.0.1", 0), functools.partial(Quiet, directory=str(site)))
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, f"http://127.0.0.1:{server.server_address[1]}/"


def check_page(context, base: str, path: str, shot: Path) -> list[str]:  # type: ignore[no-untyped-def]
    problems: list[str] = []
    page = context.new_page()
    page.on("console", lambda m: problems.append(f"console {m.type}: {m.text}") if m.type == "error" else None)
    page.on("pageerror", lambda e: problems.append(f"page error: {e}"))
    page.on("requestfailed", lambda r: problems.append(f"request failed: {r.url} ({r.failure})"))

    def route(r):  # type: ignore[no-untyped-def]
        if r.request.url.startswith(base):
            r.continue_()
        else:  # the site must not need the internet
            problems.append(f"request leaves the machine: {r.request.url}")
            r.abort()

    page.route("**/*", route)
    response = page.goto(base + path, wait_until="networkidle", timeout=60_000)
    if response is None or response.status != 200:
        problems.append(f"status {None if response is None else response.status}")
    # scroll through the page so that lazy images load, then back to the top for the screenshot
    page.evaluate("async () => { for (let y = 0; y < document.body.scrollHeight; y += 600) {"
                  " window.scrollTo(0, y); await new Promise(r => setTimeout(r, 50)); } window.scrollTo(0, 0); }")
    page.wait_for_load_state("networkidle")
    broken = page.evaluate("Array.from(document.images).filter(i => !i.complete || i.naturalWidth === 0)"
                           ".map(i => i.getAttribute('src'))")
    problems += [f"image not loaded: {src}" for src in broken]
    images = page.evaluate("document.images.length")
    if path in MUST_RENDER_DIAGRAM:
        # the theme swaps each <pre class="mermaid"> source for a <div class="mermaid"> holding the SVG
        # in a closed shadow root: rendered = the div is there and as tall as a drawing
        try:
            page.wait_for_selector("div.mermaid", timeout=20_000, state="attached")
            height = page.evaluate("Math.min(...Array.from(document.querySelectorAll('.mermaid'))"
                                   ".map(e => e.getBoundingClientRect().height))")
            if page.evaluate("document.querySelectorAll('pre.mermaid').length") or height < 60:
                problems.append(f"a mermaid diagram did not render (height {height:.0f} px)")
        except Exception:
            problems.append("the mermaid diagrams did not render")
    page.wait_for_timeout(800)  # the header's title animation after the scroll back to the top
    page.screenshot(path=str(shot))
    print(f"{path}: {images} images, {'ok' if not problems else f'{len(problems)} problems'} -> {shot.name}")
    page.close()
    return problems


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "results", help="folder for the screenshots")
    args = parser.parse_args()
    from playwright.sync_api import sync_playwright

    with tempfile.TemporaryDirectory() as tmp:
        site, profile = Path(tmp) / "site", Path(tmp) / "profile"
        build(site)
        server, base = serve(site)
        problems: dict[str, list[str]] = {}
        try:
            with sync_playwright() as pw:
                context = pw.chromium.launch_persistent_context(
                    str(profile), executable_path=CHROMIUM, headless=True, args=FLAGS,
                    viewport={"width": 1280, "height": 900},
                )
                try:
                    for path, name in PAGES.items():
                        problems[path] = check_page(context, base, path, args.out / f"site_{name}.png")
                finally:
                    context.close()
        finally:
            server.shutdown()
            server.server_close()
    found = [f"{path}: {p}" for path, ps in problems.items() for p in ps]
    for line in found:
        print(line, file=sys.stderr)
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
