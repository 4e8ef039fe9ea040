"""Grading at arm's length: each notebook runs in a sandboxed worker; the grader keeps the answers.

``python -m course_utils grade`` runs every notebook in its own worker process and runs the
checks in the grading process. The two talk over a pair of pipes::

    grading process                              worker (the student's notebook)
    ---------------                              --------------------------------
                                   <- "cell 3"   runs cell 3
                      <- "check 07.x, here is a candidate"   grader.check("07.x", fn)
    case.run(RemoteCandidate)
      draws inputs, computes expected            (never sees them)
      -> "call fn(Q, K, V)"                       runs fn under watch.forbid
                  <- outputs + the args' memory   (poisoned buffers it wrote into come back)
      compares, hints, scores
    -> "verdict"                                  prints it, goes on with the next cell

What this protects, and how:

- **The score** is computed here from data the worker sends back (tensors, arrays, numbers):
  the expected values, the comparisons and the points never enter the worker, so patching the
  checks, reading the checker's stack, lying tensor subclasses or a forged results file change
  nothing. Messages are decoded by a strict codec (no pickle): only plain data crosses.
- **Time and memory**: every cell and every exercise has a time limit, the worker's processes
  together a memory limit; past them the whole process tree is killed, that exercise (or cell)
  scores 0 with the reason, and the notebook is re-run from the top in a fresh worker with the
  exercises already graded skipped, so one endless loop costs one exercise, not the notebook.
- **Other notebooks and the instructor's files**: each worker gets a private scratch folder with
  its own copy of ``course_utils`` (without ``specs``, the grader's side) and of the notebook. On
  Linux with Landlock (kernel 5.13+), it can write only there, cannot read the course's tree or
  the other notebooks, cannot open network connections, and cannot signal the grader. The grader
  reads every notebook before running any, keeps results in memory, and writes ``grades.json``
  and ``.csv`` atomically at the end. It is a child subreaper: processes a notebook starts
  (daemons included) are killed when its worker ends.

Limits: without Landlock (older kernels, some containers) a notebook can still read and write
the user's files, though never the grades of the others in the same run; the forbidden-operation
watch runs inside the worker, so a notebook that deliberately tampers with it (rather than
calling a library shortcut) is not caught by it, only by the checks of what its code produces.
"""

from __future__ import annotations

import builtins
import ctypes
import json
import os
import select
import shutil
import signal
import struct
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from .grader import Candidate

_WORKER = None  # the worker's channel to the grader, inside a worker
MAX_HEADER = 64 << 20  # bytes of one message's JSON header
PACKAGE = Path(__file__).resolve().parent


def in_worker() -> bool:
    """True inside a sandboxed grading worker."""
    return _WORKER is not None


class ProtocolError(Exception):
    """The worker sent something that is not a well-formed message of plain data."""


class WorkerLost(BaseException):  # noqa: N818 (not an Exception: no case may catch it)
    """The worker died, hung or used too much memory during a request."""

    def __init__(self, status: str, reason: str):
        super().__init__(reason)
        self.status, self.reason = status, reason


# ============================================================================= the codec
#
# A message is a JSON header plus raw buffers. Tensors and arrays travel as views of memory
# regions: a torch tensor's whole storage (so a write past the end of a view into its guard
# region comes back too), or the owning buffer of a numpy array. Arguments that share a region
# share it on the other side, and the regions of the arguments are sent back after the call.


_TORCH_DTYPES = ("float64", "float32", "float16", "bfloat16", "int64", "int32", "int16", "int8",
                 "uint8", "bool", "complex64", "complex128")  # fmt: skip


def _torch():
    import torch

    return torch


def _np():
    import numpy as np

    return np


