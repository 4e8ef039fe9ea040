"""One rank of a graded ring exercise (chapter 13): the process that runs the student's cell.

:mod:`course_utils.grading.ranks` starts R of these per case (forked by its zygote, or as
``python`` processes) and judges what they send back; this module is what each of them runs
(:func:`_rank_main`): join the group through the FileStore, pass one warm-up block around the
ring, lock itself in (:func:`_lock`: Landlock, then no new socket), run the cell on its shard
with ``dist.batch_isend_irecv`` replaced by a recorder (:class:`_Recorder`) and the collectives
refused, and send the outputs and the log back (ranks' docstring says why in this order and what
the log holds). Its own room: the rank's side, which runs untrusted code and never judges it,
apart from the grader's side that starts, times and kills the ranks.
"""

from __future__ import annotations

import os
import sys

from . import sandbox

NCCL_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
            "NVSHMEM_DISABLE_NVLS": "1"}  # as course_utils.library.ring.NCCL_ENV
GROUP_SECONDS = 20  # torch.distributed's own timeout inside the ranks (a wrong peer errors)
# Collectives a ring exercise may not use (the ring passes blocks with batch_isend_irecv).
COLLECTIVES = ("all_gather", "all_gather_into_tensor", "all_gather_object", "all_reduce",
               "all_to_all", "all_to_all_single", "broadcast", "broadcast_object_list",
               "gather", "gather_object", "reduce", "reduce_scatter", "reduce_scatter_tensor",
               "scatter", "scatter_object_list", "send", "recv", "barrier")
# Functions counted as compute between the transfer events (by __name__).
COMPUTE = frozenset({"matmul", "__matmul__", "__rmatmul__", "bmm", "mm", "einsum", "baddbmm",
                     "addmm", "softmax", "_softmax", "exp", "exp_", "exp2", "logsumexp",
                     "scaled_dot_product_attention", "log_softmax"})


def _writes(name, kwargs):
    """Whether the torch function ``name`` writes into its first argument (or ``out=``)."""
    return (name.endswith("_") and not name.startswith("_")) or name in (
        "__setitem__", "__iadd__", "__isub__", "__imul__", "__itruediv__") or bool(
        kwargs and kwargs.get("out") is not None)


def _span(t):
    """``(lo, hi)``: the bytes of memory a tensor's view can touch."""
    if t.numel() == 0:
        return (0, 0)
    extent = sum((s - 1) * st for s, st in zip(t.shape, t.stride(), strict=True)) + 1
    lo = t.data_ptr()
    return (lo, lo + extent * t.element_size())


def _overlaps(a, b):
    return a[0] < b[1] and b[0] < a[1]


