"""pytest configuration shared by tests/ and the notebooks that nbval runs.

- Chooses the runtime mode once, before anything imports numba or triton, so the test process
  and every notebook kernel it starts (nbval's ``--nbval-current-env`` passes the environment on)
  run in the same mode: GPU if there is one, else the CPU simulator; ``COURSE_DEVICE=cpu``
  forces the simulator on a GPU machine.
- Makes a failed ``grader.check`` raise, so a solution or lecture notebook whose check fails
  fails its nbval test instead of printing ❌ and passing.
- Fails a lecture cell (``notebooks/``) that prints more than ``MAX_LECTURE_LINES`` lines: a
  lecture tells one story, and a long log belongs in a file, a folded view or the lab notes.
- Starts nbval's kernels warm when they compute on one thread (the README's ``-n 3``): forked
  from a server that imported torch once (``tests/kernel_zygote.py``; ``COURSE_KERNEL_ZYGOTE=0``
  starts each from nothing).
"""

import os
import sys

import matplotlib
import pytest

# nbval is loaded here, not as an installed plugin (`-p no:nbval` in pyproject.toml), so that
# this comes first: jsonschema, which nbformat imports, builds a Lark grammar for its optional
# IRI format checker when rfc3987_syntax is installed (about 3 s of CPU in each of the suite's
# processes), and no notebook has an IRI to check. Without the module, jsonschema skips it.
sys.modules.setdefault("rfc3987_syntax", None)
pytest_plugins = ["nbval.plugin"]

matplotlib.use("Agg")
os.environ.setdefault("MPLBACKEND", "Agg")
os.environ["COURSE_CHECKS_RAISE"] = "1"
# Under xdist with at least as many workers as cores (the README's `-n 3` on 2 cores), each
# process and every notebook kernel it starts computes on one thread: pools of OpenMP threads
# on two cores spin against each other (about 10 % of the suite's time, measured). Set by the
# environment, OMP_NUM_THREADS wins.
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0") or 0)
if _WORKERS and _WORKERS >= (os.cpu_count() or 1):
    os.environ.setdefault("OMP_NUM_THREADS", "1")

import course_utils  # noqa: E402

course_utils.setup(verbose=False)
if os.environ.get("OMP_NUM_THREADS") == "1":
    import torch

    torch.set_num_threads(1)  # torch may have started its pool before this file ran


MAX_LECTURE_LINES = 60


# ----------------------------------------------------------------------------- warm kernels

_KERNEL_SERVER: dict = {}


def _kernel_zygote():
    """tests/kernel_zygote.py (not a package module: loaded by its path)."""
    import importlib.util
    from pathlib import Path

    if "kernel_zygote" not in sys.modules:
        path = Path(__file__).parent / "tests" / "kernel_zygote.py"
        spec = importlib.util.spec_from_file_location("kernel_zygote", path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        sys.modules["kernel_zygote"] = module
    return sys.modules["kernel_zygote"]


def _kernel_server_socket() -> str | None:
    """The socket of this process's kernel server, started on the first notebook (None: off,
    or it did not come up, and nbval starts plain kernels)."""
    import atexit
    import tempfile

    if os.environ.get("COURSE_KERNEL_ZYGOTE", "1") == "0" or \
            os.environ.get("OMP_NUM_THREADS") != "1":  # the server computes on one thread
        return None
    if "socket" not in _KERNEL_SERVER:
        folder = tempfile.mkdtemp(prefix="course-kernels-")
        path = os.path.join(folder, "server")
        proc = _kernel_zygote().start(path)

        def stop():
            proc.kill()
            proc.wait()
            for name in os.listdir(folder):
                os.unlink(os.path.join(folder, name))
            os.rmdir(folder)

        atexit.register(stop)
        _KERNEL_SERVER["socket"] = path if os.path.exists(path) else None
    return _KERNEL_SERVER["socket"]


def pytest_configure(config):
    try:
        from nbval import kernel
    except ImportError:
        return
    plain = kernel.NbvalKernelspecManager.get_kernel_spec

    def get_kernel_spec(self, kernel_name):
        spec = plain(self, kernel_name)
        path = _kernel_server_socket() if kernel_name == kernel.CURRENT_ENV_KERNEL_NAME else None
        if path:
            warm = _kernel_zygote().kernel_spec(path)
            spec.argv = warm["argv"]
            spec.env = {**(spec.env or {}), **warm["env"]}
        return spec

    kernel.NbvalKernelspecManager.get_kernel_spec = get_kernel_spec


def printed_lines(outputs) -> int:
    """Lines a reader scrolls past: streams, and plain text shown without a richer form (an
    HTML table counts its rows). Images count as none; error tracebacks are nbval's business."""
    lines = 0
    for out in outputs or []:
        kind = out.get("output_type")
        if kind == "stream":
            lines += str(out.get("text", "")).count("\n")
        elif kind in ("execute_result", "display_data"):
            data = out.get("data", {})
            if "text/html" in data:
                lines += str(data["text/html"]).count("<tr")
            elif not any(k.startswith("image/") for k in data):
                lines += str(data.get("text/plain", "")).count("\n") + 1
    return lines


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if call.when != "call" or report.failed or type(item).__name__ != "IPyNbCell":
        return
    if "notebooks" not in item.path.parts:
        return
    lines = printed_lines(getattr(item, "test_outputs", None))
    if lines > MAX_LECTURE_LINES:
        report.outcome = "failed"
        report.longrepr = (f"{item.name} printed {lines} lines (at most {MAX_LECTURE_LINES} in a "
                           "lecture): show an excerpt, fold it, or move it to the lab notes")
