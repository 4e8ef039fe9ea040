"""File isolation: what a worker may import, read and write, and the proof that the lock holds.

A worker imports only a fresh read-only copy of the package (:func:`copy_package`, built by
:mod:`course_utils.grading.worker_package`) plus the grader's own import path
(:func:`_import_path`), writes only its scratch folder (under :func:`scratch_root`, deleted by
:func:`remove_tree`) and the devices of :func:`_writable_devices`; Landlock
(:func:`landlock_restrict`) makes that hold. Once locked, the worker tries what it must not be
able to do (:func:`_probe`) and the grader judges the outcome from outside
(:func:`_probe_spec`, :class:`_Listeners`, :func:`verify_isolation`). Its own room: the
filesystem and kernel side of the sandbox, apart from the messages and the processes.
"""

from __future__ import annotations

import ctypes
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

from ... import paths

PACKAGE = paths.PACKAGE  # course_utils/, the folder a worker gets a copy of

# ============================================================================= Landlock

_LL_FS = [1 << i for i in range(16)]  # EXECUTE ... IOCTL_DEV, by ABI below
_LL_FS_BY_ABI = {1: 13, 2: 14, 3: 15, 4: 15, 5: 16, 6: 16, 7: 16}
# Rights that apply to a file (not a directory): execute, write, read, truncate, ioctl.
_FILE_RIGHTS = (1 << 0) | (1 << 1) | (1 << 2) | (1 << 14) | (1 << 15)
_READ_RIGHTS = (1 << 0) | (1 << 2) | (1 << 3)  # execute, read file, read dir


def landlock_abi() -> int:
    """The kernel's Landlock ABI version (0: not available)."""
    if sys.platform != "linux":
        return 0
    libc = ctypes.CDLL(None, use_errno=True)
    libc.syscall.restype = ctypes.c_long
    abi = libc.syscall(444, None, ctypes.c_size_t(0), ctypes.c_uint32(1))
    return max(int(abi), 0)


def _read_allow_list(protected: list[str], extra: list[str]) -> list[str]:
    """Paths to grant read access so that everything but ``protected`` stays readable.

    A Landlock rule follows a symbolic link to the folder it names, so a link to a protected
    folder, into one, or to a folder above one (``/tmp/pytest-of-root/pytest-current``) is never
    granted: the folder it names is reached by its real path instead. The grader's probe after
    each start checks the result from outside, which is how that hole was found.
    """
    protected_paths = {os.path.realpath(p).rstrip("/") or "/" for p in protected}

    def touches(real: str) -> bool:
        real = real.rstrip("/") or "/"
        return any(real == p or real.startswith(p + "/") or p.startswith(real + "/")
                   or real == "/" for p in protected_paths)  # fmt: skip

    allowed = set()

    def walk(directory: str):
        try:
            names = os.listdir(directory)
        except OSError:
            return
        for name in names:
            path = os.path.join(directory, name)
            real = os.path.realpath(path)
            if os.path.islink(path):
                if not touches(real):
                    allowed.add(path)
                continue
            if real in protected_paths:
                continue
            if any(p.startswith(real.rstrip("/") + "/") for p in protected_paths) and \
                    os.path.isdir(real):
                walk(path)
            else:
                allowed.add(path)

    walk("/")
    allowed.update(os.path.realpath(p) for p in extra if os.path.exists(p))
    return sorted(allowed)


def landlock_restrict(read_protected: list[str], read_extra: list[str], writable: list[str]):
    """Lock this process (and its children) in: read everything but ``read_protected``,
    write only ``writable``, no TCP, no signals or abstract sockets outside. Returns a status."""
    abi = landlock_abi()
    if abi < 1:
        return "unavailable"
    libc = ctypes.CDLL(None, use_errno=True)
    libc.syscall.restype = ctypes.c_long
    handled = 0
    for bit in _LL_FS[:_LL_FS_BY_ABI.get(abi, 16)]:
        handled |= bit
    net = 0b11 if abi >= 4 else 0
    scoped = 0b11 if abi >= 6 else 0

    class RulesetAttr(ctypes.Structure):
        _fields_ = [("fs", ctypes.c_uint64), ("net", ctypes.c_uint64), ("scoped", ctypes.c_uint64)]

    class PathBeneath(ctypes.Structure):
        _pack_ = 1
        _fields_ = [("allowed", ctypes.c_uint64), ("fd", ctypes.c_int32)]

    attr = RulesetAttr(handled, net, scoped)
    size = 8 if abi < 4 else (16 if abi < 6 else 24)
    ruleset = libc.syscall(444, ctypes.byref(attr), ctypes.c_size_t(size), ctypes.c_uint32(0))
    if ruleset < 0:
        return f"unavailable (create_ruleset: {os.strerror(ctypes.get_errno())})"

    def allow(path, rights):
        try:
            fd = os.open(path, os.O_PATH | os.O_CLOEXEC)
        except OSError:
            return
        try:
            is_dir = os.path.isdir(path)
            rule = PathBeneath((rights if is_dir else rights & _FILE_RIGHTS) & handled, fd)
            if rule.allowed:
                libc.syscall(445, ctypes.c_int(ruleset), ctypes.c_int(1), ctypes.byref(rule),
                             ctypes.c_uint32(0))  # fmt: skip
        finally:
            os.close(fd)

    for path in _read_allow_list(read_protected, read_extra):
        allow(path, _READ_RIGHTS)
    # Its own /proc entry too: the CUDA driver writes there when it starts (error 304 without).
    for path in [*writable, f"/proc/{os.getpid()}"]:
        allow(path, handled)
    if libc.prctl(38, 1, 0, 0, 0) != 0:  # PR_SET_NO_NEW_PRIVS
        return "unavailable (no_new_privs)"
    if libc.syscall(446, ctypes.c_int(ruleset), ctypes.c_uint32(0)) != 0:
        return f"unavailable (restrict_self: {os.strerror(ctypes.get_errno())})"
    os.close(ruleset)
    return f"landlock abi {abi}"