class _Recorder:
    """The rank's log of transfers and compute; installs itself over ``dist``."""

    def __init__(self, torch, dist):
        self.torch, self.dist = torch, dist
        self.log, self.ops, self.quiet = [], 0, False
        self.pending = {}  # batch -> {"recvs": [(user, staging, span)], "sends": [...]}
        self.batches = 0
        self.real = dist.batch_isend_irecv

    def event(self, **what):
        what["ops"] = self.ops
        self.ops = 0
        self.log.append(what)

    def hazard(self, what, batch):
        if not any(e.get("ev") == "hazard" and e.get("what") == what and e.get("batch") == batch
                   for e in self.log):
            self.event(ev="hazard", what=what, batch=batch)

    # ---- compute, seen by a TorchFunctionMode
    def saw(self, func, args, kwargs):
        name = getattr(func, "__name__", "")
        if self.quiet:
            return
        if _writes(name, kwargs):
            self.wrote(args, kwargs)
        if name not in COMPUTE:
            return
        self.ops += 1
        torch = self.torch
        tensors = [a for a in (*args, *(kwargs or {}).values()) if isinstance(a, torch.Tensor)]
        for batch, entry in self.pending.items():
            for user, _, span in entry["recvs"]:
                if any(_overlaps(_span(t), span) for t in tensors if t.device == user.device):
                    self.hazard("compute read a buffer still being received into", batch)

    def wrote(self, args, kwargs):
        """An in-place operation (``add_``, ``x[i] = ...``, ``out=``): its target must not be a
        buffer still being received into (the arriving data would overwrite the write)."""
        torch = self.torch
        targets = [a for a in (args[:1] if args else ()) if isinstance(a, torch.Tensor)]
        out = (kwargs or {}).get("out")
        targets += [t for t in (out if isinstance(out, (tuple, list)) else [out])
                    if isinstance(t, torch.Tensor)]
        for batch, entry in self.pending.items():
            for user, _, span in entry["recvs"]:
                if any(_overlaps(_span(t), span) for t in targets if t.device == user.device):
                    self.hazard("wrote into a buffer still being received into", batch)

    # ---- transfers
    def batch_isend_irecv(self, p2p_ops):
        torch, dist = self.torch, self.dist
        self.quiet = True
        try:
            batch = self.batches
            self.batches += 1
            rank = dist.get_rank()
            sends, recvs, real_ops = [], [], []
            for op in p2p_ops:
                t = op.tensor
                if op.op is dist.isend:
                    sends.append((t, t.detach().clone(), _span(t)))
                    real_ops.append(op)
                else:
                    staging = torch.empty_like(t, memory_format=torch.contiguous_format)
                    recvs.append((t, staging, _span(t)))
                    real_ops.append(dist.P2POp(dist.irecv, staging, op.peer, op.group, op.tag))
            for _user, _, span in recvs:
                if any(_overlaps(span, s) for _, _, s in sends) or any(
                        _overlaps(span, s) for e in self.pending.values()
                        for _, _, s in e["sends"]):
                    self.hazard("received into a buffer that is being sent", batch)
            self.event(ev="post", batch=batch, rank=rank,
                       sends=[[int(op.peer), int(op.tensor.numel() * op.tensor.element_size())]
                              for op in p2p_ops if op.op is dist.isend],
                       recvs=[[int(op.peer), int(op.tensor.numel() * op.tensor.element_size())]
                              for op in p2p_ops if op.op is not dist.isend])
            for t, _, _ in recvs:  # undefined until wait(): NaN (or the dtype's maximum)
                t.fill_(float("nan") if t.dtype.is_floating_point else -1)
            works = self.real(real_ops)
            self.pending[batch] = {"recvs": recvs, "sends": sends}
            return [_Work(self, batch, works) for _ in (works or [None])]
        finally:
            self.quiet = False

    def finish(self, batch, works):
        if batch not in self.pending:
            return
        self.quiet = True
        try:
            for w in works:
                w.wait()
            entry = self.pending.pop(batch)
            for user, staging, _ in entry["recvs"]:
                user.copy_(staging)
            for user, snapshot, _ in entry["sends"]:
                same = (user == snapshot) | (user.isnan() & snapshot.isnan()) \
                    if user.dtype.is_floating_point else (user == snapshot)
                if not bool(same.all()):
                    self.hazard("a tensor being sent was written before its wait()", batch)
            self.event(ev="wait", batch=batch)
        finally:
            self.quiet = False


class _Work:
    def __init__(self, recorder, batch, works):
        self.recorder, self.batch, self.works = recorder, batch, works

    def wait(self, *args, **kwargs):
        self.recorder.finish(self.batch, self.works)
        return True

    def is_completed(self):
        return self.batch not in self.recorder.pending


def _forbidden(name):
    from .watch import ForbiddenCall

    def refuse(*args, **kwargs):
        raise ForbiddenCall(f"dist.{name}: a ring passes its blocks to the next rank with "
                            "dist.batch_isend_irecv (P2POp isend / irecv) only")

    return refuse


def _lock(job) -> dict:
    """Lock this rank in (after the group exists): Landlock, then no new socket."""
    locked = {}
    if job.get("landlock"):
        try:
            locked["landlock"] = sandbox.landlock_restrict(**job["landlock"])
        except Exception as exc:
            locked["landlock"] = f"unavailable ({type(exc).__name__}: {exc})"
    if job.get("seccomp"):
        try:
            from .seccomp import deny_sockets

            locked["seccomp"] = deny_sockets()
        except Exception as exc:
            locked["seccomp"] = f"unavailable ({type(exc).__name__}: {exc})"
    import socket

    try:  # the grader's own code still: a socket must be refused now
        socket.socket(socket.AF_INET, socket.SOCK_STREAM).close()
        locked["socket"] = "opened"
    except OSError:
        locked["socket"] = "refused"
    probe = job.get("probe")
    if probe:
        try:
            with open(probe, "rb") as f:
                locked["read"] = f.read(16).hex()
        except OSError:
            locked["read"] = "refused"
    return locked


