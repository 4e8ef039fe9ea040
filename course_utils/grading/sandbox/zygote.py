"""Warm starts: a zygote process forks workers and ranks with torch already imported.

A process started from nothing spends most of its start importing torch (and, for a worker,
IPython): about 3 s of CPU on the course's 2-core machine, more than the cells of most
notebooks. The grader starts one worker per notebook and per restart, and chapter 13's checks
start R ranks per case. So each grading process keeps a *zygote* per kind of child: a clean
interpreter (``python -I``, the grader's import path, one thread) that imports those libraries
once and then only forks (:mod:`.zygote_server`). Each fork becomes what the grader would have
started itself: its own session, the environment, working folder, pipes and log the grader
chose, then its entry point (``worker_main``, which copies nothing from the zygote but torch:
it imports its own fresh copy of the package, locks itself in and proves the lock).

What stays true:

- **The child is the grader's child.** The zygote forks through an intermediate process that
  exits at once, so the child is adopted by the grader, a child subreaper: the grader waits
  for it, reads its exit status and kills its tree as before (:class:`ForkedProcess` stands in
  for ``subprocess.Popen``), and never kills a zygote with a child's tree (:func:`pids`).
- **Nothing a notebook wrote is imported by a zygote**: it imports its libraries before its
  first child exists and never runs a notebook's code. A child keeps none of the zygote's
  descriptors, and a locked child cannot signal or trace a process outside its Landlock domain.
- **One thread**: the zygote runs with ``OMP_NUM_THREADS=1`` (and OpenBLAS's and MKL's) so
  that no import starts a thread pool, and it refuses to fork otherwise. A forked worker
  therefore computes on one CPU thread, what N workers side by side should do anyway.
- **Where it cannot serve** (not Linux, no subreaper, a refusal, ``COURSE_ZYGOTE=0``), children
  start from nothing as before; a zygote that dies is replaced at most :data:`MAX_STARTS`
  times per kind and process.
"""

from __future__ import annotations

import atexit
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

