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


def share_cores(threads: int) -> None:
    """A pool process's initializer: compute on ``threads`` CPU threads (the cores divided
    among the pool), so that N grading processes side by side do not each start a thread per
    core for their references."""
    for name in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ[name] = str(threads)
    import torch

    torch.set_num_threads(threads)


def take_slot(counter, slots: list[str], threads: int) -> None:
    """A pool process's initializer: take the next GPU (or MIG slice) of ``slots`` in turn
    (``counter``, shared by the pool's processes) and keep this process on it
    (``CUDA_VISIBLE_DEVICES``, read when CUDA starts). A process that replaces a dead one takes
    the next in turn."""
    with counter.get_lock():
        index = counter.value
        counter.value += 1
    os.environ["CUDA_VISIBLE_DEVICES"] = slots[index % len(slots)]
    share_cores(threads)