def _start_cuda_driver() -> None:
    """Start the CUDA driver (``cuInit``) before the socket filter is set.

    The driver opens a socket of its own when it starts: under the filter ``cuInit`` fails with
    error 304 (seen on an H200), and torch, Numba and Triton then find no GPU. Started first, it
    keeps that socket and everything after works under the filter.
    """
    import ctypes

    try:
        ctypes.CDLL("libcuda.so.1").cuInit(0)
    except OSError:
        pass


# ============================================================================= the probe


def _probe(spec: dict) -> dict:
    """Try, once locked in, what the sandbox must refuse; report each outcome as data.

    Reads return the first 64 bytes they got (the grader compares them with the file), writes
    leave a file behind (the grader looks for it), datagrams carry the grader's token (the
    grader listens for them): what is judged is observed outside this process.
    """
    import socket

    token = str(spec.get("token", "")).encode()
    found = {"read": {}, "write": {}, "send": {}, "signal": ""}
    for path in spec.get("read", []):
        try:
            with open(path, "rb") as f:
                found["read"][path] = f.read(64).hex()
        except OSError as exc:
            found["read"][path] = f"refused ({exc.strerror})"
    for path in spec.get("write", []):
        try:
            with open(path, "xb") as f:
                f.write(token)
            found["write"][path] = "written"
        except OSError as exc:
            found["write"][path] = f"refused ({exc.strerror})"
    for name, family, address in (("udp", "AF_INET", spec.get("udp")),
                                  ("unix", "AF_UNIX", spec.get("unix"))):  # fmt: skip
        if not address:
            continue
        try:
            with socket.socket(getattr(socket, family), socket.SOCK_DGRAM) as s:
                s.sendto(token, tuple(address) if name == "udp" else address)
            found["send"][name] = "sent"
        except OSError as exc:
            found["send"][name] = f"refused ({exc.strerror})"
    pid = spec.get("signal")
    if isinstance(pid, int) and pid > 0:
        try:
            os.kill(pid, 0)
            found["signal"] = "delivered"
        except OSError as exc:
            found["signal"] = f"refused ({exc.strerror})"
    return found


class _Listeners:
    """A UDP and a Unix datagram socket of the grader's, that no worker should reach."""

    def __init__(self, run_root: Path):
        import socket

        self.udp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.udp.bind(("127.0.0.1", 0))
        self.udp.setblocking(False)
        self.unix_path = str(Path(tempfile.mkdtemp(prefix="listen-", dir=run_root)) / "s")
        self.unix = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.unix.bind(self.unix_path)
        self.unix.setblocking(False)

    def received(self) -> list[str]:
        """The names of the sockets that got a datagram."""
        got = []
        for name, sock in (("udp", self.udp), ("unix", self.unix)):
            try:
                if sock.recv(4096):
                    got.append(name)
            except OSError:
                pass
        return got

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.udp.close()
        self.unix.close()
        remove_tree(Path(self.unix_path).parent)


def _first_file(path: str) -> str | None:
    """A readable regular file at or just below ``path`` (for the read probe)."""
    p = Path(path)
    if p.is_file():
        return str(p)
    try:
        for child in sorted(p.iterdir())[:200]:
            if child.is_file() and not child.is_symlink():
                return str(child)
    except OSError:
        pass
    return None


