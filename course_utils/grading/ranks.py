"""Rank processes for graded ring code (chapter 13): the grader starts them, they run one cell.

A ring exercise hands in a function that must run in R processes joined in one
``torch.distributed`` group. The grading process (or, when a student checks locally, the
student's kernel) starts those R processes itself, per case, with :func:`run`::

    grading process                                  rank r (R of them, fresh per case)
    ---------------                                  ----------------------------------
    private folder: FileStore, R scratch folders     joins the gloo (or NCCL) group through
                                                     the FileStore, passes one warm-up block
                                                     around the ring, then locks itself in:
                                                     Landlock (like the notebook's worker),
                                                     rlimits, no new socket (seccomp)
                                       <- "ready"
    -> rank r's shard only, the cell's source        runs the cell (untrusted text), calls the
                                                     function with its shard, every
                                                     batch_isend_irecv recorded
                              <- outputs + the log
    compares the gathered outputs with float64,      (killed with everything it started)
    judges the log

**Why this order.** gloo connects its full mesh of TCP sockets when the group is created (lazy
init off: ``TORCH_GLOO_LAZY_INIT`` is removed from the ranks' environment), and NCCL creates its
point-to-point communicators at the first exchange (hence the warm-up). After that no rank
needs a new socket: sends and receives use the sockets already open, which the seccomp filter
leaves working, while ``socket()``/``connect()`` are refused, so no rank can reach another
notebook's ranks (or anything else). The store is a file in a folder of this case's alone, made
unreadable by the lock before the student's code runs; each rank gets its inputs over its own
pipe, so no rank can read another's shard (not in a file, not through ``/proc``: Landlock
forbids ptrace across domains, each rank is locked in its own).

**What a rank records.** ``dist.batch_isend_irecv`` is replaced, in the rank, by a recorder: each
call is logged (peers, bytes, the compute operations run since the last event), a receive lands
in a private buffer and is copied into the student's tensor only by ``wait()`` (the student's
tensor holds NaN until then, as undefined memory may), and a sent tensor written before its
``wait()`` is noticed. A ``TorchFunctionMode`` counts the compute (matmul, exp, softmax, ...)
between the events and notices compute that reads a buffer still being received into, or an
in-place write into one (``add_``, ``x[i] = ...``: the arriving data would overwrite it). The
log is data the grader judges (it never trusts a verdict from a rank); the outputs are compared
in the grading process. Collectives (``all_gather``, ``broadcast``, ...) and blocking
``send``/``recv`` raise ``ForbiddenCall`` in a rank: a ring passes blocks with
``batch_isend_irecv``.

**The zygote.** Importing torch costs seconds per process, so the ranks are not started from
scratch: the first case starts, from the grading process, one *zygote* per process
(:mod:`course_utils.grading.sandbox.zygote`, shared with the notebooks' workers; before any
student code exists, with one thread): a Python that imports torch and this package's rank code
once, from a read-only copy the ranks share, and forks a child for each rank of each case. The
child is adopted by the grading process, closes every descriptor it inherited but its own
pipes and log, takes a session of its own, and only then becomes a rank as above (join, warm
up, lock in, run the cell). The zygote itself never receives a cell; a rank is never reused.
A case then costs a fraction of a second instead of seconds per rank.
``COURSE_RANKS_ZYGOTE=0`` (or ``COURSE_ZYGOTE=0``, for every zygote) starts each rank as its
own ``python`` process instead.

**Cleanup.** A case has two deadlines (the ranks start: :data:`CASE_SECONDS`; the cell runs
and replies: :data:`RUN_SECONDS`, ample for the exercises' tiny shards); past one, or when a rank
crashes or raises, every rank's process tree is killed
(:func:`course_utils.grading.sandbox.kill_tree`), also every process started in a rank's session,
and the case's folder (store included) is deleted. A deadlock, a hang or a crash costs that case.

**GPUs.** Where ``torch.cuda.device_count() >= R`` the ranks use NCCL, one GPU each, with
:data:`NCCL_ENV` (no NVLink multicast) set before the communicator exists.
``COURSE_RANKS_NCCL_SECCOMP=0`` leaves the socket filter off for NCCL ranks (Landlock and the
rest stay), should a driver need a new socket after the warm-up.

**Rooms.** This module is the grader's side (:func:`run`, the zygote, the deadlines and the
cleanup); what each rank runs (join, warm up, lock in, the recorder, the cell) is
:mod:`course_utils.grading.rank_process`, whose constants are re-exported here.
"""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from . import sandbox
from .rank_process import (  # noqa: F401 (re-exported: the rank's constants)
    COLLECTIVES,
    COMPUTE,
    GROUP_SECONDS,
    NCCL_ENV,
    _rank_main,
)
from .sandbox import zygote

