"""Walk lecture notebooks in JupyterLab in a headless browser, as a student would.

Run by hand (the real lectures take minutes each in CPU mode, too slow for CI; the test
``tests/test_lab_walk.py`` walks a two-cell notebook instead)::

    python tools/lab_walk.py notebooks/02_softmax_stable_and_online.ipynb \\
        notebooks/07_flash_attention_forward.ipynb notebooks/14_hopper_flash_attention.ipynb \\
        --out /tmp/lab_walk

For each notebook, one at a time, it starts nothing new but a kernel: one JupyterLab server
(no token, a free port, ``COURSE_DEVICE=cpu`` unless the environment sets it) serves a
temporary copy of the repository's working tree, so the lab never saves into the checkout.
Debian's Chromium, driven by Playwright (as ``tests/test_site.py`` does; no browser download),
opens the notebook, runs Run > Run All Cells, waits until no cell is queued and the kernel is
idle (``--timeout`` seconds per notebook), saves it, then writes into ``--out``:

- ``NN_partK.png``: the notebook panel scrolled screen by screen (JupyterLab's windowing is
  switched off, so every cell is rendered and measured);
- ``NN_report.json`` and ``NN_report.md``: the time to run; every cell with an error output;
  every output area taller than ``--tall`` pixels; every text output with lines wider than
  the output area (a table that wraps or is cut); text outputs of more than ``--lines`` lines;
  images that did not load; and for each finding the screenshots that show it;
- ``NN_executed.ipynb``: the notebook as the lab saved it, with outputs and cell timings.

``NN`` is the notebook's number (``02`` for ``02_softmax_stable_and_online.ipynb``). The exit
status is 1 when a cell raised or a notebook did not finish in time, 2 when a tool is missing
(Playwright: ``pip install playwright``; Chromium: ``apt-get install chromium`` or
``COURSE_CHROMIUM=/path``; JupyterLab: ``pip install jupyterlab``), else 0. The server, its
kernels and the browser are stopped on every exit. Without an emoji font the checks' ✅ shows
as a box in the screenshots (``apt-get install fonts-noto-color-emoji``).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from course_utils import site

REPO = Path(__file__).resolve().parents[1]
VIEWPORT = {"width": 1280, "height": 1000}
# JupyterLab settings for the walk: every cell rendered (no windowing, so a screenshot and a
# measurement see them all), cell timings recorded in the saved notebook, no autosave (the lab
# saves once, when the run is over), no news or update pop-up over the notebook.
LAB_SETTINGS = {
    "@jupyterlab/notebook-extension/tracker": {"windowingMode": "none", "recordTiming": True},
    "@jupyterlab/docmanager-extension/plugin": {"autosave": False},
    "@jupyterlab/apputils-extension/notification": {"fetchNews": "false",
                                                   "checkForUpdates": False},
}


def missing_tools() -> list[str]:
    """The tools the walk needs and cannot find, as install hints."""
    missing = []
    if importlib.util.find_spec("jupyterlab") is None:
        missing.append("JupyterLab (pip install jupyterlab)")
    if importlib.util.find_spec("playwright") is None:
        missing.append("Playwright (pip install playwright)")
    if site.chromium() is None:
        missing.append("Chromium (apt-get install chromium, or set COURSE_CHROMIUM)")
    return missing


_START = time.monotonic()


def say(message: str) -> None:
    """A progress line, stamped with the seconds since the walk started."""
    print(f"[{time.monotonic() - _START:6.1f} s] {message}", flush=True)


def number(notebook: Path) -> str:
    """``02`` for ``02_softmax_stable_and_online.ipynb``; the stem when it has no number."""
    match = re.match(r"\d+", notebook.stem)
    return match.group(0) if match else notebook.stem


# --------------------------------------------------------------------------- the server


def stage(root: Path, notebooks: list[Path], into: Path) -> list[str]:
    """Copy root's working tree into ``into``; return each notebook's path there (POSIX).

    In a git checkout the copy holds the tracked files and the untracked ones git does not
    ignore (edits included, build outputs not). A notebook outside root is copied to the top.
    """
    try:
        listed = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"],
                                cwd=root, capture_output=True, check=True).stdout
        files = [f for f in listed.decode().split("\0") if f]
    except (OSError, subprocess.CalledProcessError):
        files = [str(p.relative_to(root)) for p in root.rglob("*") if p.is_file()]
    for name in files:
        source = root / name
        if source.is_file():
            target = into / name
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, target)
    staged = []
    for notebook in notebooks:
        path = notebook.resolve()
        if path.is_relative_to(root):
            name = path.relative_to(root).as_posix()
        else:
            name = path.name
        shutil.copy2(path, into / name)  # the notebook as it is now, even if git ignores it
        staged.append(name)
    return staged


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def lab_server(root: Path, scratch: Path, log):
    """A JupyterLab server on 127.0.0.1 serving root; yields its base URL; stops it and its
    kernels (its own process group) on exit."""
    settings = scratch / "user-settings"
    for plugin, values in LAB_SETTINGS.items():
        path = settings / f"{plugin}.jupyterlab-settings"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(values))
    (scratch / "workspaces").mkdir(exist_ok=True)
    port = free_port()
    env = dict(os.environ)
    env.setdefault("COURSE_DEVICE", "cpu")
    env["JUPYTER_RUNTIME_DIR"] = str(scratch / "runtime")
    command = [
        sys.executable, "-m", "jupyterlab", "--no-browser", "--allow-root",
        "--ServerApp.ip=127.0.0.1", f"--ServerApp.port={port}", "--ServerApp.port_retries=0",
        "--IdentityProvider.token=", "--ServerApp.password=",
        f"--ServerApp.root_dir={root}", f"--LabApp.user_settings_dir={settings}",
        f"--LabApp.workspaces_dir={scratch / 'workspaces'}",
        # Nothing the walk uses: no language server, no terminals, no extension manager asking
        # a package index (the machine may reach none).
        "--ServerApp.jpserver_extensions={'jupyter_lsp': False, "
        "'jupyter_server_terminals': False}",
        "--LabApp.extension_manager=readonly",
    ]
    server = subprocess.Popen(command, cwd=root, env=env, stdout=log, stderr=subprocess.STDOUT,
                              start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            if server.poll() is not None:
                raise RuntimeError(f"JupyterLab exited with {server.returncode} (see its log)")
            try:
                with urllib.request.urlopen(f"{url}/api/status", timeout=2):
                    break
            except OSError:
                if time.monotonic() > deadline:
                    raise RuntimeError("JupyterLab did not answer within 120 s") from None
                time.sleep(0.5)
        yield url
    finally:
        _stop(server)


def _stop(process: subprocess.Popen) -> None:
    """SIGTERM to the server's process group (the server and its kernels), SIGKILL after 15 s."""
    if process.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(timeout=15)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
            process.wait()
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(process.pid, signal.SIGKILL)  # a kernel left behind in the group


