"""What one grading task runs, wherever it runs: a pool's process, a Dask or a Ray worker.

Only data goes in and out (the notebook's text, its name, the limits as a dict, the paths its
worker may not read; the report as a dict), so the same function runs on this machine or on
another one that has the course installed.
"""

from __future__ import annotations

import os
import time


def grade_one(text: str, path: str, limits: dict, protected: list[str]) -> dict:
    """Grade one submission in a sandboxed worker of this process; its report as a dict, with
    the seconds it took under ``"seconds"``."""
    from ..grader import grade_notebook
    from ..sandbox import Limits
    from .store import report_dict

    start = time.monotonic()
    report = grade_notebook(path, text=text, limits=Limits(**limits), protected=protected)
    out = report_dict(report)
    out["seconds"] = time.monotonic() - start
    out["host"] = os.uname().nodename
    return out


def take_slot(counter, slots: list[str]) -> None:
    """A pool process's initializer: take the next GPU (or MIG slice) of ``slots`` in turn
    (``counter``, shared by the pool's processes) and keep this process on it
    (``CUDA_VISIBLE_DEVICES``, read when CUDA starts). A process that replaces a dead one takes
    the next in turn."""
    with counter.get_lock():
        index = counter.value
        counter.value += 1
    os.environ["CUDA_VISIBLE_DEVICES"] = slots[index % len(slots)]
