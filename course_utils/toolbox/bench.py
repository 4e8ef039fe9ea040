"""Timing and throughput: how fast is a kernel, and how far from SDPA is it?

* :func:`time_fn` times a function the way GPU benchmarks should be timed: warm-up calls
  first (compilation, autotuning, caches), then many runs timed with CUDA events, reporting
  the median. On the CPU it falls back to ``time.perf_counter`` and, for slow simulator runs,
  times as few calls as it can.
* :func:`attention_flops` counts FLOPs with the convention of the FlashAttention papers:
  forward ``4 * B * H * Nq * Nk * d``, causal x 0.5, backward 2.5 x forward.
* :func:`tflops`, :func:`gbps` turn a count and a time into throughput.
* :func:`table` prints a plain text table with the ratio of every row to a baseline measured in
  the same run (machines are shared and noisy: compare ratios, never absolute numbers).
* :func:`interleaved` times several functions in interleaved rounds (A B C, A B C, ...), and
  :func:`ratio_summary` turns two of its series into the median ratio and its spread: the form
  of every headline figure in the course.
* :func:`environment_info` describes the machine, to save beside recorded results.
"""

from __future__ import annotations

import datetime
import math
import platform
import statistics
import time
from dataclasses import dataclass
from importlib import metadata

import torch

from .. import runtime

__all__ = [
    "CPU_NOTE",
    "Row",
    "Timing",
    "attention_flops",
    "environment_info",
    "gbps",
    "interleaved",
    "ratio_summary",
    "table",
    "tflops",
    "time_fn",
]

CPU_NOTE = "CPU (simulator timings are not GPU performance)"

# Time budgets (ms) that choose the number of calls when warmup/rep are not given.
_GPU_WARMUP_MS, _GPU_REP_MS = 25.0, 100.0
_CPU_WARMUP_MS, _CPU_REP_MS = 0.0, 200.0
_MAX_REP = 1000
_FLUSH_BYTES_DEFAULT = 256 * 2**20  # used when the device does not report its L2 size
# Timed GPU calls are queued in chunks, each behind a GPU sleep long enough to queue it (the
# launch queue holds about a thousand entries; a chunk uses ~4 per call).
_CHUNK = 100
_EVENT_QUEUE_MS = 0.01  # CPU time to record a pair of events, roughly
_CYCLES_PER_MS = 2e6  # ~2 GHz; a slower clock only makes the sleep longer, which is harmless
_MAX_SLEEP_MS = 200.0

_MODES = {"fwd": 1.0, "bwd": 2.5, "fwd+bwd": 3.5}


def time_fn(fn, *args, warmup=None, rep=None, flush_l2=False, **kwargs):
    """Time ``fn(*args, **kwargs)``; return a :class:`Timing` (median, min, spread, n).

    On a GPU (when an argument is a CUDA tensor, or, with no tensor arguments, the course runs
    in GPU mode):

    1. one call, not timed (compilation, autotuning, first-touch allocations);
    2. ``warmup`` more calls (default: enough to fill ~25 ms);
    3. ``rep`` timed calls (default: enough to fill ~100 ms, between 5 and 1000), each
       between two CUDA events, queued while the GPU is kept busy, so that they run back to
       back and the time is the GPU's work, not Python's launch latency;
    4. the median of those times (robust to the occasional slow run).

    With ``flush_l2=True`` a buffer of twice the L2 cache is read before each timed
    call, outside its two events, so that every call starts with a cold cache (what a kernel
    sees in a real model, where other layers ran in between).

    On the CPU each call is timed with ``time.perf_counter``. When the first call alone takes
    longer than the ~200 ms budget (the CUDA simulator), it is the only measurement: a
    5-second simulator run is not repeated 100 times.

    Args:
        fn: the function to time; its return value is ignored.
        *args, **kwargs: passed to ``fn``. (So ``fn`` cannot take keyword arguments named
            ``warmup``, ``rep`` or ``flush_l2``; wrap it in a lambda if it does.)
        warmup: number of untimed calls after the first one; None to choose by time.
        rep: number of timed calls; None to choose by time.
        flush_l2: GPU only: empty the L2 cache before every timed call.
    """
    if not callable(fn):
        raise TypeError(f"time_fn needs a function to time, got {type(fn).__name__}")
    for name, value in (("warmup", warmup), ("rep", rep)):
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int):  # True is an int to Python
            raise TypeError(f"{name}={value!r} ({type(value).__name__}): {name} is a number of "
                            f"calls, an int (e.g. {name}=10), or None to choose by time")
        if value < 0:
            raise ValueError(f"{name} must be None or an int >= 0, got {value!r}")
    if rep == 0:
        raise ValueError("rep must be at least 1: there is nothing to report from 0 timed calls")
    cuda_device = _cuda_device(args, kwargs)
    if cuda_device is not None:
        return _time_gpu(fn, args, kwargs, warmup, rep, flush_l2, cuda_device)
    return _time_cpu(fn, args, kwargs, warmup, rep)