# --------------------------------------------------------------------------- the page

# Every cell of the open notebook, measured in the page: output height, text lines, lines
# wider than their box (measured in the text's own font: the lab wraps them, so a table's rows
# break), images that did not load; in markdown, code blocks too wide and numbered lists that
# start past 1 (a wrapped line that began with "240)" or "3." became a list item).
MEASURE_JS = """
() => {
  const panel = document.querySelector('.jp-NotebookPanel:not(.lm-mod-hidden)');
  const canvas = document.createElement('canvas').getContext('2d');
  const cells = [...panel.querySelectorAll('.jp-Notebook .jp-Cell')];
  function measure(pres) {
    const found = {lines: 0, maxChars: 0, wide: 0, example: ''};
    for (const pre of pres) {
      const folded = pre.closest('details:not([open])');  // a folded view shows its summary
      if ((folded && !pre.closest('summary')) || !pre.getClientRects().length) continue;
      const style = getComputedStyle(pre);
      canvas.font = style.font;
      const room = pre.clientWidth - parseFloat(style.paddingLeft)
                   - parseFloat(style.paddingRight);
      const lines = pre.textContent.replace(/\\n$/, '').split('\\n');
      found.lines += lines.length;
      let wide = 0;
      for (const line of lines) {
        found.maxChars = Math.max(found.maxChars, line.length);
        if (canvas.measureText(line).width > room + 1) {
          wide += 1;
          if (!found.example) found.example = line.slice(0, 160);
        }
      }
      if (!wide && pre.scrollWidth > pre.clientWidth + 1) {  // cut, with a scroll bar
        wide = 1;
        found.example = found.example || lines[0].slice(0, 160);
      }
      found.wide += wide;
    }
    return found;
  }
  return cells.map((cell, index) => {
    const wrapper = cell.querySelector('.jp-Cell-outputWrapper');
    const outputs = [...cell.querySelectorAll('.jp-OutputArea-output')];
    const text = measure(cell.querySelectorAll('.jp-OutputArea-output pre'));
    const markdown = cell.classList.contains('jp-MarkdownCell');
    const md = markdown ? measure(cell.querySelectorAll('.jp-RenderedMarkdown pre'))
                        : measure([]);
    const lists = markdown ? [...cell.querySelectorAll('.jp-RenderedMarkdown ol[start]')]
        .map(ol => parseInt(ol.getAttribute('start'))).filter(n => n > 1) : [];
    // Anything else wider than its output area (an HTML table, a figure): a scroll bar.
    const overflowing = outputs.filter(o => o.scrollWidth > o.clientWidth + 1).length;
    const images = [...cell.querySelectorAll('.jp-OutputArea-output img')];
    return {
      index,
      kind: cell.classList.contains('jp-CodeCell') ? 'code' : markdown ? 'markdown' : 'raw',
      output_px: wrapper && outputs.length ? Math.round(wrapper.getBoundingClientRect().height)
                 : 0,
      text_lines: text.lines, max_chars: text.maxChars, wide_lines: text.wide,
      wide_example: text.example, overflowing,
      markdown_wide_lines: md.wide, markdown_wide_example: md.example, list_starts: lists,
      images: images.length,
      broken_images: images.filter(i => !(i.complete && i.naturalWidth > 0)).length,
    };
  });
}
"""

