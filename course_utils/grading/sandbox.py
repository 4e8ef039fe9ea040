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
  nothing. Messages are decoded by a strict codec (no pickle): only plain data crosses, and a
  view that repeats memory (a zero or overlapping stride) or leaves it is refused before
  anything is built from it.
- **No oracle**: the first check of an exercise is the graded one, and the worker is told
  only that it was handed in; the cases, hints and score go to the report, never back.
- **Time and memory**: every cell and every exercise has a time limit (the exercise's covers
  the grader's own checks too; messages from the worker never extend a deadline), the worker's
  processes together a memory limit, its scratch folder a disk limit; past them the whole
  process tree is killed, that exercise (or cell) scores 0 with the reason, and the notebook
  is re-run from the top in a fresh worker with the exercises already graded skipped, so one
  endless loop costs one exercise, not the notebook. Workers ask the kernel's OOM killer to
  choose them first, so a container's memory limit never takes the grader.
- **Every start from clean files**: each start (and each restart) gets a new scratch folder,
  the only place it may write, and a new read-only copy of what it may import from
  ``course_utils`` (:mod:`course_utils.grading.worker_package`: no ``specs``, no function that
  answers an exercise). The interpreter runs isolated (``-I``: no user site, ``PYTHONPATH`` or
  ``sitecustomize`` of the worker's making) and locks itself in before it imports anything a
  worker could have written. The course's own code in the worker is saved before the first
  cell; a request finds it replaced and refuses the exercise.
- **Other notebooks and the instructor's files**: on Linux with Landlock (kernel 5.13+) the
  worker can write only its scratch folder (and the null, random and GPU devices), cannot read
  the course's tree, the notebooks' folders or ``/dev/shm``, cannot open TCP connections (ABI
  4+) or signal the grader (ABI 6+); a seccomp filter (:mod:`course_utils.grading.seccomp`) denies
  every other socket. **The grader then checks the lock from outside** before any cell runs: the
  worker tries to read protected files (the grader compares what came back with the files),
  to write outside its folder (the grader looks for the files) and to send datagrams to the
  grader's own sockets (the grader listens). A lock that did not hold stops that notebook;
  ``isolation`` in the report says what was verified. The grader reads every notebook before
  running any, keeps results in memory, writes ``grades.json`` and ``.csv`` atomically at the
  end, and is a child subreaper: processes a notebook starts are killed when its worker ends.

Limits: without Landlock (older kernels, some containers) a notebook can still read and write
the user's files, though never the grades of the others in the same run, and the report says
"NOT isolated". The forbidden-operation watch runs inside the worker: code that tampers with
the interpreter during the call itself (``gc`` on a running helper's objects, ``ctypes``) is
not caught by it, only by the checks of what its code produces (docs/instructors.md: limits).
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

from .. import paths
from .types import Candidate, NeedsGPU, Result, student_error

_WORKER = None  # the worker's channel to the grader, inside a worker
MAX_HEADER = 64 << 20  # bytes of one message's JSON header
MAX_ITEMS = 100_000  # values (numbers, strings, lists, ...) in one message; big data goes as arrays
TOO_MANY = (f"more than {MAX_ITEMS} Python values (numbers, strings, tuples, lists) in one reply: "
            "no exercise needs that many; return a tensor or an array for large data")
PACKAGE = paths.PACKAGE  # course_utils/, the folder a worker gets a copy of


def in_worker() -> bool:
    """True inside a sandboxed grading worker."""
    return _WORKER is not None


class ProtocolError(Exception):
    """The worker sent something that is not a well-formed message of plain data."""


class Unsendable(TypeError):
    """What the notebook's function returned cannot cross to the grader (a flood of values, an
    object of another kind): the case fails and says so."""


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
        self.items = 0  # values encoded so far (bounded by MAX_ITEMS)
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
        self.items += 1
        if self.items > MAX_ITEMS:
            raise Unsendable(TOO_MANY)
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


MAX_DIMS = 16


def _check_layout(shape, strides, offset, extent, itemsize, what, strict) -> None:
    """Refuse a view that reads outside its memory, and (``strict``) one that repeats memory.

    ``extent`` and ``offset`` are in the units of ``strides``: elements for a tensor, bytes for
    a numpy array (``itemsize`` is 1 for a tensor). With ``strict`` (the grader reading what a
    notebook sent) a stride of 0 on a dimension longer than 1, or dimensions that overlap, are
    refused before anything is built: a 4-byte tensor expanded to 2**30 elements would
    otherwise become gigabytes at the first conversion. Nothing is allocated here.
    """
    if len(shape) != len(strides) or len(shape) > MAX_DIMS:
        raise ProtocolError(f"a {what} with {len(shape)} sizes and {len(strides)} strides")
    if any(n == 0 for n in shape):
        return
    low = high = offset
    for n, s in zip(shape, strides, strict=True):
        if s >= 0:
            high += (n - 1) * s
        else:
            low += (n - 1) * s
    if low < 0 or high + itemsize > extent:
        raise ProtocolError(f"a {what}'s view reaches outside its memory")
    if not strict:
        return
    span = itemsize
    for n, s in sorted(((n, abs(s)) for n, s in zip(shape, strides, strict=True) if n > 1),
                       key=lambda d: d[1]):  # fmt: skip
        if s < span:
            raise ProtocolError(
                f"a {what} with a stride of {s} over {n} elements repeats memory (a zero-stride "
                "or overlapping view, e.g. from expand): return .contiguous() data")
        span = s * n


class _Decoder:
    """Rebuilds values from a header and its buffers; ``regions`` are (owner, writable view)."""

    def __init__(self, regions_desc, buffers, known=None, device_ok=True, strict=False):
        self.strict = strict  # the grader decoding the worker's data: refuse odd layouts
        torch = _torch()
        np = _np()
        self.views = []  # per region: a torch uint8 tensor holding its bytes
        self.items = 0  # values decoded so far: a flood is refused before it costs the grader
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
        self.items += 1
        if self.items > MAX_ITEMS:
            raise Unsendable(TOO_MANY)
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
            if not isinstance(shape, list) or not isinstance(stride, list) or \
                    not all(isinstance(v, int) and v >= 0 for v in [*shape, *stride, offset]):
                raise ProtocolError("a tensor's shape, strides and offset must be >= 0 ints")
            if raw.numel() % size:
                raise ProtocolError("a tensor's storage is not a whole number of elements")
            _check_layout(shape, stride, offset, raw.numel() // size, 1, "tensor",
                          self.strict)  # fmt: skip
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
            shape, strides, offset = x["shape"], x["strides"], x["offset"]
            if not isinstance(shape, list) or not isinstance(strides, list) or \
                    not all(isinstance(v, int) for v in [*shape, *strides, offset]) or \
                    min([*shape, offset], default=0) < 0:
                raise ProtocolError("an array's shape, strides and offset must be ints")
            _check_layout(shape, strides, offset, buf.nbytes, dt.itemsize, "array", self.strict)
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
            from ..runtime import kernel_array

            return kernel_array(self.dec(x["v"], depth + 1))
        raise ProtocolError(f"unknown value type {t!r}")

    def _region(self, r):
        if isinstance(r, bool) or not isinstance(r, int) or not 0 <= r < len(self.views):
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
    from .watch import ForbiddenCall

    kind = ("unsendable" if isinstance(exc, Unsendable) else
            "not implemented" if isinstance(exc, NotImplementedError) else
            "forbidden" if isinstance(exc, ForbiddenCall) else
            "needs gpu" if isinstance(exc, NeedsGPU) else "error")  # fmt: skip
    line = student_error(exc)
    where = line[line.rfind(" (at line"):] if " (at line" in line else ""
    return {"raised": {"kind": kind, "type": type(exc).__name__, "message": str(exc)[:4000],
                       "where": where}}  # fmt: skip


class _Pristine:
    """The course's own code in the worker as it was before the notebook's first cell.

    Taken after the harness modules are imported and before any cell runs: every
    function, class and module that a ``course_utils`` module holds at module level, and each
    function's code. Before each request of the grader the worker checks that nothing was
    replaced, and it calls the watch and the harness helpers it saved here, never what the
    notebook's namespace now says: a notebook that swaps ``watch.forbid`` for a no-op, or
    ``harness.ch07.largest_tensor`` for one that reports a small tensor, gets the exercise
    refused as forbidden instead. (Code that tampers during the call itself, e.g. by reaching
    a running helper's objects through ``gc``, is beyond what one process can watch: see the
    limits in docs/instructors.md.)
    """

    def __init__(self):
        import importlib
        import pkgutil
        import types

        harness = importlib.import_module("course_utils.grading.harness")
        # Every chapter's helpers, not only this chapter's: a case may call another chapter's
        # (chapter 11's paged prefill runs chapter 09's Triton check). About 0.5 s more.
        for info in pkgutil.iter_modules(harness.__path__):
            importlib.import_module(f"course_utils.grading.harness.{info.name}")
        kinds = (types.FunctionType, type, types.ModuleType, types.BuiltinFunctionType)
        self.entries = {}
        for name, module in list(sys.modules.items()):
            if name != "course_utils" and not name.startswith("course_utils."):
                continue
            if module is None:
                continue
            saved = {k: v for k, v in vars(module).items() if isinstance(v, kinds)}
            codes = {k: v.__code__ for k, v in saved.items()
                     if isinstance(v, types.FunctionType)}  # fmt: skip
            self.entries[name] = (module, saved, codes)
        from .watch import forbid

        self.forbid = forbid

    def changed(self) -> list[str]:
        """``module.name`` of every saved entry the notebook replaced or whose code it swapped."""
        found = []
        for name, (module, saved, codes) in self.entries.items():
            now = vars(module)
            for key, value in saved.items():
                if now.get(key) is not value or (key in codes and value.__code__ is not codes[key]):
                    found.append(f"{name}.{key}")
        return found

    def resolve(self, target: str):
        """The saved student-side helper ``"course_utils.grading.harness...:function"``."""
        module, _, name = str(target).partition(":")
        entry = self.entries.get(module)
        if not module.startswith("course_utils.grading.harness") or entry is None or \
                name not in entry[1]:
            raise ProtocolError(f"no student-side helper {str(target)[:80]!r}")
        return entry[1][name]


_PRISTINE: _Pristine | None = None


def _serve(channel: _Channel, candidate) -> dict:
    """Answer the grader's requests about ``candidate`` until it sends the verdict."""
    from .watch import ForbiddenCall

    pristine = _PRISTINE
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
            changed = pristine.changed()
            if changed:
                raise ForbiddenCall(
                    f"the notebook replaced the course's own code ({', '.join(changed[:4])}): "
                    "the checks cannot trust what they measure, so this exercise is refused. "
                    "Leave course_utils as it is.")
            with pristine.forbid(header.get("forbidden", ()),
                                 torch_only=header.get("torch_only", False)):
                if op == "call":
                    out = obj(*args, **kwargs)
                elif op == "launch":
                    config = dec.dec(header["config"])
                    out = obj[config](*args)
                elif op == "invoke":
                    out = pristine.resolve(header["target"])(obj, *args, **kwargs)
                else:
                    raise ProtocolError(f"unknown request {op!r}")
            from ..runtime import synchronize

            synchronize()
            known = [(("region", i), v, {"kind": "torch", "device": str(v.device),
                                          "nbytes": v.numel()})
                     for i, v in enumerate(dec.views)]  # fmt: skip
            enc = _Encoder(known)
            for i, v in enumerate(dec.views):  # map the args' storages to their regions
                enc.keys[("torch", v.untyped_storage().data_ptr(), v.numel(), str(v.device))] = i
            try:
                value = enc.enc(out)
            except TypeError as exc:  # what was returned cannot cross: not the code's crash
                raise Unsendable(str(exc)) from None
            reply, out_buffers = enc.message({"ok": value})
            back = [v.detach().cpu().numpy() for v in dec.views]
            channel.send(dict(reply, nback=len(back)), [*back, *out_buffers])
        except Exception as exc:  # the student's code raised: send what and where
            channel.send(_raised(exc))


def hand_over(exercise_id: str, candidate):
    """``grader.check`` inside a worker: the grader runs the cases and sends the verdict."""

    channel = _WORKER
    if exercise_id in channel.skip_ids:
        print(f"{exercise_id}: graded in an earlier run of this notebook")
        return Result(exercise_id, "", 0, 0.0, 0, 0, "graded earlier", "", True)
    channel.send({"check": exercise_id, "shape": _describe_candidate(candidate)})
    verdict = _serve(channel, candidate)
    print(str(verdict.get("text", ""))[:500])
    # The score stays with the grader: the notebook learns that it handed in, nothing more.
    return Result(exercise_id, "", 0, 0.0, 0, 0, "handed in", "", True)


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
    """An import hook: ``course_utils.grading.specs`` (the grader's side) does not exist in a
    worker."""

    def find_spec(self, name, path=None, target=None):
        if name == "course_utils.grading.specs" or name.startswith("course_utils.grading.specs."):
            raise ImportError(
                f"{name} is the grader's side and is not available while a notebook is graded: "
                "import constants from course_utils.grading.harness instead"
            )
        return None


def worker_main(fd_in: int, fd_out: int) -> None:
    """Entry point of a worker: read the job, lock itself in, prove it, run the notebook's cells.

    Runs from the fresh read-only package copy the grader made for this start, in an
    interpreter started with ``-I`` (no user site, no ``PYTHONPATH``, no current folder on the
    path): until the lock below, only code the grader wrote has run, and nothing has been
    imported from a folder any worker could write. The probe then tries what a locked worker
    must not be able to do; the grader checks the outcome from outside before it says "go".
    """
    global _WORKER
    channel = _Channel(fd_in, fd_out)
    job, _ = channel.recv()
    # The grader's own import path (what the instructor set up: PYTHONPATH, user site), never a
    # folder a worker can write; nothing is imported from it before the lock below.
    sys.path[1:1] = [p for p in job.get("sys_path", []) if isinstance(p, str)]
    _apply_rlimits(job.get("limits", {}))
    _volunteer_for_oom_killer()
    locked = {}
    if job.get("landlock"):
        try:
            locked["landlock"] = landlock_restrict(**job["landlock"])
        except Exception as exc:  # an odd kernel or /proc: say so; the probe tells the rest
            locked["landlock"] = f"unavailable ({type(exc).__name__}: {exc})"
    if job.get("start_cuda"):
        _start_cuda_driver()
    if job.get("seccomp"):
        try:
            from .seccomp import deny_sockets

            locked["seccomp"] = deny_sockets()
        except Exception as exc:
            locked["seccomp"] = f"unavailable ({type(exc).__name__}: {exc})"
    if job.get("probe"):
        locked["probe"] = _probe(job["probe"])
    channel.send({"locked": locked})
    go, _ = channel.recv()
    if go.get("op") != "go":
        os._exit(4)
    sys.meta_path.insert(0, _NoSpecs())
    channel.skip_ids = set(job.get("skip_ids", ()))
    _WORKER = channel
    global _PRISTINE
    try:
        from ..runtime import setup

        setup(verbose=False)  # what the notebook's first cell does; the harness needs the mode
        _PRISTINE = _Pristine()
    except Exception as exc:
        channel.send({"fatal": f"the worker could not load the course's helpers: "
                               f"{type(exc).__name__}: {exc}"})
        os._exit(3)
    here = paths.PACKAGE  # the course_utils this worker imported
    if str(here.parent) != job["package"]:
        channel.send({"fatal": f"course_utils was imported from {here}, not the worker's copy"})
        os._exit(3)
    _run_cells(channel, job["cells"], set(job.get("skip_cells", ())))
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


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


def _volunteer_for_oom_killer() -> None:
    """Ask the kernel to kill this worker, not the grader, when the machine runs out of memory.

    A container's memory limit is enforced by the OOM killer, which picks the process with the
    highest score; at 1000 that is always a worker (its children inherit the score).
    """
    try:
        with open("/proc/self/oom_score_adj", "w") as f:
            f.write("1000")
    except OSError:
        pass


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
    """The memory of ``pids`` together, each shared page counted once (Linux PSS).

    Resident sizes would count a page shared by a forked child twice: twenty sleeping children
    of a worker that holds torch would "use" 4 GiB. The proportional set size splits each shared
    page between its users, so the sum is what the processes really hold; ``statm``'s resident
    size is the fallback where ``smaps_rollup`` is missing (Linux < 4.14).
    """
    page = os.sysconf("SC_PAGE_SIZE")
    total = 0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/smaps_rollup", "rb") as f:
                for line in f:
                    if line.startswith(b"Pss:"):
                        total += int(line.split()[1]) << 10
                        break
            continue
        except (OSError, ValueError, IndexError):
            pass
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
    exercise_seconds: float = 600.0  # the exercise's checks: the worker's time and the grader's
    notebook_seconds: float = 3600.0
    memory_mb: int = 8192
    file_mb: int = 1024
    scratch_mb: int = 4096  # what the worker's files may take on disk, all together
    message_mb: int = 256  # data one answer of the notebook may send back
    restarts: int = 4


SCRATCH_ENTRIES = 50_000  # files and folders a worker may make: more is refused as abuse


def _tree_usage(root: str, cap: int) -> tuple[int, int]:
    """(bytes on disk, entries) below ``root``, counting at most ``cap`` entries."""
    total, entries, todo = 0, 0, [root]
    while todo and entries <= cap:
        try:
            with os.scandir(todo.pop()) as it:
                for entry in it:
                    entries += 1
                    try:
                        st = entry.stat(follow_symlinks=False)
                    except OSError:
                        continue
                    total += st.st_blocks * 512
                    if entry.is_dir(follow_symlinks=False):
                        todo.append(entry.path)
        except OSError:
            continue
    return total, entries


@dataclass
class Worker:
    """A running worker: its process, the two pipe ends the grader holds, and its folders."""

    proc: object
    fd_to: int
    fd_from: int
    limits: Limits
    keep: frozenset = field(default_factory=frozenset)
    reader: _Reader | None = None
    deadline: float = 0.0
    isolation: str = ""  # what was verified from outside after the start
    verified: bool = False
    lock_requested: bool = False  # Landlock was asked for: a lock that did not hold stops it
    scratch: Path | None = None  # the only folder it may write
    package: Path | None = None  # its read-only copy of course_utils (the folder above it)

    def wait_ready(self, fd):
        """Block until ``fd`` is readable; WorkerLost past the deadline or a resource limit."""
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
                self.check_resources()

    def check_resources(self):
        """WorkerLost if the worker died, or its memory or files passed their limits."""
        if self.proc.poll() is not None:
            raise WorkerLost("crashed", f"the notebook's process exited "
                                        f"({_exit_reason(self.proc.returncode)})")
        pids = [self.proc.pid, *descendants(self.proc.pid)]
        rss = _rss_bytes(pids)
        limit = self.limits.memory_mb
        if rss > limit << 20:
            raise WorkerLost("out of memory", f"used {rss >> 20} MiB of memory, more "
                                              f"than the limit of {limit} MiB")
        if self.scratch is not None:
            used, entries = _tree_usage(str(self.scratch), SCRATCH_ENTRIES)
            if used > self.limits.scratch_mb << 20:
                raise WorkerLost("out of disk", f"wrote {used >> 20} MiB of files, more than "
                                                f"the limit of {self.limits.scratch_mb} MiB")
            if entries > SCRATCH_ENTRIES:
                raise WorkerLost("out of disk", f"made more than {SCRATCH_ENTRIES} files")

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
        """Kill the worker and all it started, then delete its folders: none is used again."""
        kill_tree(self.proc.pid, self.keep)
        for fd in (self.fd_to, self.fd_from):
            try:
                os.close(fd)
            except OSError:
                pass
        for folder in (self.scratch, self.package):
            if folder is not None:
                remove_tree(folder)


def _exit_reason(code) -> str:
    if code is None:
        return "still running"
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


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
        from . import worker_package
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


# Devices a worker may write: the null and random devices, and the GPU's (the CUDA driver talks
# to them with ioctl). Never /dev/shm or /dev/mqueue: memory there is counted by nobody.
_DEVICES = ("/dev/null", "/dev/zero", "/dev/full", "/dev/random", "/dev/urandom")
_UNREADABLE_DEVICES = ("/dev/shm", "/dev/mqueue")

_BOOT = ("import sys; sys.path.insert(0, sys.argv[1]); "
         "from course_utils.grading.sandbox import worker_main; "
         "worker_main(int(sys.argv[2]), int(sys.argv[3]))")  # fmt: skip


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


def start_worker(run_root: Path, job: dict, limits: Limits, keep, protected) -> Worker:
    """Start a worker in fresh folders under ``run_root``, lock it in and verify the lock.

    Every start (the first and each restart) gets a new scratch folder, the only place it may
    write, and a new read-only copy of ``course_utils`` made here: a worker never imports
    anything a worker could have written. The interpreter runs isolated (``-I``: no user site,
    no ``PYTHONPATH``, no ``sitecustomize`` from the scratch folder; ``-B``: no bytecode
    written). ``protected`` lists paths it may not read. The isolation is then checked from
    outside (:func:`verify_isolation`) before any of the notebook's cells runs.
    """
    import subprocess

    run_root = Path(run_root)
    base = Path(tempfile.mkdtemp(prefix="worker-", dir=run_root))
    scratch, package = base / "scratch", base / "package"
    scratch.mkdir()
    package.mkdir()
    copy_package(package)
    os.chmod(package, 0o555)
    for sub in ("home", "tmp", "cache"):
        (scratch / sub).mkdir()
    to_r, to_w = os.pipe()
    from_r, from_w = os.pipe()
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("COURSE_CHECKS_RAISE", "COURSE_GRADING", "PYTEST_", "PYTHON"))}
    env.update(HOME=str(scratch / "home"), TMPDIR=str(scratch / "tmp"),
               XDG_CACHE_HOME=str(scratch / "cache"), MPLCONFIGDIR=str(scratch / "cache"),
               TRITON_CACHE_DIR=str(scratch / "cache" / "triton"),
               TRITON_HOME=str(scratch / "cache"), NUMBA_CACHE_DIR=str(scratch / "cache"),
               TORCH_EXTENSIONS_DIR=str(scratch / "cache" / "torch_extensions"),
               MPLBACKEND="Agg")  # fmt: skip
    from .. import runtime

    env["COURSE_DEVICE"] = "gpu" if runtime.on_gpu() else "cpu"
    log = open(scratch / "worker.log", "ab")  # noqa: SIM115 (handed to the process)
    try:
        proc = subprocess.Popen(
            [sys.executable, "-I", "-B", "-u", "-c", _BOOT, str(package), str(to_r), str(from_w)],
            pass_fds=(to_r, from_w), cwd=scratch, env=env, stdin=subprocess.DEVNULL,
            stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
        )
    finally:
        log.close()
        os.close(to_r)
        os.close(from_w)
    worker = Worker(proc, to_w, from_r, limits, keep, scratch=scratch, package=package)
    worker.reader = _Reader(from_r, limits.message_mb << 20)
    job = dict(job, scratch=str(scratch), package=str(package), sys_path=_import_path(run_root),
               limits={"file_bytes": limits.file_mb << 20})  # fmt: skip
    abi = landlock_abi() if protected is not None else 0
    if abi >= 1:
        writable = [str(scratch), *_writable_devices()]
        unreadable = [*protected, str(run_root), *_UNREADABLE_DEVICES]
        job["landlock"] = {"read_protected": unreadable, "writable": writable,
                           "read_extra": [str(scratch), str(package), sys.prefix,
                                          sys.base_prefix]}  # fmt: skip
        job["seccomp"] = True
        job["start_cuda"] = env["COURSE_DEVICE"] == "gpu"
    with _Listeners(run_root) as listeners:
        probe = _probe_spec(run_root, base, package, protected or [], listeners)
        job["probe"] = probe
        worker.deadline = time.monotonic() + 120
        try:
            worker.send(job)
            header, _ = worker.recv()
            locked = header.get("locked")
            if not isinstance(locked, dict):
                raise WorkerLost("error", "the worker did not report its lock")
            worker.lock_requested = abi >= 1
            worker.verified, worker.isolation = verify_isolation(locked, probe, listeners,
                                                                 requested=abi >= 1)
        except BaseException:
            worker.stop()
            raise
    return worker


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
        decoder = _Decoder(regions, data[nback:], known=known, strict=True)
        return decoder.dec(reply["ok"])

    def __call__(self, *args, **kwargs):
        return self._request("call", args, kwargs)

    def __getitem__(self, config):
        return lambda *args: self._request("launch", args, config=config)

    def invoke(self, target, *args, **kwargs):
        return self._request("invoke", args, kwargs, target=target)


def _rebuild_exception(info: dict) -> BaseException:
    from .watch import ForbiddenCall

    if not isinstance(info, dict):
        return ProtocolError("malformed exception")
    kind, name = info.get("kind"), str(info.get("type", "Exception"))[:100]
    message = str(info.get("message", ""))[:4000]
    cls = {"not implemented": NotImplementedError, "forbidden": ForbiddenCall,
           "unsendable": Unsendable,
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