class _Encoder:
    def __init__(self, regions=None):
        self.buffers: list = []  # region index -> bytes-like, filled at encode time
        self.regions: list[dict] = []
        self.keys: dict = {}  # region key -> index
        self.owners: list = []  # region index -> the object owning the memory (for write-back)
        if regions:  # known regions (the arguments'), referenced but not re-sent
            for key, owner, desc in regions:
                self.keys[key] = len(self.regions)
                self.regions.append(dict(desc, sent=False))
                self.owners.append(owner)
                self.buffers.append(None)

    # ---- regions
    def _storage_region(self, t):
        torch = _torch()
        storage = t.untyped_storage()
        key = ("torch", storage.data_ptr(), storage.nbytes(), str(t.device))
        if key not in self.keys:
            self.keys[key] = len(self.regions)
            raw = torch.empty(0, dtype=torch.uint8, device=t.device).set_(storage)
            self.regions.append({"kind": "torch", "device": str(t.device), "nbytes": raw.numel(),
                                 "sent": True})  # fmt: skip
            self.owners.append(raw)
            self.buffers.append(raw.detach().cpu().numpy() if raw.numel() else b"")
        return self.keys[key]

    def _numpy_region(self, a):
        np = _np()
        root = a
        while isinstance(root.base, np.ndarray):
            root = root.base
        torch = _torch()
        if isinstance(root.base, torch.Tensor):
            return self._storage_region(root.base), True
        if not root.flags.c_contiguous:
            root = np.ascontiguousarray(a)  # a copy: it alone, no write-back through others
        key = ("numpy", root.__array_interface__["data"][0], root.nbytes)
        if key not in self.keys:
            self.keys[key] = len(self.regions)
            flat = root.reshape(-1).view(np.uint8)
            self.regions.append({"kind": "numpy", "device": "cpu", "nbytes": flat.nbytes,
                                 "sent": True})  # fmt: skip
            self.owners.append(flat)
            self.buffers.append(flat)
        return self.keys[key], False

    def _base_address(self, index):
        owner = self.owners[index]
        torch = _torch()
        if isinstance(owner, torch.Tensor):
            return owner.data_ptr()
        return owner.__array_interface__["data"][0]

    # ---- values
    def enc(self, x, depth=0):
        if depth > 32:
            raise TypeError("data nested more than 32 levels deep cannot be sent")
        if x is None or isinstance(x, (bool, str)):
            return x
        if isinstance(x, int):
            return x if abs(x) < 2**63 else {"t": "bigint", "v": str(x)}
        if isinstance(x, float):
            return {"t": "float", "v": repr(x)}  # keeps nan, inf and every bit of the value
        if isinstance(x, (tuple, list)):
            return {"t": type(x).__name__, "v": [self.enc(v, depth + 1) for v in x]}
        if isinstance(x, dict):
            return {"t": "dict", "k": [self.enc(k, depth + 1) for k in x],
                    "v": [self.enc(v, depth + 1) for v in x.values()]}  # fmt: skip
        if isinstance(x, bytes):
            return {"t": "bytes", "v": x.hex()}
        np = _np()
        torch = _torch()
        if isinstance(x, torch.Tensor):
            if type(x) is not torch.Tensor and not isinstance(x, torch.nn.Parameter):
                x = x.as_subclass(torch.Tensor)  # a subclass's behaviour does not cross
            name = str(x.dtype).removeprefix("torch.")
            if name not in _TORCH_DTYPES or x.is_sparse or x.device.type not in ("cpu", "cuda"):
                raise TypeError(f"a {x.dtype} tensor on {x.device} cannot be sent")
            r = self._storage_region(x)
            return {"t": "tensor", "r": r, "dtype": name, "shape": list(x.shape),
                    "stride": list(x.stride()), "offset": x.storage_offset(),
                    "grad": bool(x.requires_grad)}  # fmt: skip
        if isinstance(x, np.ndarray):
            if x.dtype.hasobject or x.dtype.kind not in "biufc":
                raise TypeError(f"an array of dtype {x.dtype} cannot be sent")
            r, _ = self._numpy_region(x)
            offset = x.__array_interface__["data"][0] - self._base_address(r)
            return {"t": "ndarray", "r": r, "dtype": x.dtype.str, "shape": list(x.shape),
                    "strides": list(x.strides), "offset": offset}  # fmt: skip
        if isinstance(x, np.generic):
            if x.dtype.hasobject or x.dtype.kind not in "biufc":
                raise TypeError(f"a numpy scalar of dtype {x.dtype} cannot be sent")
            return {"t": "npscalar", "dtype": x.dtype.str, "v": x.tobytes().hex()}
        if isinstance(x, torch.dtype):
            return {"t": "dtype", "v": str(x).removeprefix("torch.")}
        if isinstance(x, torch.device):
            return {"t": "device", "v": str(x)}
        tensor = getattr(x, "_course_tensor", None)  # runtime.kernel_array on a GPU
        if tensor is not None:
            return {"t": "kernel_array", "v": self.enc(tensor, depth + 1)}
        raise TypeError(
            f"a {type(x).__module__}.{type(x).__qualname__} cannot cross between the notebook "
            "and the grader: return tensors, arrays, numbers, strings, or tuples/lists/dicts "
            "of them"
        )

    def message(self, header: dict) -> tuple[dict, list]:
        header = dict(header, regions=self.regions)
        sent = [b for b, r in zip(self.buffers, self.regions, strict=True) if r["sent"]]
        return header, sent


