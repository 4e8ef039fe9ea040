"""The message codec between the grader and a worker: plain data only, no pickle.

A message is a JSON header plus raw buffers (:func:`send`, :class:`_Reader`). :class:`_Encoder`
turns values (numbers, strings, tuples/lists/dicts, tensors, numpy arrays) into a header and the
memory regions they view; :class:`_Decoder` rebuilds them and, on the grader's side
(``strict``), refuses a view that repeats memory or leaves it before anything is built from it.
An exception crosses as its kind, type and message (:func:`_raised`, :func:`_rebuild_exception`).
Its own room because both ends use it (the worker and the grader here, the ranks of
:mod:`course_utils.grading.ranks` too), and because it is the one place where what a notebook
sends is trusted or not: nothing in it starts a process or touches a file.
"""

from __future__ import annotations

import builtins
import json
import os
import struct

from ..types import NeedsGPU, student_error

MAX_HEADER = 64 << 20  # bytes of one message's JSON header
MAX_ITEMS = 100_000  # values (numbers, strings, lists, ...) in one message; big data goes as arrays
TOO_MANY = (f"more than {MAX_ITEMS} Python values (numbers, strings, tuples, lists) in one reply: "
            "no exercise needs that many; return a tensor or an array for large data")


class ProtocolError(Exception):
    """The worker sent something that is not a well-formed message of plain data."""


class Unsendable(TypeError):
    """What the notebook's function returned cannot cross to the grader (a flood of values, an
    object of another kind): the case fails and says so."""


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
            from ...runtime import kernel_array

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


# ----------------------------------------------------------------------------- exceptions


_BUILTIN_ERRORS = {
    name: value for name, value in vars(builtins).items()
    if isinstance(value, type) and issubclass(value, Exception)
}


def _raised(exc) -> dict:
    from ..watch import ForbiddenCall

    kind = ("unsendable" if isinstance(exc, Unsendable) else
            "not implemented" if isinstance(exc, NotImplementedError) else
            "forbidden" if isinstance(exc, ForbiddenCall) else
            "needs gpu" if isinstance(exc, NeedsGPU) else "error")  # fmt: skip
    line = student_error(exc)
    where = line[line.rfind(" (at line"):] if " (at line" in line else ""
    return {"raised": {"kind": kind, "type": type(exc).__name__, "message": str(exc)[:4000],
                       "where": where}}  # fmt: skip


def _rebuild_exception(info: dict) -> BaseException:
    from ..watch import ForbiddenCall

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
