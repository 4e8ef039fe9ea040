"""Issue 42: every public attention function of the package, called with bad and edge inputs.

The sweep enumerates the public callables (each module's ``__all__``) of ``course_utils.*`` and
``course_utils.library.kernels.*``, finds the attention-like ones (they take ``q, k, v``, or partial
``O`` and ``LSE`` to merge), and calls each with: a wrong dtype (int64), the meta device (no
data), a wrong rank, a head dim in k that is not q's, non-contiguous views, empty tensors
(N = 0, B = 0), a NaN in q, and lengths past the end where a length argument exists. Each call
ends as one of

* ``clear error``: a TypeError / ValueError / NotImplementedError / RuntimeError raised by a
  ``raise`` statement of the course (the traceback's innermost frame), naming what is wrong;
* ``correct``: returns what a float64 attention written here (not the course's reference)
  computes from the same inputs (NaN exactly where it has NaN; on the meta device, the shapes);
* ``unclear error``: raised by the course but the message names no argument or property;
* ``deep crash``: raised inside torch, triton, numpy or a kernel's body;
* ``bare error``: ZeroDivisionError / IndexError / KeyError / AssertionError;
* ``silent wrong``: returns something that differs from float64, NaN that was not asked for,
  or an answer to inputs that have none (a head dim mismatch accepted).

Every call but the first two kinds fails its test, unless listed in ``KNOWN`` (a file another
helper owns: ``xfail(strict=True)`` with the reason, so a fix shows up as XPASS). The summary
test prints the table (``-s``) and asserts that the sweep still makes enough calls.
"""

from __future__ import annotations

import importlib
import inspect
import math
import pkgutil
import re
import socket
import traceback
from collections import Counter
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import course_utils as cu
from course_utils import checks

PACKAGE = Path(cu.__file__).parent
DEV = cu.device()
DTYPE = torch.float32  # every entry point takes float32 (exact products, small sizes)
D = 16

# Modules not swept, and why: grading and publishing machinery, process launchers, compilers.
SKIPPED_MODULES = {
    "course_utils.__main__": "command line entry point",
    "course_utils.grading.assign": "builds the exercise notebooks (grading machinery)",
    "course_utils.publishing.colab": "notebook environment setup",
    "course_utils.toolbox.doctor": "environment report, starts processes",
    "course_utils.grading.grader": "grading machinery",
    "course_utils.grading.sandbox": "grading machinery, starts sandboxed workers",
    "course_utils.grading.seccomp": "sandbox syscall filter",
    "course_utils.grading.ranks": "starts rank processes for chapter 13's exercises",
    "course_utils.grading.worker_package": "grading worker packaging",
    "course_utils.publishing.site": "publishing the course site",
    "course_utils.toolbox.cuda": "compiles CUDA (NVRTC / nvcc)",
    "course_utils.toolbox.cuda_cpu": "compiles CUDA C++ for the CPU (starts a compiler)",
    "course_utils.toolbox.portability": "compiles CUDA for several architectures",
    "course_utils.grading.specs": "exercise specifications (grading machinery)",
    "course_utils.grading.harness": "exercise-side helpers of the specifications",
    "course_utils.grading.sanitize.flash_backward": "compute-sanitizer driver scripts (GPU)",
    "course_utils.grading.sanitize.flash_forward": "compute-sanitizer driver scripts (GPU)",
    "course_utils.grading.sanitize.flash_mma": "compute-sanitizer driver scripts (GPU)",
}