SCROLLER = ".jp-NotebookPanel:not(.lm-mod-hidden) .jp-WindowedPanel-outer"


def _dismiss_dialogs(page) -> None:
    """Accept a dialog (a kernel choice, a "notebook changed on disk" question) if one is up."""
    dialog = page.locator(".jp-Dialog")
    if dialog.count():
        page.keyboard.press("Enter")
        page.wait_for_timeout(500)


def _status(page) -> str:
    """The kernel's state as the status bar says it ("idle", "busy", "no kernel", ...).

    (The toolbar's execution indicator says "idle" before a kernel exists.)
    """
    item = page.locator('.jp-StatusBar-TextItem[title^="Change kernel"]')
    if not item.count():
        return ""
    text = item.first.inner_text().strip()
    if text.startswith("No Kernel"):
        return "no kernel"
    return text.rsplit("|", 1)[-1].strip().lower()


def _queued(page) -> int:
    """Cells whose prompt shows ``[*]``: running or waiting to run."""
    return page.evaluate(
        "() => [...document.querySelectorAll('.jp-NotebookPanel:not(.lm-mod-hidden) "
        ".jp-InputPrompt')].filter(p => p.textContent.includes('*')).length")


def _menu(page, menu: str, item: str) -> None:
    page.locator(".lm-MenuBar-itemLabel", has_text=re.compile(f"^{menu}$")).first.click()
    page.locator(".lm-Menu-itemLabel", has_text=re.compile(f"^{re.escape(item)}$")).first.click()


def _local_only(url: str):
    """A route handler that lets requests to the lab's server through and aborts the rest."""
    local = url.split("/", 3)[:3]

    def handle(route):
        if route.request.url.split("/", 3)[:3] == local:
            route.continue_()
        else:
            route.abort()

    return handle


