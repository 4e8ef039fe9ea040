"""The zygote's own loop: one warm interpreter that forks fresh processes for the grader.

The grader starts it as ``python -I -B -u -c <this file's text> SOCKET_FD CONFIG_JSON`` (see
:mod:`course_utils.grading.sandbox.zygote`), so until it preloads what ``CONFIG_JSON`` names it
runs nothing but the standard library. It then imports, once, the libraries that every forked
process would otherwise import again (torch, numpy, IPython: seconds each time), and waits on
its socket. For each request it forks twice::

    zygote --fork--> intermediate --fork--> child (a worker or a rank)
                     exits at once           adopted by the grader (a child subreaper)

so the child becomes the grader's own: the grader waits for it, measures it and kills its
process tree exactly as it does a process it started itself. The zygote runs no notebook's
code. It forks only while it has a single thread (a fork copies one thread and leaves any
lock another held locked forever), and when the grader closes the socket it deletes the
folder it was given and ends.
"""

import gc
import json
import os
import signal
import socket
import sys

MAX_REQUEST = 1 << 20
FDS_PER_REQUEST = 3  # the child's end of each of its two pipes, and its log file
FD_IN, FD_OUT = 3, 4  # where the child finds its pipes


def _preload(names):
    loaded = []
    for name in names:
        try:
            __import__(name)
        except Exception:  # noqa: BLE001 (not installed here: the child imports what it needs)
            continue
        loaded.append(name)
    return loaded


def _threads() -> int:
    return len(os.listdir("/proc/self/task"))


def _reseed() -> None:
    """A forked child would repeat the zygote's random streams: draw fresh seeds."""
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        numpy.random.seed()
    torch = sys.modules.get("torch")
    if torch is not None:
        torch.seed()


def _become_child(request: dict, fds, base_path) -> None:
    """In the forked child: the process the grader would have started, then its entry point."""
    try:
        import fcntl
        import tempfile

        # high copies first, so that no dup2 below overwrites a descriptor not yet moved
        to_r, from_w, log = (fcntl.fcntl(f, fcntl.F_DUPFD, 1000) for f in fds)
        null = fcntl.fcntl(os.open(os.devnull, os.O_RDONLY), fcntl.F_DUPFD, 1000)
        os.setsid()  # its own session and process group, as start_new_session gives
        os.dup2(null, 0)
        os.dup2(log, 1)
        os.dup2(log, 2)
        os.dup2(to_r, FD_IN)
        os.dup2(from_w, FD_OUT)
        os.closerange(FD_OUT + 1, 1 << 16)  # the zygote's socket and every other child's pipes
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGCHLD, signal.SIGPIPE):
            signal.signal(sig, signal.SIG_DFL)
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        tempfile.tempdir = None  # found again from TMPDIR, the child's own
        sys.path[:] = base_path
        if request.get("package"):
            sys.path.insert(0, request["package"])
        sys.argv[:] = ["-c"]
        _reseed()
        module, _, function = request["entry"].partition(":")
        getattr(__import__(module, fromlist=[function]), function)(FD_IN, FD_OUT)
    except BaseException:  # noqa: BLE001 (the child's log says what went wrong)
        import traceback

        traceback.print_exc()
        sys.stderr.flush()
    os._exit(7)


def _remove(folder: str) -> None:
    import shutil

    def writable_again(func, path, _exc):
        try:
            os.chmod(os.path.dirname(path), 0o700)
            os.chmod(path, 0o700)
            func(path)
        except OSError:
            pass

    shutil.rmtree(folder, onerror=writable_again)


def _fork(request: dict, fds, base_path) -> int | None:
    """Fork the child through an intermediate that exits at once; return the child's pid."""
    report_r, report_w = os.pipe()
    middle = os.fork()
    if middle == 0:
        try:
            os.close(report_r)
            child = os.fork()
            if child == 0:
                os.close(report_w)
                _become_child(request, fds, base_path)  # never returns
            os.write(report_w, str(child).encode())
        finally:
            os._exit(0)
    os.close(report_w)
    pid = os.read(report_r, 32)
    os.close(report_r)
    os.waitpid(middle, 0)
    return int(pid) if pid else None


def serve(sock: socket.socket, config: dict, base_path) -> None:
    """Answer fork requests until the grader closes its end of the socket."""
    while True:
        try:
            data, fds, _flags, _addr = socket.recv_fds(sock, MAX_REQUEST, FDS_PER_REQUEST)
        except OSError:
            data, fds = b"", []
        if not data:
            if config.get("folder"):
                _remove(config["folder"])
            return
        pid, why, threads = None, "", 1
        try:
            request = json.loads(data)
            if len(fds) != FDS_PER_REQUEST:
                why = f"{len(fds)} descriptors, not {FDS_PER_REQUEST}"
            elif (threads := _threads()) != 1:
                why = f"{threads} threads: a fork would copy only one"
            else:
                pid = _fork(request, fds, base_path)
                why = "" if pid else "the fork failed"
        except (ValueError, OSError) as exc:
            why = f"{type(exc).__name__}: {exc}"[:200]
        finally:
            for fd in fds:
                os.close(fd)
        reply = {"pid": pid} if pid else {"error": why, "threads": threads}
        sock.send(json.dumps(reply).encode())


def main(argv) -> None:
    sock = socket.socket(fileno=int(argv[1]))
    config = json.loads(argv[2])
    base_path = list(sys.path)
    # The grader's own import path (what the instructor set up), read before any child exists;
    # a package folder first where the children share one read-only copy (the ranks).
    sys.path[1:1] = [p for p in config.get("path", []) if isinstance(p, str)]
    if config.get("package"):
        sys.path.insert(0, config["package"])
        base_path.insert(0, config["package"])
    loaded = _preload(config.get("preload", []))
    # The preloaded modules' objects move to the permanent generation: a child's collections
    # never walk them (nor write to their pages, which stay shared): about a quarter of a small
    # worker's CPU (0.7 -> 0.5 s for an exercise-01 notebook, measured)
    gc.collect()
    gc.freeze()
    sock.send(json.dumps({"ready": loaded, "threads": _threads()}).encode())
    serve(sock, config, base_path)


if __name__ == "__main__":
    main(sys.argv)