# Attention-like public functions the sweep does not call, and why.
NOT_CALLED = {
    "attention.available": "reports which impls run here; computes no attention",
    "attention.why_not": "reports why an impl cannot run; computes no attention",
    "attention.bottom_right_forward": "takes a kernel function; swept through "
                                      "attention(causal='bottom_right')",
    "attention.bottom_right_backward": "takes a kernel function; swept through attention()",
    "ops.tune_outside": "times chapter 09's autotuner on a GPU; returns configs, not attention",
    "flash_attention_triton.validate_inputs": "the validator every swept Triton entry point "
                                              "calls",
    "flash_attention_tma.attention_forward_fp8": "FP8: its error bound is chapter 14's tests'",
    "flash_attention_tma.quantize_fp8_inputs": "FP8 quantisation, not attention",
    "flash_attention_tma.attention_forward_fp8_wgmma": "FP8 in CUDA, sm_90 only (a CPU refuses "
                                                       "every input): chapter 14's tests bound "
                                                       "its error and its refusals",
    "flash_attention_tma.quantize_fp8_inputs_wgmma": "FP8 quantisation, not attention",
    "ring.block_forward": "one block pair inside the ring's loop, on inputs the swept ring entry "
                          "points have checked",
    "ring.block_backward": "one block pair inside the ring's backward, on checked inputs",
}

# (function, bad input) -> reason: outcomes in files this sweep's author does not own, left
# for their owners (xfail strict: the test turns XPASS when fixed). Empty when all pass.
KNOWN: dict[tuple[str, str], str] = {}
# Seen in CPU mode. On a GPU the kernels run compiled (the TMA ones only on sm_90, elsewhere a
# clear error) and the ring's blocks go to chapter 09's kernel: not verified there, not strict.
STRICT = not cu.on_gpu()

BAD_INPUTS = ("base", "int64", "meta", "rank", "d mismatch", "non-contiguous", "N = 0",
              "B = 0", "NaN", "past the end")
FAILING = ("unclear error", "deep crash", "bare error", "silent wrong")


# =============================================================================================
# The float64 attention the outcomes are checked against (written here, from the definition)
# =============================================================================================


