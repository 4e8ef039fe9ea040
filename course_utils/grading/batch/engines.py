"""Who runs the grading tasks: this process, a pool of processes, or a distributed engine.

Every engine has the same two calls: ``submit(*args)`` runs :func:`task.grade_one` on them
somewhere and returns a handle; ``wait_any(handles)`` blocks until at least one is finished and
returns ``[(handle, report or None, error or None), ...]`` for those. The class's driver keeps
only a bounded number of tasks in flight, so its memory does not grow with the class.

- ``InProcess`` (``--jobs 1``): one notebook after another in this process, as the plain grade
  command always did.
- ``LocalPool`` (``--jobs N``): N grading processes on this machine (``spawn``), each with its
  own sandboxed workers, each on its own CPU cores where there are enough
  (:func:`.machine.core_sets`); on a machine with GPUs each process is kept on one GPU or MIG
  slice.
- ``DaskEngine`` (``--engine dask``): Dask's distributed scheduler, a local cluster of N
  single-threaded worker processes by default, each on its own CPU cores as the pool's, or an
  existing cluster (``--address``; its machines are not ours to pin).
- ``RayEngine`` (``--engine ray``): Ray, locally with N CPUs by default, or a running cluster.
"""

from __future__ import annotations

from .machine import core_sets, cores
from .task import close_helper, grade_one, pin_server, take_slot


class InProcess:
    """Grade in this process, one notebook after another."""

    name = "in process"

    def __init__(self):
        self._done = []

    def submit(self, *args):
        try:
            outcome = (grade_one(*args), None)
        except Exception as error:  # noqa: BLE001 - reported for that notebook, the class goes on
            outcome = (None, f"{type(error).__name__}: {error}")
        handle = object()
        self._done.append((handle, *outcome))
        return handle

    def wait_any(self, handles):
        done, self._done = [d for d in self._done if d[0] in handles], []
        return done

    def close(self):
        pass