class _Decoder:
    """Rebuilds values from a header and its buffers; ``regions`` are (owner, writable view)."""

    def __init__(self, regions_desc, buffers, known=None, device_ok=True):
        torch = _torch()
        np = _np()
        self.views = []  # per region: a torch uint8 tensor holding its bytes
        it = iter(buffers)
        for i, desc in enumerate(regions_desc):
            if not isinstance(desc, dict):
                raise ProtocolError("malformed region")
            if not desc.get("sent"):
                if known is None or i >= len(known):
                    raise ProtocolError("a region refers to nothing")
                self.views.append(known[i])
                continue
            data = next(it, None)
            if data is None:
                raise ProtocolError("a region's bytes are missing")
            nbytes, device = desc.get("nbytes"), desc.get("device", "cpu")
            if not isinstance(nbytes, int) or nbytes != len(data):
                raise ProtocolError("a region's size does not match its bytes")
            if device != "cpu" and not (isinstance(device, str) and device.startswith("cuda")):
                raise ProtocolError(f"unknown device {device!r}")
            host = torch.from_numpy(np.frombuffer(bytearray(data), dtype=np.uint8))
            self.views.append(host.to(device) if device != "cpu" else host)

    def dec(self, x, depth=0):
        if depth > 34:
            raise ProtocolError("nested too deeply")
        if x is None or isinstance(x, (bool, str, int)):
            return x
        if isinstance(x, float):
            return x
        if not isinstance(x, dict) or "t" not in x:
            raise ProtocolError(f"unexpected {type(x).__name__} in a message")
        t = x["t"]
        if t == "float":
            return float(x["v"])
        if t == "bigint":
            return int(x["v"])
        if t in ("tuple", "list"):
            items = [self.dec(v, depth + 1) for v in x["v"]]
            return tuple(items) if t == "tuple" else items
        if t == "dict":
            return {self.dec(k, depth + 1): self.dec(v, depth + 1)
                    for k, v in zip(x["k"], x["v"], strict=True)}  # fmt: skip
        if t == "bytes":
            return bytes.fromhex(x["v"])
        torch = _torch()
        np = _np()
        if t == "tensor":
            name = x["dtype"]
            if name not in _TORCH_DTYPES:
                raise ProtocolError(f"dtype {name!r} is not allowed")
            raw = self._region(x["r"])
            dtype = getattr(torch, name)
            size = dtype.itemsize
            shape, stride, offset = x["shape"], x["stride"], x["offset"]
            if not all(isinstance(v, int) and v >= 0 for v in [*shape, *stride, offset]):
                raise ProtocolError("a tensor's shape, strides and offset must be >= 0 ints")
            if raw.numel() % size:
                raise ProtocolError("a tensor's storage is not a whole number of elements")
            t_ = torch.empty(0, dtype=dtype, device=raw.device)
            t_.set_(raw.untyped_storage(), offset, shape, stride)
            if x.get("grad") and dtype.is_floating_point:
                t_.requires_grad_(True)
            return t_
        if t == "ndarray":
            dt = np.dtype(x["dtype"])
            if dt.hasobject or dt.kind not in "biufc":
                raise ProtocolError(f"array dtype {dt} is not allowed")
            raw = self._region(x["r"])
            if raw.device.type != "cpu":
                raise ProtocolError("a numpy array must live on the CPU")
            buf = raw.numpy()
            try:
                return np.ndarray(tuple(x["shape"]), dtype=dt, buffer=buf, offset=x["offset"],
                                  strides=tuple(x["strides"]))  # fmt: skip
            except (TypeError, ValueError) as exc:
                raise ProtocolError(f"malformed array: {exc}") from None
        if t == "npscalar":
            dt = np.dtype(x["dtype"])
            if dt.hasobject or dt.kind not in "biufc":
                raise ProtocolError(f"scalar dtype {dt} is not allowed")
            return np.frombuffer(bytes.fromhex(x["v"]), dtype=dt)[0]
        if t == "dtype":
            if x["v"] not in _TORCH_DTYPES:
                raise ProtocolError(f"dtype {x['v']!r} is not allowed")
            return getattr(torch, x["v"])
        if t == "device":
            return torch.device(str(x["v"]))
        if t == "kernel_array":
            from .runtime import kernel_array

            return kernel_array(self.dec(x["v"], depth + 1))
        raise ProtocolError(f"unknown value type {t!r}")

    def _region(self, r):
        if not isinstance(r, int) or not 0 <= r < len(self.views):
            raise ProtocolError("a value refers to a region that does not exist")
        return self.views[r]