def _attn64(q, k, v, causal=False, offset=0, scale=None):
    """O, LSE of ``(..., Nq, d)`` against ``(..., Nk, d)``; row r sees c <= r + offset if causal;
    a row that sees no key: O = 0, LSE = -inf; NaN propagates."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    S = scale * (q @ k.transpose(-1, -2))
    if causal:
        r = torch.arange(q.shape[-2])[:, None]
        c = torch.arange(k.shape[-2])[None, :]
        S = S.masked_fill(c > r + offset, -math.inf)
    LSE = torch.logsumexp(S, -1) if S.shape[-1] else S.new_full(S.shape[:-1], -math.inf)
    seen = torch.isfinite(LSE) | torch.isnan(LSE)
    keep = seen[..., None] & (S != -math.inf)  # a masked key weighs exactly 0, even in a NaN row
    P = torch.where(keep, torch.exp(S - LSE[..., None]), torch.zeros_like(S))
    return P @ v, LSE


def _gqa(k, G, dim):
    return k.repeat_interleave(G, dim)


def _dense_fwd(t):
    return _attn64(t["q"], t["k"], t["v"], causal=True)


def _dense_grads(t):
    q, k, v = (t[n].detach().clone().requires_grad_() for n in "qkv")
    O, _ = _attn64(q, k, v, causal=True)
    O.backward(t["dO"])
    return q.grad, k.grad, v.grad


def _varlen64(t):
    q, k, v = t["q"], t["k"], t["v"]
    lq, lk = t["lens_q"], t["lens_k"]
    G = q.shape[1] // k.shape[1]
    O = torch.zeros(q.shape[0], q.shape[1], v.shape[2], dtype=torch.float64)
    LSE = torch.full((q.shape[1], q.shape[0]), -math.inf, dtype=torch.float64)
    q0 = k0 = 0
    for nq, nk in zip(lq, lk, strict=True):
        if k0 + nk > k.shape[0] or q0 + nq > q.shape[0]:
            raise ValueError("lengths past the end")
        qs = q[q0:q0 + nq].transpose(0, 1)
        ks, vs = (_gqa(x[k0:k0 + nk].transpose(0, 1), G, 0) for x in (k, v))
        o, lse = _attn64(qs, ks, vs, causal=True, offset=nk - nq)
        O[q0:q0 + nq], LSE[:, q0:q0 + nq] = o.transpose(0, 1), lse
        q0, k0 = q0 + nq, k0 + nk
    return O, LSE


def _decode64(t):
    q, k, v, lens = t["q"], t["k"], t["v"], t["lens"]
    G = q.shape[1] // k.shape[2]
    O = torch.zeros(q.shape[0], q.shape[1], v.shape[3], dtype=torch.float64)
    LSE = torch.full(q.shape[:2], -math.inf, dtype=torch.float64)
    for b, n in enumerate(lens):
        if n > k.shape[1]:
            raise ValueError("length past the end")
        ks, vs = (_gqa(x[b, :n].transpose(0, 1), G, 0) for x in (k, v))
        o, lse = _attn64(q[b][:, None], ks, vs)
        O[b], LSE[b] = o[:, 0], lse[:, 0]
    return O, LSE


def _merge64(t):
    O_p, L_p = t["O_parts"], t["LSE_parts"]
    LSE = torch.logsumexp(L_p, 0)
    w = torch.exp(L_p - LSE)
    return (w[..., None] * O_p).sum(0), LSE


# =============================================================================================
# Problems: named tensors, and their bad versions
# =============================================================================================


def _randn(*shape, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g, dtype=torch.float64)


def _dense(B=1, N=8):
    q, k, v, dO = (_randn(B, 2, N, D, seed=s) for s in range(4))
    O, LSE = _attn64(q, k, v, causal=True)
    return {"q": q, "k": k, "v": v, "dO": dO, "O": O, "LSE": LSE}


def _packed(lens_q=(3, 5), lens_k=(4, 5), past=False):
    q = _randn(sum(lens_q), 2, D, seed=10)
    k, v = (_randn(sum(lens_k), 1, D, seed=s) for s in (11, 12))
    lens_k = list(lens_k)
    if past and lens_k:
        lens_k[-1] += 4  # cu_seqlens_k ends past Tk
    return {"q": q, "k": k, "v": v, "lens_q": list(lens_q), "lens_k": lens_k}


def _decode(B=2, lens=(5, 20)):
    q = _randn(B, 2, D, seed=20)
    k, v = (_randn(B, 32, 1, D, seed=s) for s in (21, 22))
    return {"q": q, "k": k, "v": v, "lens": list(lens)}


def _parts(B=1):
    O_p = _randn(2, B, 2, D, seed=30)
    L_p = _randn(2, B, 2, seed=31)
    return {"O_parts": O_p, "LSE_parts": L_p}


def _noncontiguous(x):
    """The same values through a view with a stride of 2 in the last dim."""
    return x.unsqueeze(-1).expand(*x.shape, 2)[..., 0]


def _bad(problem, kind, build):
    """The problem's tensors (float64, CPU) made bad in one way; None if it does not apply."""
    t = dict(problem)
    first = next(n for n in ("q", "O_parts") if n in t)
    floats = [n for n, x in t.items() if isinstance(x, torch.Tensor)]
    if kind == "rank":
        t[first] = t[first][0]
    elif kind == "d mismatch":
        if "k" not in t:
            return None
        t["k"] = torch.cat([t["k"], t["k"]], -1)
    elif kind == "N = 0":
        t = build("N")
    elif kind == "B = 0":
        t = build("B")
    elif kind == "NaN":
        t[first] = t[first].clone()
        t[first].view(-1)[0] = math.nan
    elif kind == "past the end":
        t = build("past")
    if t is None:
        return None
    if kind == "non-contiguous":
        for n in floats:
            t[n] = _noncontiguous(t[n])
    return t