def interleaved(fns: dict, *args, rounds: int = 5, **time_kwargs) -> dict[str, list[float]]:
    """Time every function of ``fns`` (name -> callable) in ``rounds`` interleaved rounds.

    Round r times each function once with :func:`time_fn` (its median over many calls), in the
    order of ``fns``; then round r + 1 starts. A clock or thermal drift during the run then
    touches every function alike, which timing all rounds of A before any round of B does not.

    Returns:
        ``{name: [median ms of round 0, round 1, ...]}``.
    """
    if isinstance(rounds, bool) or not isinstance(rounds, int) or rounds < 1:
        raise ValueError(f"rounds must be an int >= 1, got {rounds!r}")
    if not fns or not all(callable(f) for f in fns.values()):
        raise TypeError("fns must map names to functions, e.g. {'course': f, 'sdpa': g}")
    out: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            out[name].append(time_fn(fn, *args, **time_kwargs).median_ms)
    return out


def ratio_summary(ms: dict[str, list[float]], kernel: str, baseline: str) -> dict:
    """The speed of ``kernel`` relative to ``baseline`` (> 1: faster), round by round.

    Each round's ratio is ``baseline ms / kernel ms`` of that round (both measured back to back),
    and the summary is their median with the lowest and highest round: ``{"median", "lo", "hi",
    "rounds"}``. Report it as ``median (lo-hi over n rounds)``, never the best round.
    """
    a, b = ms[kernel], ms[baseline]
    if len(a) != len(b) or not a:
        raise ValueError(f"{kernel!r} and {baseline!r} need the same number (>= 1) of rounds")
    ratios = [_positive_ms(y) / _positive_ms(x) for x, y in zip(a, b, strict=True)]
    return {"median": statistics.median(ratios), "lo": min(ratios), "hi": max(ratios),
            "rounds": len(ratios)}