# ----------------------------------------------------------------------------- framing


def _write_all(fd, data) -> None:
    view = memoryview(data).cast("B")
    while view:
        n = os.write(fd, view[:1 << 20])
        view = view[n:]


def send(fd, header: dict, buffers=()) -> None:
    """One message: header length, JSON header, then each buffer as length + bytes."""
    head = json.dumps(dict(header, nbuf=len(buffers))).encode()
    _write_all(fd, struct.pack("<Q", len(head)) + head)
    for b in buffers:
        mv = memoryview(b).cast("B") if not isinstance(b, bytes) else memoryview(b)
        _write_all(fd, struct.pack("<Q", mv.nbytes))
        if mv.nbytes:
            _write_all(fd, mv)


class _Reader:
    """Reads messages from ``fd``; ``wait(deadline)`` is called while no bytes are ready."""

    def __init__(self, fd, limit_bytes: int):
        self.fd, self.limit = fd, limit_bytes

    def _exact(self, n, wait):
        chunks, got = [], 0
        while got < n:
            if wait is not None:
                wait(self.fd)
            data = os.read(self.fd, min(n - got, 1 << 20))
            if not data:
                raise EOFError
            chunks.append(data)
            got += len(data)
        return b"".join(chunks)

    def recv(self, wait=None):
        (n,) = struct.unpack("<Q", self._exact(8, wait))
        if n > MAX_HEADER:
            raise ProtocolError(f"a message header of {n} bytes")
        try:
            header = json.loads(self._exact(n, wait))
        except ValueError as exc:
            raise ProtocolError(f"not a message: {exc}") from None
        if not isinstance(header, dict) or not isinstance(header.get("nbuf"), int):
            raise ProtocolError("not a message")
        buffers, total = [], 0
        for _ in range(header["nbuf"]):
            (m,) = struct.unpack("<Q", self._exact(8, wait))
            total += m
            if total > self.limit:
                raise ProtocolError(f"more than {self.limit >> 20} MiB of data in one message")
            buffers.append(self._exact(m, wait))
        return header, buffers


# ============================================================================= the worker side


_BUILTIN_ERRORS = {
    name: value for name, value in vars(builtins).items()
    if isinstance(value, type) and issubclass(value, Exception)
}


class _Channel:
    def __init__(self, fd_in, fd_out):
        self.reader = _Reader(fd_in, 1 << 40)
        self.fd_out = fd_out
        self.skip_ids: set[str] = set()

    def send(self, header, buffers=()):
        send(self.fd_out, header, buffers)

    def recv(self):
        return self.reader.recv()


def _describe_candidate(obj, depth=0):
    if isinstance(obj, (tuple, list)) and depth < 2:
        items = [_describe_candidate(x, depth + 1) for x in obj]
        return {"seq": type(obj).__name__, "items": items}
    return {"object": type(obj).__name__}


def _at(obj, path):
    for i in path:
        obj = obj[i]
    return obj


def _raised(exc) -> dict:
    from .grader import NeedsGPU, _student_error
    from .watch import ForbiddenCall

    kind = ("not implemented" if isinstance(exc, NotImplementedError) else
            "forbidden" if isinstance(exc, ForbiddenCall) else
            "needs gpu" if isinstance(exc, NeedsGPU) else "error")  # fmt: skip
    line = _student_error(exc)
    where = line[line.rfind(" (at line"):] if " (at line" in line else ""
    return {"raised": {"kind": kind, "type": type(exc).__name__, "message": str(exc)[:4000],
                       "where": where}}  # fmt: skip