def _to_call(t, kind):
    """The tensors as the function receives them: DTYPE on DEV, int64 or meta for those kinds."""
    out = {}
    for n, x in t.items():
        if isinstance(x, torch.Tensor):
            if kind == "int64":
                x = (3 * x).round().to(torch.int64)
            elif kind != "non-contiguous":
                x = x.to(DTYPE)
            else:  # keep the view: cast the base, view again
                x = _noncontiguous(x[..., ::1].contiguous().to(DTYPE))
            x = x.to("meta" if kind == "meta" else DEV)
        out[n] = x
    return out


def _lens(lens, device):
    return torch.tensor(lens, dtype=torch.int32).to(device)


def _cu(lens, device):
    from course_utils import serving

    return serving.cu_seqlens(list(lens)).to(device)


# =============================================================================================
# Specs: how to call each swept function, and its float64 answer
# =============================================================================================


def _specs():
    from course_utils import attention as front
    from course_utils import ops, reference, ring, serving, ulysses
    from course_utils.library.kernels import flash_attention_tma as tma
    from course_utils.library.kernels import flash_attention_triton as fat
    from course_utils.library.kernels import flash_decoding as fd

    def dense_build(which):
        return _dense(B=0) if which == "B" else _dense(N=0) if which == "N" else None

    def decode_build(which):
        if which == "B":
            return _decode(B=0, lens=())
        if which == "N":
            return _decode(lens=(0, 0))
        return _decode(lens=(5, 40))  # past the 32 rows of the cache

    def packed_build(which):
        if which == "B":
            return _packed((), ())
        if which == "N":
            return _packed((0, 0), (0, 0))
        return _packed(past=True)

    def parts_build(which):
        return _parts(B=0) if which == "B" else None

    scale = D ** -0.5
    dense = (_dense, dense_build)
    s = {}
    s["reference.attention"] = (reference.attention, dense, _dense_fwd,
                                lambda t: t["fn"](t["q"], t["k"], t["v"], True))
    s["ops.attention_forward_torch"] = (ops.attention_forward_torch, dense, _dense_fwd,
                                        lambda t: t["fn"](t["q"], t["k"], t["v"], True, scale))
    s["ops.flash_attention"] = (ops.flash_attention, dense, lambda t: _dense_fwd(t)[0],
                                lambda t: t["fn"](t["q"], t["k"], t["v"], True))
    s["ops.attention_backward_torch"] = (
        ops.attention_backward_torch, dense, _dense_grads,
        lambda t: t["fn"](t["dO"], torch.zeros_like(t["LSE"]), t["q"], t["k"], t["v"], t["O"],
                          t["LSE"], True, scale))
    s["flash_attention_triton.attention_forward"] = (
        fat.attention_forward, dense, _dense_fwd, lambda t: t["fn"](t["q"], t["k"], t["v"], True))
    s["flash_attention_triton.flash_attention_triton"] = (
        fat.flash_attention_triton, dense, lambda t: _dense_fwd(t)[0],
        lambda t: t["fn"](t["q"], t["k"], t["v"], True))
    s["flash_attention_triton.attention_backward"] = (
        fat.attention_backward, dense, _dense_grads,
        lambda t: t["fn"](t["q"], t["k"], t["v"], t["O"], t["LSE"], t["dO"], True))
    s["flash_attention_tma.attention_forward_tma"] = (
        tma.attention_forward_tma, dense, _dense_fwd,
        lambda t: t["fn"](t["q"], t["k"], t["v"], True))
    s["flash_attention_tma.flash_attention_tma"] = (
        tma.flash_attention_tma, dense, lambda t: _dense_fwd(t)[0],
        lambda t: t["fn"](t["q"], t["k"], t["v"], True))
    s["flash_attention_tma.attention_backward_tma"] = (
        tma.attention_backward_tma, dense, _dense_grads,
        lambda t: t["fn"](t["q"], t["k"], t["v"], t["O"], t["LSE"], t["dO"], True))
    for impl in ("reference", "torch", "triton"):
        s[f"attention.attention[{impl}]"] = (
            front.attention, dense, lambda t: _dense_fwd(t)[0],
            lambda t, impl=impl: t["fn"](t["q"], t["k"], t["v"], causal=True, impl=impl))
    s["ring.ring_attention_forward"] = (
        ring.ring_attention_forward, dense, _dense_fwd,
        lambda t: t["fn"](t["q"], t["k"], t["v"], causal=True))
    s["ring.ring_attention"] = (ring.ring_attention, dense, lambda t: _dense_fwd(t)[0],
                                lambda t: t["fn"](t["q"], t["k"], t["v"], True))
    s["ring.allgather_attention"] = (ring.allgather_attention, dense, _dense_fwd,
                                     lambda t: t["fn"](t["q"], t["k"], t["v"], causal=True))
    s["ring.ring_attention_backward"] = (
        ring.ring_attention_backward, dense, _dense_grads,
        lambda t: t["fn"](t["dO"], t["q"], t["k"], t["v"], t["O"], t["LSE"], causal=True))
    s["ring.allgather_attention_backward"] = (
        ring.allgather_attention_backward, dense, _dense_grads,
        lambda t: t["fn"](t["dO"], t["q"], t["k"], t["v"], t["O"], t["LSE"], causal=True))
    s["ulysses.ulysses_attention"] = (ulysses.ulysses_attention, dense, _dense_fwd,
                                      lambda t: t["fn"](t["q"], t["k"], t["v"], causal=True))
    parts = (_parts, parts_build)
    s["serving.merge_partials"] = (serving.merge_partials, parts, _merge64,
                                   lambda t: t["fn"](t["O_parts"], t["LSE_parts"]))
    s["ring.merge"] = (ring.merge, parts, _merge64,
                       lambda t: t["fn"](t["O_parts"][0], t["LSE_parts"][0], t["O_parts"][-1],
                                         t["LSE_parts"][-1]))
    packed = (_packed, packed_build)
    s["serving.reference_varlen"] = (
        serving.reference_varlen, packed, _varlen64,
        lambda t: t["fn"](t["q"], t["k"], t["v"], _cu(t["lens_q"], t["q"].device),
                          _cu(t["lens_k"], t["q"].device), causal=True))
    s["flash_decoding.varlen_attention"] = (
        fd.varlen_attention, packed, _varlen64,
        lambda t: t["fn"](t["q"], t["k"], t["v"], _cu(t["lens_q"], t["q"].device),
                          _cu(t["lens_k"], t["q"].device), max(t["lens_q"], default=0),
                          max(t["lens_k"], default=0), causal=True))
    decode = (_decode, decode_build)
    s["serving.reference_decode"] = (
        serving.reference_decode, decode, _decode64,
        lambda t: t["fn"](t["q"], t["k"], t["v"], _lens(t["lens"], t["q"].device)))
    s["serving.decode_split_kv_torch"] = (
        serving.decode_split_kv_torch, decode, _decode64,
        lambda t: t["fn"](t["q"], t["k"], t["v"], _lens(t["lens"], t["q"].device), 2))
    s["flash_decoding.decode_attention"] = (
        fd.decode_attention, decode, _decode64,
        lambda t: t["fn"](t["q"], t["k"], t["v"], _lens(t["lens"], t["q"].device),
                          num_splits=2))
    return s