def run_all(page, url: str, name: str, timeout: float) -> tuple[float, bool]:
    """Open ``name`` in the lab, Run All Cells, wait until done; (seconds, timed out)."""
    page.goto(f"{url}/lab/tree/{name}?reset", wait_until="load")
    page.wait_for_selector(".jp-NotebookPanel .jp-Notebook .jp-Cell", timeout=120_000)
    deadline = time.monotonic() + 120
    while _status(page) != "idle":  # the kernel has started
        _dismiss_dialogs(page)
        if time.monotonic() > deadline:
            raise RuntimeError(f"the kernel of {name} did not start within 120 s")
        page.wait_for_timeout(500)
    # The file browser closed: the notebook gets the width a student would give it.
    if page.locator(".jp-FileBrowser:visible").count():
        _menu(page, "View", "File Browser")
    start = time.monotonic()
    _menu(page, "Run", "Run All Cells")
    settled = 0
    timed_out = False
    page.wait_for_timeout(1000)
    while settled < 2:  # idle and nothing queued, twice in a row
        page.wait_for_timeout(1000)
        _dismiss_dialogs(page)
        status = _status(page)
        if status == "dead":  # the kernel died and was not restarted: nothing more will run
            break
        settled = settled + 1 if status == "idle" and _queued(page) == 0 else 0
        if time.monotonic() - start > timeout:
            timed_out = True
            _menu(page, "Kernel", "Interrupt Kernel")
            page.wait_for_timeout(3000)
            break
    seconds = time.monotonic() - start
    with contextlib.suppress(Exception):  # figures decoded before they are measured
        page.wait_for_function(
            "() => [...document.querySelectorAll('.jp-OutputArea-output img')]"
            ".every(i => i.complete)", timeout=30_000)
    return seconds, timed_out


def save(page, staged: Path) -> None:
    """File > Save Notebook, then wait until the file on disk has changed."""
    before = staged.stat().st_mtime_ns
    _menu(page, "File", "Save Notebook")
    deadline = time.monotonic() + 60
    while staged.stat().st_mtime_ns == before and time.monotonic() < deadline:
        _dismiss_dialogs(page)
        page.wait_for_timeout(500)
    page.wait_for_timeout(500)


# Where the scroller is, where the notebook ends (the last cell's bottom, not scrollHeight: the
# lab pads the notebook so it scrolls past its end) and which cells are on screen, read live:
# typesetting math and drawing editors as they come into view moves the cells below.
VIEW_JS = """
e => {
  const box = e.getBoundingClientRect();
  const cells = [...e.querySelectorAll('.jp-Notebook .jp-Cell')];
  const last = cells[cells.length - 1];
  const end = last ? last.getBoundingClientRect().bottom - box.top + e.scrollTop + 20
                   : e.scrollHeight;
  const seen = [];
  cells.forEach((cell, index) => {
    const r = cell.getBoundingClientRect();
    if (r.bottom > box.top && r.top < box.bottom) seen.push(index);
  });
  return {top: e.scrollTop, view: e.clientHeight, end, seen};
}
"""


def settle(page) -> None:
    """Scroll through the notebook once so that everything drawn on view is drawn."""
    scroller = page.locator(SCROLLER).first
    top = 0
    for _ in range(1000):
        state = scroller.evaluate(VIEW_JS)
        if state["top"] + state["view"] >= state["end"] - 1:
            break
        top = state["top"] + state["view"]
        scroller.evaluate(f"e => {{ e.scrollTop = {top}; }}")
        page.wait_for_timeout(150)
    scroller.evaluate("e => { e.scrollTop = 0; }")
    page.wait_for_timeout(1000)


def screenshots(page, out: Path, prefix: str) -> list[dict]:
    """The notebook panel scrolled screen by screen; [{file, top, cells}] (cells on screen)."""
    scroller = page.locator(SCROLLER).first
    page.mouse.move(2, VIEWPORT["height"] - 2)  # no hover highlight on a cell
    parts = []
    top = 0
    for _ in range(1000):
        scroller.evaluate(f"e => {{ e.scrollTop = {top}; }}")
        page.wait_for_timeout(300)
        state = scroller.evaluate(VIEW_JS)
        path = out / f"{prefix}_part{len(parts) + 1:02d}.png"
        page.screenshot(path=str(path))
        parts.append({"file": path.name, "top": state["top"], "cells": state["seen"]})
        if state["top"] + state["view"] >= state["end"] - 1:
            break
        # 80 px of overlap: a line cut at the edge of one screen is whole on the next
        top = state["top"] + max(state["view"] - 80, 100)
    scroller.evaluate("e => { e.scrollTop = 0; }")
    return parts


# --------------------------------------------------------------------------- the report


def _errors(executed: dict) -> dict[int, dict]:
    found = {}
    for index, cell in enumerate(executed.get("cells", [])):
        for output in cell.get("outputs", []):
            if output.get("output_type") == "error":
                found[index] = {"ename": output.get("ename", ""),
                                "evalue": output.get("evalue", "")[:300]}
    return found