def _probe_spec(run_root: Path, base: Path, package: Path, protected, listeners) -> dict:
    import secrets

    reads = [f for f in (_first_file(p) for p in protected) if f]
    token = secrets.token_hex(16)
    writes = [str(run_root / f"probe-{token}"), str(package / f"probe-{token}"),
              str(base / f"probe-{token}")]  # fmt: skip
    if os.path.isdir("/dev/shm"):
        writes.append(f"/dev/shm/course-probe-{token}")
    return {"token": token, "read": reads, "write": writes,
            "udp": list(listeners.udp.getsockname()), "unix": listeners.unix_path,
            "signal": os.getpid()}  # fmt: skip


def verify_isolation(locked: dict, probe: dict, listeners, requested: bool) -> tuple[bool, str]:
    """Judge the worker's probe from outside; return (the lock holds, what was verified).

    A read counts as refused unless the worker sent back the file's real first bytes; a write
    as refused unless its file exists now (checked here, then deleted); a datagram unless one
    of the grader's sockets got it. Only the signal's outcome is the worker's own word (its
    code is the grader's own at that point: no cell has run).
    """
    found = locked.get("probe") or {}
    broken = []
    for path in probe["read"]:
        got = (found.get("read") or {}).get(path, "")
        try:
            with open(path, "rb") as f:
                real = f.read(64).hex()
        except OSError:
            real = None
        if real is not None and got == real:
            broken.append(f"read {path}")
    for path in probe["write"]:
        if os.path.lexists(path):
            broken.append(f"wrote {path}")
            try:
                os.unlink(path)
            except OSError:
                pass
    time.sleep(0.01)
    broken += [f"reached the grader's {name} socket" for name in listeners.received()]
    if found.get("signal") == "delivered":
        broken.append("signalled the grader")
    how = "; ".join(str(locked[k]) for k in ("landlock", "seccomp") if locked.get(k))
    if not requested:
        how = "process only (no Landlock on this kernel)"
    if broken:
        return False, f"{how}: NOT isolated: " + ", ".join(broken)
    return True, (f"{how}; verified: reads of the course and notebooks refused "
                  f"({len(probe['read'])} tried), writes outside its scratch folder refused "
                  f"({len(probe['write'])} tried), no datagram reached the grader, no signal")


# ============================================================================= folders and devices


# Devices a worker may write: the null and random devices, and the GPU's (the CUDA driver talks
# to them with ioctl). Never /dev/shm or /dev/mqueue: memory there is counted by nobody.
_DEVICES = ("/dev/null", "/dev/zero", "/dev/full", "/dev/random", "/dev/urandom")
_UNREADABLE_DEVICES = ("/dev/shm", "/dev/mqueue")


def _import_path(run_root: Path) -> list[str]:
    """The grader's import path for a worker: absolute folders only, never the course's tree
    (its package comes from the copy) nor anything under the grading run's folders."""
    course, run = str(PACKAGE.parent), str(Path(run_root).resolve())
    keep = []
    for entry in sys.path:
        if not entry or not os.path.isabs(entry) or not os.path.isdir(entry):
            continue
        real = os.path.realpath(entry)
        if any(real == p or real.startswith(p + os.sep) for p in (course, run)):
            continue
        if real not in keep:
            keep.append(real)
    return keep


def _writable_devices() -> list[str]:
    import glob

    return [d for d in _DEVICES if os.path.exists(d)] + sorted(
        glob.glob("/dev/nvidia*") + glob.glob("/dev/nvidia-caps/*"))


def scratch_root() -> Path:
    """A private folder (mode 0700) for this grading run's scratch folders."""
    return Path(tempfile.mkdtemp(prefix="course-grade-"))


def remove_tree(path: Path) -> None:
    """Delete a folder even where its files and folders were made read-only."""
    def writable_again(func, p, _exc):
        try:
            os.chmod(os.path.dirname(p), 0o700)
            os.chmod(p, 0o700)
        except OSError:
            pass
        try:
            func(p)
        except OSError:
            pass

    shutil.rmtree(path, onerror=writable_again)


def copy_package(dest: Path) -> Path:
    """A fresh read-only copy of what a worker may import, in ``dest/course_utils``.

    Without the grader's side (``specs``) and without the functions that answer an exercise
    (:mod:`course_utils.grading.worker_package` chooses); files 0444, folders 0555.
    """
    try:
        from .. import worker_package
    except ImportError:
        worker_package = None
    if worker_package is not None:
        return worker_package.build(dest)
    target = dest / "course_utils"
    shutil.copytree(PACKAGE, target, ignore=shutil.ignore_patterns("__pycache__", "specs",
                                                                  "*.pyc"))
    for root, dirs, files in os.walk(target, topdown=False):
        for name in files:
            os.chmod(os.path.join(root, name), 0o444)
        for name in dirs:
            os.chmod(os.path.join(root, name), 0o555)
    os.chmod(target, 0o555)
    return target