# =============================================================================================
# Enumeration: the attention-like public functions of the package
# =============================================================================================


def _modules():
    """The modules at the top of each layer (core, toolbox, library, grading, publishing) and
    of library/kernels: where the package's public functions live."""
    names = []
    for folder in ("", "toolbox", "library", "grading", "publishing", "library/kernels"):
        prefix = "course_utils." + (folder.replace("/", ".") + "." if folder else "")
        names += [m.name for m in pkgutil.iter_modules([str(PACKAGE / folder)], prefix)
                  if m.name.rsplit(".", 1)[1] not in ("toolbox", "library", "grading",
                                                        "publishing")]
    return sorted(names)


def _attention_like(fn):
    try:
        params = set(inspect.signature(fn).parameters)
    except (TypeError, ValueError):
        return False
    return ({"q", "k", "v"} <= params or {"q", "k_cache", "v_cache"} <= params
            or ({"LSE"} <= params and bool(params & {"O", "O_parts"})) or "LSE_parts" in params)


def _public_attention_functions():
    found = {}
    for name in _modules():
        if name in SKIPPED_MODULES:
            continue
        module = importlib.import_module(name)
        for attr in getattr(module, "__all__", ()):
            fn = getattr(module, attr)
            if callable(fn) and not inspect.isclass(fn) and _attention_like(fn):
                found[f"{name.rsplit('.', 1)[1]}.{attr}"] = fn
    return found