CASE_SECONDS = 90.0  # one case: start R processes, join, warm up, lock in
RUN_SECONDS = 6.0  # then the cell on tiny shards, and the replies (a deadlock fails the case)
REPLY_MB = 256

__all__ = ["CASE_SECONDS", "RankFailure", "backend_for", "defining_cell", "run"]


class RankFailure(Exception):
    """A case's ranks did not all reply: ``status`` (crashed, timed out, error, forbidden,
    not implemented), the rank (or None) and why."""

    def __init__(self, status: str, rank, reason: str, exc=None):
        super().__init__(f"rank {rank}: {reason}" if rank is not None else reason)
        self.status, self.rank, self.reason, self.exc = status, rank, reason, exc


# ============================================================================ student's side


def defining_cell(fn) -> tuple[str, str]:
    """``(source, name)``: the whole cell (or file) that defines ``fn``, and its name.

    Runs next to the candidate (``grader.invoke``); the text is untrusted and is executed only
    inside the locked-in ranks.
    """
    import linecache

    code = getattr(fn, "__code__", None)
    name = getattr(fn, "__name__", None)
    if code is None or not isinstance(name, str):
        raise TypeError("hand in the function itself (a def in a cell), not "
                        f"{type(fn).__name__}")
    lines = linecache.getlines(code.co_filename)
    if not lines:
        import inspect

        lines = inspect.getsource(fn).splitlines(keepends=True)
    return "".join(lines), name


# ============================================================================ the zygote

# What every rank would import at its start: the ranks' zygote imports them once, with the
# package copy the ranks share (sandbox.zygote: forked, adopted, one thread).
RANK_PRELOAD = ("torch", "torch.distributed", "torch.distributed.distributed_c10d",
                "torch.overrides", "course_utils.grading.rank_process")
RANK_ENTRY = "course_utils.grading.rank_process:_rank_main"


def _make_zygote():
    """The ranks' zygote: a folder holding the package copy the ranks import, deleted with it."""
    _remove_orphaned_zygote_folders()
    folder = Path(tempfile.mkdtemp(prefix=f"course-ranks-zygote-{os.getpid()}-"))
    try:
        package = folder / "package"
        package.mkdir()
        sandbox.copy_package(package)
        os.chmod(package, 0o555)
        made = zygote.Zygote(RANK_PRELOAD, sandbox._import_path(folder),
                             dict(_base_env(), HOME=str(folder)), package=package,
                             folder=folder, cwd=folder)  # fmt: skip
    except BaseException:
        _remove_walking(folder)
        raise
    return made


def _remove_walking(folder: Path) -> None:
    """Delete ``folder`` file by file (no ``shutil``): a failed start leaves nothing behind."""
    for root, dirs, files in os.walk(folder, topdown=False):
        try:
            os.chmod(root, 0o700)  # the package copy is read-only
        except OSError:
            pass
        for name in files:
            try:
                os.unlink(os.path.join(root, name))
            except OSError:
                pass
        for name in dirs:
            try:
                os.rmdir(os.path.join(root, name))
            except OSError:
                pass
    try:
        os.rmdir(folder)
    except OSError:
        pass


