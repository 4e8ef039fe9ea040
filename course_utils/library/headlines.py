"""The headline of a fast chapter: its default kernel against SDPA's flash backend and cuDNN.

A headline is one kernel fixed *before* timing (chapter 10: the ``mma.sync`` forward and backward;
chapter 14: the forward variant :func:`default_variant` picks for the shape, then the ``wgmma``
backward), timed together with SDPA's flash backend (FlashAttention-2, an Ampere ``mma.sync``
kernel) and SDPA's cuDNN backend (Hopper ``wgmma``: the bar on an H100/H200) on the same inputs,
in interleaved rounds (:func:`course_utils.toolbox.bench.interleaved`). Each round gives a ratio;
the headline is their median with the lowest and highest round (:func:`bench.ratio_summary`), never
the best of many kernels per shape.

    python -m course_utils.library.headlines 10 14      # on a GPU: measure, print; COURSE_RECORD=1
    saves
    python -m course_utils.library.headlines 10-backward  # chapter 10's two backward kernels

``show(chapter)`` measures on a GPU that can run the chapter's kernel and prints the recording
(``course_utils/recorded/NN_headline.json``) elsewhere.
"""

from __future__ import annotations

import math
import statistics
import sys

from .. import paths
from .attention import default_variant

ROUNDS = 5
TOKENS, HIDDEN = 32768, 2048  # B x N and H x d of every shape: the same work per shape
NS = (1024, 2048, 4096, 8192, 16384)
DS = (64, 128)
CHAPTER_DS = {10: (64, 96, 128), 14: DS}  # each chapter's headline head dims (H = HIDDEN // d)
BASELINES = ("sdpa flash", "sdpa cudnn")
COURSE = "course"
KERNELS = paths.KERNELS
BF16_PEAK_TFLOPS = 989  # H100 SXM and H200 datasheets: dense bf16 on the tensor cores
CHAPTERS = {10: "FlashAttention-2 on tensor cores (mma.sync), chapter 10",
            14: "the Hopper kernel (TMA, wgmma, default variant), chapter 14"}

# chapter 14's head dims that run forward only (96: d = 128's tiles on padded columns; 192 and 256:
# the wide heads), 16 heads each (H x d = 2048 is not a multiple of 96 or 192)
FORWARD_ONLY_DS, FORWARD_ONLY_HEADS = (96, 192, 256), 16

BACKWARDS = ("deterministic", "atomic")  # chapter 10's two backward kernels

__all__ = ["BACKWARDS", "CHAPTERS", "ROUNDS", "default_variant", "measure",
           "measure_backward_variants", "measure_fp8", "measure_head_dims", "print_fp8", "show",
           "summary"]


def _course_kernels(chapter: int):
    """(forward(q, k, v, causal) -> O, autograd function(q, k, v, causal) -> O) of a chapter:
    the front door's builds of the same kernels (``course_utils.library.attention``, impl "mma" or
    "hopper"; chapter 14's forward variant from :func:`default_variant`)."""
    if chapter not in CHAPTERS:
        raise ValueError(f"chapters with a headline: {sorted(CHAPTERS)}, not {chapter!r}")
    from ..contract import TOP_LEFT
    from .attention import _KernelAttention, _pair

    impl = {10: "mma", 14: "hopper"}[chapter]

    def fwd(q, k, v, causal):
        return _pair(q, k, v, causal, impl)[0]

    def train(q, k, v, causal):
        return _KernelAttention.apply(q, k, v, impl, TOP_LEFT if causal else None, None)[0]

    return fwd, train


def _sdpa(backend):
    import torch
    from torch.nn.attention import sdpa_kernel

    def run(q, k, v, causal):
        with sdpa_kernel(backend):
            return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal)

    return run


def _train_step(f, q, k, v, dO, causal):
    """A training step of ``f(q, k, v, causal) -> O`` on fresh leaves: () -> [dq, dk, dv]."""
    def step():
        leaves = [t.detach().requires_grad_() for t in (q, k, v)]
        f(*leaves, causal).backward(dO)
        return [t.grad for t in leaves]
    return step