def _timing(cell: dict) -> float | None:
    timing = cell.get("metadata", {}).get("execution", {})
    start, end = timing.get("iopub.execute_input"), timing.get("shell.execute_reply")
    if not (start and end):
        return None
    from datetime import datetime

    def parse(stamp: str) -> datetime:
        return datetime.fromisoformat(stamp.replace("Z", "+00:00"))

    return round((parse(end) - parse(start)).total_seconds(), 2)


def report(notebook: Path, seconds: float, timed_out: bool, cells: list[dict],
           executed: dict, parts: list[dict], tall: int, many_lines: int) -> dict:
    errors = _errors(executed)
    source_cells = executed.get("cells", [])
    findings = []
    for cell in cells:
        index = cell["index"]
        source = source_cells[index] if index < len(source_cells) else {}
        text = "".join(source.get("source", ""))
        cell["first_line"] = text.strip().splitlines()[0][:100] if text.strip() else ""
        cell["execution_count"] = source.get("execution_count")
        cell["seconds"] = _timing(source)
        cell["screenshots"] = [p["file"] for p in parts if index in p["cells"]]
        problems = []
        if index in errors:
            cell["error"] = errors[index]
            problems.append(f"error {errors[index]['ename']}: {errors[index]['evalue'][:120]}")
        if cell["output_px"] > tall:
            problems.append(f"output {cell['output_px']} px tall")
        if cell["wide_lines"]:
            problems.append(f"{cell['wide_lines']} text line(s) wider than the output area "
                            f"(widest {cell['max_chars']} chars), e.g. {cell['wide_example']!r}")
        if cell["overflowing"] and not cell["wide_lines"]:
            problems.append(f"{cell['overflowing']} output(s) wider than the output area "
                            "(a horizontal scroll bar)")
        if cell["text_lines"] > many_lines:
            problems.append(f"{cell['text_lines']} lines of text output")
        if cell["markdown_wide_lines"]:
            problems.append(f"{cell['markdown_wide_lines']} line(s) of a markdown code block "
                            f"wider than the cell, e.g. {cell['markdown_wide_example']!r}")
        if cell["list_starts"]:
            problems.append("a numbered list starting at "
                            + ", ".join(str(n) for n in cell["list_starts"])
                            + " (a wrapped line that begins with a number and '.' or ')'?)")
        if cell["broken_images"]:
            problems.append(f"{cell['broken_images']} image(s) did not load")
        if problems:
            findings.append({"cell": index, "execution_count": cell["execution_count"],
                             "first_line": cell["first_line"], "problems": problems,
                             "screenshots": cell["screenshots"]})
    code = [c for c in cells if c["kind"] == "code"]
    return {
        "notebook": str(notebook), "seconds": round(seconds, 1), "timed_out": timed_out,
        "cells": len(cells), "code_cells": len(code),
        "code_cells_run": sum(1 for c in code if c["execution_count"] is not None),
        "errors": len(errors), "thresholds": {"tall_px": tall, "text_lines": many_lines},
        "viewport": VIEWPORT, "screenshots": [p["file"] for p in parts],
        "findings": findings, "cell_details": cells,
    }


def markdown(data: dict) -> str:
    lines = [f"# Lab walk: {data['notebook']}", "",
             f"- run all: {data['seconds']} s"
             + (" (TIMED OUT, kernel interrupted)" if data["timed_out"] else ""),
             f"- cells: {data['cells']} ({data['code_cells']} code, "
             f"{data['code_cells_run']} run), errors: {data['errors']}",
             f"- screenshots: {len(data['screenshots'])} at {data['viewport']['width']}x"
             f"{data['viewport']['height']}",
             f"- flagged: output taller than {data['thresholds']['tall_px']} px, text lines wider"
             f" than the output area, more than {data['thresholds']['text_lines']} text lines,"
             " errors, images that did not load", ""]
    if not data["findings"]:
        lines.append("No findings.")
    for finding in data["findings"]:
        lines.append(f"## cell {finding['cell']} [{finding['execution_count'] or ' '}]: "
                     f"`{finding['first_line']}`")
        lines += [f"- {problem}" for problem in finding["problems"]]
        lines += [f"- seen in: {', '.join(finding['screenshots'])}", ""]
    slow = sorted((c for c in data["cell_details"] if c.get("seconds")),
                  key=lambda c: -c["seconds"])[:5]
    if slow:
        lines += ["", "## slowest cells", ""]
        lines += [f"- cell {c['index']}: {c['seconds']} s `{c['first_line']}`" for c in slow]
    return "\n".join(lines) + "\n"