def _serve(channel: _Channel, candidate) -> dict:
    """Answer the grader's requests about ``candidate`` until it sends the verdict."""
    from .grader import resolve
    from .watch import forbid

    while True:
        header, buffers = channel.recv()
        op = header.get("op")
        if op == "verdict":
            return header
        try:
            dec = _Decoder(header["regions"], buffers)
            args = dec.dec(header.get("args", {"t": "tuple", "v": []}))
            kwargs = dec.dec(header.get("kwargs", {"t": "dict", "k": [], "v": []}))
            obj = _at(candidate, header.get("path", []))
            watch = forbid(header.get("forbidden", ()), torch_only=header.get("torch_only", False))
            with watch:
                if op == "call":
                    out = obj(*args, **kwargs)
                elif op == "launch":
                    config = dec.dec(header["config"])
                    out = obj[config](*args)
                elif op == "invoke":
                    out = resolve(header["target"])(obj, *args, **kwargs)
                else:
                    raise ProtocolError(f"unknown request {op!r}")
            from .runtime import synchronize

            synchronize()
            known = [(("region", i), v, {"kind": "torch", "device": str(v.device),
                                          "nbytes": v.numel()})
                     for i, v in enumerate(dec.views)]  # fmt: skip
            enc = _Encoder(known)
            for i, v in enumerate(dec.views):  # map the args' storages to their regions
                enc.keys[("torch", v.untyped_storage().data_ptr(), v.numel(), str(v.device))] = i
            value = enc.enc(out)
            reply, out_buffers = enc.message({"ok": value})
            back = [v.detach().cpu().numpy() for v in dec.views]
            channel.send(dict(reply, nback=len(back)), [*back, *out_buffers])
        except Exception as exc:  # the student's code raised: send what and where
            channel.send(_raised(exc))


def hand_over(exercise_id: str, candidate):
    """``grader.check`` inside a worker: the grader runs the cases and sends the verdict."""
    from .grader import Result

    channel = _WORKER
    if exercise_id in channel.skip_ids:
        print(f"{exercise_id}: graded in an earlier run of this notebook")
        return Result(exercise_id, "", 0, 0.0, 0, 0, "graded earlier", "", True)
    channel.send({"check": exercise_id, "shape": _describe_candidate(candidate)})
    verdict = _serve(channel, candidate)
    print(verdict.get("text", ""))
    fields = verdict.get("result", {})
    return Result(**fields) if fields else Result(exercise_id, "", 0, 0.0, 0, 0, "error", "", True)


def _run_cells(channel: _Channel, cells: list[str], skip_cells: set[int]) -> None:
    try:
        from IPython.core.interactiveshell import InteractiveShell

        shell = InteractiveShell.instance()
    except Exception:  # IPython missing: plain exec in one namespace
        shell = None
    namespace = {"__name__": "__main__"}
    for index, source in enumerate(cells):
        if index in skip_cells:
            continue
        channel.send({"cell": index})
        error = None
        if shell is not None:
            result = shell.run_cell(source, store_history=True, silent=False)
            exc = result.error_before_exec or result.error_in_exec
            if exc is not None:
                error = f"{type(exc).__name__}: {exc}"
        else:
            try:
                exec(compile(source, f"<cell {index}>", "exec"), namespace)
            except BaseException as exc:  # noqa: BLE001 (a cell's error is reported, not fatal)
                error = f"{type(exc).__name__}: {exc}"
        if error:
            channel.send({"cell_error": index, "error": error[:2000]})
        sys.stdout.flush()
    channel.send({"done": True})


class _NoSpecs:
    """An import hook: ``course_utils.specs`` (the grader's side) does not exist in a worker."""

    def find_spec(self, name, path=None, target=None):
        if name == "course_utils.specs" or name.startswith("course_utils.specs."):
            raise ImportError(
                f"{name} is the grader's side and is not available while a notebook is graded: "
                "import constants from course_utils.harness instead"
            )
        return None