def _remove_orphaned_zygote_folders() -> None:
    """Delete the zygote folders of grading processes that no longer run (one killed before
    its zygote could clean up): ``course-ranks-zygote-<pid>-*``."""
    import glob

    for path in glob.glob(os.path.join(tempfile.gettempdir(), "course-ranks-zygote-*-*")):
        owner = os.path.basename(path).split("-")[3]
        if owner.isdigit() and not os.path.exists(f"/proc/{owner}"):
            sandbox.remove_tree(Path(path))


def _zygote():
    """This process's ranks' zygote, started (again) if it is not running; None where it is
    off (``COURSE_RANKS_ZYGOTE=0`` or ``COURSE_ZYGOTE=0``) or cannot fork (not Linux)."""
    if os.environ.get("COURSE_RANKS_ZYGOTE", "1") == "0":
        return None
    return zygote.get("ranks", _make_zygote)


def _base_env() -> dict:
    return {k: v for k, v in os.environ.items()
            if not k.startswith(("COURSE_CHECKS_RAISE", "COURSE_GRADING", "PYTEST_", "PYTHON",
                                 "TORCH_GLOO_LAZY_INIT", "MASTER_", "RANK", "WORLD_SIZE",
                                 "LOCAL_RANK"))}


# ============================================================================ the grader's side

_BOOT = ("import sys; sys.path.insert(0, sys.argv[1]); "
         "from course_utils.grading.rank_process import _rank_main; "
         "_rank_main(int(sys.argv[2]), int(sys.argv[3]))")


def backend_for(world: int) -> str:
    """``"nccl"`` where this machine has a GPU per rank, else ``"gloo"`` (CPU shards)."""
    try:
        import torch

        if torch.cuda.is_available() and torch.cuda.device_count() >= world:
            return "nccl"
    except Exception:
        pass
    return "gloo"


def _session_of(pid):
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
        return int(stat[stat.rfind(b")") + 2:].split()[4])
    except (OSError, ValueError, IndexError):
        return None


def _family(pids):
    """The ranks, their descendants and every process in one of their sessions."""
    found = set(pids)
    for p in pids:
        found.update(sandbox.descendants(p))
    sessions = set(pids)
    if os.path.isdir("/proc"):
        for entry in os.listdir("/proc"):
            if entry.isdigit() and _session_of(int(entry)) in sessions:
                found.add(int(entry))
    return found