# =============================================================================================
# Outcomes
# =============================================================================================

_WORDS = re.compile(r"dtype|device|shape|dims?\b|contiguous|head dim|length|cache|seqlens|"
                    r"window|causal|split|layout|block|NaN|float|int|tensor|empty|meta|rows|"
                    r"\bd\b|\bd=|q\b|k\b|v\b|O\b|LSE", re.IGNORECASE)


def _classify_error(error):
    if isinstance(error, (ZeroDivisionError, IndexError, KeyError, AssertionError)):
        return "bare error", f"{type(error).__name__}: {error}"
    frames = traceback.extract_tb(error.__traceback__)
    if Path(frames[-1].filename).resolve() == Path(__file__).resolve():
        raise error  # the sweep's own call built bad arguments: a bug here, not an outcome
    frame = frames[-1]
    where = f"{Path(frame.filename).name}:{frame.lineno}"
    in_course = Path(frame.filename).resolve().is_relative_to(PACKAGE.resolve())
    raised = (frame.line or "").lstrip().startswith("raise")
    message = f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"
    if not (in_course and raised and isinstance(
            error, (TypeError, ValueError, NotImplementedError, RuntimeError))):
        return "deep crash", f"{message[:90]} [{where}]"
    if not _WORDS.search(str(error)):
        return "unclear error", message[:90]
    return "clear error", message[:90]


def _as_list(x):
    return list(x) if isinstance(x, (tuple, list)) else [x]


def _classify_result(got, want, meta):
    got, want = _as_list(got), _as_list(want)
    if len(got) < len(want):
        return "silent wrong", f"{len(got)} outputs, expected {len(want)}"
    for i, (g, w) in enumerate(zip(got, want, strict=False)):
        if not isinstance(g, torch.Tensor) or tuple(g.shape) != tuple(w.shape):
            return "silent wrong", (f"output {i}: shape {tuple(getattr(g, 'shape', ()))}, "
                                    f"expected {tuple(w.shape)}")
        if meta:
            continue
        g64 = g.detach().cpu().double()
        unasked = torch.isnan(g64) & ~torch.isnan(w)
        if unasked.any():
            return "silent wrong", f"output {i}: {int(unasked.sum())} NaN where float64 has none"
        hidden = ~torch.isnan(g64) & torch.isnan(w)
        if hidden.any():
            values = sorted({str(float(x)) for x in g64[hidden]})[:3]
            return "silent wrong", (f"output {i}: {int(hidden.sum())} element(s) where float64 is "
                                    f"NaN (a NaN input) came back as {', '.join(values)}")
        ok = ~torch.isnan(w)
        if not torch.equal(torch.isinf(g64[ok]), torch.isinf(w[ok])):
            return "silent wrong", f"output {i}: inf pattern differs"
        finite = ok & torch.isfinite(w)
        atol, rtol = checks.tolerance(torch.float32, 20.0)
        err = (g64[finite] - w[finite]).abs() - rtol * w[finite].abs()
        if err.numel() and float(err.max()) > atol:
            return "silent wrong", f"output {i}: off by {float(err.max()):.2e} > {atol:.1e}"
    return "correct", "meta: shapes" if meta else "against float64"


