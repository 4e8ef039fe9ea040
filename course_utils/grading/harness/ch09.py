"""Chapter 09's student-side helpers, the tile sizes its notebooks import, and the small kernels
its exercises plug into.

The exercises of chapter 09 are variants of what the lecture's kernels
(``course_utils/library/kernels/flash_attention_triton.py``) do, so that their answers are nowhere
in the package:

- ``09.window_split``: the key ranges a query tile visits under a causal **sliding window**
  (three stages: the window's left edge, masked; the middle, unmasked; the diagonal, masked).
  :func:`window_split_bounds` runs the student's ``@triton.jit`` function in a probe kernel.
- ``09.window_inner``: the loop over key tiles of a sliding-window forward that keeps its
  accumulator normalised after every tile (FlashAttention-1's form: the kernel stores ``acc``
  as O, with no division at the end).
  :func:`run_window_forward` launches :func:`_window_forward_kernel` with the student's function
  as its ``INNER``; the grader sends the stage bounds of every query tile as data.
- ``09.gqa_dkdv``: a dK/dV kernel for grouped-query attention (several query heads share one
  K/V head). :func:`run_gqa_dkdv` launches the student's kernel.

The grader's cases (``course_utils.grading.specs.ch09``) call these through ``grader.invoke``: they
run where the candidate lives (the sandboxed worker while grading), take and return data only, and
never see an expected value. The lecture's helpers for checking gradients (:func:`backward_problem`
and friends) live here too, since the lecture imports them; no exercise is graded with them.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from ... import reference
from ...library.kernels import flash_attention_triton as fat
from ...runtime import device, pick
from ..checks import random_qkv

LOG2E = fat.LOG2E
_LN2 = tl.constexpr(1.0 / LOG2E)

# Fixed tile configurations while grading (BLOCK_M = Br query rows, BLOCK_N = Bc key rows).
FWD_CONFIG = pick(gpu=triton.Config({"BLOCK_M": 64, "BLOCK_N": 32}, num_warps=4, num_stages=2),
                  cpu=triton.Config({"BLOCK_M": 16, "BLOCK_N": 16}, num_warps=4, num_stages=1))
DKDV_CONFIG = pick(gpu=triton.Config({"BLOCK_M": 32, "BLOCK_N": 64}, num_warps=4, num_stages=2),
                   cpu=triton.Config({"BLOCK_M": 16, "BLOCK_N": 32}, num_warps=4, num_stages=1))
DQ_CONFIG = pick(gpu=triton.Config({"BLOCK_M": 64, "BLOCK_N": 32}, num_warps=4, num_stages=2),
                 cpu=triton.Config({"BLOCK_M": 32, "BLOCK_N": 16}, num_warps=4, num_stages=1))

GRAD_TOL = {torch.float32: 1e-4, torch.float16: 6e-3, torch.bfloat16: 2.5e-2}
# float16 was 4e-3 until the interpreter's gradients at logits of std 50 reached 1.18x of it
# (dQ and dK, 2 of 12 fresh draws on a CPU, 2026-11-26): a check that fails on correct kernels
# now and then. Every other case stays below 0.15x of 4e-3.
SCORE_ATOL = 1e-5  # float32 only: the error of S (eps x |S|) enters P through exp


def jit_problem(obj, name) -> str:
    """Why ``obj`` cannot be plugged into a kernel as a ``@triton.jit`` function ("" if it can)."""
    from triton.runtime.jit import KernelInterface  # JITFunction, and the interpreter's

    if not isinstance(obj, KernelInterface) or not callable(getattr(obj, "fn", None)):
        return f"{name} is a {type(obj).__name__}, not a Triton function"
    return ""


# ----------------------------------------------------------------------------- 09.window_split


@triton.jit
def _window_split_probe(starts, lengths, windows, out, SPLIT: tl.constexpr,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, FN_HASH: tl.constexpr):
    # Program p calls SPLIT for query tile starts[p], Nk = lengths[p], WINDOW = windows[p].
    # (FN_HASH: SPLIT's source hash, so that an edited SPLIT compiles a new probe.)
    p = tl.program_id(0)
    start_m = tl.load(starts + p)
    Nk = tl.load(lengths + p)
    window = tl.load(windows + p)
    lo, mid_lo, mid_hi, hi = SPLIT(start_m, Nk, window, BLOCK_M, BLOCK_N)
    tl.store(out + 4 * p, lo)
    tl.store(out + 4 * p + 1, mid_lo)
    tl.store(out + 4 * p + 2, mid_hi)
    tl.store(out + 4 * p + 3, hi)


def _run_probe(probe, columns, **consts):
    """Launch ``probe`` with one program per row of the int32 ``columns`` and a poisoned
    (rows, 4) output; the four numbers each program stored, as a list of 4-tuples."""
    rows = len(columns[0])
    inputs = [torch.tensor(list(c), dtype=torch.int32, device=device()) for c in columns]
    out = torch.full((rows, 4), -(2**31), dtype=torch.int32, device=device())
    probe[(rows,)](*inputs, out, **consts)
    return [tuple(int(x) for x in row) for row in out.cpu()]


def window_split_bounds(split, starts, lengths, windows, block_m, block_n):
    """Run ``split(start_m, Nk, WINDOW, BLOCK_M, BLOCK_N)`` for each triple: a list of 4-tuples."""
    return _run_probe(_window_split_probe, (starts, lengths, windows), SPLIT=split,
                      BLOCK_M=block_m, BLOCK_N=block_n, FN_HASH=fat.source_hash(split))


@triton.jit
def _split_probe(starts, lengths, out, SPLIT: tl.constexpr, BLOCK_M: tl.constexpr,
                 BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr, FN_HASH: tl.constexpr):
    # The same probe for the lecture's causal_split(start_m, Nk, BLOCK_M, BLOCK_N, CAUSAL).
    p = tl.program_id(0)
    start_m = tl.load(starts + p)
    Nk = tl.load(lengths + p)
    lo, hi, diag_lo, diag_hi = SPLIT(start_m, Nk, BLOCK_M, BLOCK_N, CAUSAL)
    tl.store(out + 4 * p, lo)
    tl.store(out + 4 * p + 1, hi)
    tl.store(out + 4 * p + 2, diag_lo)
    tl.store(out + 4 * p + 3, diag_hi)


def split_bounds(split, starts, lengths, block_m, block_n, causal):
    """Run the lecture's ``causal_split``-like ``split`` for each (start_m, Nk): 4-tuples."""
    return _run_probe(_split_probe, (starts, lengths), SPLIT=split, BLOCK_M=block_m,
                      BLOCK_N=block_n, CAUSAL=bool(causal), FN_HASH=fat.source_hash(split))