def _rank_main(fd_in: int, fd_out: int) -> None:
    """A rank: join the group, warm up, lock in, run the cell's function on its shard."""
    channel = sandbox._Channel(fd_in, fd_out)
    job, _ = channel.recv()
    sys.path[1:1] = [p for p in job.get("sys_path", []) if isinstance(p, str)]
    sandbox._apply_rlimits(job.get("limits", {}))
    sandbox._volunteer_for_oom_killer()
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    rank, world, backend = job["rank"], job["world"], job["backend"]
    torch.set_num_threads(max(1, int(job.get("threads", 1))))
    kwargs = {}
    if backend == "nccl":
        os.environ.update(NCCL_ENV)
        torch.cuda.set_device(rank)
        kwargs["device_id"] = torch.device("cuda", rank)
    device = torch.device("cuda", rank) if backend == "nccl" else torch.device("cpu")
    store = dist.FileStore(job["store"], world)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world,
                            timeout=timedelta(seconds=job.get("group_seconds", GROUP_SECONDS)),
                            **kwargs)
    # Warm-up: one block around the ring (NCCL makes its P2P communicators here, gloo proves
    # the mesh), before the lock takes new sockets away.
    token = torch.full((4,), float(rank), device=device)
    got = torch.empty_like(token)
    for w in dist.batch_isend_irecv([dist.P2POp(dist.isend, token, (rank + 1) % world),
                                     dist.P2POp(dist.irecv, got, (rank - 1) % world)]):
        w.wait()
    if int(got[0].item()) != (rank - 1) % world:
        os._exit(5)
    if device.type == "cuda":
        torch.cuda.synchronize()
    locked = _lock(job)
    channel.send({"ready": locked})
    task, buffers = channel.recv()
    dec = sandbox._Decoder(task["regions"], buffers)
    args = dec.dec(task["args"])
    call_kwargs = dec.dec(task["kwargs"])
    args = tuple(a.to(device) if isinstance(a, torch.Tensor) else a for a in args)
    recorder = _Recorder(torch, dist)
    from torch.overrides import TorchFunctionMode

    class Watch(TorchFunctionMode):
        def __torch_function__(self, func, types, fargs=(), fkwargs=None):
            recorder.saw(func, fargs, fkwargs)
            return func(*fargs, **(fkwargs or {}))

    dist.batch_isend_irecv = recorder.batch_isend_irecv
    import torch.distributed.distributed_c10d as c10d

    c10d.batch_isend_irecv = recorder.batch_isend_irecv
    for name in COLLECTIVES:
        if hasattr(dist, name):
            setattr(dist, name, _forbidden(name))
    try:
        namespace = {"__name__": "__ring_cell__"}
        import linecache

        cell = "<the exercise's cell>"  # tracebacks quote the line that raised
        linecache.cache[cell] = (len(task["source"]), None,
                                 task["source"].splitlines(keepends=True), cell)
        exec(compile(task["source"], cell, "exec"), namespace)
        fn = namespace.get(task["name"])
        if not callable(fn):
            raise NameError(f"the cell does not define {task['name']}")
        with Watch():
            out = fn(*args, **call_kwargs)
        if device.type == "cuda":
            torch.cuda.synchronize()
        recorder.event(ev="end", pending=sorted(recorder.pending))
        enc = sandbox._Encoder()
        value = enc.enc(_to_cpu(torch, out))
        log = enc.enc(recorder.log)
        reply, data = enc.message({"ok": value, "log": log})
        channel.send(reply, data)
    except BaseException as exc:  # noqa: BLE001 (the student's code: report what and where)
        try:
            channel.send(sandbox._raised(exc if isinstance(exc, Exception)
                                         else RuntimeError(repr(exc))))
        except Exception:
            os._exit(6)
    sys.stdout.flush()
    sys.stderr.flush()
    try:  # wait to be killed: leaving early could strand a peer's last receive
        channel.recv()
    finally:
        os._exit(0)


def _to_cpu(torch, x):
    if isinstance(x, torch.Tensor):
        return x.detach().to("cpu")
    if isinstance(x, (tuple, list)):
        return type(x)(_to_cpu(torch, v) for v in x)
    return x