def _outcome(fn, build, oracle, call, kind):
    problem, rebuild = build
    base = problem()
    t = base if kind in ("base", "int64", "meta") else _bad(base, kind, rebuild)
    if t is None:
        return None
    args = _to_call(t, kind)
    args["fn"] = fn
    try:
        got = call(args)
    except Exception as error:  # noqa: BLE001 - classifying every exception is the point
        return _classify_error(error)
    ref = {n: (x.double() if isinstance(x, torch.Tensor) else x) for n, x in t.items()}
    if kind == "int64":
        ref = {n: ((3 * x).round() if isinstance(x, torch.Tensor) else x) for n, x in ref.items()}
    try:
        want = oracle(ref)
    except Exception as error:  # noqa: BLE001
        return "silent wrong", (f"returned for inputs that have no answer ({type(error).__name__}"
                                f": {str(error)[:60]})")
    return _classify_result(got, want, kind == "meta")


@pytest.fixture(scope="module")
def one_rank_group():
    if dist.is_initialized():
        yield
        return
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


_RESULTS: dict[tuple[str, str], tuple[str, str] | None] = {}


def _result(name, kind):
    if (name, kind) not in _RESULTS:
        fn, build, oracle, call = _specs()[name]
        _RESULTS[name, kind] = _outcome(fn, build, oracle, call, kind)
    return _RESULTS[name, kind]


SPEC_NAMES = sorted(_specs())


def _params():
    out = []
    for name in SPEC_NAMES:
        for kind in BAD_INPUTS:
            reason = KNOWN.get((name, kind))
            marks = [pytest.mark.xfail(strict=STRICT, reason=reason)] if reason else []
            out.append(pytest.param(name, kind, id=f"{name}-{kind}", marks=marks))
    return out


# =============================================================================================
# Tests
# =============================================================================================


def test_every_attention_like_public_function_is_swept_or_skipped_with_a_reason():
    found = _public_attention_functions()
    specs = {name.split("[")[0] for name in SPEC_NAMES}
    missing = sorted(set(found) - specs - set(NOT_CALLED))
    assert not missing, f"public attention functions with no sweep spec: {missing}"
    assert len(found) >= 25, f"only {len(found)} attention-like public functions found"
    gone = sorted((specs | set(NOT_CALLED)) - set(found))
    assert not gone, f"swept but no longer public (update the specs): {gone}"


@pytest.mark.parametrize("name,kind", _params())
def test_bad_input(name, kind, one_rank_group):
    result = _result(name, kind)
    if result is None:
        pytest.skip(f"{kind} does not apply to {name}")
    outcome, detail = result
    assert outcome not in FAILING, f"{name} with {kind}: {outcome}: {detail}"


def test_summary_table_and_counts(one_rank_group, capsys):
    rows = [(name, kind, _result(name, kind)) for name in SPEC_NAMES for kind in BAD_INPUTS]
    rows = [(n, k, r) for n, k, r in rows if r is not None]
    counts = Counter(r[0] for _, _, r in rows)
    width = max(len(n) for n, _, _ in rows)
    lines = [f"{'function':{width}}  {'input':14}  {'outcome':13}  detail"]
    lines += [f"{n:{width}}  {k:14}  {r[0]:13}  {r[1]}" for n, k, r in rows]
    lines.append(f"{len(rows)} calls over {len(SPEC_NAMES)} swept functions: "
                 + ", ".join(f"{c} {o}" for o, c in counts.most_common()))
    with capsys.disabled():
        print("\n" + "\n".join(lines))
    assert len(rows) >= 200, f"the sweep shrank to {len(rows)} calls"
    assert counts["clear error"] >= 80 and counts["correct"] >= 60, counts
    bad = [(n, k, r) for n, k, r in rows if r[0] in FAILING and (n, k) not in KNOWN]
    assert not bad, "\n".join(f"{n} / {k}: {r[0]}: {r[1]}" for n, k, r in bad)