# ----------------------------------------------------------------------------- 09.window_inner


@triton.jit
def _window_forward_kernel(Q, K, V, O, LSE, BOUNDS, qk_scale, Nq, Nk, WINDOW,
                           HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                           EVEN_M: tl.constexpr, EVEN_N: tl.constexpr, INNER: tl.constexpr,
                           FN_HASH: tl.constexpr):
    # Program (i, bh): query rows start_m .. start_m + BLOCK_M - 1 of (batch, head) bh, under a
    # causal sliding window (query r sees keys r - WINDOW < key <= r). BOUNDS[i] holds the four
    # bounds of its three stages: [lo, mid_lo) masked, [mid_lo, mid_hi) unmasked, [mid_hi, hi)
    # masked. (FN_HASH: INNER's source hash, so that an edited INNER compiles a new kernel.)
    i = tl.program_id(0)
    start_m = i * BLOCK_M
    bh = tl.program_id(1).to(tl.int64)
    Q += bh * Nq * HEAD_DIM
    K += bh * Nk * HEAD_DIM
    V += bh * Nk * HEAD_DIM
    O += bh * Nq * HEAD_DIM
    LSE += bh * Nq

    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    q_ptrs = Q + offs_m[:, None] * HEAD_DIM + offs_d[None, :]
    if EVEN_M:
        q = tl.load(q_ptrs)
    else:
        q = tl.load(q_ptrs, mask=offs_m[:, None] < Nq, other=0.0)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    lo = tl.load(BOUNDS + 4 * i)
    mid_lo = tl.load(BOUNDS + 4 * i + 1)
    mid_hi = tl.load(BOUNDS + 4 * i + 2)
    hi = tl.load(BOUNDS + 4 * i + 3)
    acc, l_i, m_i = INNER(acc, l_i, m_i, q, K, V, qk_scale, offs_m, offs_n, offs_d, lo, mid_lo,
                          Nk, WINDOW, HEAD_DIM, BLOCK_N, True, EVEN_N)  # the window's left edge
    acc, l_i, m_i = INNER(acc, l_i, m_i, q, K, V, qk_scale, offs_m, offs_n, offs_d, mid_lo,
                          mid_hi, Nk, WINDOW, HEAD_DIM, BLOCK_N, False, EVEN_N)  # inside: no mask
    acc, l_i, m_i = INNER(acc, l_i, m_i, q, K, V, qk_scale, offs_m, offs_n, offs_d, mid_hi, hi,
                          Nk, WINDOW, HEAD_DIM, BLOCK_N, True, EVEN_N)  # the diagonal

    # INNER keeps acc normalised (FlashAttention-1's form): acc is O itself, stored as it is,
    # so a NaN computed in the loop shows. A row that sees no key at all (more queries than
    # keys + WINDOW) has l = 0 and acc = 0: O = 0 and LSE = -inf there.
    l_safe = tl.where(l_i == 0.0, 1.0, l_i)
    lse = tl.where(l_i == 0.0, float("-inf"), (m_i + tl.log2(l_safe)) * _LN2)
    o_ptrs = O + offs_m[:, None] * HEAD_DIM + offs_d[None, :]
    tl.store(o_ptrs, acc.to(O.dtype.element_ty), mask=offs_m[:, None] < Nq)
    tl.store(LSE + offs_m, lse, mask=offs_m < Nq)