SERVER = Path(__file__).with_name("zygote_server.py")  # run as a script, never imported here
MAX_STARTS = 3
READY_SECONDS = 180.0  # a cold import of torch on a loaded machine
SINGLE_THREAD = {"OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}


class ZygoteRefused(Exception):
    """The zygote could not fork (it was not single-threaded, or it is gone). ``threads``:
    it has more than one thread, so a zygote of its kind would refuse again."""

    def __init__(self, why: str, threads: bool = False):
        super().__init__(why)
        self.threads = threads


class ForkedProcess:
    """A child forked by a zygote and adopted by this process: the part of ``Popen`` the
    grader uses (``pid``, ``returncode``, ``poll()``, ``wait(timeout)``)."""

    def __init__(self, pid: int):
        self.pid = pid
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            try:
                pid, status = os.waitpid(self.pid, os.WNOHANG)
            except ChildProcessError:  # reaped already (kill_tree reaps what it kills)
                self.returncode = -signal.SIGKILL
                return self.returncode
            if pid:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        end = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if end is not None and time.monotonic() > end:
                raise subprocess.TimeoutExpired(f"process {self.pid}", timeout)
            time.sleep(0.01)
        return self.returncode


class Zygote:
    """A zygote and the grader's end of its socket. ``preload``: the modules it imports once;
    ``package``: a read-only package copy its children share (the ranks), imported from there;
    ``folder``: deleted when the zygote closes (by the grader, or by the zygote should the
    grader die first)."""

    def __init__(self, preload, import_path: list[str], env: dict, *, package=None,
                 folder=None, cwd="/"):
        config = {"preload": list(preload), "path": list(import_path),
                  "package": str(package) if package else None,
                  "folder": str(folder) if folder else None}  # fmt: skip
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        source = SERVER.read_text(encoding="utf-8")
        try:
            self.proc = subprocess.Popen(
                [sys.executable, "-I", "-B", "-u", "-c", source, str(theirs.fileno()),
                 json.dumps(config)],
                pass_fds=(theirs.fileno(),), cwd=cwd, env=dict(env, **SINGLE_THREAD),
                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                start_new_session=True,
            )
        except BaseException:
            ours.close()
            raise
        finally:
            theirs.close()
        self.sock, self.folder = ours, folder
        self.package = Path(package) if package else None  # what its children import
        self.sock.settimeout(READY_SECONDS)
        try:
            hello = json.loads(self.sock.recv(1 << 16) or b"{}")
        except (OSError, ValueError):
            hello = {}
        if "ready" not in hello:
            self.close()
            raise ZygoteRefused("the zygote did not start")
        self.loaded, self.threads = hello["ready"], hello.get("threads")

    def spawn(self, entry: str, fds, cwd, env: dict, package=None,
              seconds: float = 60.0) -> ForkedProcess:
        """A fresh child that runs ``entry`` (``"module:function"``, called with its two
        pipes) in ``cwd`` with ``env``; ``fds`` are its ``(to_r, from_w, log)``."""
        request = {"entry": entry, "cwd": str(cwd), "env": env,
                   "package": str(package) if package else None}  # fmt: skip
        try:
            self.sock.settimeout(seconds)
            socket.send_fds(self.sock, [json.dumps(request).encode()], list(fds))
            reply = json.loads(self.sock.recv(1 << 16) or b"{}")
        except (OSError, ValueError) as exc:
            raise ZygoteRefused(f"the zygote did not answer ({exc})") from None
        if "pid" not in reply:
            raise ZygoteRefused(str(reply.get("error", "the zygote is gone")),
                                threads=reply.get("threads", 1) != 1)
        return ForkedProcess(int(reply["pid"]))

    def alive(self) -> bool:
        return self.proc.poll() is None

    def close(self) -> None:
        try:
            self.sock.close()
            self.proc.kill()
            self.proc.wait(timeout=5)
        except Exception:  # noqa: BLE001 (closing at exit: nothing left to report to)
            pass
        if self.folder is not None:
            from .isolation import remove_tree

            remove_tree(Path(self.folder))


_ZYGOTES: dict[str, Zygote] = {}
_STARTS: dict[str, int] = {}


def enabled() -> bool:
    return (sys.platform == "linux" and hasattr(socket, "send_fds")
            and os.environ.get("COURSE_ZYGOTE", "1") != "0")  # fmt: skip


def pids() -> frozenset[int]:
    """The zygotes' process ids: never killed with a child's tree."""
    return frozenset(z.proc.pid for z in _ZYGOTES.values())


def get(kind: str, make) -> Zygote | None:
    """This process's zygote of ``kind``, made by ``make()`` (again, if the last one died, at
    most :data:`MAX_STARTS` times); None where zygotes are off or cannot work here."""
    if not enabled():
        return None
    zygote = _ZYGOTES.get(kind)
    if zygote is not None and zygote.alive():
        return zygote
    if zygote is not None:
        zygote.close()
        del _ZYGOTES[kind]
    if _STARTS.get(kind, 0) >= MAX_STARTS:
        return None
    _STARTS[kind] = _STARTS.get(kind, 0) + 1
    from .process import set_subreaper

    if not set_subreaper():  # a child could not be adopted
        _STARTS[kind] = MAX_STARTS
        return None
    try:
        _ZYGOTES[kind] = make()
    except (OSError, ZygoteRefused):
        return None
    return _ZYGOTES[kind]


def spawn(kind: str, make, entry: str, fds, cwd, env: dict, package=None):
    """A child forked by the zygote of ``kind`` (see :meth:`Zygote.spawn`), or None: start it
    from nothing. A zygote that refuses is closed; one that cannot fork single-threaded is not
    started again."""
    zygote = get(kind, make)
    if zygote is None:
        return None
    try:
        return zygote.spawn(entry, fds, cwd, env, package=package)
    except ZygoteRefused as exc:
        if exc.threads:
            _STARTS[kind] = MAX_STARTS
        zygote.close()
        _ZYGOTES.pop(kind, None)
        return None


def shutdown() -> None:
    """Stop every zygote of this process (each also stops by itself when this process ends)."""
    for zygote in list(_ZYGOTES.values()):
        zygote.close()
    _ZYGOTES.clear()


atexit.register(shutdown)