def _shape_row(chapter, fwd, train, D, causal, N, rounds, modes=("fwd", "fwd+bwd"), H=None):
    import torch
    from torch.nn.attention import SDPBackend

    from ..toolbox import bench

    B, H = TOKENS // N, H or HIDDEN // D
    q, k, v, dO = (torch.randn(B, H, N, D, device="cuda", dtype=torch.bfloat16) for _ in range(4))
    impls = {COURSE: fwd, "sdpa flash": _sdpa(SDPBackend.FLASH_ATTENTION),
             "sdpa cudnn": _sdpa(SDPBackend.CUDNN_ATTENTION)}
    # the same answer first: the course's O against float64 and against SDPA's flash backend
    O = fwd(q, k, v, causal).float()
    ref = _sdpa(SDPBackend.FLASH_ATTENTION)(q, k, v, causal).float()
    from ..reference import attention

    O64, _ = attention(q[:1, :1].double(), k[:1, :1].double(), v[:1, :1].double(), causal=causal)
    err64 = float((O[:1, :1].double() - O64).abs().max())
    if not math.isfinite(err64) or err64 > 2e-2:
        raise AssertionError(f"chapter {chapter}, d={D}, causal={causal}, N={N}: the course's O "
                             f"is {err64:.1e} from float64: not timing a wrong kernel")
    rows = []
    for mode in modes:
        def run(impl, mode=mode):
            if mode == "fwd":
                return lambda: impl(q, k, v, causal)
            return _train_step(train if impl is fwd else impl, q, k, v, dO, causal)

        runs = {}
        for name, impl in impls.items():
            try:
                run(impl)()  # a backend may refuse a shape: then it has no figure here
                runs[name] = run(impl)
            except RuntimeError as exc:
                if name == COURSE:
                    raise
                print(f"{name} refused d={D}, causal={causal}, N={N}: {str(exc)[:120]}")
        ms = bench.interleaved(runs, rounds=rounds)
        flops = bench.attention_flops(B, H, N, N, D, causal, mode=mode)
        rows.append({
            "D": D, "causal": causal, "N": N, "B": B, "H": H, "mode": mode,
            "variant": default_variant(D, causal, N) if chapter == 14 else None,
            "tflops": {name: bench.tflops(flops, statistics.median(t)) for name, t in ms.items()},
            "ratio": {b: bench.ratio_summary(ms, COURSE, b) if b in ms else None
                      for b in BASELINES},
            "max_abs_vs_float64": err64,
            "max_abs_vs_flash": float((O - ref).abs().max()),
        })
    return rows


def measure(chapter: int, *, rounds: int = ROUNDS, Ns=NS, save: bool = True,
            progress: bool = False) -> dict:
    """Time chapter ``chapter``'s default kernel against SDPA flash and cuDNN on every shape
    (d in 64 and 128, causal and not, N in ``Ns``; B x N and H x d fixed), in ``rounds``
    interleaved rounds; save the result as ``NN_headline`` while recording."""
    import torch

    from .. import recorded

    if not torch.cuda.is_available():
        raise RuntimeError("measuring a headline needs a CUDA GPU; on a CPU, show() prints the "
                           "recording")  # fmt: skip
    if chapter == 14 and torch.cuda.get_device_capability() != (9, 0):
        raise RuntimeError("chapter 14's kernel runs on sm_90 (H100/H200) only")
    fwd, train = _course_kernels(chapter)
    rows = []
    for D in CHAPTER_DS[chapter]:
        for causal in (False, True):
            for N in Ns:
                rows += _shape_row(chapter, fwd, train, D, causal, N, rounds)
                if progress:
                    print(f"  measured d={D}, causal={causal}, N={N}", file=sys.stderr, flush=True)
    data = {"chapter": chapter, "kernel": CHAPTERS[chapter], "device": torch.cuda.get_device_name(),
            "rounds": rounds, "dtype": "bfloat16", "tokens": TOKENS, "hidden": HIDDEN,
            "peak_tflops": BF16_PEAK_TFLOPS, "rows": rows}  # fmt: skip
    if save:
        recorded.save(f"{chapter}_headline", data)
    return data