def run_window_forward(inner, q, k, v, window, scale, bounds, O, LSE):
    """The sliding-window forward with ``inner`` as its loop; writes and returns ``(O, LSE)``.

    q ``(B, H, Nq, d)``, k, v ``(B, H, Nk, d)``; ``bounds`` ``(Tr, 4)`` int32: the stage bounds
    ``(lo, mid_lo, mid_hi, hi)`` of each query tile (computed by the caller); O like q, LSE
    ``(B, H, Nq)`` float32 (pre-filled by the caller). Tiles: :data:`FWD_CONFIG`.
    """
    B, H, Nq, Nk, d = fat.validate_inputs(q, k, v)
    block_m, block_n = FWD_CONFIG.kwargs["BLOCK_M"], FWD_CONFIG.kwargs["BLOCK_N"]
    grid = (triton.cdiv(Nq, block_m), B * H)
    _window_forward_kernel[grid](
        q, k, v, O, LSE, bounds.to(device=q.device, dtype=torch.int32).contiguous(),
        scale * LOG2E, Nq, Nk, int(window), HEAD_DIM=d, BLOCK_M=block_m, BLOCK_N=block_n,
        EVEN_M=Nq % block_m == 0, EVEN_N=Nk % block_n == 0, INNER=inner,
        FN_HASH=fat.source_hash(inner), num_warps=FWD_CONFIG.num_warps,
        num_stages=FWD_CONFIG.num_stages)
    return O, LSE


# ----------------------------------------------------------------------------- 09.gqa_dkdv