def worker_main(fd_in: int, fd_out: int) -> None:
    """Entry point of a worker: read the job, lock itself in, run the notebook's cells."""
    global _WORKER
    channel = _Channel(fd_in, fd_out)
    job, _ = channel.recv()
    limits = job.get("limits", {})
    _apply_rlimits(limits)
    if job.get("landlock"):
        try:
            status = landlock_restrict(**job["landlock"])
        except Exception as exc:  # an odd kernel or /proc: grade anyway, and say so
            status = f"unavailable ({type(exc).__name__}: {exc})"
        channel.send({"landlock": status})
    sys.meta_path.insert(0, _NoSpecs())
    channel.skip_ids = set(job.get("skip_ids", ()))
    _WORKER = channel
    here = Path(__file__).resolve().parent
    if str(here.parent) != job["scratch"]:
        channel.send({"fatal": f"course_utils was imported from {here}, not the scratch copy"})
        os._exit(3)
    _run_cells(channel, job["cells"], set(job.get("skip_cells", ())))
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _apply_rlimits(limits: dict) -> None:
    import resource

    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    fsize = limits.get("file_bytes")
    if fsize:
        resource.setrlimit(resource.RLIMIT_FSIZE, (fsize, fsize))


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
    """Paths to grant read access so that everything but ``protected`` stays readable."""
    protected_paths = {os.path.realpath(p) for p in protected}
    allowed = set()

    def walk(directory: str):
        try:
            names = os.listdir(directory)
        except OSError:
            return
        for name in names:
            path = os.path.join(directory, name)
            real = os.path.realpath(path)
            if real in protected_paths:
                continue
            if any(p.startswith(real.rstrip("/") + "/") for p in protected_paths) and \
                    os.path.isdir(real) and not os.path.islink(path):
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


# ============================================================================= the grader side


def _proc_children() -> dict[int, list[int]]:
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                stat = f.read()
        except OSError:
            continue
        ppid = int(stat[stat.rfind(b")") + 2:].split()[1])
        children.setdefault(ppid, []).append(int(entry))
    return children


def descendants(pid: int) -> list[int]:
    """Every process below ``pid`` (Linux /proc)."""
    if not os.path.isdir("/proc"):
        return []
    children, found, todo = _proc_children(), [], [pid]
    while todo:
        for c in children.get(todo.pop(), []):
            found.append(c)
            todo.append(c)
    return found


def _rss_bytes(pids) -> int:
    page = os.sysconf("SC_PAGE_SIZE")
    total = 0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/statm") as f:
                total += int(f.read().split()[1]) * page
        except (OSError, ValueError, IndexError):
            pass
    return total


def set_subreaper() -> bool:
    """Make this process adopt the orphans of its descendants (Linux), so none escape."""
    if sys.platform != "linux":
        return False
    return ctypes.CDLL(None, use_errno=True).prctl(36, 1, 0, 0, 0) == 0


