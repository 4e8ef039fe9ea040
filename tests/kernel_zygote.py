"""Warm notebook kernels for the suite: nbval's kernels forked from one that imported torch once.

Every notebook that nbval runs starts a fresh IPython kernel, and each of the 30 kernels spent
about 5 s of CPU importing ipykernel, torch, numpy, numba and Triton before its first cell ran.
Here one **server** per test process imports them once (:data:`PRELOAD`) and forks a kernel
for each notebook; the kernel then starts in a fraction of a second. The notebooks see what
they saw before: a new process per notebook, in the notebook's folder, with the environment
nbval gives it (numba and Triton are preloaded only when that environment already switches on
the simulator and the interpreter, as the suite's ``conftest`` does in CPU mode).

jupyter_client starts, signals and kills a **launcher** (``python kernel_zygote.py launch -f
CONNECTION``), a small process that stands in for the kernel:

- it sends the server its argv, folder, environment and its stdin, stdout and stderr
  (``SCM_RIGHTS``), and the server forks the kernel;
- it forwards SIGINT (an interrupt), SIGTERM and SIGHUP to the kernel and exits when the
  kernel exits;
- the kernel holds the launcher's socket and ends itself when the launcher is gone, so
  jupyter_client's SIGKILL of the launcher's process group ends the kernel too;
- with no server (or one that refuses), the launcher becomes a plain ``ipykernel_launcher``.

Test infrastructure only: students and the grader never go through it.
``COURSE_KERNEL_ZYGOTE=0`` turns it off.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import sys
import threading

SOCKET_ENV = "COURSE_KERNEL_ZYGOTE_SOCKET"
BASE = ["ipykernel.kernelapp", "ipykernel.ipkernel", "IPython", "numpy", "torch"]
# torch._dynamo imports triton (so it waits for Triton's switch), and torch imports it on the
# first call of many functions: about 2 s in each kernel that meets one, until preloaded.
SWITCHED = {"NUMBA_ENABLE_CUDASIM": ["numba", "numba.cuda"],
            "TRITON_INTERPRET": ["triton", "torch._dynamo"]}
# Read once, when numpy's BLAS and torch load: a kernel must ask for what the server has. The
# server runs only with one thread (OMP_NUM_THREADS=1, as the suite sets under xdist): a BLAS
# pool's threads would not survive the fork.
FIXED_AT_IMPORT = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS", *SWITCHED)


def preload_list(env) -> list[str]:
    """What the server imports: numba and Triton only when ``env`` switches on their CPU mode
    (importing them otherwise would fix their mode before a notebook's ``setup()`` chose it)."""
    return BASE + [m for var, mods in SWITCHED.items() if env.get(var) == "1" for m in mods]


# ============================================================================= the grader side


def start(path: str, env=None):
    """Start a server that listens at ``path`` once it has imported its modules; return its
    process once the socket is there (or the server ended, or two minutes passed: the caller
    looks for the socket)."""
    import subprocess
    import time

    proc = subprocess.Popen([sys.executable, __file__, "serve", path], env=env,
                            stdin=subprocess.DEVNULL, start_new_session=True)
    deadline = time.monotonic() + 120
    while not os.path.exists(path) and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    return proc


def kernel_spec(path: str) -> dict:
    """The argv and environment of a kernel spec whose kernels come from the server at
    ``path`` (``{connection_file}`` as jupyter_client fills it in)."""
    return {"argv": [sys.executable, __file__, "launch", "-f", "{connection_file}"],
            "env": {SOCKET_ENV: path}}


# ============================================================================= the server


def _reap(signum, frame):
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


def serve(path: str) -> None:
    import gc
    import importlib

    for name in preload_list(os.environ):
        importlib.import_module(name)
    gc.collect()
    gc.freeze()  # what was imported stays out of every kernel's collections (and its pages shared)
    if threading.active_count() != 1 or len(os.listdir("/proc/self/task")) != 1:
        sys.exit("kernel zygote: a preloaded module started a thread; forking is not safe")
    fixed = {var: os.environ.get(var) for var in FIXED_AT_IMPORT}
    base_path = sys.path[1:]  # without this file's folder
    signal.signal(signal.SIGCHLD, _reap)
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(path + ".tmp")
    os.rename(path + ".tmp", path)  # the launcher only sees a socket that listens
    server.listen(16)
    while True:
        try:
            conn, _ = server.accept()
        except InterruptedError:
            continue
        try:
            data, fds, _, _ = socket.recv_fds(conn, 1 << 20, 3)
            request = json.loads(data)
        except (OSError, ValueError):
            conn.close()
            continue
        env = request["env"]
        if len(fds) != 3 or any(env.get(var) != value for var, value in fixed.items()):
            conn.sendall(b"refused\n")  # another mode: the launcher starts a plain kernel
            for fd in fds:
                os.close(fd)
            conn.close()
            continue
        pid = os.fork()
        if pid == 0:
            server.close()
            _kernel(request, fds, conn, base_path)  # never returns
        for fd in fds:
            os.close(fd)
        conn.sendall(f"{pid}\n".encode())
        conn.close()  # the kernel keeps its copy: the launcher's end closing is its signal


def _kernel(request, fds, conn, base_path) -> None:
    """In the forked child: become the notebook's kernel."""
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    os.setsid()
    for target, fd in enumerate(fds):
        os.dup2(fd, target)
        os.close(fd)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    sys.path[:] = [request["cwd"], *base_path]
    sys.argv = ["ipykernel_launcher", *request["argv"]]
    import numpy

    numpy.random.seed()  # fresh entropy, as a new interpreter would have

    def watch():  # the launcher is gone (killed with its group): end the kernel
        try:
            while conn.recv(64):
                pass
        except OSError:
            pass
        os._exit(1)

    threading.Thread(target=watch, daemon=True).start()
    from ipykernel import kernelapp

    try:
        kernelapp.launch_new_instance()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


# ============================================================================= the launcher


def launch(argv: list[str]) -> None:
    path = os.environ.get(SOCKET_ENV, "")
    pid = 0
    if path:
        try:
            conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            conn.connect(path)
            request = {"argv": argv, "cwd": os.getcwd(), "env": dict(os.environ)}
            socket.send_fds(conn, [json.dumps(request).encode()], [0, 1, 2])
            reply = conn.makefile("rb").readline().strip()
            pid = int(reply) if reply.isdigit() else 0
        except OSError:
            pid = 0
    if not pid:  # no server, or it refused: a plain kernel in this very process
        os.execv(sys.executable, [sys.executable, "-m", "ipykernel_launcher", *argv])
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, lambda signum, frame: _forward(pid, signum))
    try:
        pidfd = os.pidfd_open(pid)
    except (AttributeError, OSError):  # an older kernel or Python: ask every tenth of a second
        import time

        while _alive(pid):
            time.sleep(0.1)
        sys.exit(0)
    import select

    select.select([pidfd], [], [])  # readable once the kernel has exited
    sys.exit(0)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)  # the server reaps its children at once: a gone pid is an ended kernel
    except ProcessLookupError:
        return False
    return True


def _forward(pid: int, signum: int) -> None:
    try:
        os.kill(pid, signum)
    except ProcessLookupError:
        pass


if __name__ == "__main__":
    if sys.argv[1] == "serve":
        serve(sys.argv[2])
    else:
        launch(sys.argv[2:])