def measure_head_dims(*, rounds: int = ROUNDS, Ns=NS, save: bool = True,
                      progress: bool = False) -> dict:
    """Chapter 14's forward at the head dims it runs forward only (d in ``FORWARD_ONLY_DS``: 96,
    192, 256; its backward is built for 64 and 128) against SDPA flash and cuDNN, as
    :func:`measure` times the others: causal and not, N in ``Ns``, B x N = ``TOKENS``,
    ``FORWARD_ONLY_HEADS`` heads; saved as ``14_head_dims`` while recording."""
    import torch

    from .. import recorded

    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
        raise RuntimeError("chapter 14's kernel runs on sm_90 (H100/H200) only")
    fwd, train = _course_kernels(14)
    rows = []
    for D in FORWARD_ONLY_DS:
        for causal in (False, True):
            for N in Ns:
                rows += _shape_row(14, fwd, train, D, causal, N, rounds, modes=("fwd",),
                                   H=FORWARD_ONLY_HEADS)
                if progress:
                    print(f"  measured d={D}, causal={causal}, N={N}", file=sys.stderr, flush=True)
    data = {"chapter": 14, "kernel": CHAPTERS[14] + ", the head dims run forward only",
            "rounds": rounds, "device": torch.cuda.get_device_name(), "dtype": "bfloat16",
            "tokens": TOKENS, "heads": FORWARD_ONLY_HEADS, "peak_tflops": BF16_PEAK_TFLOPS,
            "rows": rows}
    if save:
        recorded.save("14_head_dims", data)
    return data


def _mma_train(backward: str):
    """f(q, k, v, causal) -> O: chapter 10's forward, and through autograd the backward
    ``backward`` (``"deterministic"``: dK/dV and dQ in two kernels, 7 products; ``"atomic"``: one
    pass, 5 products, dQ added with atomics)."""
    import torch

    from .attention import _cuda_module

    module, _ = _cuda_module("mma")
    grads = {"deterministic": module.flash_attention_mma_backward,
             "atomic": module.flash_attention_mma_backward_atomic}[backward]

    class Attention(torch.autograd.Function):
        @staticmethod
        def forward(ctx, q, k, v, causal):
            O, LSE = module.flash_attention_mma(q, k, v, causal)
            ctx.save_for_backward(q, k, v, O, LSE)
            ctx.causal = causal
            return O

        @staticmethod
        def backward(ctx, dO):
            q, k, v, O, LSE = ctx.saved_tensors
            return (*grads(q, k, v, O, dO.contiguous(), LSE, ctx.causal), None)

    return Attention.apply


def _backward_row(trains: dict, D: int, causal: bool, N: int, rounds: int) -> dict:
    """One shape of :func:`measure_backward_variants`: the two backward kernels' gradients
    compared, then every training step of ``trains`` timed in interleaved rounds."""
    import torch

    from ..toolbox import bench

    B, H = TOKENS // N, HIDDEN // D
    q, k, v, dO = (torch.randn(B, H, N, D, device="cuda", dtype=torch.bfloat16) for _ in range(4))
    runs = {name: _train_step(f, q, k, v, dO, causal) for name, f in trains.items()}
    det, atom = (runs[f"course {b}"]() for b in BACKWARDS)
    gap = max(float((a.float() - b.float()).abs().max()) for a, b in zip(det, atom, strict=True))
    scale = max(float(g.float().abs().max()) for g in det)
    if not math.isfinite(gap) or gap > 2e-2 * max(1.0, scale):
        raise AssertionError(f"d={D}, causal={causal}, N={N}: the two backward kernels disagree "
                             f"by {gap:.1e}: not timing them")
    ms = bench.interleaved(runs, rounds=rounds)
    flops = bench.attention_flops(B, H, N, N, D, causal, mode="fwd+bwd")
    return {
        "D": D, "causal": causal, "N": N, "B": B, "H": H, "mode": "fwd+bwd",
        "tflops": {n: bench.tflops(flops, statistics.median(t)) for n, t in ms.items()},
        "ratio": {f"{b} vs {base}": bench.ratio_summary(ms, f"course {b}", base)
                  for b in BACKWARDS for base in BASELINES},
        "atomic vs deterministic": bench.ratio_summary(ms, "course atomic", "course deterministic"),
        "max_abs_atomic_vs_deterministic": gap, "max_abs_grad": scale,
    }