def run_gqa_dkdv(kernel, q, k, v, O, LSE, dO, causal, scale, dK, dV):
    """Launch the student's grouped-query dK/dV ``kernel``; writes and returns ``(dK, dV)``.

    q, O, dO ``(B, H_Q, Nq, d)``; k, v, dK, dV ``(B, H_KV, Nk, d)`` with ``H_Q = GROUP * H_KV``
    (query head h reads K/V head h // GROUP); LSE ``(B, H_Q, Nq)`` float32. D = rowsum(dO * O)
    comes from the course's kernel. Grid ``(Tc, B * H_KV)``, tiles :data:`DKDV_CONFIG`, and the
    arguments::

        kernel[grid](Q, K, V, dO, LSE, Dv, dK, dV, qk_scale, sm_scale, Nq, Nk, GROUP=...,
                     HEAD_DIM=..., CAUSAL=..., BLOCK_M=..., BLOCK_N=..., EVEN_M=..., EVEN_N=...)
    """
    B, H_Q, Nq, d = q.shape
    H_KV, Nk = k.shape[1], k.shape[2]
    if H_Q % H_KV:
        raise ValueError(f"{H_Q} query heads cannot share {H_KV} K/V heads evenly")
    Dv = fat.compute_delta(O, dO.contiguous())
    block_m, block_n = DKDV_CONFIG.kwargs["BLOCK_M"], DKDV_CONFIG.kwargs["BLOCK_N"]
    grid = (triton.cdiv(Nk, block_n), B * H_KV)
    kernel[grid](q, k, v, dO.contiguous(), LSE, Dv, dK, dV, scale * LOG2E, scale, Nq, Nk,
                 GROUP=H_Q // H_KV, HEAD_DIM=d, CAUSAL=bool(causal), BLOCK_M=block_m,
                 BLOCK_N=block_n, EVEN_M=Nq % block_m == 0, EVEN_N=Nk % block_n == 0,
                 num_warps=DKDV_CONFIG.num_warps, num_stages=DKDV_CONFIG.num_stages)
    return dK, dV


# ----------------------------------------------------------------------------- the lecture's


def reference_gradients(q, k, v, dO, causal, scale):
    """float64 ``(O, LSE, dQ, dK, dV, P, dP, D)`` of attention (the closed form of chapter 08)."""
    q, k, v, dO = (t.detach().to(torch.float64) for t in (q, k, v, dO))
    O, LSE = reference.attention(q, k, v, causal=causal, scale=scale)
    S = scale * q @ k.transpose(-2, -1)
    if causal:
        keep = torch.ones(S.shape[-2:], dtype=torch.bool, device=q.device).tril()
        S = S.masked_fill(~keep, -math.inf)
    P = torch.exp(S - LSE[..., None])
    dP = dO @ v.transpose(-2, -1)
    D = (dO * O).sum(-1, keepdim=True)
    dS = P * (dP - D)
    return O, LSE, scale * dS @ k, scale * dS.transpose(-2, -1) @ q, P.transpose(-2, -1) @ dO, \
        P, dP, D


def grad_tolerance(dtype, expected, max_score):
    """``(atol, rtol)`` for a gradient computed from ``dtype`` inputs.

    ``|error| <= atol + rtol |expected|`` with ``rtol = GRAD_TOL[dtype]`` and ``atol =
    GRAD_TOL[dtype] * max(1, max|expected|)`` (+ ``SCORE_ATOL x max|S|`` in float32). Measured
    with a float32 emulation of the kernels' roundings against float64, N up to 4097, d up to
    128, logits x30: the worst error was 4.9e-3 x max|expected| in bfloat16 and 8.6e-4 in
    float16; the interpreter's float32 errors stay below 1e-6. Triton's interpreter in float16
    at logits of std 50 went further (up to 1.18x of 4e-3): float16's tolerance is 6e-3.
    """
    tol = GRAD_TOL[dtype]
    atol = tol * max(1.0, float(expected.abs().max()))
    if dtype == torch.float32:
        atol += SCORE_ATOL * max_score
    return atol, tol


def backward_problem(case, dtype):
    """Fresh ``(q, k, v, O, LSE, dO)`` in ``dtype`` (LSE float32) and the float64 references."""
    q, k, v = random_qkv(case, dtype, device())
    dO = torch.randn(q.shape, device=q.device).to(dtype)
    scale = case.scale if case.scale is not None else 1.0 / math.sqrt(case.d)
    ref = reference_gradients(q, k, v, dO, case.causal, scale)
    O, LSE = ref[0].to(dtype).contiguous(), ref[1].float().contiguous()
    return (q, k, v, O, LSE, dO), ref, scale


__all__ = [
    "DKDV_CONFIG",
    "DQ_CONFIG",
    "FWD_CONFIG",
    "GRAD_TOL",
    "SCORE_ATOL",
    "backward_problem",
    "grad_tolerance",
    "jit_problem",
    "reference_gradients",
    "run_gqa_dkdv",
    "run_window_forward",
    "split_bounds",
    "window_split_bounds",
]