def attention_flops(B, H, Nq, Nk, d, causal=False, mode="fwd"):
    """FLOPs of attention with the FlashAttention papers' convention.

    Forward: ``4 * B * H * Nq * Nk * d`` (two matrix products, ``S = Q K^T`` and ``O = P V``,
    each ``2 * Nq * Nk * d`` multiply-adds counted as 2 FLOPs; the softmax is not counted).
    Causal: half of that (about half of the scores are masked), whatever Nq and Nk are.
    Backward: 2.5 x forward (five matrix products instead of two). Forward + backward: 3.5 x.

    Args:
        B, H, Nq, Nk, d: batch, heads, query length, key length, head dimension (ints >= 1).
        causal: halve the count.
        mode: ``"fwd"``, ``"bwd"`` or ``"fwd+bwd"``.

    Returns:
        The FLOP count, an ``int``.
    """
    if mode not in _MODES:
        raise ValueError(f"mode must be one of {', '.join(map(repr, _MODES))}, got {mode!r}")
    for name, value in (("B", B), ("H", H), ("Nq", Nq), ("Nk", Nk), ("d", d)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be an int >= 1, got {value!r}")
    # In units of B*H*Nq*Nk*d: forward 4, backward 10, both 14; causal halves them. All even,
    # so the count stays an exact integer.
    units = {"fwd": 4, "bwd": 10, "fwd+bwd": 14}[mode]
    return B * H * Nq * Nk * d * units // (2 if causal else 1)


def tflops(flops, ms):
    """Throughput in TFLOP/s (10^12 FLOP per second) of ``flops`` done in ``ms`` milliseconds."""
    return flops / (_positive_ms(ms) * 1e-3) / 1e12


def gbps(nbytes, ms):
    """Bandwidth in GB/s (10^9 bytes per second) of ``nbytes`` moved in ``ms`` milliseconds."""
    return nbytes / (_positive_ms(ms) * 1e-3) / 1e9


def table(rows, baseline="sdpa fp32", *, device_name=None, verbose=True):
    """Print a plain text table of timings and return its rows as a list of dicts.

    Args:
        rows: :class:`Row` objects or dicts with ``name``, ``ms`` (a number or a
            :class:`Timing`) and optionally ``flops`` and/or ``bytes``.
        baseline: the name of the row every other row is compared with (measured in the same
            run); None for no comparison. The ratio is ``baseline ms / row ms``: above 1 the
            row is faster than the baseline, 0.5 means half its speed.
        device_name: the header's device; default the current GPU's name, or a note that CPU
            timings are not GPU performance.
        verbose: print the table (False: only return the rows).

    Returns:
        One dict per row: ``name``, ``ms``, ``flops``, ``bytes``, ``tflops``, ``gbps``,
        ``vs_baseline`` (None where unknown), plus ``baseline`` and ``device``: plain values
        that a notebook can plot or save as JSON.
    """
    parsed = [_as_row(r) for r in rows]
    if not parsed:
        raise ValueError("table got no rows")
    base_ms = None
    if baseline is not None:
        matches = [r for r in parsed if r.name == baseline]
        if not matches:
            names = ", ".join(repr(r.name) for r in parsed)
            raise ValueError(
                f"the baseline row {baseline!r} is missing; rows are: {names}. Time the "
                "baseline in the same run, or pass baseline=None (or another row's name)."
            )
        if len(matches) > 1:
            raise ValueError(f"{len(matches)} rows are named {baseline!r}: the baseline must "
                             "be unique")  # fmt: skip
        base_ms = matches[0].ms
    device_name = device_name or _device_header()
    out = []
    for r in parsed:
        out.append(
            {
                "name": r.name,
                "ms": r.ms,
                "flops": r.flops,
                "bytes": r.bytes,
                "tflops": None if r.flops is None else tflops(r.flops, r.ms),
                "gbps": None if r.bytes is None else gbps(r.bytes, r.ms),
                "vs_baseline": None if base_ms is None else base_ms / r.ms,
                "baseline": baseline,
                "device": device_name,
            }
        )
    if verbose:
        print(_format_table(out, baseline, device_name))
    return out


def environment_info():
    """The machine and software a result was measured with, as a JSON-ready dict.

    Keys: ``device``, ``gpu`` (bool), ``sm_count``, ``l2_bytes``, ``torch``, ``cuda``
    (torch's CUDA version), ``triton``, ``numba``, ``numba_cuda``, ``python``, ``platform``,
    ``date`` (UTC, ISO 8601). Versions are read from package metadata: nothing is imported,
    so calling it cannot spoil the simulator switch of ``course_utils.setup()``.
    """
    gpu = runtime.on_gpu() and torch.cuda.is_available()
    info = {
        "device": torch.cuda.get_device_name() if gpu else "CPU",
        "gpu": gpu,
        "sm_count": None,
        "l2_bytes": None,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "triton": _version("triton"),
        "numba": _version("numba"),
        "numba_cuda": _version("numba-cuda"),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }
    if gpu:
        props = torch.cuda.get_device_properties(torch.cuda.current_device())
        info["sm_count"] = props.multi_processor_count
        info["l2_bytes"] = getattr(props, "L2_cache_size", None)
    return info


# ---------------------------------------------------------------------------------------------
# Helpers
# ---------------------------------------------------------------------------------------------


def _cuda_device(args, kwargs):
    """The CUDA device to time on, or None to time on the CPU.

    A CUDA tensor among the arguments decides for the GPU, CPU tensors alone for the CPU (a
    CPU baseline measured on a GPU machine); without tensor arguments the mode decides.
    """
    tensors = [v for v in (*args, *kwargs.values()) if isinstance(v, torch.Tensor)]
    for value in tensors:
        if value.is_cuda:
            return value.device
    if not tensors and runtime.on_gpu() and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return None


def _time_gpu(fn, args, kwargs, warmup, rep, flush_l2, device):
    with torch.cuda.device(device):
        fn(*args, **kwargs)  # compile / autotune / allocate: never timed
        torch.cuda.synchronize()
        flush = None
        if flush_l2:
            l2 = getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 0)
            flush_bytes = 2 * l2 if l2 else _FLUSH_BYTES_DEFAULT
            flush = torch.empty(flush_bytes // 4, dtype=torch.int32, device=device)

        # Estimate one call's GPU time, and the CPU time it takes to queue one call.
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        t0 = time.perf_counter()
        start.record()
        for _ in range(3):
            if flush is not None:
                _flush_l2(flush)
            fn(*args, **kwargs)
        end.record()
        queue_ms = (time.perf_counter() - t0) * 1e3 / 3
        torch.cuda.synchronize()
        estimate = max(start.elapsed_time(end) / 3, 1e-4)
        if warmup is None:
            warmup = int(min(_MAX_REP, math.ceil(_GPU_WARMUP_MS / estimate)))
        if rep is None:
            rep = int(min(_MAX_REP, max(5, math.ceil(_GPU_REP_MS / estimate))))

        for _ in range(warmup):
            fn(*args, **kwargs)
        times = []
        for first in range(0, rep, _CHUNK):
            n = min(_CHUNK, rep - first)
            # A short kernel finishes before Python has queued the next one, and the events
            # would then time Python's launch latency. Keeping the GPU busy while this chunk is
            # queued makes the calls run back to back, so each event pair times the GPU's work.
            _gpu_sleep_ms(n * (queue_ms + _EVENT_QUEUE_MS))
            starts = [torch.cuda.Event(enable_timing=True) for _ in range(n)]
            ends = [torch.cuda.Event(enable_timing=True) for _ in range(n)]
            for i in range(n):
                if flush is not None:
                    _flush_l2(flush)  # queued before the start event: not part of the timing
                starts[i].record()
                fn(*args, **kwargs)
                ends[i].record()
            torch.cuda.synchronize()
            times += [s.elapsed_time(e) for s, e in zip(starts, ends, strict=True)]
        return _timing(times, torch.cuda.get_device_name(device))


def _flush_l2(buffer):
    """Fill the L2 cache with other data: read a buffer twice its size.

    Read, not written: after ``buffer.zero_()`` the L2 is full of dirty lines, and writing them
    back to HBM would happen during the timed kernel, charged to it (H100: a decode kernel
    reading 268 MB took 107.6 us after a zeroing flush, 97.6 us after this one and 98.2 us
    with no flush at all; a 2 MB add, which fits in L2, 4.4 us hot and 5.4 us after this flush).
    """
    torch.amax(buffer)


def _gpu_sleep_ms(ms):
    """Queue a GPU kernel that spins for about ``ms`` milliseconds (none if unavailable)."""
    sleep = getattr(torch.cuda, "_sleep", None)  # spins for a number of GPU clock cycles
    if sleep is not None:
        sleep(int(min(ms, _MAX_SLEEP_MS) * _CYCLES_PER_MS))


def _time_cpu(fn, args, kwargs, warmup, rep):
    t0 = time.perf_counter()
    fn(*args, **kwargs)
    first = (time.perf_counter() - t0) * 1e3
    if rep is None and first >= _CPU_REP_MS:
        return _timing([first], "cpu")  # slow (simulator): the first call is the measurement
    if warmup is None:
        warmup = int(min(_MAX_REP, math.ceil(_CPU_WARMUP_MS / max(first, 1e-3))))
    if rep is None:
        rep = int(min(_MAX_REP, max(1, _CPU_REP_MS // max(first, 1e-3))))
    for _ in range(warmup):
        fn(*args, **kwargs)
    times = []
    for _ in range(rep):
        t0 = time.perf_counter()
        fn(*args, **kwargs)
        times.append((time.perf_counter() - t0) * 1e3)
    return _timing(times, "cpu")


def _timing(times_ms, device):
    ordered = sorted(times_ms)
    n = len(ordered)

    def quantile(p):  # nearest rank on the sorted times
        return ordered[min(n - 1, max(0, round(p * (n - 1))))]

    return Timing(
        median_ms=statistics.median(ordered),
        min_ms=ordered[0],
        p20_ms=quantile(0.2),
        p80_ms=quantile(0.8),
        mean_ms=statistics.fmean(ordered),
        std_ms=statistics.stdev(ordered) if n > 1 else 0.0,
        n=n,
        device=device,
    )


def _positive_ms(ms):
    if isinstance(ms, Timing):
        ms = ms.median_ms
    if not ms > 0:
        raise ValueError(f"a time must be > 0 ms, got {ms!r}")
    return ms


def _as_row(r):
    if isinstance(r, Row):
        return r
    if isinstance(r, dict):
        unknown = set(r) - {"name", "ms", "flops", "bytes"}
        if "name" not in r or "ms" not in r or unknown:
            raise ValueError(
                f"a table row needs 'name' and 'ms' (and optionally 'flops', 'bytes'); got keys "
                f"{sorted(r)}"
            )
        return Row(r["name"], r["ms"], r.get("flops"), r.get("bytes"))
    raise TypeError(f"a table row must be a Row or a dict, got {type(r).__name__}")


def _device_header():
    if runtime.on_gpu() and torch.cuda.is_available():
        return torch.cuda.get_device_name()
    return CPU_NOTE


def _format_table(rows, baseline, device_name):
    ratio_title = f"vs {baseline}" if baseline is not None else ""
    header = ["name", "ms", "TFLOP/s", "GB/s"] + ([ratio_title] if baseline else [])
    body = []
    for r in rows:
        cells = [
            r["name"],
            f"{r['ms']:.3f}",
            _number(r["tflops"]),
            _number(r["gbps"]),
        ]
        if baseline is not None:
            cells.append(f"{r['vs_baseline']:.2f}x")
        body.append(cells)
    widths = [max(len(line[i]) for line in [header, *body]) for i in range(len(header))]

    def fmt(cells):  # name left-aligned, numbers right-aligned
        parts = [cells[0].ljust(widths[0])]
        parts += [c.rjust(w) for c, w in zip(cells[1:], widths[1:], strict=True)]
        return "  ".join(parts)

    lines = [f"device: {device_name}", fmt(header), "  ".join("-" * w for w in widths)]
    return "\n".join(lines + [fmt(c) for c in body])


def _number(x):
    """A throughput for the table: 1 decimal from 1 up, 3 significant digits below, - if None."""
    if x is None:
        return "-"
    return f"{x:.1f}" if x >= 1 else f"{x:.3g}"


def _version(package):
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


# ---------------------------------------------------------------------------------------------
# Classes
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Timing:
    """The result of :func:`time_fn`: times in milliseconds over ``n`` timed calls."""

    median_ms: float
    min_ms: float
    p20_ms: float
    p80_ms: float
    mean_ms: float
    std_ms: float
    n: int
    device: str

    def __str__(self):
        return (
            f"{self.median_ms:.4g} ms (median of {self.n}, p20-p80 {self.p20_ms:.4g}-"
            f"{self.p80_ms:.4g} ms, on {self.device})"
        )


@dataclass(frozen=True)
class Row:
    """One line of :func:`table`: a name, a time (ms or a :class:`Timing`), and optionally the
    FLOPs (for TFLOP/s) and bytes moved (for GB/s) of one call."""

    name: str
    ms: float
    flops: float | None = None
    bytes: float | None = None

    def __post_init__(self):
        if isinstance(self.ms, Timing):
            object.__setattr__(self, "ms", self.ms.median_ms)
        _positive_ms(self.ms)