def measure_backward_variants(*, rounds: int = ROUNDS, Ns=NS, save: bool = True,
                              progress: bool = False) -> dict:
    """Chapter 10's forward + backward with each of its backward kernels (:data:`BACKWARDS`),
    timed in the same interleaved rounds as SDPA flash and cuDNN on :func:`measure`'s shapes;
    each shape's gradients of the two compared first. Saved as ``10_backward_variants``."""
    import torch
    from torch.nn.attention import SDPBackend

    from .. import recorded

    if not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 0):
        raise RuntimeError("chapter 10's kernels need a CUDA GPU of sm_80 or newer")
    trains = {f"course {b}": _mma_train(b) for b in BACKWARDS}
    trains.update({"sdpa flash": _sdpa(SDPBackend.FLASH_ATTENTION),
                   "sdpa cudnn": _sdpa(SDPBackend.CUDNN_ATTENTION)})
    rows = []
    for D in DS:
        for causal in (False, True):
            for N in Ns:
                rows.append(_backward_row(trains, D, causal, N, rounds))
                if progress:
                    print(f"  measured d={D}, causal={causal}, N={N}", file=sys.stderr, flush=True)
    data = {"chapter": 10, "kernel": CHAPTERS[10] + ", both backward kernels",
            "device": torch.cuda.get_device_name(), "rounds": rounds, "dtype": "bfloat16",
            "tokens": TOKENS, "hidden": HIDDEN, "backwards": list(BACKWARDS), "rows": rows}
    if save:
        recorded.save("10_backward_variants", data)
    return data


FP8_DS, FP8_NS = (128, 256), (4096, 8192, 16384)  # the shapes: d = 128, 256, N >= 4096
# "fp8": the CUDA FP8 kernel as a user calls it (the course's FP8 forward on sm_90); "fp8
# rotated": the same with the Hadamard rotation; "fp8 kernel": the kernel alone, inputs quantized
# beforehand; "quantize": the producers alone; "triton fp8": the Triton FP8 forward as a user
# calls it; "bf16": the course's bf16 forward (chapter 14's default variant)
FP8_RUNS = ("fp8", "fp8 rotated", "fp8 kernel", "quantize", "triton fp8", "bf16", "sdpa cudnn")