def _kill_all(procs, before=frozenset()):
    """Kill every rank, all they started (in their sessions or below them), and every process
    that became this process's descendant during the case (an orphan re-parented here, this
    process being a subreaper): only ``before`` (what ran before the case) is kept."""
    pids = [p.pid for p in procs]
    for _ in range(3):
        family = _family(pids)
        keep = frozenset(p for p in sandbox.descendants(os.getpid())
                         if p not in family and p in before)
        for p in pids:
            sandbox.kill_tree(p, keep)
        for p in family:  # a process of a rank's session that is not our descendant
            try:
                os.kill(p, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        for proc in procs:
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                pass
        if not any(_session_of(p) is not None for p in _family(pids) if p != os.getpid()):
            break


class _Deadline:
    def __init__(self, seconds, procs, what="start (join, warm up, lock in)"):
        self.end, self.procs = time.monotonic() + seconds, procs
        self.seconds, self.what = seconds, what

    def wait(self, fd, rank):
        while True:
            left = self.end - time.monotonic()
            if left <= 0:
                raise RankFailure("timed out", None, f"the ranks did not {self.what} within "
                                  f"{self.seconds:g} s (a deadlock: does every send have its "
                                  "receive on the peer, in the same order?)")
            ready, _, _ = select.select([fd], [], [], min(left, 0.2))
            if ready:
                return
            code = self.procs[rank].poll()
            if code is not None:
                raise RankFailure("crashed", rank, f"the process ended "
                                  f"({sandbox._exit_reason(code)})")


def _recv(reader, deadline, rank):
    try:
        return reader.recv(lambda fd: deadline.wait(fd, rank))
    except EOFError:
        code = deadline.procs[rank].poll()
        raise RankFailure("crashed", rank, "the process ended "
                          f"({sandbox._exit_reason(code)})") from None
    except sandbox.ProtocolError as exc:
        raise RankFailure("error", rank, f"sent a malformed reply ({exc})") from None


def _first_ready(readers, deadline, todo):
    """The rank (of ``todo``) whose pipe has data first."""
    while True:
        left = deadline.end - time.monotonic()
        if left <= 0:
            deadline.wait(readers[todo[0]].fd, todo[0])  # raises timed out
        fds = {readers[r].fd: r for r in todo}
        ready, _, _ = select.select(list(fds), [], [], min(max(left, 0.001), 0.2))
        if ready:
            return fds[ready[0]]
        for r in todo:
            code = deadline.procs[r].poll()
            if code is not None:
                raise RankFailure("crashed", r, f"the process ended "
                                  f"({sandbox._exit_reason(code)})")


def _protected():
    """What a rank may not read: the course, every grading run's and every case's folders."""
    import glob

    tmp = tempfile.gettempdir()
    paths = [str(sandbox.PACKAGE.parent), *glob.glob(os.path.join(tmp, "course-grade-*")),
             *glob.glob(os.path.join(tmp, "course-ranks-*")), "/dev/shm", "/dev/mqueue"]
    return [p for p in paths if os.path.exists(p)]


def run(source: str, name: str, shards, kwargs=None, *, backend=None,
        seconds: float = CASE_SECONDS, run_seconds: float = RUN_SECONDS):
    """Run ``name`` from the cell ``source`` in ``len(shards)`` fresh, locked-in ranks.

    ``shards[r]`` is the tuple of positional arguments of rank r (tensors, numbers), ``kwargs``
    the keyword arguments of every rank. Returns a list, per rank, of ``(output, log)``: the
    function's output (tensors on the CPU) and the rank's event log (see the module's
    docstring). Raises :class:`RankFailure` when a rank crashes, times out or raises (``exc``:
    the rebuilt exception). Every process is killed and every file deleted before it returns.
    """
    world = len(shards)
    backend = backend or backend_for(world)
    sandbox.set_subreaper()
    warm = _zygote()  # before ``before``: the zygote outlives the case
    before = frozenset(sandbox.descendants(os.getpid()))
    folder = Path(tempfile.mkdtemp(prefix="course-ranks-"))
    procs, writers, readers = [], [], []
    try:
        if warm is not None:
            package = warm.package
        else:
            package = folder / "package"
            package.mkdir()
            sandbox.copy_package(package)
            os.chmod(package, 0o555)
        (folder / "store").mkdir(mode=0o700)
        abi = sandbox.landlock_abi()
        protected = _protected()
        probe = next((f for f in (sandbox._first_file(p) for p in protected[:1]) if f), None)
        base_env = _base_env()
        threads = max(1, (os.cpu_count() or 1) // world)
        for r in range(world):
            scratch = folder / f"rank{r}"
            scratch.mkdir(mode=0o700)
            for sub in ("home", "tmp", "cache"):
                (scratch / sub).mkdir()
            env = dict(base_env, HOME=str(scratch / "home"), TMPDIR=str(scratch / "tmp"),
                       XDG_CACHE_HOME=str(scratch / "cache"), GLOO_SOCKET_IFNAME="lo",
                       OMP_NUM_THREADS=str(threads), MPLBACKEND="Agg",
                       TRITON_CACHE_DIR=str(scratch / "cache" / "triton"))
            if backend == "nccl":
                env.update(NCCL_ENV)
            to_r, to_w = os.pipe()
            from_r, from_w = os.pipe()
            log = open(scratch / "rank.log", "ab")  # noqa: SIM115 (handed to the process)
            try:
                forked = None
                if warm is not None:  # forked with torch imported: seconds saved per rank
                    forked = zygote.spawn("ranks", _make_zygote, RANK_ENTRY,
                                          (to_r, from_w, log.fileno()), scratch, env)
                if forked is not None:
                    procs.append(forked)
                else:
                    procs.append(subprocess.Popen(
                        [sys.executable, "-I", "-B", "-u", "-c", _BOOT, str(package),
                         str(to_r), str(from_w)], pass_fds=(to_r, from_w), cwd=scratch,
                        env=env, stdin=subprocess.DEVNULL, stdout=log,
                        stderr=subprocess.STDOUT, start_new_session=True))
            finally:
                log.close()
                os.close(to_r)
                os.close(from_w)
            writers.append(to_w)
            readers.append(sandbox._Reader(from_r, REPLY_MB << 20))
            job = {"rank": r, "world": world, "backend": backend, "threads": threads,
                   "store": str(folder / "store" / "filestore"), "probe": probe,
                   "sys_path": sandbox._import_path(folder),
                   "limits": {"file_bytes": 64 << 20}, "group_seconds": GROUP_SECONDS}
            if abi >= 1:
                writable = [str(scratch), "/dev/null", "/dev/zero", "/dev/urandom",
                            "/dev/random"]
                unreadable = [*protected, str(folder)]
                if backend == "nccl":  # the GPUs, and NCCL's shared-memory segments
                    writable += [*sandbox._writable_devices(), "/dev/shm"]
                    unreadable = [p for p in unreadable if p != "/dev/shm"]
                job["landlock"] = {"read_protected": unreadable,
                                   "writable": writable,
                                   "read_extra": [str(scratch), str(package), sys.prefix,
                                                  sys.base_prefix]}
                job["seccomp"] = backend != "nccl" or \
                    os.environ.get("COURSE_RANKS_NCCL_SECCOMP", "1") != "0"
            sandbox.send(to_w, job)
        deadline = _Deadline(seconds, procs)
        for r in range(world):
            header, _ = _recv(readers[r], deadline, r)
            locked = header.get("ready")
            if not isinstance(locked, dict):
                raise RankFailure("error", r, "did not report its lock")
            if locked.get("socket") != "refused" and job.get("seccomp"):
                raise RankFailure("error", r, f"the lock did not hold: a socket opened "
                                  f"({locked})")
            if abi >= 1 and probe and locked.get("read") != "refused":
                raise RankFailure("error", r, f"the lock did not hold: read {probe}")
        for r in range(world):
            enc = sandbox._Encoder()
            header = {"source": source, "name": name, "args": enc.enc(tuple(shards[r])),
                      "kwargs": enc.enc(dict(kwargs or {}))}
            header, data = enc.message(header)
            sandbox.send(writers[r], header, data)
        deadline = _Deadline(min(run_seconds, max(0.0, deadline.end - time.monotonic())),
                             procs, "run the cell")
        replies = [None] * world
        todo = list(range(world))
        while todo:
            r = _first_ready(readers, deadline, todo)
            header, data = _recv(readers[r], deadline, r)
            todo.remove(r)
            if "raised" in header:
                exc = sandbox._rebuild_exception(header["raised"])
                info = header["raised"] if isinstance(header["raised"], dict) else {}
                raise RankFailure(str(info.get("kind", "error")), r,
                                  f"{type(exc).__name__}: {exc}{getattr(exc, 'where', '')}",
                                  exc)
            try:
                dec = sandbox._Decoder(header.get("regions", []), data, strict=True)
                replies[r] = (dec.dec(header.get("ok")), dec.dec(header.get("log")))
            except (sandbox.ProtocolError, KeyError, TypeError, ValueError) as exc:
                raise RankFailure("error", r, f"sent a malformed reply ({exc})") from None
        return replies
    finally:
        _kill_all(procs, before)
        for fd in writers:
            try:
                os.close(fd)
            except OSError:
                pass
        for reader in readers:
            try:
                os.close(reader.fd)
            except OSError:
                pass
        sandbox.remove_tree(folder)