def kill_tree(root_pid: int, keep=frozenset()) -> None:
    """SIGKILL ``root_pid``'s process group and every descendant of this process not in
    ``keep``, then reap those that are ours."""
    try:
        os.killpg(root_pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    for _ in range(20):
        victims = [p for p in descendants(os.getpid()) if p not in keep]
        if not victims:
            break
        for p in victims:
            try:
                os.kill(p, signal.SIGKILL)
            except ProcessLookupError:
                pass
        for p in victims:
            try:
                os.waitpid(p, 0)
            except ChildProcessError:
                pass
        time.sleep(0.01)


@dataclass
class Limits:
    """How long and how much one notebook may take."""

    cell_seconds: float = 600.0
    exercise_seconds: float = 600.0
    notebook_seconds: float = 3600.0
    memory_mb: int = 8192
    file_mb: int = 1024
    message_mb: int = 1024  # data one answer of the notebook may send back
    restarts: int = 4


@dataclass
class Worker:
    """A running worker: its process and the two pipe ends the grader holds."""

    proc: object
    fd_to: int
    fd_from: int
    limits: Limits
    keep: frozenset = field(default_factory=frozenset)
    reader: _Reader | None = None
    deadline: float = 0.0
    landlock: str = ""

    def wait_ready(self, fd):
        """Block until ``fd`` is readable; WorkerLost past the deadline or the memory limit."""
        last_poll = 0.0
        while True:
            now = time.monotonic()
            if now > self.deadline:
                raise WorkerLost("timed out", "ran longer than its time limit")
            ready, _, _ = select.select([fd], [], [], min(0.1, max(self.deadline - now, 0.001)))
            if ready:
                return
            if now - last_poll > 0.25:
                last_poll = now
                if self.proc.poll() is not None:
                    raise WorkerLost("crashed", f"the notebook's process exited "
                                                f"({_exit_reason(self.proc.returncode)})")
                pids = [self.proc.pid, *descendants(self.proc.pid)]
                rss = _rss_bytes(pids)
                limit = self.limits.memory_mb
                if rss > limit << 20:
                    raise WorkerLost("out of memory", f"used {rss >> 20} MiB of memory, more "
                                                      f"than the limit of {limit} MiB")

    def recv(self):
        try:
            return self.reader.recv(self.wait_ready)
        except EOFError:
            self.proc.wait(timeout=5) if self.proc.poll() is None else None
            raise WorkerLost("crashed", "the notebook's process ended "
                                        f"({_exit_reason(self.proc.poll())})") from None
        except ProtocolError as exc:
            raise WorkerLost("error", f"the notebook sent a malformed message ({exc})") from None

    def send(self, header, buffers=()):
        try:
            send(self.fd_to, header, buffers)
        except (BrokenPipeError, OSError):
            raise WorkerLost("crashed", "the notebook's process stopped listening") from None

    def stop(self):
        kill_tree(self.proc.pid, self.keep)
        for fd in (self.fd_to, self.fd_from):
            try:
                os.close(fd)
            except OSError:
                pass


def _exit_reason(code) -> str:
    if code is None:
        return "still running"
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


def copy_package(scratch: Path) -> Path:
    """A private copy of course_utils for one worker, without the grader's ``specs``."""
    dest = scratch / "course_utils"
    shutil.copytree(PACKAGE, dest, ignore=shutil.ignore_patterns("__pycache__", "specs", "*.pyc"))
    return dest


def start_worker(scratch: Path, job: dict, limits: Limits, keep, protected) -> Worker:
    """Start a worker in ``scratch`` and send it ``job`` (cells, skipped cells and exercises)."""
    import subprocess

    to_r, to_w = os.pipe()
    from_r, from_w = os.pipe()
    for sub in ("home", "tmp", "cache"):
        (scratch / sub).mkdir(exist_ok=True)
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("COURSE_CHECKS_RAISE", "COURSE_GRADING", "PYTEST_"))}
    env.update(HOME=str(scratch / "home"), TMPDIR=str(scratch / "tmp"),
               XDG_CACHE_HOME=str(scratch / "cache"), MPLCONFIGDIR=str(scratch / "cache"),
               TRITON_CACHE_DIR=str(scratch / "cache" / "triton"),
               TRITON_HOME=str(scratch / "cache"), NUMBA_CACHE_DIR=str(scratch / "cache"),
               TORCH_EXTENSIONS_DIR=str(scratch / "cache" / "torch_extensions"),
               PYTHONDONTWRITEBYTECODE="1", MPLBACKEND="Agg", PYTHONUNBUFFERED="1",
               PYTHONPATH=os.pathsep.join([str(scratch), *filter(None, [
                   os.environ.get("PYTHONPATH")])]))  # fmt: skip
    from . import runtime

    env["COURSE_DEVICE"] = "gpu" if runtime.on_gpu() else "cpu"
    code = ("import sys; sys.path.insert(0, sys.argv[1]); "
            "from course_utils.sandbox import worker_main; "
            "worker_main(int(sys.argv[2]), int(sys.argv[3]))")  # fmt: skip
    log = open(scratch / "worker.log", "ab")  # noqa: SIM115 (handed to the process)
    proc = subprocess.Popen(
        [sys.executable, "-c", code, str(scratch), str(to_r), str(from_w)],
        pass_fds=(to_r, from_w), cwd=scratch, env=env, stdin=subprocess.DEVNULL,
        stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
    )
    log.close()
    os.close(to_r)
    os.close(from_w)
    worker = Worker(proc, to_w, from_r, limits, keep)
    worker.reader = _Reader(from_r, limits.message_mb << 20)
    job = dict(job, scratch=str(scratch),
               limits={"file_bytes": limits.file_mb << 20})  # fmt: skip
    if protected is not None and landlock_abi() >= 1:
        writable = [str(scratch), "/dev"]
        job["landlock"] = {"read_protected": protected, "writable": writable,
                           "read_extra": [str(scratch), sys.prefix, sys.base_prefix]}
    worker.send(job)
    worker.deadline = time.monotonic() + 120
    if "landlock" in job:
        header, _ = worker.recv()
        worker.landlock = str(header.get("landlock", ""))
    return worker