# --------------------------------------------------------------------------- main


def walk(notebooks: list[Path], out: Path, root: Path, timeout: float, tall: int,
         many_lines: int) -> int:
    from playwright.sync_api import sync_playwright

    out.mkdir(parents=True, exist_ok=True)
    failed = False
    with tempfile.TemporaryDirectory(prefix="lab_walk_") as tmp:
        scratch = Path(tmp)
        staged_root = scratch / "root"
        staged_root.mkdir()
        names = stage(root, notebooks, staged_root)
        say(f"staged {root} in {staged_root}; starting JupyterLab")
        with open(out / "lab_server.log", "w") as log, \
                lab_server(staged_root, scratch, log) as url, sync_playwright() as p:
            say(f"JupyterLab at {url}; starting Chromium")
            browser = p.chromium.launch(executable_path=site.chromium(), headless=True,
                                        args=site.CHROMIUM_ARGS)
            try:
                for notebook, name in zip(notebooks, names, strict=True):
                    prefix = number(notebook)
                    for old in out.glob(f"{prefix}_part*.png"):
                        old.unlink()
                    page = browser.new_page(viewport=VIEWPORT)
                    page.set_default_timeout(60_000)
                    page.route("**/*", _local_only(url))  # no CDN, no news feed
                    say(f"{notebook}: opening in the lab")
                    seconds, timed_out = run_all(page, url, name, timeout)
                    say(f"{notebook}: ran in {seconds:.1f} s"
                        + (" (timed out: kernel interrupted)" if timed_out else ""))
                    save(page, staged_root / name)
                    settle(page)
                    cells = page.evaluate(MEASURE_JS)
                    parts = screenshots(page, out, prefix)
                    say(f"{notebook}: saved, measured, {len(parts)} screenshots")
                    executed = json.loads((staged_root / name).read_text())
                    (out / f"{prefix}_executed.ipynb").write_text(
                        json.dumps(executed, indent=1, ensure_ascii=False) + "\n")
                    data = report(notebook, seconds, timed_out, cells, executed, parts, tall,
                                  many_lines)
                    (out / f"{prefix}_report.json").write_text(json.dumps(data, indent=1) + "\n")
                    (out / f"{prefix}_report.md").write_text(markdown(data))
                    _menu(page, "Kernel", "Shut Down Kernel")
                    page.wait_for_timeout(1000)
                    page.close()
                    failed |= bool(data["errors"]) or timed_out
                    say(f"{notebook}: {data['errors']} error(s), {len(data['findings'])} cell(s)"
                        f" flagged -> {out / (prefix + '_report.md')}")
            finally:
                browser.close()
                say("browser closed; stopping JupyterLab")
    say("done")
    return 1 if failed else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("notebooks", nargs="+", type=Path)
    parser.add_argument("--out", type=Path, required=True, help="folder for PNGs and reports")
    parser.add_argument("--root", type=Path, default=REPO,
                        help="the lab's root, copied to a temporary folder (default: the repo)")
    parser.add_argument("--timeout", type=float, default=1200,
                        help="seconds to run one notebook (default 1200)")
    parser.add_argument("--tall", type=int, default=1500, help="flag outputs taller (px)")
    parser.add_argument("--lines", type=int, default=60, help="flag text outputs longer")
    args = parser.parse_args(argv)
    missing = missing_tools()
    if missing:
        print("lab_walk needs " + ", ".join(missing), file=sys.stderr)
        return 2
    for notebook in args.notebooks:
        if not notebook.is_file():
            parser.error(f"no notebook {notebook}")
    # Killed (timeout, CI): unwind like Ctrl-C, so the server, its kernels and the browser stop.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    return walk(args.notebooks, args.out.resolve(), args.root.resolve(), args.timeout,
                args.tall, args.lines)


if __name__ == "__main__":
    sys.exit(main())
