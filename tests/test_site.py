"""The course website, built and looked at in a real headless browser.

Builds the site for chapter 07 (the page under test) and chapter 02 (whose figures are
matplotlib PNGs: chapter 07 prints its recorded tables as text and draws no figure), serves the
HTML on a local port and opens chapter 07's page in headless Chromium through Playwright.

Needs the ``site`` extra (``pip install -e ".[site]"``: Jupyter Book, Playwright) and Debian's
Chromium (``apt-get install chromium``; Playwright's own browser download is not used). Without
them the test is skipped, unless ``COURSE_REQUIRE_SITE=1`` (set by CI), where it fails; then
the site must also ship MathJax (``npm ci --prefix site``) and typeset chapter 02's math.
"""

from __future__ import annotations

import functools
import http.server
import importlib.util
import os
import threading
import time

import pytest

from course_utils import site

CHAPTER = "07_flash_attention_forward"
FIGURES = "02_softmax_stable_and_online"  # a chapter with matplotlib figures
def _missing_tools() -> list[str]:
    missing = []
    if importlib.util.find_spec("jupyter_book") is None:
        missing.append('Jupyter Book (pip install -e ".[site]")')
    if importlib.util.find_spec("playwright") is None:
        missing.append('Playwright (pip install -e ".[site]")')
    if site.chromium() is None:
        missing.append("Chromium (apt-get install chromium, or set COURSE_CHROMIUM)")
    return missing


def _required() -> bool:
    return os.environ.get("COURSE_REQUIRE_SITE", "") not in ("", "0")


def _text(s: str) -> str:  # the theme's "smart quotes" back to plain ones
    return s.replace("\u2019", "'").replace("\u2018", "'").strip()


@pytest.fixture(scope="module")
def built_site(tmp_path_factory):
    missing = _missing_tools()
    if missing:
        why = "site test needs " + ", ".join(missing)
        if _required():
            pytest.fail(f"{why} (COURSE_REQUIRE_SITE is set)")
        pytest.skip(why)
    out = tmp_path_factory.mktemp("site")
    start = time.monotonic()
    index = site.build(out, [CHAPTER[:2], FIGURES[:2]], jobs=2, timeout=600)
    print(f"site for chapters {CHAPTER[:2]}, {FIGURES[:2]} built in "
          f"{time.monotonic() - start:.0f} s")
    return index.parent


@pytest.fixture(scope="module")
def server(built_site):
    handler = functools.partial(_QuietHandler, directory=str(built_site))
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)  # port 0: a free port
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()
    httpd.server_close()


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args):
        pass


@pytest.fixture(scope="module")
def browser():
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=site.chromium(), headless=True,
                              args=site.CHROMIUM_ARGS)
        yield b
        b.close()


def _open(browser, url: str):
    page = browser.new_page(viewport={"width": 1280, "height": 900})
    local = url.split("/", 3)[:3]
    # Only the local server: a CDN script (MathJax) must not make the test wait on the network.
    page.route("**/*", lambda route: route.continue_() if route.request.url.split("/", 3)[:3]
               == local else route.abort())
    page.goto(url, wait_until="load")
    return page


def test_chapter_page_in_browser(server, browser, built_site, tmp_path):
    title = site.Chapter(site.NOTEBOOKS / f"{CHAPTER}.ipynb").title
    page = _open(browser, f"{server}/{CHAPTER}.html")

    assert title in _text(page.title()), page.title()
    heading = _text(page.locator("main h1").first.inner_text())
    assert title in heading, heading

    sidebar = page.locator("nav.bd-docs-nav")
    links = [_text(t) for t in sidebar.locator("a").all_inner_texts()]
    for stem in (CHAPTER, FIGURES):
        want = site.Chapter(site.NOTEBOOKS / f"{stem}.ipynb").title
        assert want in links, f"sidebar lacks {want!r}: {links}"
    assert links.index(site.Chapter(site.NOTEBOOKS / f"{FIGURES}.ipynb").title) < links.index(
        title), "chapters out of order in the sidebar"

    # The recorded H100 results are on the page (as the notebook prints them, in CPU mode).
    outputs = page.locator("div.cell_output").all_inner_texts()
    assert any("H100" in text for text in outputs), "no recorded GPU result shown"

    shot = tmp_path / f"{CHAPTER}.png"
    page.screenshot(path=str(shot), full_page=False)
    assert shot.stat().st_size > 20_000, f"screenshot only {shot.stat().st_size} bytes"
    page.close()


def test_notebook_figures_and_math_render(server, browser):
    page = _open(browser, f"{server}/{FIGURES}.html")
    images = page.locator("div.cell_output img")
    assert images.count() > 0, "no figure output on the page"
    page.wait_for_function(
        "() => [...document.querySelectorAll('div.cell_output img')].every(i => i.complete)")
    widths = images.evaluate_all("imgs => imgs.map(i => i.naturalWidth)")
    assert all(w > 0 for w in widths), f"a figure did not load: naturalWidth {widths}"

    # Math is typeset by the MathJax the site ships (npm ci --prefix site), without a CDN.
    if (site.MATHJAX / "tex-mml-chtml.js").exists() or _required():
        page.wait_for_selector("mjx-container", timeout=30_000)
    page.close()
