"""The launcher: :func:`launch` runs ``fn(rank, world_size, *args)`` in R new processes
(gloo on the CPU, NCCL with one GPU per rank, :data:`NCCL_ENV` set) and returns what each
rank returned.

The ranks come from a fork server (``multiprocessing``'s "forkserver"): one clean process,
started on the first launch, that imports torch once (:data:`PRELOAD`) and forks a rank for
each request. A rank is then ready in a fraction of a second, where a spawned interpreter
spends seconds importing torch. The server never touches a GPU, so each forked rank opens CUDA
itself, as a spawned one would; and each rank takes the launching process's environment as it
is at the launch (:func:`_entry`), as a spawned one would.

Its own room: process management, which no attention code needs.
"""

from __future__ import annotations

import os
import socket
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

# What the fork server imports once, before it forks any rank.
PRELOAD = ["torch", "torch.distributed"]

# Set in every NCCL process (the lent machines have no NVLink multicast/NVLS to rely on).
NCCL_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
            "NVSHMEM_DISABLE_NVLS": "1"}


# =============================================================================================
# The launcher: R processes from a notebook or a test (torch.multiprocessing, a fork server)
# =============================================================================================


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank, fn, world_size, backend, port, folder, args, env):
    """One rank: join the group, run ``fn(rank, world_size, *args)``, save what it returns.

    ``env`` is the launcher's environment at the launch: the fork server's own is the one it
    started with, which a later launch (a test's setting, :data:`NCCL_ENV`) may have changed."""
    os.environ.clear()
    os.environ.update(env)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank))
    if backend == "nccl":
        os.environ.update(NCCL_ENV)  # before the communicator exists
        torch.cuda.set_device(rank)
    else:  # gloo: share the CPU cores between the ranks instead of oversubscribing them
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
    kwargs = {"device_id": torch.device("cuda", rank)} if backend == "nccl" else {}
    dist.init_process_group(backend, rank=rank, world_size=world_size, **kwargs)
    try:
        result = fn(rank, world_size, *args)
        torch.save(_to_cpu(result), Path(folder) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def _to_cpu(x):
    if isinstance(x, torch.Tensor):
        return x.detach().cpu()
    if isinstance(x, dict):
        return {key: _to_cpu(val) for key, val in x.items()}
    if isinstance(x, (list, tuple)):
        return type(x)(_to_cpu(val) for val in x)
    return x


def launch(fn, world_size, *args, backend=None, timeout=300):
    """Run ``fn(rank, world_size, *args)`` in ``world_size`` new processes, one group.

    ``fn`` must be importable (a module's function, not a notebook cell's: each rank finds it
    by its module and name). ``backend``: ``"gloo"`` (CPU) or ``"nccl"`` (one GPU per
    rank); default gloo. Returns the list of what each rank's ``fn`` returned (tensors moved to
    the CPU). A rank that raises makes ``launch`` raise with its traceback.
    """
    import torch.multiprocessing as mp

    backend = backend or "gloo"
    if backend not in ("gloo", "nccl"):
        raise ValueError(f"backend={backend!r}: use 'gloo' (CPU) or 'nccl' (GPUs)")
    if not (isinstance(world_size, int) and world_size >= 1):
        raise ValueError(f"world_size={world_size!r}: must be an int >= 1")
    if backend == "nccl":
        os.environ.update(NCCL_ENV)  # inherited by every rank from its first line
    if backend == "nccl" and torch.cuda.device_count() < world_size:
        raise RuntimeError(f"nccl with {world_size} ranks needs {world_size} GPUs, this machine "
                           f"has {torch.cuda.device_count()}")
    if getattr(fn, "__module__", "__main__") == "__main__":
        raise ValueError(f"{getattr(fn, '__name__', fn)} is defined in __main__ (a notebook "
                         "cell?): the ranks need a function they can import; put it in a module")
    mp.get_context("forkserver").set_forkserver_preload(PRELOAD)  # read at the server's start
    with tempfile.TemporaryDirectory() as folder:
        ctx = mp.start_processes(_entry, args=(fn, world_size, backend, _free_port(), folder,
                                               args, dict(os.environ)),
                                 nprocs=world_size, join=False, start_method="forkserver")
        deadline = time.monotonic() + timeout
        while not ctx.join(timeout=1):
            if time.monotonic() > deadline:
                for p in ctx.processes:
                    p.kill()
                raise TimeoutError(f"ranks still running after {timeout} s")
        return [torch.load(Path(folder) / f"rank{r}.pt", weights_only=False)
                for r in range(world_size)]
