"""pytest configuration shared by tests/ and the notebooks that nbval runs.

- Chooses the runtime mode once, before anything imports numba or triton, so the test process
  and every notebook kernel it starts (nbval's ``--nbval-current-env`` passes the environment on)
  run in the same mode: GPU if there is one, else the CPU simulator; ``COURSE_DEVICE=cpu``
  forces the simulator on a GPU machine.
- Makes a failed ``grader.check`` raise, so a solution or lecture notebook whose check fails
  fails its nbval test instead of printing ❌ and passing.
- Fails a lecture cell (``notebooks/``) that prints more than ``MAX_LECTURE_LINES`` lines: a
  lecture tells one story, and a long log belongs in a file, a folded view or the lab notes.
"""

import os

import matplotlib
import pytest

matplotlib.use("Agg")
os.environ.setdefault("MPLBACKEND", "Agg")
os.environ["COURSE_CHECKS_RAISE"] = "1"
# Under xdist with as many workers as cores (the README's `-n 2` on 2 cores), each process and
# every notebook kernel it starts computes on one thread: two pools of OpenMP threads on two
# cores spin against each other (about 10 % of the suite's time, measured). Set by the
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
