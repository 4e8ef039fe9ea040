"""What one grading task runs, wherever it runs: a pool's process, a Dask or a Ray worker.

Only data goes in and out (the notebook's text, its name, the limits as a dict, the paths its
worker may not read; the report as a dict), so the same function runs on this machine or on
another one that has the course installed.
"""

from __future__ import annotations

import os
import time

_MAIN_THREAD_HELPER = None  # a process of our own, for callers that are not a main thread


def grade_one(text: str, path: str, limits: dict, protected: list[str]) -> dict:
    """Grade one submission in a sandboxed worker of this process; its report as a dict, with
    the seconds it took under ``"seconds"`` and where it ran (host, process, GPU, CPU cores)
    under ``"where"``.

    Grading needs the main thread of a process that runs nothing else: the grader's own time
    limit is a timer signal, and the cases' random inputs come from the process's generators,
    seeded per notebook, which no other thread may draw from meanwhile (a Dask worker runs its
    tasks in a thread beside its event loop, which does). Called from another thread, the
    notebook is graded in a helper process started once (``spawn``) and kept for the next."""
    import threading

    if threading.current_thread() is not threading.main_thread():
        return _helper().submit(grade_one, text, path, limits, protected).result()
    from ..grader import grade_notebook, report_dict
    from ..sandbox import Limits

    start = time.monotonic()
    report = grade_notebook(path, text=text, limits=Limits(**limits), protected=protected)
    out = report_dict(report)
    out["seconds"] = time.monotonic() - start
    out["where"] = {"host": os.uname().nodename, "pid": os.getpid(),
                    "gpu": os.environ.get("CUDA_VISIBLE_DEVICES"), "cpus": cpu_list()}
    return out


def cpu_list() -> str:
    """The CPU cores this process may run on, as Linux writes such lists (``"0-3,8"``)."""
    try:
        runs: list[list[int]] = []
        for c in sorted(os.sched_getaffinity(0)):
            if runs and c == runs[-1][1] + 1:
                runs[-1][1] = c
            else:
                runs.append([c, c])
    except AttributeError:  # not Linux
        return ""
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)


def _helper():
    global _MAIN_THREAD_HELPER
    if _MAIN_THREAD_HELPER is None:
        import multiprocessing
        from concurrent.futures import ProcessPoolExecutor

        _MAIN_THREAD_HELPER = ProcessPoolExecutor(
            max_workers=1, mp_context=multiprocessing.get_context("spawn"),
            initializer=_helper_start, initargs=(os.getpid(),))
    return _MAIN_THREAD_HELPER


def close_helper() -> None:
    """End this process's helper, if it has one: run on a local Dask worker before its
    cluster closes (a closing worker waits on it, until its nanny kills the worker 4 s later)."""
    global _MAIN_THREAD_HELPER
    if _MAIN_THREAD_HELPER is not None:
        _MAIN_THREAD_HELPER.shutdown(wait=True, cancel_futures=True)
        _MAIN_THREAD_HELPER = None


def _helper_start(parent: int) -> None:
    """The helper's initializer: one compute thread, and a watch that ends the helper (and so
    its sandbox's zygote) as soon as the process that started it is gone: a Dask worker that
    closes does not wait for its executors' children, which would otherwise live on."""
    import threading
    import time

    share_cores(1)

    def watch():
        while os.getppid() == parent:
            time.sleep(1.0)
        os._exit(0)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()


def share_cores(threads: int) -> None:
    """A pool process's initializer: compute on ``threads`` CPU threads (the cores divided
    among the pool), so that N grading processes side by side do not each start a thread per
    core for their references."""
    for name in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ[name] = str(threads)
    import torch

    torch.set_num_threads(threads)


def pin_server(core_sets: list[list[int]], dask_worker=None) -> str:
    """A local Dask worker's pinning, run on it by ``Client.run``: worker ``i`` (LocalCluster
    names them 0, 1, ...) takes ``core_sets[i]``, as a pool's process takes its slot. Every
    thread of the process is pinned (``sched_setaffinity`` of pid 0 pins only the calling
    thread, and a task's helper is started from the task's thread), so the helper and the
    notebook workers it starts run there. The cores it runs on afterwards (``""`` for a worker
    whose name is no number: not pinned)."""
    try:
        mine = core_sets[int(dask_worker.name) % len(core_sets)]
    except (AttributeError, TypeError, ValueError, ZeroDivisionError):
        return ""
    for tid in os.listdir("/proc/self/task"):
        try:
            os.sched_setaffinity(int(tid), mine)
        except OSError:  # a thread that ended meanwhile, or cores taken away (a cpuset)
            pass
    return cpu_list()


def take_slot(counter, slots: list[str], threads: int,
              core_sets: list[list[int]] | None = None) -> None:
    """A pool process's initializer: take the next slot in turn (``counter``, shared by the
    pool's processes; a process that replaces a dead one takes the next): its GPU or MIG slice
    of ``slots`` where there are any (``CUDA_VISIBLE_DEVICES``, read when CUDA starts), and its
    own CPU cores of ``core_sets`` where the pool has them (``sched_setaffinity``: this process,
    its zygote and every worker they start run there, and compute on that many threads)."""
    with counter.get_lock():
        index = counter.value
        counter.value += 1
    if slots:
        os.environ["CUDA_VISIBLE_DEVICES"] = slots[index % len(slots)]
    if core_sets:
        mine = core_sets[index % len(core_sets)]
        try:
            os.sched_setaffinity(0, mine)
            threads = len(mine)
        except OSError:  # the cores were taken away meanwhile (a cpuset): run where it may
            pass
    share_cores(threads)