class LocalPool:
    """``jobs`` grading processes on this machine, each on its own GPU slot when there are any,
    and on its own CPU cores (:func:`core_sets`)."""

    def __init__(self, jobs: int, slots: list[str] | None = None):
        import multiprocessing
        from concurrent.futures import ProcessPoolExecutor

        context = multiprocessing.get_context("spawn")  # no inherited threads, locks or CUDA
        pins = core_sets(jobs)
        self.pool = ProcessPoolExecutor(
            max_workers=jobs, mp_context=context, initializer=take_slot,
            initargs=(context.Value("i", 0), slots or [], max(1, cores() // jobs), pins))
        self.name = (f"{jobs} local processes" + (f" on {len(slots)} GPU(s)" if slots else "")
                     + (", each on its own CPU cores" if pins else ""))

    def submit(self, *args):
        return self.pool.submit(grade_one, *args)

    def wait_any(self, handles):
        from concurrent.futures import FIRST_COMPLETED, wait

        done, _ = wait(handles, return_when=FIRST_COMPLETED)
        return [(f, *_outcome(f.result, f.exception)) for f in done]

    def close(self):
        self.pool.shutdown(wait=True, cancel_futures=True)


def _outcome(result, exception):
    error = exception()
    if error is not None:
        return None, f"{type(error).__name__}: {error}"
    return result(), None


class DaskEngine:
    """Dask distributed: a ``LocalCluster`` of ``jobs`` single-threaded processes (each on its
    own CPU cores, as the pool's, where :func:`core_sets` gives them), or the
    cluster whose scheduler listens at ``address`` (``tcp://host:8786``; start one by hand, or
    through dask-jobqueue on Slurm or dask-kubernetes)."""

    def __init__(self, jobs: int, address: str | None = None):
        import dask
        from dask.distributed import Client, LocalCluster

        # A grading task starts processes of its own (the sandboxed worker): Dask's workers
        # must not be daemonic processes, which may not have children.
        dask.config.set({"distributed.worker.daemon": False})
        # A local worker shares its cores with the notebooks it grades: no sampling profiler
        # (every 10 ms), GIL monitor (every 1 ms) or memory check every 100 ms beside them.
        dask.config.set({"distributed.worker.profile.enabled": False,
                         "distributed.admin.system-monitor.gil.enabled": False,
                         "distributed.worker.memory.monitor-interval": "1s"})
        self.cluster = None
        if address:
            self.client = Client(address)
            self.name = f"Dask at {address}"
        else:
            self.cluster = LocalCluster(n_workers=jobs, threads_per_worker=1, processes=True,
                                        dashboard_address=None)
            self.client = Client(self.cluster)
            # Each worker process on its own cores, as the pool's (a remote cluster's machines
            # are not ours to pin). Not the nannies: a LocalCluster's run in this process,
            # whose threads would all be pinned; a worker a nanny restarts runs on every core.
            pins = core_sets(jobs)
            if pins:
                self.client.wait_for_workers(jobs)
                self.client.run(pin_server, pins)
            self.name = (f"Dask LocalCluster ({jobs} process{'es' if jobs != 1 else ''}"
                         + (", each on its own CPU cores)" if pins else ")"))

    def submit(self, *args):
        return self.client.submit(grade_one, *args, pure=False, retries=0)

    def wait_any(self, handles):
        from dask.distributed import wait

        done = wait(list(handles), return_when="FIRST_COMPLETED").done
        out = []
        for f in done:
            if f.status == "error":
                error = f.exception()
                out.append((f, None, f"{type(error).__name__}: {error}"))
            else:
                out.append((f, f.result(), None))
        return out

    def close(self):
        if self.cluster is not None:  # the workers' helpers first: 4 s less to close
            self.client.run(close_helper, on_error="ignore")
        self.client.close()
        if self.cluster is not None:
            self.cluster.close()


class RayEngine:
    """Ray: a local instance with ``jobs`` CPUs, or a running cluster (``address="auto"`` or
    ``ray://host:10001``; Ray's own launchers start one on Slurm or Kubernetes)."""

    def __init__(self, jobs: int, address: str | None = None, gpus: int = 0):
        import ray

        self.ray = ray
        if address:
            ray.init(address=address, ignore_reinit_error=True, log_to_driver=False)
            self.name = f"Ray at {address}"
        else:
            ray.init(num_cpus=jobs, num_gpus=gpus, include_dashboard=False,
                     ignore_reinit_error=True, log_to_driver=False)
            self.name = f"Ray, local ({jobs} CPUs)"
        self.remote = ray.remote(num_cpus=1, num_gpus=1 if gpus else 0, max_retries=0)(grade_one)

    def submit(self, *args):
        return self.remote.remote(*args)

    def wait_any(self, handles):
        ready, _ = self.ray.wait(list(handles), num_returns=1)
        out = []
        for ref in ready:
            try:
                out.append((ref, self.ray.get(ref), None))
            except Exception as error:  # noqa: BLE001 - that notebook's failure, reported
                out.append((ref, None, f"{type(error).__name__}: {error}"))
        return out

    def close(self):
        self.ray.shutdown()


ENGINES = ("local", "dask", "ray")


def make_engine(engine: str, jobs: int, address: str | None, slots: list[str]):
    """The engine ``engine`` with ``jobs`` workers (see the module's docstring)."""
    if engine not in ENGINES:
        raise ValueError(f"unknown engine {engine!r}: choose one of {', '.join(ENGINES)}")
    if engine == "local":
        if address:
            raise ValueError("--address names a cluster: use it with --engine dask or ray")
        return InProcess() if jobs == 1 and len(slots) <= 1 else LocalPool(jobs, slots)
    try:
        if engine == "dask":
            return DaskEngine(jobs, address)
        return RayEngine(jobs, address, gpus=len(slots))
    except ImportError as missing:
        package = "dask[distributed]" if engine == "dask" else "ray"
        raise RuntimeError(f"--engine {engine} needs {package}: pip install '{package}' "
                           f"({missing})") from None