def _fp8_row(fwd, D: int, causal: bool, N: int, rounds: int) -> dict:
    """One shape of :func:`measure_fp8`: each FP8 output checked against float64, then every
    entry of :data:`FP8_RUNS` timed in interleaved rounds."""
    import torch
    from torch.nn.attention import SDPBackend

    from ..reference import attention
    from ..toolbox import bench
    from .kernels import flash_attention_tma as tma

    B, H = TOKENS // N, HIDDEN // D
    q, k, v = (torch.randn(B, H, N, D, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    O64, _ = attention(q[:1, :1].double(), k[:1, :1].double(), v[:1, :1].double(), causal=causal)
    calls = {"fp8": lambda: tma.attention_forward_fp8_wgmma(q, k, v, causal),
             "fp8 rotated": lambda: tma.attention_forward_fp8_wgmma(q, k, v, causal, rotate=True),
             "triton fp8": lambda: tma.attention_forward_fp8(q, k, v, causal)}
    if D not in tma.FP8_SUPPORTED_D:  # the Triton FP8 forward stops at d = 128
        del calls["triton fp8"]
    err = {}
    for name, call in calls.items():
        O, _ = call()
        err[name] = float((O[:1, :1].double() - O64).abs().max() / O64.abs().max())
        if not math.isfinite(err[name]) or err[name] > 0.25:
            raise AssertionError(f"FP8 ({name}), causal={causal}, N={N}: max |O - O64| is "
                                 f"{err[name]:.2f} of max |O64|: not timing a wrong kernel")
    inputs = tma.quantize_fp8_inputs_wgmma(q, k, v)
    runs = {**calls,
            "fp8 kernel": lambda: tma.attention_forward_fp8_wgmma_quantized(inputs, causal),
            "quantize": lambda: tma.quantize_fp8_inputs_wgmma(q, k, v),
            "bf16": lambda: fwd(q, k, v, causal),
            "sdpa cudnn": lambda: _sdpa(SDPBackend.CUDNN_ATTENTION)(q, k, v, causal)}
    runs = {name: runs[name] for name in FP8_RUNS if name in runs}
    ms = bench.interleaved(runs, rounds=rounds)
    flops = bench.attention_flops(B, H, N, N, D, causal, mode="fwd")
    return {
        "D": D, "causal": causal, "N": N, "B": B, "H": H, "mode": "fwd",
        "ms": {n: statistics.median(t) for n, t in ms.items()},
        "tflops": {n: bench.tflops(flops, statistics.median(t)) for n, t in ms.items()
                   if n != "quantize"},
        "ratio": {f"{a} vs {b}": bench.ratio_summary(ms, a, b)
                  for a in ("fp8", "fp8 rotated", "fp8 kernel", "triton fp8") if a in ms
                  for b in ("bf16", "sdpa cudnn")},
        "rel_err_vs_float64": err,
    }


def measure_fp8(*, rounds: int = ROUNDS, Ns=FP8_NS, save: bool = True,
                progress: bool = False) -> dict:
    """Chapter 14's FP8 forwards as a user calls them, from bfloat16 tensors (the producer
    kernels quantize Q, K, V and write V^T inside the timed call), beside the course's bf16
    forward (chapter 14's default variant) and cuDNN, in the same interleaved rounds (the runs
    of :data:`FP8_RUNS`); d in ``FP8_DS``, causal and not, N in ``Ns``. Then
    :func:`accuracy_study` (the Triton FP8 forward, the same quantization) at N = 4096, causal
    and not. Saved as ``14_fp8``."""
    import torch

    from .. import recorded
    from .kernels import flash_attention_tma as tma

    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
        raise RuntimeError("chapter 14's kernels run on sm_90 (H100/H200) only")
    fwd, _ = _course_kernels(14)
    rows = []
    for D in FP8_DS:
        for causal in (False, True):
            for N in Ns:
                rows.append(_fp8_row(fwd, D, causal, N, rounds))
                if progress:
                    print(f"  measured FP8 d={D}, causal={causal}, N={N}", file=sys.stderr,
                          flush=True)
    accuracy = {"B": 1, "H": 4, "N": 4096, "D": 128,
                "rows": {str(c): tma.accuracy_study(1, 4, 4096, 128, causal=c, device="cuda")
                         for c in (False, True)}}
    data = {"chapter": 14, "kernel": "chapter 14's FP8 (e4m3) forward, CUDA (wgmma)",
            "device": torch.cuda.get_device_name(), "rounds": rounds, "dtype": "bfloat16 in",
            "tokens": TOKENS, "hidden": HIDDEN, "runs": list(FP8_RUNS), "rows": rows,
            "accuracy": accuracy}
    if save:
        recorded.save("14_fp8", data)
    return data


def print_fp8(data: dict, where: str) -> None:
    """The table of :func:`measure_fp8` (or its recording ``14_fp8``)."""
    print(f"{data['kernel']}, B x N = {data['tokens']}, H x d = {data['hidden']}; {where}")
    print("TFLOP/s; fp8 = as a user calls it (quantization inside); ratio = bf16's time / "
          f"FP8's (median, lowest-highest over {data['rounds']} interleaved rounds)")
    print(f"{'d':>3} {'causal':>6} {'N':>5} | {'fp8':>5} {'rot.':>5} {'kern.':>5} {'Triton':>6} "
          f"{'bf16':>5} {'cuDNN':>5} {'quant. ms':>9} | {'fp8 vs bf16':>16} {'kernel vs bf16':>16}")
    for r in data["rows"]:
        t = r["tflops"]
        triton_fp8 = f"{t['triton fp8']:6.0f}" if "triton fp8" in t else f"{'-':>6}"
        print(f"{r['D']:3d} {str(r['causal']):>6} {r['N']:5d} | {t['fp8']:5.0f} "
              f"{t['fp8 rotated']:5.0f} {t['fp8 kernel']:5.0f} {triton_fp8} {t['bf16']:5.0f} "
              f"{t['sdpa cudnn']:5.0f} {r['ms']['quantize']:9.3f} | "
              f"{_fmt(r['ratio']['fp8 vs bf16']):>16} {_fmt(r['ratio']['fp8 kernel vs bf16']):>16}")
    acc = data["accuracy"]
    print(f"accuracy, max |O - O64| / max |O64| (B={acc['B']}, H={acc['H']}, N={acc['N']}, "
          f"d={acc['D']}; Q and K with 2 channels scaled by the outlier factor):")
    for causal, rows in acc["rows"].items():
        print(f"  causal={causal}: " + "; ".join(
            f"x{r['outlier']:g}: plain {r['plain']:.3f}, rotated {r['rotated']:.3f}"
            for r in rows))


def summary(data: dict, baseline: str, *, mode: str = "fwd", D=None, causal=None,
            min_N: int = 0) -> dict:
    """The spread of the per-shape median ratios against ``baseline`` over the selected shapes:
    ``{"lo", "hi", "shapes", "rounds_lo", "rounds_hi"}`` (the lowest/highest median, and the
    lowest/highest single round)."""
    sel = [r for r in data["rows"] if r["mode"] == mode and r["N"] >= min_N
           and (D is None or r["D"] == D) and (causal is None or r["causal"] == causal)]
    if not sel:
        raise ValueError("no recorded shape matches that selection")
    med = [r["ratio"][baseline]["median"] for r in sel]
    return {"lo": min(med), "hi": max(med), "shapes": len(sel),
            "rounds_lo": min(r["ratio"][baseline]["lo"] for r in sel),
            "rounds_hi": max(r["ratio"][baseline]["hi"] for r in sel)}


def _fmt(r):
    if r is None:
        return "refused"
    return f"{r['median']:4.2f} ({r['lo']:.2f}-{r['hi']:.2f})"


def _print(data: dict, where: str) -> None:
    """The table of a headline recording: of :func:`measure` (forward and forward + backward at
    a fixed H x d) or of :func:`measure_head_dims` (forward only, a fixed H)."""
    size = f"H x d = {data['hidden']}" if "hidden" in data else f"H = {data['heads']}"
    print(f"{data['kernel']}: bf16, B x N = {data['tokens']}, {size}; {where}")
    print(f"ratio = SDPA's time / the course's time, median (lowest-highest) over "
          f"{data['rounds']} interleaved rounds; > 1: the course is faster")
    recorded_modes = [m for m in ("fwd", "fwd+bwd") if any(r["mode"] == m for r in data["rows"])]
    head = f"{'d':>3} {'causal':>6} {'N':>5} | "
    print(head + " | ".join(f"{m + ' TFLOP/s':>15} {'x flash':>16} {'x cuDNN':>16}"
                            for m in recorded_modes))
    by_shape = {}
    for r in data["rows"]:
        by_shape.setdefault((r["D"], r["causal"], r["N"]), {})[r["mode"]] = r
    for (D, causal, N), modes in by_shape.items():
        cells = []
        for m in recorded_modes:
            r = modes[m]
            cells.append(f"{r['tflops'][COURSE]:15.0f} {_fmt(r['ratio']['sdpa flash']):>16} "
                         f"{_fmt(r['ratio']['sdpa cudnn']):>16}")
        print(f"{D:3d} {str(causal):>6} {N:5d} | " + " | ".join(cells))
    worst = max(r["max_abs_vs_float64"] for r in data["rows"])
    print(f"every shape checked first: largest |O - float64 O| {worst:.1e} (bf16 inputs)")


def runtime_on_gpu() -> bool:
    from .. import runtime

    return runtime.on_gpu()


def show(chapter: int, *, rounds: int = ROUNDS, progress: bool = False) -> None:
    """Measure and print chapter ``chapter``'s headline on a GPU that runs its kernel; print the
    recording elsewhere. (It returns nothing, so that a notebook cell ending with it does not
    echo the data: :func:`measure` and ``recorded.load`` give the data.)"""
    from .. import recorded, runtime

    if chapter not in CHAPTERS:
        raise ValueError(f"chapters with a headline: {sorted(CHAPTERS)}, not {chapter!r}")
    live = runtime.on_gpu()
    if live:
        import torch

        cap = torch.cuda.get_device_capability()
        live = cap == (9, 0) if chapter == 14 else cap >= (8, 0)
    if live:
        import torch

        data = measure(chapter, rounds=rounds, progress=progress)
        _print(data, f"measured now on {torch.cuda.get_device_name()}")
        return None
    name = f"{chapter}_headline"
    try:
        data = recorded.load(name, verbose=False)
    except FileNotFoundError as why:
        print(f"not recorded yet: {why}")
        return None
    _print(data, recorded.label(name))
    return None


if __name__ == "__main__":
    for arg in sys.argv[1:] or ["10", "14"]:
        if arg == "10-backward":
            measure_backward_variants(progress=True)
        elif arg == "14-head-dims":
            data = measure_head_dims(progress=True)
            _print(data, f"measured now on {data['device']}")
        elif arg == "14-fp8":
            print_fp8(measure_fp8(progress=True), "measured now")
        else:
            show(int(arg), progress=True)