class RemoteCandidate(Candidate):
    """A candidate object living in the worker, reached by its path in the handed-over value."""

    def __init__(self, worker: Worker, path: tuple, exercise):
        self.worker, self.path, self.exercise = worker, list(path), exercise

    def _request(self, op: str, args=(), kwargs=None, **extra):
        enc = _Encoder()
        header = {"op": op, "path": self.path, "forbidden": list(self.exercise.forbidden),
                  "torch_only": self.exercise.torch_only,
                  "args": enc.enc(tuple(args)), "kwargs": enc.enc(dict(kwargs or {}))}
        for k, v in extra.items():
            header[k] = enc.enc(v) if k == "config" else v
        header, buffers = enc.message(header)
        self.worker.send(header, buffers)
        reply, data = self.worker.recv()
        if "raised" in reply:
            raise _rebuild_exception(reply["raised"])
        if "ok" not in reply:
            raise WorkerLost("error", "the notebook answered out of turn")
        return self._decode_reply(enc, reply, data)

    def _decode_reply(self, enc: _Encoder, reply, data):
        nback = reply.get("nback")
        if nback != len(enc.regions) or len(data) < nback:
            raise ProtocolError("the notebook sent back the wrong number of argument buffers")
        torch = _torch()
        np = _np()
        for owner, desc, raw in zip(enc.owners, enc.regions, data[:nback], strict=True):
            if len(raw) != desc["nbytes"]:
                raise ProtocolError("an argument's memory came back with another size")
            host = np.frombuffer(raw, dtype=np.uint8)
            if isinstance(owner, torch.Tensor):
                owner.copy_(torch.from_numpy(host.copy()).to(owner.device))
            else:
                owner[...] = host
        known = [o if isinstance(o, torch.Tensor) else torch.from_numpy(o) for o in enc.owners]
        regions = reply.get("regions", [])
        if not isinstance(regions, list):
            raise ProtocolError("malformed regions")
        decoder = _Decoder(regions, data[nback:], known=known)
        return decoder.dec(reply["ok"])

    def __call__(self, *args, **kwargs):
        return self._request("call", args, kwargs)

    def __getitem__(self, config):
        return lambda *args: self._request("launch", args, config=config)

    def invoke(self, target, *args, **kwargs):
        return self._request("invoke", args, kwargs, target=target)


def _rebuild_exception(info: dict) -> BaseException:
    from .grader import NeedsGPU
    from .watch import ForbiddenCall

    if not isinstance(info, dict):
        return ProtocolError("malformed exception")
    kind, name = info.get("kind"), str(info.get("type", "Exception"))[:100]
    message = str(info.get("message", ""))[:4000]
    cls = {"not implemented": NotImplementedError, "forbidden": ForbiddenCall,
           "needs gpu": NeedsGPU}.get(kind)  # fmt: skip
    if cls is None:
        cls = _BUILTIN_ERRORS.get(name)
        if cls is None or not issubclass(cls, Exception) or name in ("StopIteration",):
            cls = type(name if name.isidentifier() else "Error", (RuntimeError,), {})
    try:
        exc = cls(message)
    except Exception:
        exc = RuntimeError(f"{name}: {message}")
    exc.where = str(info.get("where", ""))[:500]
    return exc


def remote_candidate(worker: Worker, shape, exercise, path=()):
    """The grader-side stand-in for what the notebook handed over (tuples stay tuples)."""
    if isinstance(shape, dict) and "seq" in shape and isinstance(shape.get("items"), list):
        items = [remote_candidate(worker, s, exercise, (*path, i))
                 for i, s in enumerate(shape["items"][:64])]  # fmt: skip
        return tuple(items) if shape["seq"] == "tuple" else items
    return RemoteCandidate(worker, path, exercise)


def scratch_root() -> Path:
    """A private folder (mode 0700) for this grading run's scratch folders."""
    return Path(tempfile.mkdtemp(prefix="course-grade-"))


if __name__ == "__main__":  # pragma: no cover
    worker_main(int(sys.argv[1]), int(sys.argv[2]))
