"""A block scheduler for Numba's CUDA simulator that waits instead of polling.

In CPU mode every CUDA thread of a block runs as a Python thread. Numba's simulator
(``numba.cuda.simulator.kernel.BlockManager``) then watches them from the launching thread in
a loop that never sleeps: it asks every live thread whether it is alive and whether it waits
at ``syncthreads()``, over and over, and each question takes the interpreter's lock from the
threads doing the work. Profiled on chapter 04's register-tiled kernel, that loop took more
than half of the launch's time.

:func:`install` replaces the loop with a barrier the threads report to: a thread that reaches
``syncthreads()`` (or ends) counts itself under a lock; the last of the block's live threads
to arrive releases the others; the launching thread sleeps until every thread has ended or
one has raised. What a kernel sees is unchanged: the barrier waits for every thread that has
not yet ended (as Numba's does), an exception in one thread aborts the others at their next
barrier and is raised from the launch with the thread's index, and ``syncthreads_count``,
``_and`` and ``_or`` use the same barrier. ``COURSE_FAST_SIMULATOR=0`` keeps Numba's loop.
"""

from __future__ import annotations

import importlib.abc
import os
import sys
import threading

MODULE = "numba.cuda.simulator.kernel"


class _Barrier:
    """The block's threads meet here; the launching thread waits here for the block's end."""

    def __init__(self, threads: int):
        self.cond = threading.Condition()
        self.live, self.waiting, self.generation = threads, 0, 0
        self.aborted = False
        self.failed = None  # the first thread that raised

    def _release(self):
        self.waiting = 0
        self.generation += 1
        self.cond.notify_all()

    def arrive(self):
        """A thread at ``syncthreads()``: wait until every live thread is here."""
        with self.cond:
            generation = self.generation
            self.waiting += 1
            if self.waiting == self.live:
                self._release()
                return
            while generation == self.generation and not self.aborted:
                self.cond.wait()

    def leave(self, failed=None):
        """A thread ended (``failed``: itself, when it raised)."""
        with self.cond:
            self.live -= 1
            if failed is not None and self.failed is None:
                self.failed = failed
                self.cond.notify_all()
            elif self.live == 0:
                self.cond.notify_all()
            elif self.waiting == self.live:  # the others were waiting only for this one
                self._release()

    def wait_for_end(self):
        with self.cond:
            while self.live > 0 and self.failed is None:
                self.cond.wait()
            return self.failed

    def abort(self):
        with self.cond:
            self.aborted = True
            self.cond.notify_all()


def _patch(kernel) -> None:
    import numpy as np

    BlockThread = kernel.BlockThread  # noqa: N806 (Numba's class)

    def run(self, grid_point, *args):
        barrier = _Barrier(int(np.prod(self._block_dim)))
        self._course_barrier = barrier

        def target():
            try:
                self._f(*args)
            except BaseException:
                barrier.leave(failed=threading.current_thread())
                raise
            barrier.leave()

        threads = [BlockThread(target, self, grid_point, block_point, self._debug)
                   for block_point in np.ndindex(*self._block_dim)]  # fmt: skip
        for t in threads:
            t.start()
        failed = barrier.wait_for_end()
        if failed is not None:  # abort the others at their next barrier, as Numba does
            for t in threads:
                t.abort = True
            barrier.abort()
            failed.join()  # it is storing its exception (BlockThread.run)
            raise failed.exception[0].with_traceback(failed.exception[1])

    def syncthreads(self):
        if self.abort:
            raise RuntimeError("abort flag set on syncthreads call")
        self._manager._course_barrier.arrive()
        if self.abort:
            raise RuntimeError("abort flag set on syncthreads clear")

    kernel._course_numba_run = kernel.BlockManager.run  # Numba's own, for comparison
    kernel._course_numba_sync = BlockThread.syncthreads
    kernel.BlockManager.run = run
    BlockThread.syncthreads = syncthreads
    kernel._course_fast_scheduler = True


class _PatchOnImport(importlib.abc.MetaPathFinder):
    """Patches the simulator's kernel module right after it is first imported."""

    def find_spec(self, name, path=None, target=None):
        if name != MODULE:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(name, path, target)
            if spec is not None and spec.loader is not None:
                exec_module = spec.loader.exec_module

                def exec_and_patch(module, exec_module=exec_module):
                    exec_module(module)
                    _patch(module)

                spec.loader.exec_module = exec_and_patch
                return spec
        return None


def install() -> None:
    """Use the waiting scheduler in this process (now, or when the simulator is imported)."""
    if os.environ.get("COURSE_FAST_SIMULATOR", "1") == "0":
        return
    kernel = sys.modules.get(MODULE)
    if kernel is not None:
        if not getattr(kernel, "_course_fast_scheduler", False):
            _patch(kernel)
        return
    if not any(isinstance(f, _PatchOnImport) for f in sys.meta_path):
        sys.meta_path.insert(0, _PatchOnImport())
